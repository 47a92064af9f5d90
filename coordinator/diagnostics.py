"""Routing self-diagnosis: the key parity probe's state and predicted-vs-actual cached tokens.

Two silent failures leave every KV index full while kv_cache_aware matches nothing, or matches
what the worker does not actually reuse; neither trips the empty-index alarm. This module keeps
what catches them, per server:

- **parity** (coordinator/kv_parity.py): probed at admission and after a restart (new worker id);
  a `kv_mismatch` server's matches are treated as unknown by the policy (router/policies.py).
- **prediction**: the fleet's `/finish` reports, for each kv-aware placement, the matched tokens
  the route receipt predicted and the `usage.prompt_tokens_details.cached_tokens` the worker
  reported. Totals are exported as counters; a sliding window gives the recent ratio
  actual/predicted, and the alarm is raised while that ratio stays below `alarm_ratio` with at
  least `min_requests` predicting requests (and `min_predicted_tokens`) in the window.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Callable

from . import kv_parity
from protocol.prompt import TokenizerUnavailable, load_tokenizer, routing_tokenizer_name

log = logging.getLogger("splitserve.coordinator.diagnostics")

__all__ = ["Diagnostics", "Prediction"]

WINDOW_S = 60.0
ALARM_RATIO = 0.5
MIN_REQUESTS = 8
ALARM_WARN_EVERY_S = 60.0


@dataclass(slots=True)
class Prediction:
    requests: int = 0
    prompt: int = 0
    predicted: int = 0
    actual: int = 0
    # [second, predicting requests, predicted, actual] per second with reports (bounded by the
    # window's length in seconds, whatever the request rate)
    window: collections.deque = field(default_factory=collections.deque)
    alarm: bool = False
    alarm_since: float | None = None
    alarms: int = 0
    warned_at: float = -1e18

    def recent(self, now: float, window_s: float) -> tuple[int, int, int]:
        w = self.window
        while w and w[0][0] < now - window_s:
            w.popleft()
        return sum(x[1] for x in w), sum(x[2] for x in w), sum(x[3] for x in w)


class Diagnostics:
    def __init__(self, config, *, block_size: int, key_scheme: str, ns_seed: int,
                 enabled: bool, session: Callable, clock: Callable[[], float],
                 on_change: Callable[[], None]):
        self.config = config
        self.block_size, self.key_scheme, self.ns_seed = block_size, key_scheme, ns_seed
        self.enabled = enabled          # some role routes on block keys
        self._session = session
        self.clock = clock
        self.on_change = on_change
        self.parity: dict[str, kv_parity.Parity] = {}
        self.mismatches_total: dict[tuple[str, str], int] = {}
        self._tokenizers: dict[str, object] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self.pred: dict[str, Prediction] = {}
        self.window_s = WINDOW_S
        self.alarm_ratio = ALARM_RATIO
        self.min_requests = MIN_REQUESTS
        self.min_predicted_tokens = 4 * block_size

    # ---- parity -----------------------------------------------------------------------------
    def kv_unknown(self, server: str) -> bool:
        p = self.parity.get(server)
        return p is not None and p.status == kv_parity.MISMATCH

    def admitted(self, url: str, info: dict | None, worker_id: str | None) -> None:
        """A server became healthy or re-read its /server_info: probe it unless this worker
        instance was already probed."""
        if not self.enabled:
            return
        p = self.parity.get(url)
        if p is not None and p.worker_id == worker_id and not p.probe_failed:
            return   # this instance was probed (a failed probe is retried on the next admission)
        t = self._tasks.get(url)
        if t is not None and not t.done():
            return
        self._tasks[url] = asyncio.get_running_loop().create_task(
            self._probe(url, dict(info or {}), worker_id), name=f"kv-parity {url}")

    def _tokenizer(self, model: str | None):
        name = routing_tokenizer_name(self.config, [model] if model else [])
        key = name or ""
        if key not in self._tokenizers:
            self._tokenizers[key] = load_tokenizer(name)
        return self._tokenizers[key]

    async def _probe(self, url: str, info: dict, worker_id: str | None) -> None:
        model = info.get("model")
        try:
            tok = self._tokenizer(model)
            res = await kv_parity.probe(self._session(), url, tok, model,
                                        block_size=self.block_size, key_scheme=self.key_scheme,
                                        ns_seed=self.ns_seed)
        except asyncio.CancelledError:
            raise
        except (TokenizerUnavailable, ValueError) as e:
            res = kv_parity.Parity(kv_parity.UNVERIFIED, None, f"no routing tokenizer: {e}")
        except Exception as e:  # noqa: BLE001 - network trouble: unverified, retried on readmission
            res = kv_parity.Parity(kv_parity.UNVERIFIED, None,
                                   f"probe failed: {type(e).__name__}: {e}", probe_failed=True)
        res.worker_id = worker_id
        old = self.parity.get(url)
        self.parity[url] = res
        if res.status == kv_parity.MISMATCH:
            k = (url, res.field or "unknown")
            self.mismatches_total[k] = self.mismatches_total.get(k, 0) + 1
            log.error("server %s: KV key mismatch in %s (%s); kv_cache_aware treats its cache "
                      "matches as unknown and places on it by load until it is fixed and restarted",
                      url, res.field, res.detail)
        elif old is not None and old.status == kv_parity.MISMATCH:
            log.info("server %s: KV keys match again (worker %s)", url, worker_id)   # a recovery
        elif res.status == kv_parity.UNVERIFIED:
            log.info("server %s: KV key parity unverified: %s", url, res.detail)
        if old is None or old.status != res.status or old.field != res.field:
            self.on_change()

    def removed(self, url: str) -> None:
        t = self._tasks.pop(url, None)
        if t is not None:
            t.cancel()
        self.parity.pop(url, None)
        self.pred.pop(url, None)

    async def stop(self) -> None:
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    # ---- predicted vs actual ----------------------------------------------------------------
    def report(self, server: str, prompt: int, predicted: int, actual: int) -> None:
        p = self.pred.get(server)
        if p is None:
            p = self.pred[server] = Prediction()
        p.requests += 1
        p.prompt += prompt
        p.predicted += predicted
        p.actual += actual
        if predicted or actual:
            sec = float(int(self.clock()))
            w = p.window
            if w and w[-1][0] == sec:
                b = w[-1]
                b[1] += predicted > 0
                b[2] += predicted
                b[3] += actual
            else:
                w.append([sec, int(predicted > 0), predicted, actual])

    def check(self, now: float) -> None:
        for server, p in self.pred.items():
            n, pr, ac = p.recent(now, self.window_s)
            low = n >= self.min_requests and pr >= self.min_predicted_tokens \
                and ac < self.alarm_ratio * pr
            if low and not p.alarm:
                p.alarm, p.alarm_since = True, now
                p.alarms += 1
            elif not low and p.alarm:
                p.alarm, p.alarm_since = False, None
                log.info("server %s: reported cached tokens back to %.2f of predicted", server,
                            ac / pr if pr else 1.0)
            if p.alarm and now - p.warned_at >= ALARM_WARN_EVERY_S:
                p.warned_at = now
                log.warning("server %s: workers reported %d cached tokens where routing predicted "
                            "%d over the last %.0fs (%d requests, ratio %.2f < %.2f): the KV index "
                            "claims blocks the server does not reuse (evicted faster than events "
                            "arrive, or keys that do not match its cache)", server, ac, pr,
                            self.window_s, n, ac / pr, self.alarm_ratio)

    def describe_prediction(self, server: str) -> dict | None:
        p = self.pred.get(server)
        if p is None:
            return None
        n, pr, ac = p.recent(self.clock(), self.window_s)
        return {"requests": p.requests, "prompt_tokens": p.prompt, "predicted_tokens": p.predicted,
                "actual_cached_tokens": p.actual,
                "recent": {"window_s": self.window_s, "requests": n, "predicted_tokens": pr,
                           "actual_cached_tokens": ac,
                           "ratio": round(ac / pr, 4) if pr else None},
                "alarm": p.alarm}
