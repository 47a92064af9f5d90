"""The scheduler on the sim engine: determinism, prefix-cache accounting, chunked prefill,
preemption, aborts at every stage, pinned transfers, two-leg flows, failures."""
from __future__ import annotations

import asyncio

import pytest

from tests.worker.conftest import make_sim_engine, wait_for
from worker.kv_connector import KvConnector
from worker.requests import (
    CONTEXT_ONLY, GENERATION_ONLY, EngineRequest, InvalidRequest, SamplingParams,
    TransferUnavailable,
)

GREEDY = dict(temperature=0.0)


def req(rid, prompt, max_tokens=8, **kw):
    sp = kw.pop("sampling", None) or SamplingParams(max_tokens=max_tokens, **GREEDY)
    return EngineRequest(rid, list(prompt), sp, **kw)


async def run(engine, r):
    stream = await engine.submit(r)
    toks, text, last = [], "", None
    async for ev in stream:
        toks += ev.token_ids
        text += ev.text
        last = ev
    return toks, text, last


def prompt(n, salt=0):
    return [(i * 7 + salt * 13) % 200 + 32 for i in range(n)]


@pytest.fixture
async def sim():
    engines = []

    async def make(**kw):
        e = make_sim_engine(**kw)
        await e.start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        await e.stop()
        e.pool.check_invariants()
        assert e.pool.num_used == 0, "engine stop must return every block"


async def test_tokens_are_deterministic_and_cached_tokens_follow_the_cache(sim):
    e = await sim(num_blocks=16, block_size=4)
    p = prompt(22)
    t1, _, l1 = await run(e, req("a", p))
    assert l1.cached_tokens == 0 and l1.finish_reason == "length" and len(t1) == 8
    t2, _, l2 = await run(e, req("b", p))
    assert t2 == t1
    # 22 prompt tokens: 5 full blocks, but the hit is capped so one prompt token is computed
    assert l2.cached_tokens == 20
    exact = p[:20]
    _, _, l3 = await run(e, req("c", exact))
    assert l3.cached_tokens == 16, "a block-aligned prompt recomputes its last block"
    # push the prompt out of the 16-block cache with unrelated prompts
    for i in range(4):
        await run(e, req(f"x{i}", prompt(24, salt=i + 1)))
    _, _, l4 = await run(e, req("d", p))
    assert l4.cached_tokens < 20
    e.clear_cache()
    _, _, l5 = await run(e, req("e", p))
    assert l5.cached_tokens == 0
    assert e.stats()["prefix_hit_tokens_total"] == 20 + 16 + l4.cached_tokens


async def test_batching_chunking_and_preemption_do_not_change_tokens(sim):
    alone = await sim(num_blocks=64, block_size=4)
    prompts = [prompt(30, salt=s) for s in range(4)]
    want = [(await run(alone, req(f"a{i}", p, max_tokens=12)))[0] for i, p in enumerate(prompts)]
    # 12 blocks of 4 tokens cannot hold four 42-token sequences: chunked prefill with a small
    # budget, and preemption by recomputation
    tight = await sim(num_blocks=12, block_size=4, max_num_tokens=8, decode_us=200)
    got = await asyncio.gather(*(run(tight, req(f"b{i}", p, max_tokens=12))
                                 for i, p in enumerate(prompts)))
    assert [g[0] for g in got] == want
    st = tight.stats()
    assert st["preemptions_total"] > 0
    assert st["kv_blocks_used"] == 0
    tight.pool.check_invariants()


async def test_max_batch_size_queues_requests(sim):
    e = await sim(max_batch_size=1, decode_us=2000)
    s1 = await e.submit(req("a", prompt(5), max_tokens=20))
    s2 = await e.submit(req("b", prompt(5, 1), max_tokens=3))
    await wait_for(lambda: e.stats()["running"] == 1 and e.stats()["waiting"] == 1)
    assert e.abort("b")  # abort while waiting: holds no blocks, gets a final event
    evs = [ev async for ev in s2]
    assert evs[-1].finish_reason == "abort" and evs[-1].token_ids == []
    out = [ev async for ev in s1]
    assert out[-1].finish_reason == "length" and out[-1].completion_tokens == 20


