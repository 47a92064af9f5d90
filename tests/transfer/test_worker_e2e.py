"""Disaggregated serving through real workers: KV moved by the transfer layer, outputs compared
with aggregated serving.

Workers are real `WorkerServer`s on real sockets (HTTP, ZMQ control plane, transfer agents); the
failure cases run the peer as a real `splitserve worker` process and kill it mid-transfer.
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import aiohttp
import pytest

from tests.worker.conftest import spawn_worker, stop_worker

PROMPTS = [
    "Disaggregated serving moves the KV cache from prefill to decode workers.",
    "A short one.",
    "Paged attention stores keys and values in fixed-size blocks; " * 3,
]


@pytest.fixture(scope="module")
def tiny():
    import torch

    torch.set_num_threads(1)
    from worker.presets import build_preset

    return build_preset("tiny")


@pytest.fixture(scope="module")
def tiny_sliding():
    import dataclasses

    from worker.model import LlamaForCausalLM
    from worker.presets import init_random_weights, preset_config

    cfg = dataclasses.replace(preset_config("tiny"), sliding_window=8, name="tiny-sw")
    m = LlamaForCausalLM(cfg)
    init_random_weights(m, seed=0, namespace="tiny-sw")
    return m.eval().requires_grad_(False)


class W:
    """One in-process worker (engine + its KV connector + HTTP server)."""

    def __init__(self, server, url):
        self.server, self.url = server, url
        self.engine = server.engine
        self.link = server.engine.kv_connector

    async def close(self):
        await self.server.stop()
        if self.link is not None:
            await self.link.close()


async def start(model, role, *, agent="tcp", block_size=4, num_blocks=192, max_num_tokens=64,
                transfer=True, pipeline=True, pin_timeout=30.0, transfer_timeout=30.0,
                async_scheduling=None):
    from protocol.tokenizer import ByteTokenizer
    from worker.cli import build_kv_connector
    from worker.engine import TorchEngine
    from worker.runner import ModelRunner
    from worker.server import WorkerServer

    link = None
    if transfer:
        ns = SimpleNamespace(transfer_agent=agent, host="127.0.0.1", transfer_port=0, role=role,
                             pin_timeout=pin_timeout, transfer_timeout=transfer_timeout,
                             transfer_pipeline="on" if pipeline else "off")
        link = build_kv_connector(ns, "tiny", None)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size)
    engine = TorchEngine(runner, ByteTokenizer(vocab_size=model.config.vocab_size),
                         max_num_tokens=max_num_tokens, pin_timeout_s=pin_timeout,
                         kv_connector=link, async_scheduling=async_scheduling)
    srv = WorkerServer(engine, model_name="tiny", role=role, host="127.0.0.1", port=0,
                       transfer_info=link.server_info() if link else None,
                       ctx_info_endpoint=link.endpoint if link else None)
    url = await srv.start()
    return W(srv, url)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


_ids = iter(range(1 << 41, 1 << 42))


async def complete(http, url, body):
    async with http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def aggregated(http, url, prompt, n):
    st, out = await complete(http, url, {"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert st == 200, out
    return out["choices"][0]["text"]


async def context_first(http, ctx, gen, prompt, n):
    did = next(_ids)
    st, c = await complete(http, ctx.url, {
        "prompt": prompt, "max_tokens": n, "temperature": 0,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}})
    assert st == 200, c
    ch = c["choices"][0]
    if ch["finish_reason"] not in ("length", "not_finished"):
        return ch["text"], c
    dp = dict(ch["disaggregated_params"], request_type="generation_only")
    st, g = await complete(http, gen.url, {"prompt": c["prompt_token_ids"], "max_tokens": n,
                                           "temperature": 0, "disaggregated_params": dp})
    assert st == 200, g
    return g["choices"][0]["text"], c


async def generation_first(http, ctx, gen, prompt, n):
    did = next(_ids)
    async with http.get(ctx.url + "/server_info") as r:
        ep = (await r.json())["disaggregated_params"]["ctx_info_endpoint"]
    gen_body = {"prompt": prompt, "max_tokens": n, "temperature": 0,
                "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": did,
                                         "disagg_request_id": did, "ctx_info_endpoint": ep,
                                         "schedule_style": "generation_first"}}
    gen_task = asyncio.create_task(complete(http, gen.url, gen_body))
    await asyncio.sleep(0.05)
    st, c = await complete(http, ctx.url, {
        "prompt": prompt, "max_tokens": n, "temperature": 0,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}})
    assert st == 200, c
    st, g = await gen_task
    assert st == 200, g
    return g["choices"][0]["text"]


async def settled(*ws, timeout=15.0):
    """Every worker's pool back to baseline: nothing used or pinned, no transfer session left."""
    deadline = time.monotonic() + timeout
    while True:
        bad = []
        for w in ws:
            s = w.engine.stats()
            p = w.link.tx.pending() if w.link else {}
            if s["kv_blocks_used"] or s["kv_blocks_pinned"] or s["pinned_transfers"] \
                    or p.get("send") or p.get("recv") or p.get("parked") or p.get("inflight_tasks"):
                bad.append((w.url, {k: s[k] for k in ("kv_blocks_used", "kv_blocks_pinned",
                                                      "pinned_transfers")}, p))
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"workers did not return to baseline: {bad}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("agent", ["tcp", "shm", pytest.param("nixl", marks=pytest.mark.nixl)])
async def test_context_first_equals_aggregated(agent, tiny, http):
    agg = await start(tiny, "both", transfer=False)
    ctx = await start(tiny, "context", agent=agent)
    gen = await start(tiny, "generation", agent=agent)
    try:
        async with http.get(gen.url + "/server_info") as r:
            info = (await r.json())["transfer"]
        assert info["agent"]["kind"] == agent and info["endpoint"].startswith("tcp://")
        for p in PROMPTS:
            want = await aggregated(http, agg.url, p, 12)
            got, c = await context_first(http, ctx, gen, p, 12)
            assert got == want, (p, got, want)
        # a context-side prefix hit: the reused prefix blocks are transferred too
        got, c = await context_first(http, ctx, gen, PROMPTS[2], 12)
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert got == await aggregated(http, agg.url, PROMPTS[2], 12)
        assert ctx.link.tx.stats["send_done"] == len(PROMPTS) + 1
        await settled(ctx, gen)
    finally:
        for w in (agg, ctx, gen):
            await w.close()


