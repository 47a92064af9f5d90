"""Lease accounting under concurrency: 1,000 interleaved select / retry / finish / renew / abandon
flows over HTTP must leave every in-flight count at exactly zero, and every lease must be
accounted for as finished, expired or replaced."""
from __future__ import annotations

import asyncio
import random

import numpy as np

from coordinator.client import HttpCoordinatorClient, InProcessCoordinatorClient

from .conftest import cfg, wait_for

TTL_S = 1.0
LATE_S = 1.2


async def _flow(client, i: int, rng: random.Random, urls: list[str]) -> str:
    kind = rng.choice(["finish", "retry", "fail", "double", "renew", "abandon", "pair", "late"])
    keys = np.arange(i % 7, i % 7 + 4, dtype=np.uint64)
    rk = {"block_keys": keys, "num_tokens": 64 + i % 5}
    role = rng.choice(["context", "generation"])
    await asyncio.sleep(rng.random() * 0.02)
    if kind == "pair":
        await client.select_pair(i, rk)
        await asyncio.sleep(rng.random() * 0.05)
        await asyncio.gather(client.finish("context", i), client.finish("generation", i))
        return kind
    await client.select(role, i, rk)
    if kind == "retry":      # the same key selected again, excluding the first server
        await client.select(role, i, rk, exclude=[rng.choice(urls)])
    await asyncio.sleep(rng.random() * 0.05)
    if kind == "abandon":    # a fleet process that died: only expiry releases it
        return kind
    if kind == "renew":
        await client.renew(role, i)
        await asyncio.sleep(rng.random() * 0.05)
    if kind == "late":       # finished after its lease expired
        await asyncio.sleep(LATE_S)
    await client.finish(role, i, success=kind != "fail")
    if kind == "double":
        await client.finish(role, i)
    return kind


def _check_zero(c) -> None:
    assert c.in_flight() == {"context": 0, "generation": 0}
    assert len(c.leases) == 0 and c.leases.loads() == {}
    for url in c.registry.servers:
        assert c.load(url) == (0, 0)
    st = c.stats
    acquired = sum(st.selects.values())
    finished = sum(st.finishes.values())
    expired = sum(st.leases_expired.values())
    assert acquired == finished + expired + st.leases_replaced, (acquired, finished, expired,
                                                                 st.leases_replaced)


async def test_thousand_concurrent_interleavings_end_at_zero(workers, coordinator):
    ws = [await workers("both") for _ in range(4)]
    urls = [w.url for w in ws]
    # 1,000 placements arrive as one channel batch: on a 2-core CI box the tail of it waits past the
    # default shedding deadline (coordinator.max_queue_delay_s), which this test is not about.
    c, s = await coordinator(cfg(urls, urls, ctx_router="load_balancing", gen_router="kv_cache_aware",
                                 ttl=TTL_S, threshold=1_000_000, max_queue_delay_s=30.0))
    await wait_for(c.is_ready)
    client = HttpCoordinatorClient(s.tcp_url, timeout_s=60)   # 1,000 at once on a busy 2-core box
    rng = random.Random(1234)
    try:
        kinds = await asyncio.gather(*[_flow(client, i, rng, urls) for i in range(1000)])
    finally:
        await client.close()
    assert set(kinds) == {"finish", "retry", "fail", "double", "renew", "abandon", "pair", "late"}
    await wait_for(lambda: len(c.leases) == 0, timeout=30, what="abandoned leases to expire")
    _check_zero(c)
    assert sum(c.stats.leases_expired.values()) >= kinds.count("abandon")
    assert c.stats.leases_replaced >= kinds.count("retry")


async def test_in_process_client_same_accounting(workers, coordinator):
    ws = [await workers("both") for _ in range(3)]
    urls = [w.url for w in ws]
    c, _ = await coordinator(cfg(urls, urls, ttl=TTL_S, threshold=1_000_000), serve=False)
    await wait_for(c.is_ready)
    client = InProcessCoordinatorClient(c)
    rng = random.Random(99)
    await asyncio.gather(*[_flow(client, i, rng, urls) for i in range(1000)])
    await wait_for(lambda: len(c.leases) == 0, timeout=30)
    _check_zero(c)


async def test_expiry_is_counted_and_renew_extends(workers, coordinator):
    w = await workers("both")
    c, s = await coordinator(cfg([w.url], [w.url], ttl=0.25))
    await wait_for(c.is_ready)
    client = InProcessCoordinatorClient(c)
    await client.select("ctx", 1)
    await client.select("ctx", 2)
    for _ in range(6):                 # keep 1 alive well past its ttl
        await asyncio.sleep(0.1)
        assert await client.renew("ctx", 1)
    assert c.leases.get("context", 1) is not None and c.leases.get("context", 2) is None
    assert c.stats.leases_expired["context"] == 1
    assert not await client.renew("ctx", 2)
    await client.finish("ctx", 1)
    _check_zero(c)
