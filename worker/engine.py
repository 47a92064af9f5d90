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
See docs/INTERFACES.md §5/§6.
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
                 ns_seed: int = 0, eos_token_ids=None):
        import torch  # noqa: F401  (only this engine needs it)

        from worker.runner import Chunk
        from worker.sampling import make_generator, sample

        self._Chunk, self._make_generator, self._sample = Chunk, make_generator, sample
        self.runner = runner
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
            kv_connector=kv_connector)
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
        return self._sample(logits, rows) if rows else {}

    async def stop(self) -> None:
        await super().stop()
        self._executor.shutdown(wait=True)
