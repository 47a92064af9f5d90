"""kv_cache_aware's implicit sessions end to end: two real sim workers (processes) with 24-block KV
caches, registered with the coordinator (served over HTTP), their KV events applied from their
publishers. A prompt's prefix is evicted from the cache of the server that computed it; the next
request sharing that prefix, which the index then matches nowhere, is placed on that server again
(router/prefix_pins.py, credited in router/policy_kv.py's time cost), where the prefix tree is
rebuilt for the requests after it, and not on the next server in turn."""
from __future__ import annotations

import aiohttp

from coordinator.client import HttpCoordinatorClient
from router.block_keys import block_keys

from .conftest import cfg, start_sim_worker, wait_for
from .test_with_worker import _stop

BLOCKS = 24             # each worker's KV cache: three 8-block prompts


async def _start_worker(coord_url: str):
    """A sim worker registered with the coordinator; started again (3 tries) when a port it
    picked free was taken meanwhile (its KV-event sockets bind ports of their own)."""
    for attempt in range(3):
        try:
            return await start_sim_worker(coord_url, "--block-size", "16", num_blocks=BLOCKS)
        except AssertionError as e:
            if "Address already in use" not in str(e) or attempt == 2:
                raise


def _prompt(seed: int, n: int) -> list[int]:
    # the tiny model's vocabulary is 261 tokens
    return [(seed * 61 + i * 7 + (i * i) % 13) % 250 + 3 for i in range(n)]


async def test_a_prefix_evicted_from_its_server_brings_its_next_request_back(coordinator):
    c, s = await coordinator(cfg([], [], minimal=(1, 1), threshold=1, interval=0.1))
    procs = []
    client = HttpCoordinatorClient(s.tcp_url)
    try:
        for _ in range(2):
            procs.append(await _start_worker(s.tcp_url))
        urls = [u for _, u in procs]
        await wait_for(lambda: all(c.registry.get(u) is not None and c.registry.get(u).healthy
                                   and c.kv.kv_ready(u) for u in urls),
                       timeout=30, what="both workers prepared, feeds ready")
        x = _prompt(1, 130)                         # 8 full blocks: one implicit-session mark
        nxt = x[:128] + _prompt(2, 34)              # its next request: the 128 tokens shared
        assert block_keys(nxt, 16)[7] == block_keys(x, 16)[7]
        rid = iter(range(1, 100))

        async def place(prompt) -> dict:
            r = next(rid)
            ans = await client.select("gen", r, {"block_keys": block_keys(prompt, 16),
                                                 "num_tokens": len(prompt)})
            ans["req_id"] = r
            return ans

        async def run(session, server: str, prompt, req_id: int | None = None) -> int:
            async with session.post(server + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}) as resp:
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]
            if req_id is not None:
                await client.finish("gen", req_id)
            return usage["prompt_tokens_details"]["cached_tokens"]

        async with aiohttp.ClientSession() as session:
            first = await place(x)
            home = first["server"]
            other = next(u for u in urls if u != home)
            assert await run(session, home, x, first["req_id"]) == 0
            xkeys = set(block_keys(x, 16).tolist())
            await wait_for(lambda: xkeys <= c.index.keys_of(home), timeout=10,
                           what="x's blocks in the index (the worker's events)")
            # three other prompts sent to that worker directly (not placed): 24 new blocks, and
            # its LRU evicts x's
            for seed in (3, 4, 5):
                assert await run(session, home, _prompt(seed, 130)) == 0
            await wait_for(lambda: not (xkeys & c.index.keys_of(home)), timeout=10,
                           what="x's blocks evicted (the worker's removals)")
            assert c.index.longest_prefix(block_keys(nxt, 16)) == {}
            # nothing matches anywhere and no server is loaded: without the session the two
            # would tie and the next in turn (the other server) would take it
            ans = await place(nxt)
            assert ans["server"] == home, (ans, home, other)
            info = ans["info"]
            assert info["matched_tokens"] == 0      # predicted: what the index holds, nothing
            assert "implicit session affinity" in info["reason"], info
            assert await run(session, home, nxt, ans["req_id"]) == 0     # recomputed there
            await wait_for(lambda: set(block_keys(nxt, 16).tolist()) <= c.index.keys_of(home),
                           timeout=10, what="the rebuilt prefix in the index")
            # the tree's next request now finds its prefix cached where it was sent
            again = x[:128] + _prompt(6, 40)
            ans = await place(again)
            assert ans["server"] == home and ans["info"]["matched_tokens"] == 128
            assert await run(session, home, again, ans["req_id"]) == 128
        assert sum(c.leases.requests(u) for u in urls) == 0
    finally:
        await client.close()
        for proc, _ in procs:
            await _stop(proc)