async def test_abort_running_and_stream_close_free_blocks(sim):
    e = await sim(decode_us=2000)
    s = await e.submit(req("a", prompt(12), max_tokens=1000, aliases=("x-req-7",)))
    first = await s.__anext__()
    assert first.token_ids
    assert e.pool.num_used > 0
    assert e.abort("x-req-7"), "an alias names the request"
    rest = [ev async for ev in s]
    assert rest[-1].finish_reason == "abort"
    assert not e.abort("x-req-7"), "aborting twice finds nothing"
    s2 = await e.submit(req("b", prompt(12), max_tokens=1000))
    await s2.__anext__()
    await s2.aclose()  # the consumer went away (client disconnect)
    await wait_for(lambda: e.pool.num_used == 0)
    assert e.stats()["requests_finished"]["abort"] == 2


async def test_stop_strings_stop_token_ids_and_eos(sim):
    e = await sim()
    p = prompt(9)
    toks, text, _ = await run(e, req("a", p, max_tokens=16))
    stop = text[5:7]
    cut = text.index(stop)
    _, t2, l2 = await run(e, req("b", p, sampling=SamplingParams(max_tokens=16, temperature=0,
                                                                 stop=(stop,))))
    assert l2.finish_reason == "stop" and l2.stop_reason == stop and t2 == text[:cut]
    _, t3, l3 = await run(e, req("c", p, sampling=SamplingParams(
        max_tokens=16, temperature=0, stop_token_ids=(toks[3],))))
    first = toks.index(toks[3])
    assert l3.finish_reason == "stop" and l3.stop_reason == toks[3]
    assert l3.completion_tokens == first + 1 and t3 == text[:first]
    # the sim never samples EOS; a model's EOS arrives as a first_gen_token here
    g = await sim()
    eos = e.tokenizer.eos_token_ids[0]
    _, t4, l4 = await run(g, req("d", p, request_type=GENERATION_ONLY, first_gen_tokens=[eos],
                                 disaggregated_params={"ctx_request_id": 1}))
    assert l4.finish_reason == "stop" and t4 == "" and l4.completion_tokens == 1


