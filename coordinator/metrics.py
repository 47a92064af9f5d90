"""Prometheus exposition of the coordinator's state.

The hot path only bumps plain integers; metric families are built from the live state when
`/metrics` is scraped (a custom collector), so a `/select` pays no metric locks.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)

from coordinator.snapshot import take

if TYPE_CHECKING:
    from coordinator.service import Coordinator

PREFIX = "splitserve_coordinator_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; /select is expected in the tens of microseconds, so the low end is fine-grained.
LATENCY_BUCKETS = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0)


class LatencyHistogram:
    """Cumulative-at-export histogram; `observe` is one bisect and two adds."""

    __slots__ = ("bounds", "counts", "sum", "n")

    def __init__(self, bounds: Iterable[float] = LATENCY_BUCKETS):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.n += 1

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((repr(float(b)), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out

    def quantile(self, q: float) -> float | None:
        """Upper bucket bound holding the q-quantile (coarse; for /cluster_info)."""
        if self.n == 0:
            return None
        target, acc = q * self.n, 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            if acc >= target:
                return b
        return float("inf")


def _scaling_signal(snap, gauge) -> Iterable[Metric]:
    """Per role, what an autoscaler (HPA/KEDA, Dynamo's planner, llm-d's) acts on: the prefill work
    queued on the role (the per-server `queued_prefill_tokens` of /cluster_info, summed), and how
    full its KV caches are (helm/splitserve/examples/)."""
    tokens = {"context": 0, "generation": 0}
    blocks = {"context": 0, "generation": 0}
    capacity = {"context": 0, "generation": 0}
    for row in snap.rows:
        e = row.entry
        if not e.healthy:
            continue
        cap = (e.server_info or {}).get("kv_capacity_blocks")
        for role in e.roles:
            tokens[role] += row.phase[0]
            if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
                blocks[role] += row.index_blocks
                capacity[role] += cap
    q = gauge("role_queued_prefill_tokens", "prompt tokens still to prefill on a role's healthy "
              "servers: leases placed whose first token is not reported yet", ["role"])
    occ = gauge("role_kv_occupancy", "KV-index blocks over the KV capacity (/server_info "
                "kv_capacity_blocks) of a role's healthy servers that report one", ["role"])
    for role in ("context", "generation"):
        q.add_metric([role], tokens[role])
        if capacity[role]:
            occ.add_metric([role], blocks[role] / capacity[role])
    yield q
    yield occ


class CoordinatorCollector:
    """The families of one scrape, from one `coordinator.snapshot.ClusterSnapshot` (the object
    `/cluster_info` is built from too)."""

    def __init__(self, coord: "Coordinator"):
        self.coord = coord

    def collect(self) -> Iterable[Metric]:  # noqa: C901 - one flat list of families
        snap = take(self.coord)
        c = snap.coord
        st = c.stats

        def counter(name, doc, labels=()):
            return CounterMetricFamily(PREFIX + name, doc, labels=list(labels))

        def gauge(name, doc, labels=()):
            return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))

        ready = gauge("ready", "1 while the configured minimum of healthy servers per role exists")
        ready.add_metric([], 1.0 if snap.is_ready else 0.0)
        yield ready

        sel = counter("select", "placements answered by /select and /select_pair", ["role"])
        for role, n in st.selects.items():
            sel.add_metric([role], n)
        yield sel
        rej = counter("select_rejected", "placements refused", ["role", "reason"])
        for (role, reason), n in st.select_rejected.items():
            rej.add_metric([role, reason], n)
        yield rej
        bad = counter("bad_requests", "requests answered 400/415", ["endpoint"])
        for ep, n in st.bad_requests.items():
            bad.add_metric([ep], n)
        yield bad
        pair = counter("select_pair_mode", "select_pair outcomes by P/D decision", ["mode"])
        for mode, n in st.pair_modes.items():
            pair.add_metric([mode], n)
        yield pair

        h = st.select_latency
        hist = HistogramMetricFamily(PREFIX + "select_seconds",
                                     "time spent handling one placement inside the coordinator")
        hist.add_metric([], h.buckets(), h.sum)
        yield hist

        fin = counter("finish", "leases finished by /finish", ["role", "success"])
        for (role, ok), n in st.finishes.items():
            fin.add_metric([role, "true" if ok else "false"], n)
        yield fin
        fin_unknown = counter("finish_unknown", "/finish calls for no live lease (repeats, expired)")
        fin_unknown.add_metric([], st.finish_unknown)
        yield fin_unknown
        ren = counter("renew", "lease renewals", ["result"])
        ren.add_metric(["renewed"], st.renewed)
        ren.add_metric(["unknown"], st.renew_unknown)
        yield ren
        rep = counter("lease_replaced", "leases replaced by a repeated /select of the same key")
        rep.add_metric([], st.leases_replaced)
        yield rep
        exp = counter("lease_expired", "leases released by expiry (no finish or renew in time)",
                      ["role"])
        for role, n in st.leases_expired.items():
            exp.add_metric([role], n)
        yield exp
        inflight = gauge("leases_in_flight", "live leases", ["role"])
        for role, n in snap.in_flight.items():
            inflight.add_metric([role], n)
        yield inflight

        healthy = gauge("servers", "servers by role and state", ["role", "state"])
        counts: dict = {}
        for row in snap.rows:
            e = row.entry
            for role in e.roles:
                counts[(role, e.state.value)] = counts.get((role, e.state.value), 0) + 1
        for role in ("context", "generation"):
            for state in ("pending", "healthy", "unhealthy", "refused"):
                healthy.add_metric([role, state], counts.get((role, state), 0))
        yield healthy

        up = gauge("server_healthy", "1 when the server receives traffic", ["server"])
        load_r = gauge("server_load_requests", "in-flight leases per server", ["server"])
        load_t = gauge("server_load_tokens", "leased prompt tokens per server", ["server"])
        ej = counter("server_ejections", "ejections per server", ["server"])
        idx = gauge("kv_index_blocks", "KV-index entries per server", ["server"])
        lag = gauge("kv_event_lag_seconds", "publish-to-apply delay of the last applied batch",
                    ["server"])
        age = gauge("kv_event_age_seconds", "time since the last applied batch", ["server"])
        ev = counter("kv_events_applied", "KV events applied", ["server"])
        bl = counter("kv_blocks_applied", "blocks stored or removed by applied events", ["server", "op"])
        gaps = counter("kv_gaps", "sequence gaps detected", ["server"])
        rp = counter("kv_replays", "replay requests", ["server", "outcome"])
        cl = counter("kv_clears", "times a server's entries were cleared", ["server", "cause"])
        de = counter("kv_decode_errors", "undecodable event batches", ["server"])
        cf = counter("kv_connect_failures", "failed connects to (or polls of) a server's event "
                     "source", ["server"])
        rr = counter("kv_reader_restarts", "KV-event readers that died and were restarted",
                     ["server"])
        rdy = gauge("kv_ready", "1 once the server's index was rebuilt and it counts for kv-aware "
                    "placement", ["server"])
        empty = gauge("kv_index_empty_under_traffic",
                      "1 while a server gets kv-aware traffic but its index stays empty "
                      "(events not arriving)", ["server"])
        for row in snap.rows:
            e, s = row.entry, row.url
            up.add_metric([s], 1.0 if e.healthy else 0.0)
            load_r.add_metric([s], row.requests)
            load_t.add_metric([s], row.tokens)
            ej.add_metric([s], e.ejections)
            idx.add_metric([s], row.index_blocks)
            empty.add_metric([s], 1.0 if row.empty_under_traffic else 0.0)
            feed = row.feed
            rdy.add_metric([s], 1.0 if row.kv_ready else 0.0)
            if feed is None:
                continue
            if feed.lag_s is not None:
                lag.add_metric([s], feed.lag_s)
            if feed.last_applied_mono is not None:
                age.add_metric([s], max(0.0, snap.mono - feed.last_applied_mono))
            ev.add_metric([s], feed.events_applied)
            bl.add_metric([s, "stored"], feed.blocks_stored)
            bl.add_metric([s, "removed"], feed.blocks_removed)
            gaps.add_metric([s], feed.gaps)
            rp.add_metric([s, "ok"], feed.replays_ok)
            rp.add_metric([s, "failed"], feed.replays_failed)
            for cause, n in feed.clears.items():
                cl.add_metric([s, cause], n)
            fs = (feed, *feed.ranks)
            de.add_metric([s], sum(f.decode_errors for f in fs))
            cf.add_metric([s], sum(f.connect_failures for f in fs))
            rr.add_metric([s], sum(f.reader_restarts for f in fs))
        yield from (up, load_r, load_t, ej, idx, lag, age, ev, bl, gaps, rp, cl, de, cf, rr, rdy,
                    empty)
        yield from _scaling_signal(snap, gauge)

        total = gauge("kv_index_size", "KV-index entries over all servers")
        total.add_metric([], snap.index_size)
        yield total
        warn = counter("kv_empty_index_warnings", "warnings raised for kv-aware traffic to a server "
                       "whose index stayed empty")
        warn.add_metric([], st.empty_index_warnings)
        yield warn
        yield from _diagnostics(c.diag, counter, gauge)
        ut = counter("kv_unknown_topic", "batches on the bound endpoint from an unknown topic")
        ut.add_metric([], c.kv.unknown_topic)
        yield ut

        reg = counter("registrations", "dynamic registrations", ["event"])
        reg.add_metric(["registered"], c.registry.registrations_total)
        reg.add_metric(["expired"], c.registry.registrations_expired)
        yield reg
        ids = gauge("identities_held", "fleet (node_id, process_id) pairs leased")
        ids.add_metric([], len(c.identities))
        yield ids
        ide = counter("identities_expired", "fleet identity leases that expired")
        ide.add_metric([], c.identities.expired_total)
        yield ide
        srv = getattr(c, "transport", None)   # the CoordinatorServer serving it, if any
        if srv is not None:
            shed = counter("shed", "placements shed by a saturated coordinator (429, no lease)",
                           ["transport"])
            shed.add_metric(["http"], srv.api.shed)
            ch = srv.channel
            if ch is not None:
                cs = ch.stats
                shed.add_metric(["channel"], cs.shed)
                conns = gauge("channel_connections", "open fleet channel connections")
                conns.add_metric([], cs.connections)
                yield conns
                frames = counter("channel_batches", "batches received on fleet channels")
                frames.add_metric([], cs.batches)
                yield frames
                calls = counter("channel_calls", "calls and finishes received on fleet channels",
                                ["kind"])
                calls.add_metric(["call"], cs.calls)
                calls.add_metric(["finish"], cs.finishes)
                calls.add_metric(["malformed"], cs.bad_calls)
                yield calls
            yield shed
        upt = gauge("uptime_seconds", "seconds since the coordinator started")
        upt.add_metric([], snap.uptime_s)
        yield upt


def _diagnostics(d, counter, gauge) -> Iterable[Metric]:
    """Key parity and predicted-vs-actual cached tokens (coordinator/diagnostics.py)."""
    mm = counter("kv_key_mismatch", "key parity probes that found a server's block keys differ "
                 "from the routing recipe, by the first differing field", ["server", "field"])
    for (server, fld), n in d.mismatches_total.items():
        mm.add_metric([server, fld], n)
    st = gauge("kv_parity", "1 for the server's current key parity status", ["server", "status"])
    for server, p in d.parity.items():
        st.add_metric([server, p.status], 1.0)
    pr = counter("routing_predicted_cached_tokens", "prompt tokens kv-aware placement predicted "
                 "cached on the chosen server (route receipt matched_tokens)", ["server"])
    ac = counter("routing_actual_cached_tokens", "prompt tokens the server reported cached "
                 "(usage.prompt_tokens_details.cached_tokens) for kv-aware placements", ["server"])
    pt = counter("routing_reported_prompt_tokens", "prompt tokens of kv-aware placements with a "
                 "usage report", ["server"])
    al = gauge("routing_prediction_alarm", "1 while actual/predicted cached tokens stays below "
               "the alarm ratio under traffic", ["server"])
    alt = counter("routing_prediction_alarms", "times the predicted-vs-actual alarm was raised",
                  ["server"])
    for server, p in d.pred.items():
        pr.add_metric([server], p.predicted)
        ac.add_metric([server], p.actual)
        pt.add_metric([server], p.prompt)
        al.add_metric([server], 1.0 if p.alarm else 0.0)
        alt.add_metric([server], p.alarms)
    yield from (mm, st, pr, ac, pt, al, alt)


def render(coord: "Coordinator") -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CoordinatorCollector(coord))
    return generate_latest(reg)
