"""Prometheus exposition of the coordinator's state.

The hot path only bumps plain integers; metric families are built when `/metrics` is scraped (a
custom collector), so a `/select` pays no metric locks. The collector reads one
`coordinator.snapshot.ClusterSnapshot` and nothing else: the object `/cluster_info` is built from,
with what the listeners counted (coordinator/listeners.py `CoordinatorServer.counters`).
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)

from coordinator.snapshot import ClusterSnapshot, ListenerCounters

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


def _counter(name: str, doc: str, labels=()) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=list(labels))


def _gauge(name: str, doc: str, labels=()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))


class CoordinatorCollector:
    """The families of one scrape, from one `coordinator.snapshot.ClusterSnapshot` (the object
    `/cluster_info` is built from too) and nothing else. `source` takes it: the coordinator's
    `snapshot` with what its listeners counted (coordinator/api.py `/metrics`)."""

    def __init__(self, source: Callable[[], ClusterSnapshot]):
        self.source = source

    def collect(self) -> Iterable[Metric]:
        snap = self.source()
        yield from _placements(snap)
        yield from _servers(snap)
        yield from _diagnostics(snap.diag, _counter, _gauge)
        yield from _membership(snap)
        if snap.listeners is not None:
            yield from _listeners(snap.listeners)
        upt = _gauge("uptime_seconds", "seconds since the coordinator started")
        upt.add_metric([], snap.uptime_s)
        yield upt


def _placements(snap: ClusterSnapshot) -> Iterable[Metric]:
    """Readiness, placements, their latency and the leases they hold."""
    st = snap.stats
    ready = _gauge("ready", "1 while the configured minimum of healthy servers per role exists")
    ready.add_metric([], 1.0 if snap.is_ready else 0.0)
    yield ready
    sel = _counter("select", "placements answered by /select and /select_pair", ["role"])
    for role, n in st.selects.items():
        sel.add_metric([role], n)
    yield sel
    rej = _counter("select_rejected", "placements refused", ["role", "reason"])
    for (role, reason), n in st.select_rejected.items():
        rej.add_metric([role, reason], n)
    yield rej
    bad = _counter("bad_requests", "requests answered 400/415", ["endpoint"])
    for ep, n in st.bad_requests.items():
        bad.add_metric([ep], n)
    yield bad
    pair = _counter("select_pair_mode", "select_pair outcomes by P/D decision", ["mode"])
    for mode, n in st.pair_modes.items():
        pair.add_metric([mode], n)
    yield pair

    h = st.select_latency
    hist = HistogramMetricFamily(PREFIX + "select_seconds",
                                 "time spent handling one placement inside the coordinator")
    hist.add_metric([], h.buckets(), h.sum)
    yield hist

    fin = _counter("finish", "leases finished by /finish", ["role", "success"])
    for (role, ok), n in st.finishes.items():
        fin.add_metric([role, "true" if ok else "false"], n)
    yield fin
    fin_unknown = _counter("finish_unknown", "/finish calls for no live lease (repeats, expired)")
    fin_unknown.add_metric([], st.finish_unknown)
    yield fin_unknown
    ren = _counter("renew", "lease renewals", ["result"])
    ren.add_metric(["renewed"], st.renewed)
    ren.add_metric(["unknown"], st.renew_unknown)
    yield ren
    rep = _counter("lease_replaced", "leases replaced by a repeated /select of the same key")
    rep.add_metric([], st.leases_replaced)
    yield rep
    exp = _counter("lease_expired", "leases released by expiry (no finish or renew in time)",
                   ["role"])
    for role, n in st.leases_expired.items():
        exp.add_metric([role], n)
    yield exp
    inflight = _gauge("leases_in_flight", "live leases", ["role"])
    for role, n in snap.in_flight.items():
        inflight.add_metric([role], n)
    yield inflight


def _servers(snap: ClusterSnapshot) -> Iterable[Metric]:
    """Servers by state, and per server its load, KV index and KV-event feed."""
    healthy = _gauge("servers", "servers by role and state", ["role", "state"])
    counts: dict = {}
    for row in snap.rows:
        e = row.entry
        for role in e.roles:
            counts[(role, e.state.value)] = counts.get((role, e.state.value), 0) + 1
    for role in ("context", "generation"):
        for state in ("pending", "healthy", "unhealthy", "refused"):
            healthy.add_metric([role, state], counts.get((role, state), 0))
    yield healthy

    up = _gauge("server_healthy", "1 when the server receives traffic", ["server"])
    load_r = _gauge("server_load_requests", "in-flight leases per server", ["server"])
    load_t = _gauge("server_load_tokens", "leased prompt tokens per server", ["server"])
    ej = _counter("server_ejections", "ejections per server", ["server"])
    idx = _gauge("kv_index_blocks", "KV-index entries per server", ["server"])
    lag = _gauge("kv_event_lag_seconds", "publish-to-apply delay of the last applied batch",
                 ["server"])
    age = _gauge("kv_event_age_seconds", "time since the last applied batch", ["server"])
    ev = _counter("kv_events_applied", "KV events applied", ["server"])
    bl = _counter("kv_blocks_applied", "blocks stored or removed by applied events", ["server", "op"])
    gaps = _counter("kv_gaps", "sequence gaps detected", ["server"])
    rp = _counter("kv_replays", "replay requests", ["server", "outcome"])
    cl = _counter("kv_clears", "times a server's entries were cleared", ["server", "cause"])
    de = _counter("kv_decode_errors", "undecodable event batches", ["server"])
    cf = _counter("kv_connect_failures", "failed connects to (or polls of) a server's event "
                  "source", ["server"])
    rr = _counter("kv_reader_restarts", "KV-event readers that died and were restarted",
                  ["server"])
    rdy = _gauge("kv_ready", "1 once the server's index was rebuilt and it counts for kv-aware "
                 "placement", ["server"])
    capm = _gauge("kv_capacity_room_blocks", "blocks the KV index's capacity model lets the "
                  "server's LRU keep (its KV capacity less the blocks running requests brought; "
                  "docs/routing.md, capacity-aware prediction)", ["server"])
    empty = _gauge("kv_index_empty_under_traffic",
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
        if row.kv_capacity is not None:
            capm.add_metric([s], row.kv_capacity["room_blocks"])
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
                empty, capm)
    yield from _scaling_signal(snap)

    total = _gauge("kv_index_size", "KV-index entries over all servers")
    total.add_metric([], snap.index_size)
    yield total
    warn = _counter("kv_empty_index_warnings", "warnings raised for kv-aware traffic to a server "
                    "whose index stayed empty")
    warn.add_metric([], snap.stats.empty_index_warnings)
    yield warn
    ut = _counter("kv_unknown_topic", "batches on the bound endpoint from an unknown topic")
    ut.add_metric([], snap.kv_unknown_topic)
    yield ut


def _scaling_signal(snap: ClusterSnapshot) -> Iterable[Metric]:
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
    q = _gauge("role_queued_prefill_tokens", "prompt tokens still to prefill on a role's healthy "
              "servers: leases placed whose first token is not reported yet", ["role"])
    occ = _gauge("role_kv_occupancy", "KV-index blocks over the KV capacity (/server_info "
                "kv_capacity_blocks) of a role's healthy servers that report one", ["role"])
    for role in ("context", "generation"):
        q.add_metric([role], tokens[role])
        if capacity[role]:
            occ.add_metric([role], blocks[role] / capacity[role])
    yield q
    yield occ


def _membership(snap: ClusterSnapshot) -> Iterable[Metric]:
    """Dynamic registrations and the fleet's identity leases."""
    reg = _counter("registrations", "dynamic registrations", ["event"])
    reg.add_metric(["registered"], snap.registrations)
    reg.add_metric(["expired"], snap.registrations_expired)
    yield reg
    ids = _gauge("identities_held", "fleet (node_id, process_id) pairs leased")
    ids.add_metric([], snap.identities_held)
    yield ids
    ide = _counter("identities_expired", "fleet identity leases that expired")
    ide.add_metric([], snap.identities_expired)
    yield ide


