"""One read of the coordinator's state, feeding both `/cluster_info` and the Prometheus collector.

`take(coord)` walks the registry, the lease table, the KV index and the feeds once and keeps what
both views need (per server: entry, load, index size, KV readiness, feed). `/cluster_info` is
`ClusterSnapshot.cluster_info()`; `coordinator.metrics` builds its families from the same object,
so the two can never disagree on readiness, in-flight leases, load or index sizes. It is taken
synchronously on the event loop (no await between reads): a consistent view.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator.registry import CONTEXT, GENERATION

if TYPE_CHECKING:
    from coordinator.kv_feed import WorkerFeed
    from coordinator.registry import ServerEntry
    from coordinator.service import Coordinator

__all__ = ["ClusterSnapshot", "ServerRow", "take"]

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

    @property
    def url(self) -> str:
        return self.entry.url


@dataclass(slots=True)
class ClusterSnapshot:
    coord: "Coordinator"           # for the counters both views read as they are (stats, diag, kv)
    now: float                     # the coordinator's clock
    mono: float                    # time.monotonic(), for feed ages
    not_ready_reason: str | None
    minimal: dict[str, int]
    rows: list[ServerRow]
    healthy: dict[str, list[str]]  # healthy urls per role
    in_flight: dict[str, int]      # live leases per role (the lease table's own counts)
    index_size: int

    @property
    def is_ready(self) -> bool:
        return self.not_ready_reason is None

    @property
    def uptime_s(self) -> float:
        return max(0.0, self.now - self.coord.started_at)

    def cluster_info(self) -> dict[str, Any]:
        c = self.coord
        st = c.stats
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
            par = c.diag.parity.get(e.url)
            d["kv_parity"] = par.describe() if par is not None else None
            d["kv_mismatch"] = par.field if par is not None and par.status == "kv_mismatch" else None
            d["routing_prediction"] = c.diag.describe_prediction(e.url)
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
            "membership": c.membership.describe() if c.membership is not None else None,
            "routing": c.routing_info(),
            "routing_key_configs": {role: {"tokens_per_block": c.block_size,
                                           "key_scheme": c.key_scheme} for role in ROLES},
            "routers": {role: {"type": c.router_types[role], "args": c.router_args[role]}
                        for role in ROLES},
            "leases": {"in_flight": dict(self.in_flight), "ttl_s": c.lease_ttl_s,
                       "expired_total": dict(st.leases_expired),
                       "replaced_total": st.leases_replaced,
                       "prefill_ttl_s": c.leases.prefill_ttl,
                       "first_tokens_total": c.leases.first_tokens,
                       "prefill_timeouts_total": c.leases.prefill_timeouts,
                       "first_token_unknown_total": st.first_token_unknown,
                       # docs/failover.md: re-registered after a move, ended by a fleet process's
                       # death announcement, dropped with a restarted server's process
                       "reregistered_total": c.leases_reregistered,
                       "ended_by_announcement_total": c.leases_ended_by_announcement,
                       "fenced_total": st.leases_fenced},
            "kv_index": {"size": self.index_size, "bind_endpoint": c.kv.bound_endpoint,
                         "bound_reader_restarts": c.kv.bound_reader_restarts},
            "routing_diagnostics": {
                "kv_mismatch": sorted(u for u in c.diag.parity if c.diag.kv_unknown(u)),
                "prediction_alarm": sorted(u for u, p in c.diag.pred.items() if p.alarm),
                "alarm_ratio": c.diag.alarm_ratio, "window_s": c.diag.window_s},
            "select_latency_s": {"count": st.select_latency.n,
                                 "p50_le": st.select_latency.quantile(0.5),
                                 "p99_le": st.select_latency.quantile(0.99)},
            "identities": {"held": len(c.identities), "ttl_s": c.identities.ttl_s},
            "version": c.version,
            "cluster_id": c.cluster_id,
            "uptime_s": round(self.now - c.started_at, 3),
        }


def take(coord: "Coordinator") -> ClusterSnapshot:
    """Read the coordinator's state once."""
    leases, index, kv = coord.leases, coord.index, coord.kv
    empty = coord.empty_index_servers
    rows = []
    for e in coord.registry.servers.values():
        r, t = leases.load(e.url)
        rows.append(ServerRow(entry=e, requests=int(r), tokens=int(t), phase=leases.phase(e.url),
                              index_blocks=int(index.worker_size(e.url)), kv_ready=kv.kv_ready(e.url),
                              empty_under_traffic=e.url in empty, feed=kv.feeds.get(e.url)))
    return ClusterSnapshot(
        coord=coord, now=coord.clock(), mono=time.monotonic(),
        not_ready_reason=coord.not_ready_reason(), minimal=dict(coord.minimal), rows=rows,
        healthy={role: [e.url for e in coord.registry.healthy(role)] for role in ROLES},
        in_flight=coord.in_flight(), index_size=int(index.size))
