"""Prometheus metrics of the fleet: one view aggregated over every fleet process.

With several fleet processes the launcher sets `PROMETHEUS_MULTIPROC_DIR` (a fresh directory) in
their environment *before* they import prometheus_client, so every process writes its samples to
mmap'd files there and any process's `/metrics` merges all of them (prometheus_client multiprocess
mode). With one process the default registry is served directly.

Label values are bounded: `role` ∈ {context, generation}, `server` is a configured or registered
worker URL, `endpoint`/`phase`/`reason` are fixed sets below.
"""
from __future__ import annotations

import os
from bisect import bisect_left

from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from ._mp_values import install_lean_values

MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
if MULTIPROC_DIR:
    install_lean_values()

# 0.5 ms .. ~2 min: covers routing overheads (sub-ms) and long prefills alike.
_LAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 120.0, float("inf"))
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                float("inf"))
_RTT_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
                1.0, 5.0, float("inf"))

class _LoopValue:
    """prometheus_client's `MutexValue` without the lock, for one-process fleets: every fleet
    metric is written and read (`/metrics`) on the event-loop thread only."""

    __slots__ = ("_value",)
    _multiprocess = False

    def __init__(self):
        self._value = 0.0

    def inc(self, amount) -> None:
        self._value += amount

    def set(self, value, timestamp=None) -> None:
        self._value = value

    def set_exemplar(self, exemplar) -> None:
        return

    def get(self):
        return self._value

    def get_exemplar(self):
        return None


class _Counter(Counter):
    """Counter with the hot path of a labelled child or plain counter: no observability check per
    call, no lock in a one-process fleet (same samples)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        if not MULTIPROC_DIR:
            self._value = _LoopValue()

    def inc(self, amount: float = 1, exemplar=None) -> None:
        if exemplar or amount < 0 or (self._labelnames and not self._labelvalues):
            return super().inc(amount, exemplar)    # errors and exemplars: as upstream
        self._value.inc(amount)


class _Gauge(Gauge):
    def _metric_init(self) -> None:
        super()._metric_init()
        if not MULTIPROC_DIR:
            self._value = _LoopValue()

    def inc(self, amount: float = 1) -> None:
        if self._labelnames and not self._labelvalues:
            return super().inc(amount)
        self._value.inc(amount)

    def dec(self, amount: float = 1) -> None:
        if self._labelnames and not self._labelvalues:
            return super().dec(amount)
        self._value.inc(-amount)


NS = "splitserve_fleet"

REQUESTS = _Counter(f"{NS}_requests_total", "Public API requests answered, by endpoint and HTTP status.",
                   ["endpoint", "status"])
INFLIGHT = _Gauge(f"{NS}_inflight_requests", "Public API requests in progress (summed over fleet processes).",
                 multiprocess_mode="livesum")
LEG_REQUESTS = _Counter(f"{NS}_leg_requests_total", "Upstream legs sent to workers, by role (attempts included).",
                       ["role"])
LEG_ERRORS = _Counter(f"{NS}_leg_errors_total", "Upstream legs that failed, by role and reason.",
                     ["role", "reason"])
RATE_LIMITED = _Counter(f"{NS}_rate_limited_total",
                       "Requests answered 429 by the rate limit (fleet.rate_limit), by reason "
                       "(queue_full, queue_timeout).", ["reason"])
LEG_RETRIES = _Counter(f"{NS}_leg_retries_total",
                      "Upstream legs retried on another server after a connect-level failure or an answer in "
                      "fleet.retry_on_status, by role.", ["role"])


class _Histogram(Histogram):
    """prometheus_client's Histogram with a cheaper hot path, same samples: children looked up once
    per label tuple (`labels()` validates and locks on every call; no fleet histogram child is ever
    removed, so the cache cannot go stale), and the bucket found by bisection instead of a linear
    scan (5 observations per two-leg request, `bench/fleet/fleet_metrics.py`)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        if not MULTIPROC_DIR:
            self._sum = _LoopValue()
            self._buckets = [_LoopValue() for _ in self._buckets]

    def labels(self, *values, **kw):
        if kw:
            return super().labels(*values, **kw)
        cache = self.__dict__.setdefault("_child_cache", {})
        try:
            return cache[values]
        except KeyError:
            child = cache[values] = super().labels(*values)
            return child

    def observe(self, amount: float, exemplar=None) -> None:
        if exemplar or amount != amount or (self._labelnames and not self._labelvalues):
            return super().observe(amount, exemplar)   # exemplars, NaN, a parent: as upstream
        self._sum.inc(amount)
        # upstream increments the first bucket whose bound is >= amount; the last bound is +Inf
        self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)


