"""The scheduler's counters and the ``engine.stats()`` snapshot (``/metrics`` and ``/server_info``
read it; worker/metrics.py maps it to Prometheus). No torch imported here."""
from __future__ import annotations

import collections
from typing import Callable

from worker.kv_cache import BlockPool

__all__ = ["SchedulerStats", "RATE_WINDOW_S"]

#: Token rates are averaged over the steps of this many recent seconds.
RATE_WINDOW_S = 10.0


class SchedulerStats:
    """Monotonic ``counters`` (requests, tokens, steps, preemptions, ``finished_<reason>``,
    ``pins_released_<reason>``) and the recent step history the rates come from."""

    def __init__(self, clock: Callable[[], float]):
        self.counters: collections.Counter = collections.Counter()
        self._clock = clock
        self._history: collections.deque[tuple[float, int, int]] = collections.deque()

    def record_step(self, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        now = self._clock()
        c = self.counters
        c["steps"] += 1
        c["prefill_tokens"] += num_prefill_tokens
        c["decode_tokens"] += num_decode_tokens
        self._history.append((now, num_prefill_tokens, num_decode_tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        h = self._history
        while h and h[0][0] < now - RATE_WINDOW_S:
            h.popleft()

    def snapshot(self, *, engine: str, running: int, waiting: int, receiving: int,
                 pinned_transfers: int, pool: BlockPool) -> dict:
        """The ``stats()`` dict; ``running`` counts receiving requests too."""
        now = self._clock()
        self._trim(now)
        h, c = self._history, self.counters
        span = max(1e-9, min(RATE_WINDOW_S, now - h[0][0])) if h else 1.0
        pre = sum(x[1] for x in h)
        dec = sum(x[2] for x in h)
        return {
            "engine": engine,
            "running": running,
            "waiting": waiting,
            "receiving": receiving,
            "pinned_transfers": pinned_transfers,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_blocks_cached": pool.num_cached,
            "kv_blocks_pinned": pool.num_pinned,
            "prefix_hit_tokens_total": c["prefix_hit_tokens"],
            "prompt_tokens_total": c["prompt_tokens"],
            "prefill_tokens_total": c["prefill_tokens"],
            "decode_tokens_total": c["decode_tokens"],
            "generation_tokens_total": c["generation_tokens"],
            "preemptions_total": c["preemptions"],
            "steps_total": c["steps"],
            "prefill_tokens_per_s": pre / span if h else 0.0,
            "decode_tokens_per_s": dec / span if h else 0.0,
            "requests_finished": {k.removeprefix("finished_"): v for k, v in c.items()
                                  if k.startswith("finished_")},
            "pins_released": {k.removeprefix("pins_released_"): v
                              for k, v in c.items() if k.startswith("pins_released_")},
        }
