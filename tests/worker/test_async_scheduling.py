"""Async scheduling (worker/step_loop.py ``StepLoop.run_async``, worker/engine.py ``TorchEngine._launch``): step
k+1 is planned and queued before step k's tokens reach the host, its decode rows fed on the device.
On the tiny preset (CPU) the tokens, finish reasons and usage equal the synchronous loop's for
batches mixing short and long prompts, chunked prefill, stops by EOS / stop id / stop string /
max_tokens, seeded sampling, aborts and preemption; every block comes back."""
from __future__ import annotations

import asyncio

import pytest

from tests.worker.conftest import make_torch_engine, prompt
from worker.requests import EngineRequest, SamplingParams



async def run(engine, r):
    stream = await engine.submit(r)
    toks, last = [], None
    async for ev in stream:
        toks += ev.token_ids
        last = ev
    return toks, last.finish_reason, last.completion_tokens


async def both(engines, reqs, **kw):
    """Run ``reqs()`` (fresh requests each call) on a synchronous and an async engine at once each."""
    sync = await engines(async_scheduling=False, **kw)
    fast = await engines(async_scheduling=True, **kw)
    assert not sync.async_scheduling and fast.async_scheduling
    a = await asyncio.gather(*(run(sync, r) for r in reqs()))
    b = await asyncio.gather(*(run(fast, r) for r in reqs()))
    return sync, fast, a, b


async def test_tokens_equal_the_synchronous_loop_with_every_kind_of_stop(engines):
    # Greedy continuations of these prompts, found with the synchronous loop, give the stop id and
    # string below something to hit mid-stream.
    probe = await engines(async_scheduling=False, num_blocks=256, block_size=8)
    ref, _, _ = await run(probe, EngineRequest("probe", prompt(70, 1), SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True)))
    stop_id = ref[5]
    stop_text = bytes([ref[3]]).decode("latin-1") if ref[3] < 128 else None

    def reqs():
        out = [
            EngineRequest("long", prompt(70, 1), SamplingParams(max_tokens=12, temperature=0.0,
                                                                stop_token_ids=[stop_id], ignore_eos=True)),
            EngineRequest("short", prompt(5, 2), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
            EngineRequest("one", prompt(9, 3), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)),
            EngineRequest("eos", prompt(12, 4), SamplingParams(max_tokens=30, temperature=0.0)),
            EngineRequest("seeded", prompt(33, 5), SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9,
                                                                  top_k=30, seed=7, ignore_eos=True)),
            EngineRequest("mid", prompt(41, 6), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
        ]
        if stop_text is not None:
            out.append(EngineRequest("text", prompt(70, 1), SamplingParams(max_tokens=12, temperature=0.0,
                                                                           stop=[stop_text], ignore_eos=True)))
        return out

    sync, fast, a, b = await both(engines, reqs, num_blocks=256, block_size=8, max_num_tokens=24)
    assert b == a
    by_id = dict(zip([r.request_id for r in reqs()], a))
    assert by_id["long"][1] == "stop" and by_id["long"][0][-1] == stop_id and len(by_id["long"][0]) == 6
    assert by_id["one"][0] and len(by_id["one"][0]) == 1 and by_id["short"][2] == 20
    # one step queued ahead: a stop the host cannot foresee costs at most one extra step per stop
    assert fast.stats()["steps_total"] <= sync.stats()["steps_total"] + len(a)


async def test_async_loop_queues_the_next_step_before_applying_the_last(engines):
    e = await engines(async_scheduling=True, num_blocks=128, block_size=8)
    order = []
    launch, apply = e.scheduler.launch, e.scheduler.loop.apply
    count = {"launch": 0, "apply": 0}

    async def traced_launch(plan):
        count["launch"] += 1
        order.append(("launch", count["launch"]))
        return await launch(plan)

    def traced_apply(plan, sampled, error):
        count["apply"] += 1
        order.append(("apply", count["apply"]))
        return apply(plan, sampled, error)

    e.scheduler.launch, e.scheduler.loop.apply = traced_launch, traced_apply
    toks, reason, n = await run(e, EngineRequest("a", prompt(10), SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True)))
    assert reason == "length" and n == 8 == len(toks)
    # step k+1 is launched before step k is applied, for every step but the last
    for k in range(1, count["apply"]):
        assert order.index(("launch", k + 1)) < order.index(("apply", k)), order
    assert count["launch"] == count["apply"] == 8  # max_tokens is foreseen: no wasted step