TTFT = _Histogram(f"{NS}_time_to_first_token_seconds",
                 "From the request's arrival at the fleet to the first response byte relayed to the client.",
                 ["mode"], buckets=_LAT_BUCKETS)
E2E = _Histogram(f"{NS}_e2e_request_latency_seconds",
                "From the request's arrival at the fleet to the last response byte sent to the client.",
                ["mode"], buckets=_LAT_BUCKETS)
ITL = _Histogram(f"{NS}_inter_token_latency_seconds",
                "Gap between consecutive streamed events relayed to the client (one event per token step).",
                buckets=_ITL_BUCKETS)
LEG_LATENCY = _Histogram(f"{NS}_leg_latency_seconds",
                        "Duration of one upstream leg, from sending it to its last byte, by role.",
                        ["role"], buckets=_LAT_BUCKETS)
COORD_RTT = _Histogram(f"{NS}_coordinator_rtt_seconds",
                      "Round trip of one coordinator call as seen by the fleet, by call.", ["call"],
                      buckets=_RTT_BUCKETS)
COORD_FALLBACK = _Counter(f"{NS}_coordinator_fallback_total",
                         "Placements made locally (last-known server list) because the coordinator was "
                         "unreachable, by role.", ["role"])
COORD_UP = _Gauge(f"{NS}_coordinator_reachable",
                 "1 while this fleet process reaches its coordinator, 0 while it places locally.",
                 multiprocess_mode="min")
FINISH_DROPPED = _Counter(f"{NS}_finish_dropped_total",
                         "Lease /finish calls that could not be delivered (the lease expires on its TTL).")
DUPLICATE_IDS = _Counter(f"{NS}_duplicate_request_ids_total",
                        "Requests answered 409: their client disagg_request_id was already in flight.")
BODY_TIMEOUTS = _Counter(f"{NS}_body_timeouts_total",
                        "Requests answered 408 because their body did not arrive within fleet.body_timeout_s.")
ORPHANED_LEASES = _Counter(f"{NS}_orphaned_placements_total",
                          "Placements whose client hung up while the coordinator was answering; their "
                          "leases are finished as soon as the answer arrives.")
PLACEMENT = _Counter(f"{NS}_placements_total",
                    "How requests were served: disaggregated (context+generation legs), generation_only "
                    "(conditional disaggregation skipped the context leg), aggregate_fallback (no context "
                    "server), context_only (the context leg already finished the request), aggregated (no context "
                    "servers configured), no_kv_transfer (the generation server cannot receive KV: served "
                    "aggregated there).", ["mode"])
DISCONNECTS = _Counter(f"{NS}_client_disconnects_total",
                      "Clients that went away before their answer was complete, by phase.", ["phase"])
ABORTS = _Counter(f"{NS}_upstream_aborts_total", "Worker /v1/abort calls sent, by role.", ["role"])
STRIPPED = _Counter(f"{NS}_stripped_disaggregated_params_total",
                   "Client-supplied disaggregated_params removed for lack of a valid HMAC.")
EJECTIONS = _Counter(f"{NS}_server_ejections_total",
                    "Servers ejected locally after failures, by role and server.", ["role", "server"])
PREDICTED_TOKENS = _Counter(f"{NS}_routing_predicted_cached_tokens_total",
                           "Prompt tokens the placement predicted to be cached on the chosen server.",
                           ["role", "server"])
CACHED_TOKENS = _Counter(f"{NS}_routing_reported_cached_tokens_total",
                        "Prompt tokens the server reported as cached (usage.prompt_tokens_details.cached_tokens).",
                        ["role", "server"])
PROMPT_TOKENS = _Counter(f"{NS}_routing_prompt_tokens_total",
                        "Prompt tokens of requests placed on the server (for hit-rate ratios).", ["role", "server"])


def render() -> tuple[bytes, str]:
    """The Prometheus exposition of this fleet (all processes in multiprocess mode)."""
    if MULTIPROC_DIR:
        from prometheus_client import multiprocess
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=MULTIPROC_DIR)
        return generate_latest(reg), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    """Drop a dead process's live gauges (called by the launcher when a fleet process exits)."""
    if MULTIPROC_DIR:
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid, MULTIPROC_DIR)
