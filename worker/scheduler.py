"""Continuous-batching scheduler shared by the torch and sim engines (no torch imported here).

One asyncio task runs the loop: plan a step, execute it (the ``execute`` callable its engine passes
in: a model step in a worker thread, or a simulated sleep), apply the sampled tokens, publish KV
events, repeat. The engines own a ``Scheduler`` (worker/engine.py, worker/sim.py); pinned
transfers live in worker/pins.py, counters and the ``stats()`` dict (``SchedulerStats.snapshot``)
in worker/sched_stats.py, the per-request state in worker/sequence.py. This file holds the
``Scheduler`` itself (requests, pins, planning, applying a step, finishing, generation_only receives)
and owns three objects: its ``StepLoop`` (worker/step_loop.py: the loop task, wake-ups, and the
``StepsInFlight`` ledger of sequences held by launched steps), its ``RequestTable``
(worker/request_table.py: live requests by id and by every name they can be aborted by) and its
``PinTable``.
Everything that touches scheduler state runs on the event loop thread, so there are no locks.

Step planning (``_schedule``), under ``max_num_tokens`` tokens and ``max_batch_size`` sequences:

1. running sequences with one token to feed (decodes), in admission order;
2. running sequences still prefilling (chunked: a chunk takes what is left of the budget);
3. waiting sequences, first come first served: a prefix-cache lookup (capped so at least one
   prompt token is computed), then a first chunk. A waiting sequence that does not fit waits.

A running sequence that cannot get a block preempts the most recently admitted other running
sequence (its blocks go back to the pool, cached where committed, and it is recomputed later:
recomputation reuses its own cached blocks) or, if there is none, itself.

Request lifecycle invariants:

* a request holds blocks only while RUNNING or RECEIVING; WAITING requests hold none;
* every path out (finish, abort, error, preemption, engine stop) returns exactly the blocks it
  holds; a finished ``context_only`` request converts its references into pins owned by the
  pinned-transfer table, which ``release`` (transfer done, cancel, abort, timeout) undoes;
* the blocks of a sequence inside an executing step are freed only after the step returns, so
  the model never writes into a block that was handed to someone else.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Awaitable, Callable

from protocol.tasks import cancel_and_wait
from router.block_keys import KEY_SCHEME, block_keys_list
from worker.detokenizer import IncrementalDetokenizer
from worker.kv_cache import BlockPool
from worker.pins import PinTable
from worker.requests import (
    CONTEXT_ONLY, GENERATION_ONLY, ContextResult, EngineRequest, EngineStopped, InvalidRequest,
    PinnedTransfer, ReceiveSpec, TokenEvent, TransferUnavailable,
)
from worker.sched_stats import SchedulerStats
from worker.request_table import RequestTable
from worker.sequence import FINISHED, RECEIVING, RUNNING, WAITING, Plan, RequestStream, Seq
from worker.step_loop import StepLoop

log = logging.getLogger("splitserve.worker.scheduler")

__all__ = ["Scheduler", "RequestStream", "Plan", "Seq", "StepFn"]

#: Runs one step: one sampled token per plan entry (None where ``sample`` is False).
StepFn = Callable[[Plan], Awaitable[list[int | None]]]
#: Async scheduling: queues one step and returns at once with an awaitable of what ``StepFn`` returns.
LaunchFn = Callable[[Plan], Awaitable[Awaitable[list[int | None]]]]


class _Quiesce(Exception):
    """Planning needs a preemption, which must wait until no step is in flight."""


class Scheduler:
    """The engine core, owned by an engine. ``execute(plan)`` runs one step (the engine's model
    or simulation; the scheduler looks it up on every step). ``prefix_reuse=False`` never reuses
    a cached block (the sim engine's engine-that-lies mode); blocks are still committed."""

    def __init__(self, *, execute: StepFn, pool: BlockPool, tokenizer, eos_token_ids,
                 vocab_size: int, max_model_len: int, max_batch_size: int = 64,
                 max_num_tokens: int = 2048, pin_timeout_s: float = 60.0,
                 worker_id: str = "worker", kv_connector=None, engine_name: str = "base",
                 prefix_reuse: bool = True, clock: Callable[[], float] = time.monotonic,
                 launch: LaunchFn | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self._stats = SchedulerStats(clock)
        self.counters = self._stats.counters
        self.pins = PinTable(pool, timeout_s=pin_timeout_s, counters=self.counters, clock=clock,
                             on_release=self._pin_released)
        self.execute = execute
        #: Async scheduling (worker/step_loop.py ``StepLoop.run_async``) when the engine can queue a step
        #: without waiting.
        self.launch = launch
        self.engine_name = engine_name
        self.prefix_reuse = bool(prefix_reuse)
        self.pool = pool
        self.tokenizer = tokenizer
        self.block_size = pool.block_size
        self.eos_token_ids = frozenset(int(t) for t in (eos_token_ids or ()))
        self.vocab_size = int(vocab_size)
        # A sequence longer than the whole pool could never finish, even alone.
        self.max_model_len = min(int(max_model_len), pool.num_blocks * pool.block_size)
        self.max_batch_size = int(max_batch_size)
        self.max_num_tokens = int(max_num_tokens)
        self.pin_timeout_s = float(pin_timeout_s)
        self.worker_id = worker_id
        # How KV crosses workers (worker/kv_connector.py): its hooks are called below, at fixed
        # points of a request's life. None: generation_only requests are refused (501).
        self.kv_connector = kv_connector
        # The URL this worker is reachable at; context responses carry it in the opaque state so
        # the generation side knows whom to tell that a transfer finished.
        self.worker_url: str | None = None
        self.event_sink: Callable[[list], None] | None = None
        self._waiting: collections.deque[Seq] = collections.deque()
        self._running: list[Seq] = []
        self._receiving: dict[str, Seq] = {}
        self._requests = RequestTable()
        # execute and launch are looked up on the scheduler at every step: an engine (or a test)
        # may replace them after the loop is built.
        self.loop = StepLoop(
            plan=self._next_plan, execute=lambda plan: self.execute(plan),
            launch=None if launch is None else (lambda plan: self.launch(plan)),
            apply=self._apply, flush=self._flush_events)
        #: Sequences inside launched steps, not yet applied: their blocks must not be freed yet.
        self._in_step = self.loop.in_flight
        self._sweep_task: asyncio.Task | None = None
        self._local_ids = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._sweep_task is not None:
            return
        self.loop.start(name=f"{self.engine_name}-engine-loop")
        self._sweep_task = asyncio.create_task(self.pins.run_sweeper(),
                                               name="pinned-transfer-sweep")

    async def stop(self) -> None:
        """Abort every request, release every pin, stop the loop. Blocks return to the pool."""
        self.loop.stopping = True
        if self._sweep_task is not None:
            self._sweep_task.cancel()
        await self.loop.stop()
        await cancel_and_wait(self._sweep_task)
        for sid in self._requests.ids():
            self._finish_by_id(sid, "abort", error="engine stopped")
        tasks = [s.receive_task for s in list(self._receiving.values()) if s.receive_task]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.pins.release_all("shutdown")
        self._flush_events()

    @property
    def alive(self) -> bool:
        """True while the loop task runs (``/health``)."""
        return self.loop.alive

    # ------------------------------------------------------------------ requests
    def next_local_id(self) -> int:
        """Worker-local ids stay below 2**40 (docs/design.md §3), never colliding with snowflakes."""
        self._local_ids = (self._local_ids + 1) % (1 << 40)
        return self._local_ids

    def validate(self, req: EngineRequest) -> None:
        """Raise a typed ``EngineError`` for a request this engine can never run."""
        if self.loop.stopping:
            raise EngineStopped("the worker is shutting down")
        p = req.prompt_token_ids
        if not p:
            raise InvalidRequest("the prompt is empty; expected at least one token", param="prompt")
        bad = [t for t in p if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequest(
                f"prompt token ids must be ints in [0, {self.vocab_size}); found {bad[:5]}",
                param="prompt")
        sp = req.sampling
        if sp.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {sp.max_tokens}", param="max_tokens")
        if len(p) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(p)} tokens; this worker's maximum context is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)",
                param="prompt", code="context_length_exceeded")
        if len(p) + sp.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(p)} tokens) plus max_tokens ({sp.max_tokens}) exceeds this worker's "
                f"maximum context of {self.max_model_len} tokens",
                param="max_tokens", code="context_length_exceeded")
        if req.request_id in self._requests:
            raise InvalidRequest(f"request id {req.request_id!r} is already running",
                                 param="request_id", code="duplicate_request_id")
        if req.request_type == GENERATION_ONLY:
            if self.kv_connector is None:
                raise TransferUnavailable(
                    "this worker cannot serve generation_only requests: generation_only needs a "
                    "KV transfer agent to receive the context worker's KV cache, and none is "
                    "configured on this worker", param="disaggregated_params.request_type",
                    code="transfer_unavailable")
            fg = req.first_gen_tokens
            if fg is not None:
                if not fg or any(not (isinstance(t, int) and 0 <= t < self.vocab_size) for t in fg):
                    raise InvalidRequest(
                        f"first_gen_tokens must be a non-empty list of token ids in "
                        f"[0, {self.vocab_size}); got {fg!r}",
                        param="disaggregated_params.first_gen_tokens")
                if len(fg) > sp.max_tokens:
                    raise InvalidRequest(
                        f"{len(fg)} first_gen_tokens exceed max_tokens {sp.max_tokens}",
                        param="max_tokens")

    async def submit(self, req: EngineRequest) -> RequestStream:
        """Validate and enqueue; iterate the returned stream for ``TokenEvent``s."""
        self.validate(req)
        if req.request_type == CONTEXT_ONLY and req.ctx_request_id is None:
            req.ctx_request_id = self.next_local_id()
        seq = Seq(req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                              req.sampling.stop))
        self._requests.add(seq, (*req.aliases, req.ctx_request_id) if req.request_type == CONTEXT_ONLY
                           else req.aliases)
        self._waiting.append(seq)
        self.counters["requests_submitted"] += 1
        if self.kv_connector is not None and req.request_type == GENERATION_ONLY:
            # told at once, before the receive (which may wait for free blocks) begins
            self.kv_connector.receive_expected(req)
        self.loop.wake()
        return RequestStream(self.abort, seq)

    def abort(self, request_id) -> bool:
        """Abort whatever ``request_id`` names (request id, alias, or ``ctx_request_id`` of a
        pinned transfer). True if anything was aborted or released."""
        key = str(request_id)
        hit = False
        for sid in self._requests.named(key):
            hit |= self._finish_by_id(sid, "abort")
        for cid in self.pins.named(key):
            hit |= self.pins.release(cid, "abort")
        if hit:
            self.loop.wake()
        return hit

    def fail_requests(self, error: str) -> None:
        """Fail every request outside the executing step (those fail when their step returns,
        e.g. a step a dead rank aborted)."""
        for sid in self._requests.ids():
            if not self._in_step.holds(sid):
                self._finish_by_id(sid, "error", error=error)

    # ------------------------------------------------------------------ pinned transfers
    def pinned_transfer(self, ctx_request_id) -> PinnedTransfer | None:
        return self.pins.get(ctx_request_id)

    def pinned_transfers(self) -> list[PinnedTransfer]:
        return self.pins.values()

    def release(self, ctx_request_id, reason: str = "transferred") -> bool:
        """Unpin a finished context request's blocks (transfer done, cancelled, aborted, timed
        out). Idempotent: False when nothing is pinned under that id."""
        return self.pins.release(ctx_request_id, reason)

    def sweep_pins(self) -> int:
        """Release pins whose deadline passed; returns how many."""
        return self.pins.sweep()

    def _pin_released(self, ctx_request_id: int, reason: str) -> None:
        self.loop.wake()   # freed blocks may let a waiting request in
        if self.kv_connector is not None:
            self.kv_connector.pin_released(ctx_request_id, reason)

    # ------------------------------------------------------------------ cache control
    def clear_cache(self) -> None:
        """Drop every prefix-cache entry (``AllBlocksCleared``); running requests keep going."""
        self.pool.clear()
        for s in self._requests:
            s.num_committed = len(s.blocks) if s.state in (RUNNING, RECEIVING) else 0
        self._flush_events()

    def flush_events(self) -> None:
        """Hand pending pool events to the sink now (the snapshot handler calls this first)."""
        self._flush_events()

    def _flush_events(self) -> None:
        if self.pool.has_pending_events:
            evs = self.pool.drain_events()
            if self.event_sink is not None and evs:
                self.event_sink(evs)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        return self._stats.snapshot(
            engine=self.engine_name, running=len(self._running) + len(self._receiving),
            waiting=len(self._waiting), receiving=len(self._receiving),
            pinned_transfers=len(self.pins), pool=self.pool)

    # ------------------------------------------------------------------ planning
    def _blocks_for(self, ntokens: int) -> int:
        return -(-ntokens // self.block_size)

    def _next_plan(self) -> Plan | None:
        return self._schedule() if (self._running or self._waiting) else None

    def _schedule(self) -> Plan:
        try:
            return self._schedule_once()
        except _Quiesce:
            # Nothing was launched or admitted (running sequences plan before waiting ones): an empty
            # plan lets the loop apply what is in flight and plan again with the preemption allowed.
            return Plan()

    def _schedule_once(self) -> Plan:
        plan = Plan()
        budget = self.max_num_tokens
        planned: set[str] = set()

        # Running sequences: decodes first, then prefill chunks.
        for phase in (1, 2):
            for s in list(self._running):
                if budget <= 0:
                    break
                if s.state != RUNNING or s.id in planned:
                    continue
                if (s.pending == 1) != (phase == 1):
                    continue
                if s.inflight and self._ends_with_inflight(s):
                    continue
                n = self._grow(s, min(s.pending, budget), planned, preempt=True)
                if n <= 0:
                    continue
                self._plan(plan, s, n)
                planned.add(s.id)
                budget -= n

        # Waiting sequences, FCFS.
        while self._waiting and budget > 0 and self._num_active() < self.max_batch_size:
            s = self._waiting[0]
            if s.req.request_type == GENERATION_ONLY and not s.admitted:
                if not self._start_receive(s):
                    break
                continue
            if not s.blocks:
                self._match_prefix(s)
            n = self._grow(s, min(s.pending, budget), planned, preempt=False)
            if n <= 0:
                # Does not fit now; give back the prefix hit until blocks free up.
                self.pool.free(s.blocks)
                s.blocks, s.num_computed, s.num_committed = [], 0, 0
                break
            self._waiting.popleft()
            s.state = RUNNING
            self._running.append(s)
            if not s.admitted:
                s.admitted = True
                s.cached_tokens = s.num_computed
                self.counters["prefix_hit_tokens"] += s.num_computed
                self.counters["prompt_tokens"] += s.num_prompt
            self._plan(plan, s, n)
            planned.add(s.id)
            budget -= n
        return plan

    def _ends_with_inflight(self, s: Seq) -> bool:
        """Whether the token ``s`` has in flight is certain to finish it (no step to plan after it)."""
        sp = s.req.sampling
        return (s.num_output + s.inflight >= sp.max_tokens or len(s.tokens) + s.inflight >= self.max_model_len
                or s.req.request_type == CONTEXT_ONLY)

    def _num_active(self) -> int:
        return len(self._running) + len(self._receiving)

    def _plan(self, plan: Plan, s: Seq, n: int) -> None:
        sample = s.num_computed + n == len(s.tokens) + s.inflight
        plan.entries.append((s, s.num_computed, n, sample))
        if s.num_computed >= s.num_prompt and n == 1:
            plan.num_decode_tokens += 1
        else:
            plan.num_prefill_tokens += n

    def _grow(self, s: Seq, n: int, planned: set[str], preempt: bool) -> int:
        """Make ``s.blocks`` cover ``s.num_computed + n`` tokens; returns the chunk length that
        fits (maybe less than ``n``; 0 when nothing fits and ``s`` was not admitted, or when ``s``
        itself was preempted)."""
        while True:
            have = len(s.blocks)
            need = self._blocks_for(s.num_computed + n) - have
            if need <= self.pool.num_available:
                if need > 0:
                    s.blocks.extend(self.pool.allocate(need))
                return n
            fit = (have + self.pool.num_available) * self.block_size - s.num_computed
            if fit > 0:
                n = fit
                continue
            if not preempt:
                return 0
            if self._in_step:
                raise _Quiesce
            victim = next((v for v in reversed(self._running)
                           if v is not s and v.state == RUNNING and v.id not in planned), None)
            self._preempt(victim or s)
            if victim is None:
                return 0

    def _preempt(self, s: Seq) -> None:
        """Recompute preemption: drop the KV, keep the tokens, queue at the front."""
        self.pool.free(s.blocks)
        s.blocks, s.num_computed, s.num_committed = [], 0, 0
        s.state = WAITING
        self._running.remove(s)
        self._waiting.appendleft(s)
        self.counters["preemptions"] += 1
        log.info("preempted %s (%d tokens) for lack of KV blocks", s.id, len(s.tokens))

    def _keys_upto(self, s: Seq, nblocks: int) -> list[int]:
        """Canonical keys of the first ``nblocks`` full blocks of ``s.tokens`` (memoised)."""
        have = len(s.keys)
        if nblocks > have:
            B = self.block_size
            parent = s.keys[-1] if s.keys else None
            s.keys.extend(block_keys_list(s.tokens[have * B:nblocks * B], B, self.pool.ns_seed,
                                          parent))
        return s.keys[:nblocks]

    def _match_prefix(self, s: Seq) -> None:
        if not self.prefix_reuse:
            return
        # At least one token must be computed to get logits: cap the hit at len(tokens) - 1.
        max_blocks = (len(s.tokens) - 1) // self.block_size
        if max_blocks <= 0:
            return
        blocks = self.pool.match_prefix(self._keys_upto(s, max_blocks))
        s.blocks = blocks
        s.num_computed = len(blocks) * self.block_size
        s.num_committed = len(blocks)

    # ------------------------------------------------------------------ applying a step
    def _sends_prefill(self, s: Seq, start: int) -> bool:
        """``s``'s chunk from ``start`` is prompt KV a generation leg will fetch: the connector is
        told as soon as it is queued (``prefill_launched``) and once it is written (``_apply``)."""
        return self.kv_connector is not None and s.req.request_type == CONTEXT_ONLY \
            and start < s.num_prompt

    def prefill_launched(self, plan: Plan, mark) -> None:
        """Async scheduling: ``plan`` is queued on the device, not computed yet. Each context
        chunk in it may be sent right behind its compute: ``mark()`` (called at most once, right
        here) records the device event after the step's K/V writes (None on the CPU, where the
        step has run by then), which the connector's
        transfer waits for on the device — no host sync, nothing handed to a thread, so each
        chunk's write overlaps the next chunk's compute and, for the last chunk, the engine's own
        wait for it."""
        ev = None
        for s, start, n, _sample in plan.entries:
            if s.state != RUNNING or not self._sends_prefill(s, start):
                continue
            if ev is None:
                ev = mark()
            self.kv_connector.prefill_launched(s.req, min(start + n, s.num_prompt), s.blocks, ev)

    def _apply(self, plan: Plan, sampled: list[int | None] | None, error: str | None) -> None:
        self._stats.record_step(plan.num_prefill_tokens, plan.num_decode_tokens)
        for i, (s, start, n, sample) in enumerate(plan.entries):
            if s.state == FINISHED:  # aborted during the step: free what it held now
                if s.free_after_step and not self._in_step.holds(s.id):
                    s.free_after_step = False
                    self._drop_blocks(s)
                continue
            if s.state != RUNNING:
                continue
            if error is not None:
                self._finish(s, "error", error=error)
                continue
            if self.launch is None:
                s.num_computed = start + n
            # Only what this step wrote is offered to the prefix cache: under async scheduling a later
            # step may still be writing the positions after it.
            self._commit_full_blocks(s, start + n)
            if self._sends_prefill(s, start):  # pipelining: finished blocks can leave now
                self.kv_connector.prefill_progress(s.req, min(start + n, s.num_prompt),
                                                   s.blocks)
            if sample:
                if self.launch is not None:
                    s.inflight -= 1
                self._on_token(s, int(sampled[i]))

    def _commit_full_blocks(self, s: Seq, upto: int | None = None) -> None:
        done = s.num_computed if upto is None else min(upto, s.num_computed)
        full = min(done // self.block_size, len(s.blocks))
        if full <= s.num_committed:
            return
        keys = self._keys_upto(s, full)
        B = self.block_size
        i = s.num_committed
        self.pool.commit_run(s.blocks[i:full], keys[i:full], keys[i - 1] if i else None,
                             s.tokens[i * B:full * B])
        s.num_committed = full

    def _on_token(self, s: Seq, tok: int) -> bool:
        """Append a sampled token, emit it, finish on a stop condition. True if finished."""
        s.tokens.append(tok)
        s.num_output += 1
        self.counters["generation_tokens"] += 1
        sp = s.req.sampling
        finish = stop_reason = None
        text = ""
        if tok in self.eos_token_ids and not sp.ignore_eos:
            finish = "stop"
        elif tok in sp.stop_token_ids:
            finish, stop_reason = "stop", tok
        else:
            text = s.detok.add(tok)
            if s.detok.stopped_on is not None:
                finish, stop_reason = "stop", s.detok.stopped_on
        if finish is None and (s.num_output >= sp.max_tokens or len(s.tokens) >= self.max_model_len):
            finish = "length"
        if finish is None and s.req.request_type == CONTEXT_ONLY:
            finish = "length"  # a context leg ends after its first token; gen continues
        if finish is not None:
            text += s.detok.flush()
        ev = TokenEvent(token_ids=[tok], text=text, prompt_tokens=s.num_prompt,
                        cached_tokens=s.cached_tokens, completion_tokens=s.num_output)
        if finish is None:
            s.queue.put_nowait(ev)
            return False
        ev.stop_reason = stop_reason
        if s.req.request_type == CONTEXT_ONLY:
            ev.context = self._finish_context(s, keep=finish == "length")
        self._finish(s, finish, last=ev)
        return True

    def _finish_context(self, s: Seq, keep: bool) -> ContextResult:
        """Turn a finished prefill's references into pins (when a generation leg will follow)."""
        cid = int(s.req.ctx_request_id)
        prompt_blocks = list(s.blocks[:self._blocks_for(s.num_prompt)])
        opaque: dict[str, Any] = {
            "v": 1, "worker_id": self.worker_id, "ctx_request_id": cid,
            "num_tokens": s.num_prompt, "block_size": self.block_size, "key_scheme": KEY_SCHEME,
            "block_ids": prompt_blocks, "worker_url": self.worker_url,
        }
        if keep:
            p = self.pins.pin(cid, request_id=s.id, aliases=s.req.aliases,
                              prompt_token_ids=list(s.tokens[:s.num_prompt]),
                              block_ids=prompt_blocks)
            if self.kv_connector is not None:
                opaque.update(self.kv_connector.context_finished(p))
        return ContextResult(ctx_request_id=cid, first_gen_tokens=list(s.tokens[s.num_prompt:]),
                             prompt_token_ids=list(s.tokens[:s.num_prompt]), block_ids=prompt_blocks,
                             opaque_state=opaque, pinned=keep)

    # ------------------------------------------------------------------ finishing
    def _finish_by_id(self, sid: str, reason: str, error: str | None = None) -> bool:
        s = self._requests.get(sid)
        if s is None or s.state == FINISHED:
            return False
        if s.state == RECEIVING and s.receive_task is not None:
            # Finish now (the client sees the abort); blocks are freed when the receiver confirms.
            self._finish(s, reason, error=error, keep_blocks=True)
            s.receive_task.cancel()
            return True
        self._finish(s, reason, error=error)
        return True

    def _finish(self, s: Seq, reason: str, *, error: str | None = None,
                last: TokenEvent | None = None, keep_blocks: bool = False) -> None:
        prev = s.state
        s.state = FINISHED
        s.finish_reason = reason
        if prev == WAITING:
            try:
                self._waiting.remove(s)
            except ValueError:
                pass
        elif prev == RUNNING:
            self._running.remove(s)
        if not keep_blocks:
            if self._in_step.holds(s.id):
                s.free_after_step = True
            else:
                self._drop_blocks(s)
        self._requests.remove(s)
        s.rng = None
        self.counters[f"finished_{reason}"] += 1
        if last is None:
            last = TokenEvent(token_ids=[], text=s.detok.flush() if reason != "error" else "",
                              prompt_tokens=s.num_prompt, cached_tokens=s.cached_tokens,
                              completion_tokens=s.num_output)
        last.finish_reason = reason
        last.error = error
        s.queue.put_nowait(last)
        if self.kv_connector is not None:
            if s.req.request_type == CONTEXT_ONLY:
                self.kv_connector.context_ended(s.req)
            elif not s.admitted and s.req.request_type == GENERATION_ONLY:
                # ended before its receive began (aborted while queued; client gone, shutdown):
                # the context worker may hold its KV pinned
                self.kv_connector.receive_abandoned(s.req)
        self.loop.wake()

    def _drop_blocks(self, s: Seq) -> None:
        if s.blocks:
            self.pool.free(s.blocks)
            s.blocks = []

    # ------------------------------------------------------------------ generation_only
    def _start_receive(self, s: Seq) -> bool:
        need = self._blocks_for(s.num_prompt)
        if need > self.pool.num_available:
            return False
        self._waiting.popleft()
        s.blocks = self.pool.allocate(need)
        s.admitted = True
        s.state = RECEIVING
        self._receiving[s.id] = s
        self.counters["prompt_tokens"] += s.num_prompt
        dp = dict(s.req.disaggregated_params or {})
        spec = ReceiveSpec(request_id=s.id, ctx_request_id=dp.get("ctx_request_id"),
                           prompt_token_ids=list(s.tokens[:s.num_prompt]), block_ids=list(s.blocks),
                           block_size=self.block_size, disaggregated_params=dp)
        # Cleanup lives in a done callback, not in the coroutine: a task cancelled before its
        # first step never runs its body, and its blocks must still come back.
        s.receive_task = asyncio.create_task(self.kv_connector.receive(spec), name=f"kv-receive-{s.id}")
        s.receive_task.add_done_callback(lambda t, s=s: self._receive_done(s, t))
        return True

    def _receive_done(self, s: Seq, task: asyncio.Task) -> None:
        self._receiving.pop(s.id, None)
        s.receive_task = None
        self.loop.wake()
        if task.cancelled():
            # Abort or shutdown; the receiver returned only once no write can land in our blocks.
            if s.state != FINISHED:
                self._finish(s, "abort", keep_blocks=True)
            self._drop_blocks(s)
            # A task cancelled before its first step never began the receive: the context
            # worker must hear it from us (the receiver ignores this when its receive began).
            self.kv_connector.receive_abandoned(s.req)
            return
        exc = task.exception()
        if exc is not None:
            log.warning("KV receive for %s failed: %s: %s", s.id, type(exc).__name__, exc)
            if s.state != FINISHED:
                self._finish(s, "error", error=f"KV transfer failed: {type(exc).__name__}: {exc}",
                             keep_blocks=True)
            self._drop_blocks(s)
            return
        if s.state == FINISHED:  # aborted while the receiver was finishing up
            self._drop_blocks(s)
            return
        fg = s.req.first_gen_tokens
        # Without first_gen_tokens (generation_first), recompute the last prompt position for its
        # logits; its K/V slot is rewritten with the same values.
        s.num_computed = s.num_prompt if fg else s.num_prompt - 1
        self._commit_full_blocks(s)
        s.state = RUNNING
        self._running.append(s)
        for t in fg or ():
            if self._on_token(s, int(t)):
                break
        self._flush_events()