async def test_two_leg_flow_matches_one_leg(sim):
    ctx = await sim()
    gen = await sim()
    p = prompt(27)
    want, want_text, _ = await run(gen, req("one", p, max_tokens=10))
    gen.clear_cache()
    t, _, lc = await run(ctx, req("c", p, max_tokens=10, request_type=CONTEXT_ONLY,
                                  ctx_request_id=555))
    c = lc.context
    assert lc.finish_reason == "length" and t == want[:1] and c.first_gen_tokens == want[:1]
    assert c.pinned and c.ctx_request_id == 555 and ctx.pinned_transfer(555) is not None
    assert ctx.pool.num_pinned == len(c.block_ids) == -(-27 // 4)
    g, g_text, lg = await run(gen, req("g", p, max_tokens=10, request_type=GENERATION_ONLY,
                                       first_gen_tokens=c.first_gen_tokens,
                                       disaggregated_params={"ctx_request_id": 555}))
    assert g == want and g_text == want_text and lg.completion_tokens == 10
    # generation_first: no first_gen_tokens, the gen side computes the first token itself
    g2, _, _ = await run(gen, req("g2", p, max_tokens=10, request_type=GENERATION_ONLY,
                                  disaggregated_params={"ctx_request_id": 555}))
    assert g2 == want
    assert ctx.release(555, "transferred") and not ctx.release(555)
    assert ctx.pool.num_used == 0 and ctx.stats()["pinned_transfers"] == 0


async def test_context_pins_are_released_by_abort_and_timeout(sim):
    e = await sim(pin_timeout_s=0.3)
    _, _, l1 = await run(e, req("c1", prompt(10), request_type=CONTEXT_ONLY, ctx_request_id=9,
                                aliases=("snow-9",)))
    assert e.pool.num_pinned > 0
    assert e.abort("snow-9"), "/v1/abort by the request's id releases a finished context's pins"
    assert e.pool.num_used == 0
    await run(e, req("c2", prompt(10), request_type=CONTEXT_ONLY, ctx_request_id=10))
    assert e.pool.num_used > 0
    await wait_for(lambda: e.pool.num_used == 0, timeout=3)
    assert e.counters["pins_released_timeout"] == 1


async def test_context_leg_that_stops_is_not_pinned(sim):
    e = await sim()
    p = prompt(10)
    toks, _, _ = await run(e, req("a", p, max_tokens=1))
    _, _, l = await run(e, req("c", p, request_type=CONTEXT_ONLY, ctx_request_id=3,
                               sampling=SamplingParams(max_tokens=5, temperature=0,
                                                       stop_token_ids=(toks[0],))))
    assert l.finish_reason == "stop" and not l.context.pinned
    assert e.pinned_transfer(3) is None and e.pool.num_used == 0


class SlowReceiver(KvConnector):
    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled = False
        self.specs = []

    async def receive(self, spec):
        self.specs.append(spec)
        self.started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class FailingReceiver(KvConnector):
    async def receive(self, spec):
        raise ConnectionError("peer went away")


async def test_generation_only_receive_abort_failure_and_missing_receiver(sim):
    rx = SlowReceiver()
    e = await sim(kv_connector=rx)
    s = await e.submit(req("g", prompt(13), request_type=GENERATION_ONLY, first_gen_tokens=[70],
                           aliases=("42",), disaggregated_params={"ctx_request_id": 42}))
    await asyncio.wait_for(rx.started.wait(), 5)
    spec = rx.specs[0]
    assert spec.ctx_request_id == 42 and len(spec.block_ids) == 4 and spec.block_size == 4
    assert e.pool.num_used == 4 and e.stats()["receiving"] == 1
    assert e.abort("42")
    evs = [ev async for ev in s]
    assert evs[-1].finish_reason == "abort"
    await wait_for(lambda: e.pool.num_used == 0)
    assert rx.cancelled
    e = await sim(kv_connector=FailingReceiver())
    _, _, l = await run(e, req("g2", prompt(13), request_type=GENERATION_ONLY,
                               first_gen_tokens=[70], disaggregated_params={"ctx_request_id": 1}))
    assert l.finish_reason == "error" and "peer went away" in l.error
    assert e.pool.num_used == 0
    e = await sim(kv_connector=None)
    with pytest.raises(TransferUnavailable) as ei:
        await e.submit(req("g3", prompt(13), request_type=GENERATION_ONLY, first_gen_tokens=[70]))
    assert ei.value.status == 501 and "KV transfer agent" in ei.value.message


async def test_a_failing_step_fails_its_requests_not_the_engine(sim):
    e = await sim()
    real = e.scheduler.execute
    calls = {"n": 0}

    async def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return await real(plan)

    e.scheduler.execute = flaky
    _, _, l = await run(e, req("a", prompt(10), max_tokens=5))
    assert l.finish_reason == "error" and "device fell over" in l.error
    assert e.pool.num_used == 0 and e.alive
    _, _, l2 = await run(e, req("b", prompt(10), max_tokens=5))
    assert l2.finish_reason == "length"


async def test_validation_errors_name_the_field(sim):
    e = await sim(num_blocks=8, block_size=4)  # 32 tokens of context at most
    cases = [
        (req("a", []), "prompt"),
        (req("b", [1, 2, 999]), "prompt"),
        (req("c", prompt(32)), "prompt"),
        (req("d", prompt(20), max_tokens=13), "max_tokens"),
        (req("e", prompt(5), max_tokens=0), "max_tokens"),
    ]
    for r, param in cases:
        with pytest.raises(InvalidRequest) as ei:
            await e.submit(r)
        assert ei.value.param == param, (r.request_id, ei.value.message)
    assert e.pool.num_used == 0 and e.stats()["waiting"] == 0
