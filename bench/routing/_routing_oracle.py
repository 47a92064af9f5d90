"""The oracle placement of bench/routing/routing.py: outside the product, it sees every worker's true
cache and load at decision time, to bound what any router could achieve on the trace.

- true cache: a SUB socket on every worker's KV-event publisher (its own BlockStored /
  BlockRemoved / AllBlocksCleared, no coordinator in between); our sim workers publish the
  canonical block key as the engine hash, so a worker's resident set is exactly those hashes;
- true load: the harness itself holds every request, so it knows, per worker, the prefill work
  queued (uncached tokens of requests that have not produced their first token) and the
  requests decoding;
- memory: a worker whose KV cannot hold the prompt's uncached blocks beside the distinct blocks
  its in-flight prompts hold (shared prefixes once) is passed over unless every one is full;
- blocks being computed count as cached: a request placed on a worker whose queue already holds
  the same prefix will find it there (FCFS prefill), before any event says so;
- decision: the least `(queued prefill + cache_weight x this request's uncached tokens) x prefill
  s/token + max(1, (queued + uncached) / chunk) x decode step` (kv_cache_aware's time cost with
  the workers' exact model and true state), ties to the fewest decoding requests. cache_weight 1 is the earliest first token under a FCFS prefill
  queue; above 1 it also counts what the uncached tokens cost every later request on that worker
  (the greedy-by-TTFT choice spreads prefix trees and loses hits under load; see bench/RESULTS.md).
"""
from __future__ import annotations

import asyncio
import json
import urllib.request

import zmq
import zmq.asyncio

from router.block_keys import block_keys_list
from router.events import AllCleared, BlocksRemoved, BlocksStored, decode_zmq


class Oracle:
    def __init__(self, urls: list[str], block_size: int, cache_weight: float = 2.0,
                 model: dict | None = None, capacity_tokens: int = 0):
        self.urls = urls
        self.cache_weight = cache_weight
        m = model or {}
        self.a = m.get("prefill_s_per_token", 1.0)
        self.chunk = m.get("chunk_tokens", 1 << 30)
        self.s0 = m.get("decode_s_per_step", 0.0)
        self.s1 = m.get("decode_s_per_request", 0.0)
        self.s2 = m.get("decode_s_per_context_token", 0.0)
        self.ctx: dict[str, int] = {u: 0 for u in urls}          # decoding requests' prompt tokens
        # the blocks in-flight prompts hold, shared prefixes once: key -> requests holding it
        self.pins: dict[str, dict[int, int]] = {u: {} for u in urls}
        self.capacity = capacity_tokens
        self.B = block_size
        self.cache: dict[str, set[int]] = {u: set() for u in urls}
        self.queued: dict[str, int] = {u: 0 for u in urls}       # uncached prefill tokens
        self.decoding: dict[str, int] = {u: 0 for u in urls}
        self._req: dict[int, tuple[str, int, bool, list, int]] = {}  # i -> (server, uncached, first, keys, n)
        self.pending: dict[str, dict[int, int]] = {u: {} for u in urls}   # key -> requests computing it
        self._ctx = zmq.asyncio.Context()
        self._socks: list = []
        self._tasks: list[asyncio.Task] = []
        self.results: list = []
        self.events = 0

    async def start(self) -> None:
        for u in self.urls:
            with urllib.request.urlopen(u + "/server_info", timeout=5) as r:
                kv = json.loads(r.read())["kv_events"]
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(kv["publisher"])
            self._socks.append(s)
            self._tasks.append(asyncio.create_task(self._feed(u, s)))
        await asyncio.sleep(0.3)   # slow joiner: let the subscriptions reach the publishers

    async def _feed(self, url: str, sock) -> None:
        cache = self.cache[url]
        while True:
            frames = await sock.recv_multipart()
            for ev in decode_zmq(frames).events:
                self.events += 1
                if isinstance(ev, BlocksStored):
                    cache.update(int(h) for h in ev.engine_hashes)
                elif isinstance(ev, BlocksRemoved):
                    cache.difference_update(int(h) for h in ev.engine_hashes)
                elif isinstance(ev, AllCleared):
                    cache.clear()

    def _matched(self, url: str, keys: list[int]) -> int:
        c, p = self.cache[url], self.pending[url]
        n = 0
        for k in keys:
            if k not in c and k not in p:
                break
            n += 1
        return n * self.B

    def _unpend(self, u: str, keys: list[int]) -> None:
        p = self.pending[u]
        for k in keys:
            c = p.get(k, 0) - 1
            if c > 0:
                p[k] = c
            else:
                p.pop(k, None)

    def place(self, i: int, ids: list[int]) -> tuple[str, int]:
        keys = block_keys_list(ids, self.B)
        n = len(ids)
        best = None
        a, chunk, cw = self.a, self.chunk, self.cache_weight
        for u in self.urls:
            m = min(self._matched(u, keys), n - 1)
            q, d = self.queued[u], self.decoding[u]
            step = self.s0 + self.s1 * d + self.s2 * self.ctx[u] if d else 0.0
            # its KV cannot hold this prompt's uncached blocks beside the in-flight ones
            full = bool(self.capacity) and (len(self.pins[u]) * self.B + n - m > self.capacity)
            cost = (full, (q + cw * (n - m)) * a + max(1.0, (q + n - m) / chunk) * step, d)
            if best is None or cost < best[0]:
                best = (cost, u, m)
        _, u, m = best
        self.queued[u] += n - m
        p, pins = self.pending[u], self.pins[u]
        for k in keys:
            p[k] = p.get(k, 0) + 1
            pins[k] = pins.get(k, 0) + 1
        self._req[i] = (u, n - m, False, keys, n, keys)
        return u, m

    def first_token(self, i: int) -> None:
        u, unc, first, keys, n, held = self._req[i]
        if not first:
            self.queued[u] -= unc
            self.decoding[u] += 1
            self.ctx[u] += n
            self._unpend(u, keys)      # its blocks are committed now (events follow)
            self._req[i] = (u, unc, True, [], n, held)

    def done(self, i: int) -> None:
        t = self._req.pop(i, None)
        if t is None:
            return
        u, unc, first, keys, n, held = t
        pins = self.pins[u]
        for k in held:
            c = pins[k] - 1
            if c:
                pins[k] = c
            else:
                del pins[k]
        if first:
            self.decoding[u] -= 1
            self.ctx[u] -= n
        else:
            self.queued[u] -= unc
            self._unpend(u, keys)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._socks:
            s.close(0)
        self._ctx.term()
