"""One read of the coordinator's state, feeding both `/cluster_info` and the Prometheus collector.

`take(coord, listeners)` walks the registry, the lease table, the KV index and the feeds once and
keeps what both views need (per server: entry, load, index size, KV readiness, feed; the counters
of the coordinator, its diagnostics, membership and identities; and what its listeners counted).
`/cluster_info` is `ClusterSnapshot.cluster_info()`; `coordinator.metrics` builds its families from
the same object and from nothing else, so the two can never disagree on readiness, in-flight
leases, load or index sizes. It is taken synchronously on the event loop (no await between reads):
a consistent view.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator.registry import CONTEXT, GENERATION

if TYPE_CHECKING:
    from coordinator.diagnostics import Diagnostics
    from coordinator.kv_feed import WorkerFeed
    from coordinator.registry import ServerEntry
    from coordinator.service import Coordinator, Stats

__all__ = ["ChannelCounts", "ClusterSnapshot", "ListenerCounters", "ServerRow", "take"]

ROLES = (CONTEXT, GENERATION)


@dataclass(slots=True)
class ServerRow:
    """One server as both views show it."""
    entry: "ServerEntry"
    requests: int                  # in-flight leases on it
    tokens: int                    # their leased prompt tokens
    phase: tuple                   # (queued prefill tokens, leases in prefill, their tokens)
    index_blocks: int              # confirmed KV-index entries
    kv_ready: bool
    empty_under_traffic: bool
    feed: "WorkerFeed | None"      # its KV-event feed (rank 0; `.ranks` for the others)
    kv_capacity: dict | None = None  # the index's capacity model (router/kv_index.py)

    @property
    def url(self) -> str:
        return self.entry.url


@dataclass(frozen=True, slots=True)
class ChannelCounts:
    """The fleet channel's traffic (coordinator/channel.py `ChannelStats`)."""
    connections: int
    batches: int
    calls: int
    finishes: int
    malformed: int
    shed: int


@dataclass(frozen=True, slots=True)
class ListenerCounters:
    """What the listeners serving the coordinator counted (coordinator/listeners.py
    `CoordinatorServer.counters`): HTTP placements shed, and the channel's traffic when it is on."""
    http_shed: int
    channel: ChannelCounts | None = None


