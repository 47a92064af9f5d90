"""Pinned transfers: a finished ``context_only`` request's prompt blocks, held for the KV transfer.

A finished context leg converts its block references into pins owned by this table (one pool
reference per block, ``BlockPool.pin``); ``release`` (transfer done, cancel, abort, timeout,
shutdown) undoes exactly that. A sweep frees pins whose ``pin_timeout_s`` deadline passed, so a
generation leg that never comes cannot hold the blocks forever. No torch imported here.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable, Iterable

from worker.kv_cache import BlockPool
from worker.requests import PinnedTransfer

log = logging.getLogger("splitserve.worker.scheduler")

__all__ = ["PinTable", "ctx_id"]


def ctx_id(ctx_request_id) -> int | None:
    """``ctx_request_id`` as the table's int key (clients may send it as a string); None when it
    is not an integer at all."""
    try:
        return int(ctx_request_id)
    except (TypeError, ValueError):
        return None


class PinTable:
    """``ctx_request_id → PinnedTransfer``. Counts ``pins_created`` and ``pins_released_<reason>``
    in ``counters``; ``on_release(ctx_request_id, reason)`` runs after each release (the scheduler
    wakes its loop — freed blocks may let a waiting request in — and tells its KV connector)."""

    def __init__(self, pool: BlockPool, *, timeout_s: float, counters: collections.Counter,
                 clock: Callable[[], float],
                 on_release: Callable[[int, str], None] = lambda cid, reason: None):
        if timeout_s <= 0:
            raise ValueError(f"pin_timeout_s must be > 0, got {timeout_s}")
        self.pool = pool
        self.timeout_s = float(timeout_s)
        self.counters = counters
        self._clock = clock
        self._on_release = on_release
        self._pins: dict[int, PinnedTransfer] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, ctx_request_id) -> bool:
        return ctx_id(ctx_request_id) in self._pins

    def get(self, ctx_request_id) -> PinnedTransfer | None:
        return self._pins.get(ctx_id(ctx_request_id))

    def values(self) -> list[PinnedTransfer]:
        return list(self._pins.values())

    def pin(self, ctx_request_id: int, *, request_id: str, aliases: Iterable[str],
            prompt_token_ids: list[int], block_ids: list[int]) -> PinnedTransfer:
        """Take one pool reference per block under ``ctx_request_id``. A stale entry under the
        same id is released first (``replaced``): the new one wins."""
        cid = int(ctx_request_id)
        if cid in self._pins:
            self.release(cid, "replaced")
        now = self._clock()
        p = PinnedTransfer(ctx_request_id=cid, request_id=request_id, aliases=tuple(aliases),
                           prompt_token_ids=prompt_token_ids, block_ids=block_ids, created=now,
                           deadline=now + self.timeout_s)
        self.pool.pin(block_ids)
        self._pins[cid] = p
        self.counters["pins_created"] += 1
        log.debug("pinned transfer %s (%d blocks)", cid, len(block_ids))
        return p

    def release(self, ctx_request_id, reason: str = "transferred") -> bool:
        """Unpin; idempotent: False when nothing is pinned under that id."""
        p = self._pins.pop(ctx_id(ctx_request_id), None)
        if p is None:
            return False
        self.pool.unpin(p.block_ids)
        self.counters[f"pins_released_{reason}"] += 1
        log.debug("released pinned transfer %s (%d blocks): %s", p.ctx_request_id,
                  len(p.block_ids), reason)
        self._on_release(p.ctx_request_id, reason)
        return True

    def named(self, key: str) -> list[int]:
        """Ids of the pins ``key`` names: the ``ctx_request_id``, the request id or an alias."""
        return [cid for cid, p in self._pins.items()
                if str(cid) == key or key in p.aliases or key == p.request_id]

    def release_all(self, reason: str) -> None:
        for cid in list(self._pins):
            self.release(cid, reason)

    def sweep(self) -> int:
        """Release pins whose deadline passed; returns how many."""
        now = self._clock()
        expired = [cid for cid, p in self._pins.items() if p.deadline <= now]
        for cid in expired:
            log.warning("pinned KV of context request %s was never fetched within %.1fs; freeing",
                        cid, self.timeout_s)
            self.release(cid, "timeout")
        return len(expired)

    async def run_sweeper(self) -> None:
        """Sweep a few times per timeout, forever (the scheduler cancels it on stop)."""
        period = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            if self._pins:
                self.sweep()
