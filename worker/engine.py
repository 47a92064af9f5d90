"""The engine seam (``Engine`` protocol) and the PyTorch engine.

``TorchEngine`` owns the shared continuous-batching ``Scheduler`` (worker/scheduler.py) and a
``ModelRunner`` (worker/runner.py) that executes the scheduler's steps: each step's chunks run
through the model on one worker thread, so the asyncio loop keeps serving HTTP, ZMQ snapshots and
aborts while the model computes. ``SchedulingEngine`` is what the torch and sim engines share: the
engine surface, delegated explicitly to the scheduler it owns.
torch is imported only when a ``TorchEngine`` is built, so the sim engine stays torch-free.

KV that crosses workers goes through one ``KvConnector`` (worker/kv_connector.py), passed to the
engine's constructor as ``kv_connector=`` and bound to it there (``bind(engine)``); the scheduler
calls its hooks. What the connector may use of the engine: a finished ``context_only`` request's
prompt blocks stay pinned (``pinned_transfer(ctx_request_id)``) until ``release(ctx_request_id,
reason)`` (or an abort, or the ``pin_timeout_s`` sweep — each reported to ``pin_released``);
``pool.pin/unpin``; ``page_table()`` (torch) describes the K/V memory to register. Without a
connector ``generation_only`` requests are refused with ``TransferUnavailable`` (HTTP 501).
See docs/worker.md, "Engine, scheduler and KV connector", and docs/kv-transfer.md, "The transfer package's API".
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, AsyncIterator, Protocol, runtime_checkable

from worker.kv_cache import BlockPool
from worker.kv_connector import KvConnector
from worker.requests import (  # noqa: F401  (re-exported: the engine seam's types)
    CONTEXT_AND_GENERATION, CONTEXT_ONLY, GENERATION_ONLY, ContextResult, EngineError,
    EngineRequest, EngineStopped, InvalidRequest, PinnedTransfer, ReceiveSpec, SamplingParams,
    TokenEvent, TransferUnavailable,
)
from worker.scheduler import Plan, RequestStream, Scheduler

__all__ = [
    "Engine", "KvConnector", "SchedulingEngine", "TorchEngine", "EngineRequest", "SamplingParams",
    "TokenEvent",
    "ContextResult", "ReceiveSpec", "PinnedTransfer", "EngineError", "InvalidRequest",
    "TransferUnavailable", "RequestStream",
]


@runtime_checkable
class Engine(Protocol):
    engine_name: str
    pool: BlockPool
    tokenizer: Any
    block_size: int
    max_model_len: int
    max_batch_size: int
    max_num_tokens: int
    kv_connector: KvConnector | None

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def submit(self, req: EngineRequest) -> AsyncIterator[TokenEvent]: ...
    def abort(self, request_id) -> bool: ...
    def release(self, ctx_request_id, reason: str = "transferred") -> bool: ...
    def pinned_transfer(self, ctx_request_id) -> PinnedTransfer | None: ...
    def stats(self) -> dict: ...
    def flush_events(self) -> None: ...


class _Delegated:
    """An engine attribute that is its scheduler's: read (and, when ``writable``, set) through."""

    def __init__(self, writable: bool = False):
        self.writable = writable

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.scheduler, self.name)

    def __set__(self, engine, value) -> None:
        if not self.writable:
            raise AttributeError(f"{type(engine).__name__}.{self.name} is read-only")
        setattr(engine.scheduler, self.name, value)


class SchedulingEngine:
    """The ``Engine`` surface over the ``Scheduler`` an engine owns (``self.scheduler``, built by
    the subclass with its own step function). Every method and attribute below forwards to it."""

    engine_name = "base"
    scheduler: Scheduler

    pool: BlockPool = _Delegated()
    tokenizer = _Delegated()
    block_size: int = _Delegated()
    max_model_len: int = _Delegated()
    max_batch_size: int = _Delegated()
    max_num_tokens: int = _Delegated()
    pin_timeout_s: float = _Delegated()
    vocab_size: int = _Delegated()
    eos_token_ids: frozenset = _Delegated()
    counters = _Delegated()
    kv_connector: KvConnector | None = _Delegated()   # given at construction
    # Set by the server.
    worker_url: str | None = _Delegated(writable=True)
    worker_id: str = _Delegated(writable=True)
    event_sink = _Delegated(writable=True)

    async def start(self) -> None:
        await self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()

    @property
    def alive(self) -> bool:
        return self.scheduler.alive

    async def submit(self, req: EngineRequest) -> RequestStream:
        return await self.scheduler.submit(req)

    def abort(self, request_id) -> bool:
        return self.scheduler.abort(request_id)

    def release(self, ctx_request_id, reason: str = "transferred") -> bool:
        return self.scheduler.release(ctx_request_id, reason)

    def pinned_transfer(self, ctx_request_id) -> PinnedTransfer | None:
        return self.scheduler.pinned_transfer(ctx_request_id)

    def pinned_transfers(self) -> list[PinnedTransfer]:
        return self.scheduler.pinned_transfers()

    def sweep_pins(self) -> int:
        return self.scheduler.sweep_pins()

    def stats(self) -> dict:
        return self.scheduler.stats()

    def flush_events(self) -> None:
        self.scheduler.flush_events()

    def clear_cache(self) -> None:
        self.scheduler.clear_cache()


