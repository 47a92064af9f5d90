"""The coordinator with the real reference worker (`splitserve worker --engine sim`, a process):
self-registration, /server_info preparation, KV events applied from its publisher, the snapshot
rebuild, kv-aware receipts after a real prefill, and a killed-and-restarted worker."""
from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from coordinator.client import HttpCoordinatorClient
from router.block_keys import block_keys

from .conftest import cfg, start_sim_worker, wait_for



async def _start_worker(coord_url: str, role: str = "both", port: int = 0):
    return await start_sim_worker(coord_url, role=role, port=port)


async def _stop(proc, sig=signal.SIGTERM):
    if proc.returncode is None:
        proc.send_signal(sig)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


async def test_real_worker_registers_and_feeds_the_index(coordinator):
    c, s = await coordinator(cfg([], [], minimal=(1, 1), threshold=1, interval=0.1))
    proc, url = await _start_worker(s.tcp_url)
    try:
        await wait_for(lambda: c.registry.get(url) is not None and c.registry.get(url).healthy,
                       timeout=20, what="worker registered and prepared")
        await wait_for(lambda: url in c.kv.feeds and c.kv.kv_ready(url), timeout=10, what="feed ready")
        assert c.is_ready()
        feed = c.kv.feeds[url]
        assert feed.sync_outcome == "snapshot"
        tokens = list(range(1, 200))
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": tokens, "max_tokens": 2, "temperature": 0}) as r:
                assert r.status == 200, await r.text()
        full = len(tokens) // 16
        await wait_for(lambda: c.index.longest_prefix(block_keys(tokens, 16), [url])[url] >= full - 1,
                       timeout=10, what="the prefill's blocks in the index")
        assert feed.events_applied > 0 and feed.gaps == 0
        client = HttpCoordinatorClient(s.uds_url or s.tcp_url)
        ans = await client.select("ctx", 1, {"block_keys": block_keys(tokens, 16), "num_tokens": len(tokens)})
        assert ans["server"] == url and ans["info"]["matched_tokens"] >= (full - 1) * 16
        await client.finish("ctx", 1)
        await client.close()

        # SIGKILL: no deregistration; probes eject it, then the registration expires
        await _stop(proc, signal.SIGKILL)
        await wait_for(lambda: c.registry.get(url) is None or not c.registry.get(url).healthy,
                       timeout=10, what="ejection")
        assert not c.is_ready()
        port = int(url.rsplit(":", 1)[1])
        proc, url2 = await _start_worker(s.tcp_url, port=port)   # same url, new process
        assert url2 == url
        await wait_for(lambda: c.registry.get(url) is not None and c.registry.get(url).healthy
                       and c.kv.kv_ready(url), timeout=20, what="the restarted worker back")
        # its cache is empty: the old entries are gone (restart detected, index rebuilt)
        await wait_for(lambda: c.index.worker_size(url) == 0, timeout=10, what="stale entries dropped")
        assert c.is_ready()
    finally:
        await _stop(proc)
    # SIGTERM deregisters
    await wait_for(lambda: c.registry.get(url) is None, timeout=10, what="deregistration")
