"""The scheduler's step loop: ``StepLoopMixin``, which ``worker.scheduler.Scheduler`` inherits.

Two loops, picked by ``Scheduler.start``: ``_run`` executes one step at a time; ``_run_async`` keeps one
step queued ahead (async scheduling) when the engine passes a ``launch`` callable. Both plan with the
scheduler's ``_schedule`` and apply with ``_apply`` (worker/step_apply.py); the bookkeeping of which
sequences a launched step holds (``_in_step``) lives here. Runs on the event loop thread only.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from worker.requests import CONTEXT_ONLY
from worker.sequence import Plan, Seq

log = logging.getLogger("splitserve.worker.scheduler")

__all__ = ["StepLoopMixin"]


class StepLoopMixin:
    """The step loops of ``Scheduler`` (state and planning live there)."""

    async def _run(self) -> None:
        try:
            while not self._stopping:
                plan = self._schedule() if (self._running or self._waiting) else None
                self._flush_events()
                if plan is None or not plan.entries:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._enter_step(plan)
                try:
                    sampled = await self.execute(plan)
                    error = None
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a failed step fails its requests, not the worker
                    log.exception("engine step failed")
                    sampled, error = None, f"engine step failed: {type(e).__name__}: {e}"
                finally:
                    self._leave_step(plan)
                self._apply(plan, sampled, error)
                self._flush_events()
                # Let HTTP handlers run between steps even when the step itself never yields.
                await asyncio.sleep(0)
        finally:
            self._alive = False

    async def _run_async(self) -> None:
        """The loop with one step always queued ahead (vLLM's async scheduling): plan and launch step
        k+1 while step k runs on the device, then apply step k's tokens. A sequence sampled by step k
        is planned into step k+1 before its token is known: the engine feeds that token on the device
        (``Seq.feed_row``), so the host's planning and input preparation overlap the device's work.

        What this changes against ``_run``: a sequence that stops on a token it cannot foresee (EOS,
        a stop id or string) has run one step more, whose token is discarded and whose blocks are freed
        once that step is applied; one that ends by ``max_tokens`` or the context limit is never
        planned past its end. Tokens are the same (every step computes what ``_run``'s would). A
        preemption is planned only when no step is in flight (the loop drains first)."""
        inflight: tuple[Plan, Any, str | None] | None = None
        try:
            while not self._stopping:
                plan = self._schedule() if (self._running or self._waiting) else None
                self._flush_events()
                launched = None
                if plan is not None and plan.entries:
                    self._enter_step(plan)
                    try:
                        launched = (plan, await self.launch(plan), None)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        log.exception("engine step failed")
                        launched = (plan, None, f"engine step failed: {type(e).__name__}: {e}")
                    self._launched(plan)
                elif inflight is None:
                    self._wake.clear()
                    await self._wake.wait()
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
        self._leave_step(plan)
        self._apply(plan, sampled, error)
        self._flush_events()

    def _enter_step(self, plan: Plan) -> None:
        for e in plan.entries:
            self._in_step[e[0].id] = self._in_step.get(e[0].id, 0) + 1

    def _leave_step(self, plan: Plan) -> None:
        for e in plan.entries:
            sid = e[0].id
            left = self._in_step.get(sid, 0) - 1
            if left > 0:
                self._in_step[sid] = left
            else:
                self._in_step.pop(sid, None)

    def _launched(self, plan: Plan) -> None:
        """Async scheduling: a queued step counts as computed; its samples are in flight."""
        for i, (s, start, n, sample) in enumerate(plan.entries):
            s.num_computed = start + n
            if sample:
                s.inflight += 1
                s.feed_row = i

    def _ends_with_inflight(self, s: Seq) -> bool:
        """Whether the token ``s`` has in flight is certain to finish it (no step to plan after it)."""
        sp = s.req.sampling
        return (s.num_output + s.inflight >= sp.max_tokens or len(s.tokens) + s.inflight >= self.max_model_len
                or s.req.request_type == CONTEXT_ONLY)
