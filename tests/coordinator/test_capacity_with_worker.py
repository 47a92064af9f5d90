"""Capacity-aware prediction end to end: a real sim worker (a process) with a 24-block KV cache,
registered with the coordinator (served over HTTP), its KV events applied from its publisher.
Prompts placed there while earlier ones are still queued overflow its cache: the coordinator
must stop predicting the prefix those queued prompts will evict (router/kv_capacity.py), and
what the worker then reports cached is what it predicted."""
from __future__ import annotations

import asyncio

import aiohttp

from coordinator.client import HttpCoordinatorClient
from router.block_keys import block_keys

from .conftest import cfg, start_sim_worker, wait_for
from .test_with_worker import _stop

BLOCKS = 24             # the worker's KV cache: three 8-block prompts
PROMPT = 130            # tokens: 8 full blocks of 16 (+2, so all 8 can be reused)


async def _start_worker(coord_url: str):
    """The sim worker, registered with the coordinator; started again (3 tries) when a port it
    picked free was taken meanwhile (its KV-event sockets bind ports of their own)."""
    for attempt in range(3):
        try:
            return await _start_worker_once(coord_url)
        except AssertionError as e:
            if "Address already in use" not in str(e) or attempt == 2:
                raise


async def _start_worker_once(coord_url: str):
    return await start_sim_worker(coord_url, "--block-size", "16", "--max-batch-size", "1",
                                  num_blocks=BLOCKS)


async def test_queued_prompts_evict_a_prefix_and_the_coordinator_stops_predicting_it(coordinator):
    c, s = await coordinator(cfg([], [], minimal=(1, 1), threshold=1, interval=0.1))
    proc, url = await _start_worker(s.tcp_url)
    client = HttpCoordinatorClient(s.tcp_url)
    # four prompts with no block in common (the tiny model's vocabulary is 261 tokens)
    prompts = {name: [(k * 61 + i * 7) % 250 + 3 for i in range(PROMPT)] for k, name in
               enumerate("ABCD", start=1)}
    assert len({tuple(p[:16]) for p in prompts.values()}) == 4
    prompts["E"] = prompts["A"]              # A again, after B, C and D
    prompts["F"] = prompts["D"]              # D again: recent, still cached
    keys = {name: block_keys(p, 16) for name, p in prompts.items()}
    rid = iter(range(1, 100))
    placed: dict[str, tuple[int, int]] = {}

    async def place(name: str) -> int:
        r = next(rid)
        ans = await client.select("gen", r, {"block_keys": keys[name], "num_tokens": PROMPT})
        assert ans["server"] == url
        placed[name] = (r, ans["info"]["matched_tokens"])
        return ans["info"]["matched_tokens"]

    async def run(session, name: str) -> int:
        async with session.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": prompts[name], "max_tokens": 1,
                "temperature": 0}) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        r, predicted = placed[name]
        await client.finish("gen", r, usage={"prompt_tokens": PROMPT, "cached_tokens": cached,
                                             "predicted_tokens": predicted})
        return cached

    try:
        await wait_for(lambda: c.registry.get(url) is not None and c.registry.get(url).healthy
                       and c.kv.kv_ready(url), timeout=30, what="worker prepared, feed ready")
        # the capacity comes from the worker's /server_info
        assert c.index.capacity_of(url) == BLOCKS
        async with aiohttp.ClientSession() as session:
            assert await place("A") == 0
            assert await run(session, "A") == 0
            await wait_for(lambda: set(keys["A"].tolist()) <= c.index.keys_of(url), timeout=10,
                           what="A's blocks in the index (the worker's events)")
            assert await place("A") == 128 and await run(session, "A") == 128
            # B, C and D are placed (queued on the worker, not run yet): 24 new blocks
            for name in "BCD":
                assert await place(name) == 0
            # A's blocks are still held per the worker's events, but the queue ahead evicts them
            assert set(keys["A"].tolist()) <= c.index.keys_of(url)
            assert await place("E") == 0
            for name in "BCDE":
                assert await run(session, name) == 0     # the worker agrees: nothing reused
            assert await place("F") == 128               # D: the newest, still there
            assert await run(session, "F") == 128
        pred = c.diag.describe_prediction(url)
        assert pred["predicted_tokens"] == pred["actual_cached_tokens"] == 256, pred
        c.index.check_invariants()
        # what an operator reads: the model's state and the ratio, per server. The worker's stores
        # for E's recomputed blocks reach the index over its event stream, after E's answer: read
        # until they are in (or 10 s), then check the whole state.
        deadline = asyncio.get_running_loop().time() + 10
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(s.tcp_url + "/cluster_info") as resp:
                    info = await resp.json()
                row = next(x for x in info["servers"]["generation"] if x["url"] == url)
                model = row["kv_capacity_model"]
                if model["clock"] >= 40 or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            async with session.get(s.tcp_url + "/metrics") as resp:
                metrics = await resp.text()
        assert model["capacity_blocks"] == model["room_blocks"] == BLOCKS and model["pressed"]
        # A, B, C, D, and A's blocks again when the worker recomputed them for E (its stores)
        assert model["clock"] == 40 and model["pinned_blocks"] == 0
        assert row["routing_prediction"]["recent"]["ratio"] == 1.0
        assert f'splitserve_coordinator_routing_prediction_ratio{{server="{url}"}} 1.0' in metrics
        assert f'splitserve_coordinator_kv_capacity_room_blocks{{server="{url}"}} {BLOCKS}.0' \
            in metrics
    finally:
        await client.close()
        await _stop(proc)
