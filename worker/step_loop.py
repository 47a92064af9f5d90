"""The scheduler's step loop (``StepLoop``) and the ledger of sequences held by launched steps
(``StepsInFlight``), two objects the ``worker.scheduler.Scheduler`` owns and calls.

``StepLoop`` runs one of two loops, picked at ``start``: ``run`` executes one step at a time;
``run_async`` keeps one step queued ahead (async scheduling) when the engine passes a ``launch``
callable. Both plan and apply through the callables the scheduler gives it; the loop owns only what
is its own: the wake-up event, the stop flag, the loop task and the in-flight ledger. Runs on the
event loop thread only.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from protocol.tasks import cancel_and_wait
from worker.sequence import Plan

log = logging.getLogger("splitserve.worker.scheduler")

__all__ = ["StepLoop", "StepsInFlight"]


class StepsInFlight:
    """Which sequences launched steps hold, and how many such steps per sequence.

    Invariants: a sequence id is present exactly while at least one step that planned it has been
    entered and not yet left (its count is that number, always >= 1); ``leave`` of a plan undoes
    ``enter`` of the same plan. Blocks of a sequence present here must not be handed to anyone else
    (the model may still write them), which is why the scheduler asks ``holds`` before freeing."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def enter(self, plan: Plan) -> None:
        for e in plan.entries:
            sid = e[0].id
            self._count[sid] = self._count.get(sid, 0) + 1

    def leave(self, plan: Plan) -> None:
        for e in plan.entries:
            sid = e[0].id
            left = self._count.get(sid, 0) - 1
            if left > 0:
                self._count[sid] = left
            else:
                self._count.pop(sid, None)

    def holds(self, sid: str) -> bool:
        return sid in self._count

    def steps_holding(self, sid: str) -> int:
        return self._count.get(sid, 0)

    def clear(self) -> None:
        self._count.clear()

    def __bool__(self) -> bool:
        return bool(self._count)

    def __len__(self) -> int:
        return len(self._count)


def mark_launched(plan: Plan) -> None:
    """Async scheduling: a queued step counts as computed; its samples are in flight (the engine
    feeds each on the device from row ``feed_row`` of the step that samples it)."""
    for i, (s, start, n, sample) in enumerate(plan.entries):
        s.num_computed = start + n
        if sample:
            s.inflight += 1
            s.feed_row = i


class StepLoop:
    """Plan a step, run it, apply it, publish events; sleep on ``wake`` when there is nothing to plan.

    ``plan()`` returns the next step (None or an empty plan: nothing to run now); ``execute(plan)``
    runs one step and returns its samples; ``launch(plan)`` (async scheduling) queues one and returns
    an awaitable of them; ``apply(plan, sampled, error)`` applies a step's outcome; ``flush()``
    publishes pending KV events. The callables are attributes looked up on every step. Every step
    entered into ``in_flight`` is left before it is applied, on every path (errors included)."""

    def __init__(self, *, plan: Callable[[], Plan | None], execute: Callable[[Plan], Awaitable[Any]],
                 launch: Callable[[Plan], Awaitable[Any]] | None,
                 apply: Callable[[Plan, Any, str | None], None], flush: Callable[[], None]):
        self.plan = plan
        self.execute = execute
        self.launch = launch
        self.apply = apply
        self.flush = flush
        self.in_flight = StepsInFlight()
        self.stopping = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._alive = False

    def wake(self) -> None:
        """Something changed (a request, a finish, freed blocks): plan again."""
        self._wake.set()

    def start(self, name: str) -> None:
        if self._task is not None:
            return
        self._alive = True
        run = self.run_async() if self.launch is not None else self.run()
        self._task = asyncio.create_task(run, name=name)

    async def stop(self) -> None:
        """Stop planning and cancel the loop; steps in flight are forgotten (the caller fails their
        requests)."""
        self.stopping = True
        self._wake.set()
        await cancel_and_wait(self._task)
        self.in_flight.clear()
        self._alive = False

    @property
    def alive(self) -> bool:
        """True while the loop task runs."""
        return self._alive and self._task is not None and not self._task.done()

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    async def run(self) -> None:
        try:
            while not self.stopping:
                plan = self.plan()
                self.flush()
                if plan is None or not plan.entries:
                    await self._idle()
                    continue
                self.in_flight.enter(plan)
                try:
                    sampled = await self.execute(plan)
                    error = None
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a failed step fails its requests, not the worker
                    log.exception("engine step failed")
                    sampled, error = None, f"engine step failed: {type(e).__name__}: {e}"
                finally:
                    self.in_flight.leave(plan)
                self.apply(plan, sampled, error)
                self.flush()
                # Let HTTP handlers run between steps even when the step itself never yields.
                await asyncio.sleep(0)
        finally:
            self._alive = False

    async def run_async(self) -> None:
        """The loop with one step always queued ahead (vLLM's async scheduling): plan and launch step
        k+1 while step k runs on the device, then apply step k's tokens. A sequence sampled by step k
        is planned into step k+1 before its token is known: the engine feeds that token on the device
        (``Seq.feed_row``), so the host's planning and input preparation overlap the device's work.

        What this changes against ``run``: a sequence that stops on a token it cannot foresee (EOS,
        a stop id or string) has run one step more, whose token is discarded and whose blocks are freed
        once that step is applied; one that ends by ``max_tokens`` or the context limit is never
        planned past its end. Tokens are the same (every step computes what ``run``'s would). A
        preemption is planned only when no step is in flight (the loop drains first)."""
        inflight: tuple[Plan, Any, str | None] | None = None
        try:
            while not self.stopping:
                plan = self.plan()
                self.flush()
                launched = None
                if plan is not None and plan.entries:
                    self.in_flight.enter(plan)
                    try:
                        launched = (plan, await self.launch(plan), None)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        log.exception("engine step failed")
                        launched = (plan, None, f"engine step failed: {type(e).__name__}: {e}")
                    mark_launched(plan)
                elif inflight is None:
                    await self._idle()
                    continue
                if inflight is not None:
                    await self._complete(*inflight)
                inflight = launched
                await asyncio.sleep(0)
        finally:
            self._alive = False

    async def _complete(self, plan: Plan, result, error: str | None) -> None:
        sampled = None
        if error is None:
            try:
                sampled = await result
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("engine step failed")
                error = f"engine step failed: {type(e).__name__}: {e}"
        self.in_flight.leave(plan)
        self.apply(plan, sampled, error)
        self.flush()
