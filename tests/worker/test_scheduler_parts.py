"""The scheduler's parts, each alone: ``StepsInFlight`` (worker/step_loop.py), ``StepLoop`` driven by
plain callables, and ``RequestTable`` (worker/request_table.py). The scheduler composed of them is
tested end to end in test_engine_sim.py and test_async_scheduling.py."""
from __future__ import annotations

import asyncio

import pytest

from protocol.tokenizer import ByteTokenizer
from worker.detokenizer import IncrementalDetokenizer
from worker.request_table import RequestTable
from worker.requests import EngineRequest, SamplingParams
from worker.sequence import Plan, Seq
from worker.step_loop import StepLoop, StepsInFlight


def seq(rid: str, aliases=()) -> Seq:
    req = EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), aliases=tuple(aliases))
    return Seq(req, IncrementalDetokenizer(ByteTokenizer(), req.prompt_token_ids))


def plan_of(*seqs: Seq) -> Plan:
    p = Plan()
    for s in seqs:
        p.entries.append((s, 0, 3, True))
    return p


def test_in_flight_counts_each_step_holding_a_sequence_until_it_is_left():
    a, b = seq("a"), seq("b")
    ledger = StepsInFlight()
    first, second = plan_of(a, b), plan_of(a)
    ledger.enter(first)
    ledger.enter(second)
    assert ledger.steps_holding("a") == 2 and ledger.steps_holding("b") == 1 and len(ledger) == 2
    ledger.leave(first)
    assert ledger.holds("a") and not ledger.holds("b") and ledger.steps_holding("a") == 1
    ledger.leave(second)
    assert not ledger and ledger.steps_holding("a") == 0
    ledger.leave(second)  # leaving more than entered never goes negative
    assert not ledger.holds("a") and len(ledger) == 0


def test_request_table_reaches_a_sequence_by_every_name_until_it_is_removed():
    t = RequestTable()
    a, b = seq("a", aliases=("x-1", "shared")), seq("b", aliases=("shared",))
    t.add(a, ("x-1", "shared", 42))
    t.add(b, b.req.aliases)
    assert "a" in t and t.get("a") is a and len(t) == 2
    assert t.named("x-1") == ["a"] and t.named(42) == ["a"] and sorted(t.named("shared")) == ["a", "b"]
    with pytest.raises(ValueError, match="already live"):
        t.add(seq("a"), ())
    t.remove(a)
    assert "a" not in t and t.named("x-1") == [] and t.named("42") == [] and t.named("shared") == ["b"]
    t.remove(a)  # idempotent
    t.remove(b)
    assert len(t) == 0 and t.named("shared") == [] and list(t) == []


async def test_a_failed_step_is_applied_with_its_error_and_leaves_nothing_in_flight():
    s = seq("a")
    plans = [plan_of(s)]
    applied = []
    loop = None

    async def execute(plan):
        assert loop.in_flight.holds("a")  # the step holds its sequence while it runs
        raise RuntimeError("device lost")

    def apply(plan, sampled, error):
        applied.append((sampled, error, loop.in_flight.holds("a")))

    loop = StepLoop(plan=lambda: plans.pop() if plans else None, execute=execute, launch=None,
                    apply=apply, flush=lambda: None)
    loop.start("test-loop")
    for _ in range(100):
        if applied:
            break
        await asyncio.sleep(0.01)
    assert applied == [(None, "engine step failed: RuntimeError: device lost", False)]
    assert loop.alive  # a failed step fails its requests, not the loop
    await loop.stop()
    assert not loop.alive and loop.stopping


async def test_the_async_loop_launches_the_next_step_before_applying_the_last():
    a = seq("a")
    order: list[str] = []
    steps = iter(range(3))

    def plan():
        k = next(steps, None)
        if k is None:
            return None
        order.append(f"plan{k}")
        return plan_of(a)

    async def launch(p):
        k = len([o for o in order if o.startswith("launch")])
        order.append(f"launch{k}")
        fut = asyncio.get_running_loop().create_future()
        fut.set_result([7])
        return fut

    loop = StepLoop(plan=plan, execute=None, launch=launch,
                    apply=lambda p, sampled, error: order.append(f"apply{sampled}"), flush=lambda: None)
    loop.start("test-async-loop")
    for _ in range(100):
        if order.count("apply[7]") == 3:
            break
        await asyncio.sleep(0.01)
    await loop.stop()
    assert order.index("launch1") < order.index("apply[7]")
    assert order.count("apply[7]") == 3 and not loop.in_flight
    # a launched step counts as computed and its sample as in flight until applied
    assert a.num_computed == 3 and a.inflight == 3 and a.feed_row == 0