@pytest.mark.parametrize("pipeline, queued", [(True, False), (False, False), (True, True)],
                         ids=["pipelined", "monolithic", "pipelined-at-launch"])
async def test_generation_first_pipelined_equals_aggregated(pipeline, queued, tiny, http):
    """`queued`: the context engine schedules asynchronously, so each chunk is handed to the
    transfer when it is queued (KvConnector.prefill_launched; on the CPU it is written by then)
    and again, as a no-op, when it is applied one step later."""
    agg = await start(tiny, "both", transfer=False)
    ctx = await start(tiny, "context", max_num_tokens=24, pipeline=pipeline,
                      async_scheduling=queued or None)
    gen = await start(tiny, "generation")
    try:
        for p in PROMPTS:
            want = await aggregated(http, agg.url, p, 10)
            assert await generation_first(http, ctx, gen, p, 10) == want
        slices = ctx.link.tx.stats["slices_sent"]
        if pipeline:  # the long prompt needs several 24-token chunks: several slices
            assert slices > len(PROMPTS)
        else:
            assert slices == len(PROMPTS)
        await settled(ctx, gen)
    finally:
        for w in (agg, ctx, gen):
            await w.close()


async def test_sliding_window_model_equals_aggregated(tiny_sliding, http):
    agg = await start(tiny_sliding, "both", transfer=False)
    ctx = await start(tiny_sliding, "context", max_num_tokens=16)
    gen = await start(tiny_sliding, "generation")
    try:
        for p in PROMPTS:
            want = await aggregated(http, agg.url, p, 10)
            got, _ = await context_first(http, ctx, gen, p, 10)
            assert got == want
            assert await generation_first(http, ctx, gen, p, 10) == want
        await settled(ctx, gen)
    finally:
        for w in (agg, ctx, gen):
            await w.close()