def _listeners(lc: ListenerCounters) -> Iterable[Metric]:
    """What the listeners counted: placements shed per transport, the fleet channel's traffic."""
    shed = _counter("shed", "placements shed by a saturated coordinator (429, no lease)",
                    ["transport"])
    shed.add_metric(["http"], lc.http_shed)
    ch = lc.channel
    if ch is not None:
        shed.add_metric(["channel"], ch.shed)
        conns = _gauge("channel_connections", "open fleet channel connections")
        conns.add_metric([], ch.connections)
        yield conns
        frames = _counter("channel_batches", "batches received on fleet channels")
        frames.add_metric([], ch.batches)
        yield frames
        calls = _counter("channel_calls", "calls and finishes received on fleet channels",
                         ["kind"])
        calls.add_metric(["call"], ch.calls)
        calls.add_metric(["finish"], ch.finishes)
        calls.add_metric(["malformed"], ch.malformed)
        yield calls
    yield shed


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
    rat = gauge("routing_prediction_ratio", "actual/predicted cached tokens over the sliding "
                "window (absent while nothing was predicted there)", ["server"])
    now = d.clock()
    for server, p in d.pred.items():
        pr.add_metric([server], p.predicted)
        ac.add_metric([server], p.actual)
        pt.add_metric([server], p.prompt)
        al.add_metric([server], 1.0 if p.alarm else 0.0)
        alt.add_metric([server], p.alarms)
        _, rp_, ra_ = p.recent(now, d.window_s)
        if rp_:
            rat.add_metric([server], ra_ / rp_)
    yield from (mm, st, pr, ac, pt, al, alt, rat)


def render(snap: ClusterSnapshot) -> bytes:
    """The Prometheus text of one snapshot."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CoordinatorCollector(lambda: snap))
    return generate_latest(reg)