@dataclass(slots=True)
class ClusterSnapshot:
    now: float                     # the coordinator's clock
    mono: float                    # time.monotonic(), for feed ages
    started_at: float              # on the coordinator's clock
    not_ready_reason: str | None
    minimal: dict[str, int]
    rows: list[ServerRow]
    healthy: dict[str, list[str]]  # healthy urls per role
    in_flight: dict[str, int]      # live leases per role (the lease table's own counts)
    index_size: int
    stats: "Stats"                 # the coordinator's counters, read as they are
    diag: "Diagnostics"            # key parity and predicted-vs-actual, read as they are
    routing: dict[str, Any]        # block size, key scheme, namespace and its seed
    routers: dict[str, dict]       # {role: {"type", "args"}}
    lease_ttl_s: float
    prefill_ttl_s: float           # the lease table's prefill-phase fallback, and its counters
    first_tokens: int
    prefill_timeouts: int
    leases_reregistered: int       # docs/failover.md
    leases_ended_by_announcement: int
    kv_bind_endpoint: str | None
    kv_bound_reader_restarts: int
    kv_unknown_topic: int
    registrations: int             # dynamic registrations, ever
    registrations_expired: int
    identities_held: int
    identities_ttl_s: float
    identities_expired: int
    membership: dict | None        # the etcd membership's description, when configured
    version: str
    cluster_id: str
    listeners: ListenerCounters | None   # None: no listener serves it (in-process only)

    @property
    def is_ready(self) -> bool:
        return self.not_ready_reason is None

    @property
    def uptime_s(self) -> float:
        return max(0.0, self.now - self.started_at)

    def cluster_info(self) -> dict[str, Any]:
        st, diag = self.stats, self.diag
        servers: dict[str, list] = {CONTEXT: [], GENERATION: []}
        for row in self.rows:
            e = row.entry
            d = e.describe(self.now)
            q, npf, tpf = row.phase
            d["load"] = {"requests": row.requests, "tokens": row.tokens,
                         "queued_prefill_tokens": q, "prefilling": npf,
                         "decoding": row.requests - npf, "decoding_tokens": row.tokens - tpf}
            d["kv_index_blocks"] = row.index_blocks
            d["kv_ready"] = row.kv_ready
            d["kv_index_empty_under_traffic"] = row.empty_under_traffic
            par = diag.parity.get(e.url)
            d["kv_parity"] = par.describe() if par is not None else None
            d["kv_mismatch"] = par.field if par is not None and par.status == "kv_mismatch" else None
            d["routing_prediction"] = diag.describe_prediction(e.url)
            d["kv_capacity_model"] = row.kv_capacity
            d["kv_events"] = row.feed.describe(self.mono) if row.feed is not None else None
            d["server_info"] = e.server_info
            for role in e.roles:
                servers[role].append(d)
        return {
            "is_ready": self.is_ready,
            "not_ready_reason": self.not_ready_reason,
            "server_lists": {role: list(self.healthy[role]) for role in ROLES},
            "servers": servers,
            "minimal_instances": {"context_servers": self.minimal[CONTEXT],
                                  "generation_servers": self.minimal[GENERATION]},
            "membership": self.membership,
            "routing": dict(self.routing),
            "routing_key_configs": {role: {"tokens_per_block": self.routing["block_size"],
                                           "key_scheme": self.routing["key_scheme"]} for role in ROLES},
            "routers": {role: dict(r) for role, r in self.routers.items()},
            "leases": {"in_flight": dict(self.in_flight), "ttl_s": self.lease_ttl_s,
                       "expired_total": dict(st.leases_expired),
                       "replaced_total": st.leases_replaced,
                       "prefill_ttl_s": self.prefill_ttl_s,
                       "first_tokens_total": self.first_tokens,
                       "prefill_timeouts_total": self.prefill_timeouts,
                       "first_token_unknown_total": st.first_token_unknown,
                       # docs/failover.md: re-registered after a move, ended by a fleet process's
                       # death announcement, dropped with a restarted server's process
                       "reregistered_total": self.leases_reregistered,
                       "ended_by_announcement_total": self.leases_ended_by_announcement,
                       "fenced_total": st.leases_fenced},
            "kv_index": {"size": self.index_size, "bind_endpoint": self.kv_bind_endpoint,
                         "bound_reader_restarts": self.kv_bound_reader_restarts},
            "routing_diagnostics": {
                "kv_mismatch": sorted(u for u in diag.parity if diag.kv_unknown(u)),
                "prediction_alarm": sorted(u for u, p in diag.pred.items() if p.alarm),
                "alarm_ratio": diag.alarm_ratio, "window_s": diag.window_s},
            "select_latency_s": {"count": st.select_latency.n,
                                 "p50_le": st.select_latency.quantile(0.5),
                                 "p99_le": st.select_latency.quantile(0.99)},
            "identities": {"held": self.identities_held, "ttl_s": self.identities_ttl_s},
            "version": self.version,
            "cluster_id": self.cluster_id,
            "uptime_s": round(self.now - self.started_at, 3),
        }


def take(coord: "Coordinator", listeners: ListenerCounters | None = None) -> ClusterSnapshot:
    """Read the coordinator's state once (and what its listeners counted, when given)."""
    leases, index, kv = coord.leases, coord.index, coord.kv
    empty = coord.empty_index_servers
    rows = []
    for e in coord.registry.servers.values():
        r, t = leases.load(e.url)
        rows.append(ServerRow(entry=e, requests=int(r), tokens=int(t), phase=leases.phase(e.url),
                              index_blocks=int(index.worker_size(e.url)), kv_ready=kv.kv_ready(e.url),
                              empty_under_traffic=e.url in empty, feed=kv.feeds.get(e.url),
                              kv_capacity=index.capacity_state(e.url)))
    reg, ids = coord.registry, coord.identities
    return ClusterSnapshot(
        now=coord.clock(), mono=time.monotonic(), started_at=coord.started_at,
        not_ready_reason=coord.not_ready_reason(), minimal=dict(coord.minimal), rows=rows,
        healthy={role: [e.url for e in reg.healthy(role)] for role in ROLES},
        in_flight=coord.in_flight(), index_size=int(index.size),
        stats=coord.stats, diag=coord.diag, routing=coord.routing_info(),
        routers={role: {"type": coord.router_types[role], "args": coord.router_args[role]}
                 for role in ROLES},
        lease_ttl_s=coord.lease_ttl_s, prefill_ttl_s=leases.prefill_ttl,
        first_tokens=leases.first_tokens, prefill_timeouts=leases.prefill_timeouts,
        leases_reregistered=coord.leases_reregistered,
        leases_ended_by_announcement=coord.leases_ended_by_announcement,
        kv_bind_endpoint=kv.bound_endpoint,
        kv_bound_reader_restarts=kv.bound_reader_restarts, kv_unknown_topic=kv.unknown_topic,
        registrations=reg.registrations_total, registrations_expired=reg.registrations_expired,
        identities_held=len(ids), identities_ttl_s=ids.ttl_s, identities_expired=ids.expired_total,
        membership=coord.membership.describe() if coord.membership is not None else None,
        version=coord.version, cluster_id=coord.cluster_id, listeners=listeners)