async def test_cancellation_paths_return_pools_to_baseline(tiny, http):
    ctx = await start(tiny, "context", max_num_tokens=8)
    gen = await start(tiny, "generation", transfer_timeout=2.0)
    try:
        # 1. generation waits for a context leg that never comes: aborted by the client
        did = next(_ids)
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": did,
                                         "disagg_request_id": did,
                                         "ctx_info_endpoint": ctx.link.endpoint}}
        t = asyncio.create_task(complete(http, gen.url, body))
        await asyncio.sleep(0.3)
        async with http.post(gen.url + "/v1/abort", json={"request_id": did}) as r:
            assert (await r.json())["aborted"] is True
        st, out = await t
        assert st >= 400 or out["choices"][0]["finish_reason"] == "abort", out
        await settled(ctx, gen)
        # 2. ... or it times out (bounded by --transfer-timeout), with a clean error
        did = next(_ids)
        body["disaggregated_params"].update(ctx_request_id=did, disagg_request_id=did)
        t0 = time.monotonic()
        st, out = await complete(http, gen.url, body)
        assert st >= 500 or out["choices"][0]["finish_reason"] == "error", out
        assert time.monotonic() - t0 < 10
        await settled(ctx, gen)
        # 3. the context leg is aborted during prefill (generation_first): both sides clean up
        did = next(_ids)
        gen_body = {"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0,
                    "disaggregated_params": {"request_type": "generation_only",
                                             "ctx_request_id": did,
                                             "ctx_info_endpoint": ctx.link.endpoint}}
        gt = asyncio.create_task(complete(http, gen.url, gen_body))
        await asyncio.sleep(0.1)
        ct = asyncio.create_task(complete(http, ctx.url, {
            "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}}))
        for _ in range(200):
            if ctx.link.tx.stats["slices_sent"]:
                break
            await asyncio.sleep(0.005)
        async with http.post(ctx.url + "/v1/abort", json={"request_id": str(did)}) as r:
            assert r.status == 200
        await ct
        st, out = await gt
        assert st >= 500 or out["choices"][0]["finish_reason"] in ("error", "abort")
        await settled(ctx, gen)
        # 4. after a completed transfer, aborting the finished context request is harmless
        got, c = await context_first(http, ctx, gen, PROMPTS[1], 4)
        cid = c["choices"][0]["disaggregated_params"]["ctx_request_id"]
        async with http.post(ctx.url + "/v1/abort", json={"request_id": cid}) as r:
            assert r.status == 200
        await settled(ctx, gen)
    finally:
        for w in (ctx, gen):
            await w.close()


async def test_waiting_sends_are_not_polled_and_an_abort_ends_them_at_once(tiny, http):
    """Context legs whose KV nobody fetched yet cost nothing while they wait: the connector looks
    at a send only when something decided its fate (here: /v1/abort releases the pin), not every
    few milliseconds (the link it replaced called send_status for every send every 2 ms)."""
    ctx = await start(tiny, "context")
    calls = []
    status = ctx.link.tx.send_status
    ctx.link.tx.send_status = lambda cid: (calls.append(cid), status(cid))[1]
    try:
        cids = []
        for p in PROMPTS:
            st, c = await complete(http, ctx.url, {
                "prompt": p, "max_tokens": 2, "temperature": 0,
                "disaggregated_params": {"request_type": "context_only",
                                         "disagg_request_id": next(_ids)}})
            assert st == 200, c
            cids.append(c["choices"][0]["disaggregated_params"]["ctx_request_id"])
        assert ctx.engine.stats()["pinned_transfers"] == len(PROMPTS)
        await asyncio.sleep(0.1)
        calls.clear()
        await asyncio.sleep(0.5)   # below the connector's 1 s safety sweep
        assert calls == [], f"{len(calls)} send_status calls while nothing happened"
        async with http.post(ctx.url + "/v1/abort", json={"request_id": cids[0]}) as r:
            assert (await r.json())["aborted"] is True
        for _ in range(100):   # the abort released the pin; pin_released cancels the send now
            if ctx.link.tx.pending()["send"] == len(PROMPTS) - 1:
                break
            await asyncio.sleep(0.01)
        assert ctx.link.tx.pending()["send"] == len(PROMPTS) - 1
        assert cids[0] in calls and set(calls) == {cids[0]}
    finally:
        for c in cids[1:]:
            async with http.post(ctx.url + "/v1/abort", json={"request_id": c}) as r:
                assert r.status == 200
        await settled(ctx)
        await ctx.close()


async def test_generation_worker_killed_mid_transfer(tiny, http):
    ctx = await start(tiny, "context", max_num_tokens=8, pin_timeout=5.0)
    proc, gen_url = spawn_worker("--engine", "torch", "--model", "tiny", "--role", "generation",
                                 "--block-size", "4", "--num-blocks", "192",
                                 "--transfer-agent", "tcp", timeout=120)
    try:
        did = next(_ids)
        gen_body = {"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0,
                    "disaggregated_params": {"request_type": "generation_only",
                                             "ctx_request_id": did,
                                             "ctx_info_endpoint": ctx.link.endpoint}}
        gt = asyncio.create_task(complete(http, gen_url, gen_body))
        for _ in range(400):
            if ctx.link.tx.pending()["parked"] or ctx.link.tx.pending()["receivers"]:
                break
            await asyncio.sleep(0.01)
        ct = asyncio.create_task(complete(http, ctx.url, {
            "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}}))
        for _ in range(400):
            if ctx.link.tx.stats["slices_sent"]:
                break
            await asyncio.sleep(0.005)
        proc.kill()
        proc.wait()
        st, _ = await ct
        assert st == 200
        try:
            await gt
        except aiohttp.ClientError:
            pass
        t0 = time.monotonic()
        await settled(ctx, timeout=20)
        assert time.monotonic() - t0 < 4.0  # released on the failed write, not the 5 s pin timeout
        assert ctx.link.tx.stats["send_errors"] >= 1 and ctx.link.tx.stats["send_done"] == 0
    finally:
        stop_worker(proc)
        await ctx.close()


async def test_context_worker_killed_mid_transfer(tiny, http):
    gen = await start(tiny, "generation", transfer_timeout=30.0)
    proc, ctx_url = spawn_worker("--engine", "torch", "--model", "tiny", "--role", "context",
                                 "--block-size", "4", "--num-blocks", "192",
                                 # 2-token chunks: the prefill must outlast the 0.3 s below even
                                 # where slices move fast (at 4 it sometimes finished first)
                                 "--max-num-tokens", "2", "--transfer-agent", "tcp", timeout=120)
    try:
        async with http.get(ctx_url + "/server_info") as r:
            ep = (await r.json())["disaggregated_params"]["ctx_info_endpoint"]
        did = next(_ids)
        prompt = PROMPTS[2] * 3
        gt = asyncio.create_task(complete(http, gen.url, {
            "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": did,
                                     "ctx_info_endpoint": ep}}))
        await asyncio.sleep(0.3)
        ct = asyncio.create_task(complete(http, ctx_url, {
            "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}}))
        await asyncio.sleep(0.3)  # prefill of 4-token chunks is under way, slices flowing
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        st, out = await gt
        assert st >= 500 or out["choices"][0]["finish_reason"] == "error", out
        assert time.monotonic() - t0 < 15  # peer loss, not the 30 s timeout
        ct.cancel()
        await settled(gen)
    finally:
        stop_worker(proc)
        await gen.close()