class TorchEngine(SchedulingEngine):
    """A ``Scheduler`` whose steps a ``ModelRunner`` executes. ``runner`` owns the model and the
    K/V tensors; the pool's block ids index the runner's cache."""

    engine_name = "torch"

    def __init__(self, runner, tokenizer, *, max_batch_size: int = 64,
                 max_num_tokens: int = 2048, pin_timeout_s: float = 60.0,
                 worker_id: str = "worker", kv_connector: KvConnector | None = None,
                 ns_seed: int = 0, eos_token_ids=None, async_scheduling: bool | None = None):
        import torch

        from worker.runner import Chunk
        from worker.sampling import make_generator, sample, sample_tokens

        self._Chunk, self._make_generator, self._sample = Chunk, make_generator, sample
        self._sample_tokens, self._torch = sample_tokens, torch
        self.runner = runner
        #: Plan and prepare step k+1 while step k runs (worker/step_loop.py ``StepLoop.run_async``). Default: on
        #: for a single-rank runner on CUDA, where the device runs a step on its own; on the CPU the
        #: step runs on the host and there is nothing to overlap.
        if async_scheduling is None:
            async_scheduling = getattr(runner, "device", None) is not None and runner.device.type == "cuda"
        self.async_scheduling = bool(async_scheduling) and self._can_async()
        cfg = runner.cfg
        eos = eos_token_ids
        if eos is None:
            eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
            cfg_eos = getattr(cfg, "eos_token_id", None)
            if cfg_eos is not None:
                eos = tuple(dict.fromkeys([*eos, *([cfg_eos] if isinstance(cfg_eos, int)
                                                   else cfg_eos)]))
        self.scheduler = Scheduler(
            execute=self._execute, engine_name=self.engine_name,
            pool=BlockPool(runner.num_blocks, runner.block_size, ns_seed=ns_seed),
            tokenizer=tokenizer, eos_token_ids=eos, vocab_size=cfg.vocab_size,
            max_model_len=cfg.max_position_embeddings, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, pin_timeout_s=pin_timeout_s, worker_id=worker_id,
            kv_connector=kv_connector, launch=self._launch if self.async_scheduling else None)
        # Async scheduling: two pinned host buffers the tokens of a step (the runner's ``step_tokens``,
        # row i = plan entry i) come back through, alternately: step k's is read while step k+1's copy
        # may already be landing in the other.
        self._host_tokens: list = []
        self._flip = 0
        if kv_connector is not None:   # may build its transceiver over our K/V memory now
            kv_connector.bind(self)
        # One thread: steps are sequential by construction, and torch releases the GIL inside ops.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch-step")

    def page_table(self) -> dict:
        """The runner's K/V memory description, for the transfer layer to register."""
        return self.runner.page_table()

    async def _execute(self, plan: Plan) -> list[int | None]:
        chunks = []
        rows = []
        for i, (s, start, n, sample) in enumerate(plan.entries):
            chunks.append(self._Chunk(token_ids=s.tokens[start:start + n], start_pos=start,
                                      block_ids=list(s.blocks)))
            if sample:
                p = s.req.sampling
                if s.rng is None and not p.greedy:
                    s.rng = self._make_generator(p, self.runner.device)
                rows.append((i, p, s.rng))
        loop = asyncio.get_running_loop()
        picked = await loop.run_in_executor(self._executor, self._step, chunks, rows)
        return [picked.get(i) for i in range(len(chunks))]

    def _step(self, chunks, rows) -> dict[int, int]:
        logits = self.runner.step(chunks)
        if rows:
            return self._sample(logits, rows)  # its device→host copy waits for the step
        if self.runner.device.type == "cuda":
            # A step is applied only once its K/V is written: the scheduler then commits the blocks to
            # the prefix cache and the KV connector may start sending them (worker/scheduler.py _apply).
            self._torch.cuda.current_stream(self.runner.device).synchronize()
        return {}

    def _can_async(self) -> bool:
        """Async scheduling feeds tokens on the device: only a runner that takes them (a multi-rank
        runner sends every token to its followers, so it steps synchronously)."""
        return type(self.runner).__name__ == "ModelRunner"

    def _table(self, s) -> Any:
        """``s.blocks`` as an int64 array kept beside the list and extended as it grows, so a long
        sequence's table is not converted again every step (a 2k-entry list costs ~60 µs)."""
        import numpy as np

        blocks, t = s.blocks, s.table
        if t is None or t[0] is not blocks or t[2] > len(blocks):
            s.table = (blocks, np.empty(max(16, 2 * len(blocks)), dtype=np.int64), 0)
            t = s.table
        _, arr, n = t
        if n < len(blocks):
            if len(blocks) > arr.size:
                grown = np.empty(2 * len(blocks), dtype=np.int64)
                grown[:n] = arr[:n]
                arr = grown
            arr[n:len(blocks)] = blocks[n:]
            s.table = t = (blocks, arr, len(blocks))
        return arr[:len(blocks)]

    async def _launch(self, plan: Plan):
        """Queue one step (async scheduling); returns an awaitable of its sampled tokens. A chunk whose
        token is still being sampled by the step before takes it from the device (``feed_row``)."""
        chunks, rows, feed = [], [], []
        for i, (s, start, n, sample) in enumerate(plan.entries):
            if start + n > len(s.tokens):
                if n != 1 or s.feed_row < 0:
                    raise RuntimeError(f"{s.id}: chunk {start}+{n} runs past its {len(s.tokens)} known tokens")
                chunks.append(self._Chunk(token_ids=(0,), start_pos=start, block_ids=self._table(s)))
                feed.append(s.feed_row)
            else:
                chunks.append(self._Chunk(token_ids=s.tokens[start:start + n], start_pos=start,
                                          block_ids=self._table(s)))
                feed.append(-1)
            if sample:
                p = s.req.sampling
                if s.rng is None and not p.greedy:
                    s.rng = self._make_generator(p, self.runner.device)
                rows.append((i, p, s.rng))
        # Queued from the loop's own thread: preparing a step is Python holding the GIL, which a worker
        # thread would not free for the loop anyway, and each hand-off to the thread costs a wake-up.
        # Only the wait for the tokens (which releases the GIL) goes to the worker thread.
        done = self._queue_step(chunks, rows, feed, plan)
        return asyncio.get_running_loop().run_in_executor(self._executor, done)

    def _kv_written(self):
        """A CUDA event after the K/V writes queued so far (on the runner's stream)."""
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self.runner.device))
        return ev

    def _queue_step(self, chunks, rows, feed, plan: Plan | None = None):
        """Queues the step's device work (the runner leaves greedy tokens in ``step_tokens``, the
        other rows are sampled into it here) and the tokens' copy to the host; returns the call that
        waits for them."""
        torch, runner = self._torch, self.runner
        n = len(chunks)
        logits = runner.step(chunks, feed_index=feed, greedy_tokens=True)
        cuda = runner.device.type == "cuda"
        if plan is not None:   # context chunks may leave right behind their compute
            # (on the CPU the step ran inside runner.step: its K/V is written already)
            self.scheduler.prefill_launched(plan, self._kv_written if cuda else lambda: None)
        if not rows:  # still waited for: the step is applied only once its K/V is written (see _step)
            if not cuda:
                return dict
            done = torch.cuda.Event()
            done.record()

            def written() -> dict[int, int]:
                done.synchronize()
                return {}

            return written
        tokens = runner.step_tokens
        if any(not p.greedy for _, p, _ in rows):
            tokens[:n].copy_(self._sample_tokens(logits, rows))
        if len(self._host_tokens) != 2 or self._host_tokens[0].numel() < n:
            self._host_tokens = [torch.zeros(max(n, 256), dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        host = self._host_tokens[self._flip]
        self._flip ^= 1
        host[:n].copy_(tokens[:n], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        picked = [r for r, _, _ in rows]

        def result() -> dict[int, int]:
            if event is not None:
                event.synchronize()
            vals = host[:n].tolist()
            return {r: vals[r] for r in picked}

        return result

    async def stop(self) -> None:
        await super().stop()
        self._executor.shutdown(wait=True)
