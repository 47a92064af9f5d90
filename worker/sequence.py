"""A request's scheduler-side state (``Seq``), one step's plan (``Plan``) and the stream a caller
iterates (``RequestStream``). No torch imported here."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from worker.detokenizer import IncrementalDetokenizer
from worker.requests import EngineRequest, TokenEvent

__all__ = ["Seq", "Plan", "RequestStream", "WAITING", "RECEIVING", "RUNNING", "FINISHED"]

WAITING, RECEIVING, RUNNING, FINISHED = "waiting", "receiving", "running", "finished"


class Seq:
    """Scheduler-side state of one request."""

    __slots__ = (
        "req", "id", "tokens", "num_prompt", "num_output", "num_computed", "blocks", "keys",
        "num_committed", "cached_tokens", "admitted", "state", "queue", "detok", "rng",
        "free_after_step", "receive_task", "arrival", "finish_reason", "inflight", "feed_row", "table",
    )

    def __init__(self, req: EngineRequest, detok: IncrementalDetokenizer):
        self.req = req
        self.id = req.request_id
        self.tokens: list[int] = list(req.prompt_token_ids)
        self.num_prompt = len(self.tokens)
        self.num_output = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.keys: list[int] = []  # canonical keys of full blocks of `tokens`, chain order
        self.num_committed = 0  # leading blocks already offered to the prefix cache
        self.cached_tokens = 0
        self.admitted = False
        self.state = WAITING
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.detok = detok
        self.rng: Any = None  # engine-specific sampling state (a torch.Generator)
        self.free_after_step = False
        self.receive_task: asyncio.Task | None = None
        self.arrival = time.monotonic()
        self.finish_reason: str | None = None
        # Async scheduling (worker/scheduler.py): tokens sampled by launched steps whose values the
        # host does not know yet, and the row of the last launched step that samples the next one.
        self.inflight = 0
        self.feed_row = -1
        self.table: Any = None  # engine-specific mirror of ``blocks`` (the torch engine's numpy table)

    @property
    def pending(self) -> int:
        """Tokens to feed through the model: known ones not fed yet, plus those still being sampled."""
        return len(self.tokens) + self.inflight - self.num_computed


class Plan:
    """One step: ``entries[i] = (seq, start, n, sample)`` feeds ``seq.tokens[start:start+n]``;
    ``sample`` says whether the chunk's last logits produce a new token."""

    __slots__ = ("entries", "num_prefill_tokens", "num_decode_tokens")

    def __init__(self):
        self.entries: list[tuple[Seq, int, int, bool]] = []
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0


class RequestStream:
    """Async iterator over one request's ``TokenEvent``s. Closing it early (``aclose``, or the
    consumer being cancelled) aborts the request and frees its blocks."""

    def __init__(self, abort: Callable[[str], bool], seq: Seq):
        self._abort = abort
        self._seq = seq
        self._done = False

    @property
    def request_id(self) -> str:
        return self._seq.id

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            ev = await self._seq.queue.get()
        except BaseException:
            await self.aclose()
            raise
        if ev.finish_reason is not None:
            self._done = True
        return ev

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self._seq.id)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
