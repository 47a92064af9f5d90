"""Rate limiting at the front door (`fleet.rate_limit`): a token bucket with a bounded FIFO queue,
as sglang-router's `--rate-limit-tokens-per-second` / `--queue-size` / `--queue-timeout-secs`.

Each fleet process admits its share of the configured rate and burst (num_workers processes share
the public port through SO_REUSEPORT, so connections spread evenly). A request that finds no token
waits in the queue, first come first served, for at most `queue_timeout_s`; one that finds the queue
full, or times out in it, is answered 429 with a Retry-After of the time until the next token.
`TokenBucket` is the pure rule (time passed in); `RateLimiter` is its asyncio queue.
"""
from __future__ import annotations

import asyncio
import collections
import math
import time

from protocol.openai import ApiError

from . import metrics as M

__all__ = ["TokenBucket", "RateLimiter"]


class TokenBucket:
    __slots__ = ("rate", "burst", "tokens", "last")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.last = now

    def _refill(self, now: float) -> None:
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now

    def take(self, now: float) -> bool:
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait_s(self, now: float) -> float:
        """Seconds until a token is there (0 when one is)."""
        self._refill(now)
        return max(0.0, (1.0 - self.tokens) / self.rate)


class RateLimiter:
    def __init__(self, rate: float, burst: float, max_queue: int, queue_timeout_s: float,
                 clock=time.monotonic):
        self.clock = clock
        self.bucket = TokenBucket(rate, burst, clock())
        self.max_queue = max_queue
        self.timeout = queue_timeout_s
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self._pump: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config) -> "RateLimiter | None":
        rl = config.fleet.rate_limit
        if rl.requests_per_s is None:
            return None
        n = config.num_workers
        burst = rl.burst if rl.burst is not None else max(1.0, rl.requests_per_s)
        return cls(rl.requests_per_s / n, max(1.0, burst / n), rl.max_queue, rl.queue_timeout_s)

    def _refuse(self, reason: str, why: str) -> ApiError:
        M.RATE_LIMITED.labels(reason).inc()
        wait = self.bucket.wait_s(self.clock()) + len(self.waiters) / self.bucket.rate
        return ApiError(429, f"rate limit: {why} (fleet.rate_limit); retry shortly",
                        code="rate_limited", retry_after=max(1, math.ceil(wait)))

    async def admit(self) -> None:
        """Return once the request may go on; ApiError 429 when it may not."""
        if not self.waiters and self.bucket.take(self.clock()):
            return
        if len(self.waiters) >= self.max_queue:
            raise self._refuse("queue_full", f"{self.max_queue} request(s) already wait for "
                               f"admission" if self.max_queue else "no token left")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return       # admitted in the same instant it timed out: keep the token
            fut.cancel()
            raise self._refuse("queue_timeout", f"waited {self.timeout:g}s in the admission "
                               f"queue") from None
        except asyncio.CancelledError:
            fut.cancel()     # the client went away: its place (and no token) is given up
            raise

    async def _run_pump(self) -> None:
        """Hand out tokens to the queue in order, as they accrue."""
        while self.waiters:
            if self.waiters[0].done():       # timed out or cancelled: not served
                self.waiters.popleft()
                continue
            now = self.clock()
            if self.bucket.take(now):
                self.waiters.popleft().set_result(None)
                continue
            await asyncio.sleep(self.bucket.wait_s(now))