async def test_abort_and_preemption_under_async_scheduling_leak_nothing(engines):
    # 12 blocks of 4 tokens: three growing sequences cannot all fit, so someone gets preempted
    def reqs():
        return [EngineRequest(f"p{i}", prompt(9 + i, i), SamplingParams(max_tokens=14, temperature=0.0,
                                                                         ignore_eos=True)) for i in range(3)]

    sync, fast, a, b = await both(engines, reqs, num_blocks=12, block_size=4)
    assert b == a
    assert fast.stats()["preemptions_total"] > 0 and sync.stats()["preemptions_total"] > 0
    # an abort while steps are in flight
    stream = await fast.submit(EngineRequest("gone", prompt(10), SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True)))
    got = 0
    async for ev in stream:
        got += len(ev.token_ids)
        if got == 3:
            await stream.aclose()
            break
    # the steps still in flight are applied, then the aborted request's blocks are freed
    for _ in range(200):
        if not fast.scheduler.loop.in_flight and fast.pool.num_used == 0:
            break
        await asyncio.sleep(0.01)
    assert len(fast.scheduler._requests) == 0 and not fast.scheduler.loop.in_flight
    assert fast.pool.num_used == 0, f"{fast.pool.num_used} blocks held after the abort"


def _feed_case(runner):
    """Two prefilled sequences, then one decode step twice: tokens given on the host, and the same
    tokens taken on the device from ``step_tokens`` (rows 2 and 0 of it); then a step mixing a fed
    decode row with a prefill chunk (the eager path). Every fed step leaves its argmax tokens in
    ``step_tokens``."""
    import torch

    from worker.runner import Chunk

    seqs = [prompt(13), prompt(29, 1)]
    tables = [list(range(0, 8)), list(range(8, 16))]
    runner.step([Chunk(s, 0, t) for s, t in zip(seqs, tables)])
    toks = [77, 201]
    host = runner.step([Chunk([toks[i]], len(s), t) for i, (s, t) in enumerate(zip(seqs, tables))])
    runner.token_buffer(3)[:3] = torch.tensor([toks[1], 5, toks[0]])
    fed = runner.step([Chunk([0], len(s), t) for s, t in zip(seqs, tables)], feed_index=[2, 0])
    assert runner.step_tokens[:2].tolist() == fed.argmax(-1).tolist()
    other = Chunk(prompt(9, 2), 0, list(range(16, 20)))
    mixed_host = runner.step([Chunk([toks[0]], len(seqs[0]), tables[0]), other])
    runner.step_tokens[:3] = torch.tensor([toks[1], 5, toks[0]])
    mixed_fed = runner.step([Chunk([0], len(seqs[0]), tables[0]), other], feed_index=[2, -1])
    assert runner.step_tokens[:2].tolist() == mixed_fed.argmax(-1).tolist()
    return host, fed, mixed_host, mixed_fed


def test_runner_feeds_tokens_from_the_device(tiny_model):
    from worker.runner import Chunk, ModelRunner, RunnerInputError

    runner = ModelRunner(tiny_model, num_blocks=32, block_size=8)
    host, fed, mixed_host, mixed_fed = _feed_case(runner)
    assert (host == fed).all() and (mixed_host == mixed_fed).all()
    with pytest.raises(RunnerInputError, match="one token"):
        runner.step([Chunk([1, 2], 0, [30]), Chunk([3], 5, [31])], feed_index=[-1, 0][::-1])
    with pytest.raises(RunnerInputError, match="entries for 1 chunks"):
        runner.step([Chunk([1], 0, [30])], feed_index=[0, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_runner_feeds_tokens_from_the_device_on_cuda(graphs):
    import torch

    from worker.presets import build_preset
    from worker.runner import ModelRunner

    model = build_preset("tiny", device="cuda", dtype=torch.bfloat16)
    runner = ModelRunner(model, num_blocks=32, block_size=8, cuda_graphs=graphs)
    host, fed, mixed_host, mixed_fed = _feed_case(runner)
    assert graphs == bool(runner.graphs.captured)
    assert torch.equal(host, fed) and torch.equal(mixed_host, mixed_fed)


@pytest.mark.gpu
async def test_async_scheduling_on_cuda_equals_sync_with_long_and_short_rows():
    import torch

    from worker.presets import build_preset

    model = build_preset("tiny", device="cuda", dtype=torch.bfloat16)

    def reqs():
        return [EngineRequest("long", prompt(700, 1), SamplingParams(max_tokens=24, temperature=0.0,
                                                                     ignore_eos=True))] + [
            EngineRequest(f"s{i}", prompt(20 + 3 * i, i), SamplingParams(
                max_tokens=10 + i, temperature=0.0 if i % 2 else 0.7, seed=i, stop_token_ids=[(i * 37) % 250]))
            for i in range(12)]

    got = []
    for flag in (False, True):
        e = make_torch_engine(model, num_blocks=256, block_size=16, max_num_tokens=256, async_scheduling=flag)
        assert e.async_scheduling is flag
        await e.start()
        try:
            got.append(await asyncio.gather(*(run(e, r) for r in reqs())))
        finally:
            await e.stop()
        e.pool.check_invariants()
        assert e.pool.num_used == 0
    assert got[1] == got[0]
