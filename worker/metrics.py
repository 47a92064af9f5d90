"""Prometheus metrics of a worker, read from the engine and the event publisher at scrape time.

A collector (not module-level gauges) so several workers can live in one process (tests) and a
scrape always sees one consistent ``engine.stats()`` snapshot.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["WorkerCollector", "make_registry", "render"]

_P = "splitserve_worker_"


class WorkerCollector:
    def __init__(self, engine, publisher=None, labels: dict[str, str] | None = None):
        self.engine = engine
        self.publisher = publisher
        self.labels = dict(labels or {})

    def _g(self, name, doc, value, extra: dict | None = None):
        keys = list(self.labels) + list(extra or {})
        m = GaugeMetricFamily(_P + name, doc, labels=keys)
        m.add_metric([*self.labels.values(), *(extra or {}).values()], value)
        return m

    def _c(self, name, doc, value):
        m = CounterMetricFamily(_P + name, doc, labels=list(self.labels))
        m.add_metric(list(self.labels.values()), value)
        return m

    def collect(self):
        s = self.engine.stats()
        yield self._g("num_requests_running", "Requests holding KV blocks (running or receiving KV).",
                      s["running"])
        yield self._g("num_requests_waiting", "Requests queued for admission.", s["waiting"])
        yield self._g("num_pinned_transfers",
                      "Finished context requests whose KV is pinned for a transfer.",
                      s["pinned_transfers"])
        kv = GaugeMetricFamily(_P + "kv_blocks", "KV cache blocks by state (used = referenced, "
                               "cached = unreferenced prefix-cache entries, free = empty).",
                               labels=list(self.labels) + ["state"])
        for state in ("used", "free", "cached", "pinned"):
            kv.add_metric([*self.labels.values(), state], s[f"kv_blocks_{state}"])
        yield kv
        yield self._g("kv_blocks_total", "KV cache blocks in the pool.", s["kv_blocks_total"])
        total = max(1, s["kv_blocks_total"])
        yield self._g("kv_cache_usage_ratio", "Fraction of KV blocks referenced by requests or pins.",
                      s["kv_blocks_used"] / total)
        yield self._c("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      s["prefix_hit_tokens_total"])
        yield self._c("prompt_tokens", "Prompt tokens of admitted requests.", s["prompt_tokens_total"])
        yield self._c("prefill_tokens", "Tokens computed in prefill chunks.", s["prefill_tokens_total"])
        yield self._c("decode_tokens", "Tokens computed in decode steps.", s["decode_tokens_total"])
        yield self._c("generation_tokens", "Tokens generated (sampled or received as first tokens).",
                      s["generation_tokens_total"])
        yield self._c("preemptions", "Requests preempted for lack of KV blocks.",
                      s["preemptions_total"])
        yield self._c("engine_steps", "Engine steps executed.", s["steps_total"])
        yield self._g("prefill_tokens_per_second", "Prefill throughput over the last 10 s.",
                      s["prefill_tokens_per_s"])
        yield self._g("decode_tokens_per_second", "Decode throughput over the last 10 s.",
                      s["decode_tokens_per_s"])
        fin = CounterMetricFamily(_P + "requests_finished", "Finished requests by finish reason.",
                                  labels=list(self.labels) + ["finish_reason"])
        for reason, n in sorted(s["requests_finished"].items()):
            fin.add_metric([*self.labels.values(), reason], n)
        yield fin
        rel = CounterMetricFamily(_P + "pins_released", "Pinned transfers released, by cause "
                                  "(transferred, receiver_cancelled, write_failed, abort, "
                                  "timeout, ...).", labels=list(self.labels) + ["reason"])
        for reason, n in sorted(s.get("pins_released", {}).items()):
            rel.add_metric([*self.labels.values(), reason], n)
        yield rel
        if self.publisher is not None:
            p = self.publisher
            yield self._c("kv_event_batches", "KV event batches published.", p.batches_published)
            yield self._c("kv_events", "KV events published.", p.events_published)
            yield self._c("kv_event_replays", "Replay requests answered.", p.replays_served)
            yield self._g("kv_event_last_seq", "Sequence number of the last published batch.",
                          p.last_seq)


def make_registry(engine, publisher=None, labels=None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(WorkerCollector(engine, publisher, labels))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
