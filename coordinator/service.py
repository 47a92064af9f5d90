"""The coordinator: the one owner of cluster state (its listeners: `coordinator.listeners`).

`Coordinator` holds the registry and health loop, the KV index fed by ZMQ events, the load leases,
the routing policies (and with them the conversation table) and the fleet identities. Its methods
are synchronous state operations (one event loop, no locks): the HTTP handlers, the channel and the
in-process client call the same ones (`place`, `place_pair`, `end_lease`, `renew_lease` once their
transport has checked the request), so the one-process topology and the networked one behave
alike. `/cluster_info` and `/metrics` read one snapshot of it (coordinator/snapshot.py).

Invariants:
- Every placement creates a lease keyed by `(role, req_id)`; a repeated placement of the same key
  replaces the lease (its load is released first), `finish` is idempotent, and expiry releases
  leases nobody finished or renewed. In-flight counts (the lease table's own, per role) therefore
  return to zero after any mix.
- Only `healthy` servers are candidates; for `kv_cache_aware`, servers whose index is still being
  rebuilt are skipped while any rebuilt one is available.
- `is_ready()` is true only while each role has at least its configured minimum of healthy servers.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable


from coordinator import checks
from coordinator import snapshot as snapshot_mod
from protocol import coord as wire
from coordinator.api import make_app
from coordinator.config import ClusterConfig, load_config
from coordinator.diagnostics import Diagnostics
from protocol.channel import FirstToken
from protocol.coord import BadRequest, NoServerAvailable, NotServing, identity_slot
from coordinator.election import Election, OrderedReplicas, Solo, own_index
from coordinator.health import HealthMonitor
from coordinator.identity import IdentityTable
from coordinator.kv_ingest import FeedSource, KvIngest
from coordinator.kv_sources import advertised_source, static_source
from coordinator.metrics import LatencyHistogram
from coordinator.registry import CONTEXT, GENERATION, Registry, ServerEntry, ServerState, normalize_url
from router.kv_capacity import RoutedPrompts
from router.kv_index import KvIndex
from protocol.version import VERSION
from router.leases import LeaseTable
from router.pairing import PairRules, PolicyKind, pair
from router.policies import Candidate, RoutingKey, make_policy

log = logging.getLogger("splitserve.coordinator")

__all__ = ["Coordinator", "make_app", "make_election"]

ROLES = (CONTEXT, GENERATION)
EMPTY_INDEX_GRACE_S = 10.0      # kv-aware traffic this long with an empty index raises the warning
EMPTY_INDEX_WARN_EVERY_S = 60.0
# Speculative keys looked at per maintenance slice (~0.3 ms at ~1.2 µs a key): a backlog is worked
# through in slices SPEC_EXPIRE_SLICE_S apart, the loop serving selects in between
# (router/kv_speculation.py); 1,024-key slices (~1.2 ms) were the open loop's p99 after a burst.
SPEC_EXPIRE_KEYS_PER_SLICE = 256
SPEC_EXPIRE_SLICE_S = 0.002


def _incarnation(info: dict | None) -> str | None:
    """What names one process behind a server's url: our worker's `start_id`, else a
    `worker_id` (ours before start ids, and registered workers)."""
    if not info:
        return None
    v = info.get("start_id") or info.get("worker_id")
    return str(v) if v is not None else None


def _epoch(info: dict | None) -> str | None:
    """The KV-event publisher's epoch the server advertises (our worker: its start id)."""
    kv = (info or {}).get("kv_events")
    ep = kv.get("epoch") if isinstance(kv, dict) else None
    return ep if isinstance(ep, str) and ep else None


def make_election(cfg: ClusterConfig) -> Election:
    """The replica election the config names: the ordered replica list when `coordinator.replicas`
    has more than one entry, else none (this coordinator always serves)."""
    co = cfg.coordinator
    if len(co.replicas) < 2:
        return Solo()
    index = co.replica_index
    if index is None:
        import socket
        index = own_index(list(co.replicas), socket.gethostname())
    if co.election != "ordered":
        from coordinator.election_lease import lease_election
        return lease_election(cfg, co.replicas[index])
    return OrderedReplicas(list(co.replicas), index,
                           interval_s=co.replica_probe_interval_s,
                           timeout_s=co.replica_probe_timeout_s, failback_s=co.failback_s)


@dataclass(slots=True)
class Stats:
    selects: dict = field(default_factory=lambda: {CONTEXT: 0, GENERATION: 0})
    select_rejected: dict = field(default_factory=dict)     # (role, reason) -> n
    bad_requests: dict = field(default_factory=dict)        # endpoint -> n
    pair_modes: dict = field(default_factory=dict)          # mode -> n
    finishes: dict = field(default_factory=dict)            # (role, success) -> n
    finish_unknown: int = 0
    first_token_unknown: int = 0    # first-token reports of leases not live or already past prefill
    renewed: int = 0
    renew_unknown: int = 0
    leases_expired: dict = field(default_factory=lambda: {CONTEXT: 0, GENERATION: 0})
    empty_index_warnings: int = 0
    not_serving: int = 0            # calls refused: another replica serves
    restarts: dict = field(default_factory=dict)    # cause -> servers seen restarting
    leases_fenced: int = 0          # leases dropped with the process they were on
    select_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    leases: LeaseTable | None = None      # the coordinator's: what it counts is read from it

    @property
    def leases_replaced(self) -> int:
        """Selects that replaced a live lease of the same key (a leg re-placed)."""
        return self.leases.replaced if self.leases is not None else 0


def _matched_tokens(answer: dict) -> int:
    """The prompt tokens a placement answer says its server caches (the channel's `KvChoice`, or
    the explanation's `matched_tokens`)."""
    info = answer["info"]
    kv = info.get("kv")
    return kv.matched_tokens if kv is not None else int(info.get("matched_tokens") or 0)


class _LoadView:
    """The policies' window on load and cache state (router.policies.LoadView). The load methods
    are the table's own bound methods: no extra call layer per candidate."""

    __slots__ = ("requests", "tokens", "loads", "phases", "lease_states", "_index", "_version",
                 "_walk")

    def __init__(self, leases: LeaseTable, index: KvIndex):
        self.requests = leases.requests
        self.tokens = leases.tokens
        self.loads = leases.loads_for
        self.phases = leases.phases_for
        self.lease_states = leases.states
        self._index = index
        # KvIndex.walk_version without its call layer (the index's owner table is its own for
        # life): one Python call fewer per leg
        self._version = index.owners.version
        self._walk: tuple | None = None     # (keys, the index's walk version, answer)

    def matched_blocks(self, keys) -> dict[str, int]:
        """The index's matches per server (read-only: the answer is shared). Both legs of a
        `select_pair` ask with the same keys object; the second gets the first's answer when the
        index has not changed in between (a speculative insert or an expiry changes it)."""
        version = self._version()
        w = self._walk
        if w is not None and w[0] is keys and w[1] == version:
            return w[2]
        res = self._index.longest_prefix(keys)
        self._walk = (keys, version, res)
        return res


class Coordinator:
    """All cluster state. Build, `await start()`, use, `await stop()`."""

    def __init__(self, config: ClusterConfig | dict | str | os.PathLike | None = None, *,
                 clock: Callable[[], float] = time.monotonic, cluster_id: str | None = None):
        """`cluster_id`: the name the launcher minted for its cluster, so that its fleet processes
        can tell their own coordinator from another cluster's on a shared port or socket (issue
        39); a random one when not given."""
        cfg = config if isinstance(config, ClusterConfig) else load_config(config)
        self.config = cfg
        self.cluster_id = cluster_id or secrets.token_hex(8)
        self.clock = clock
        self.block_size = cfg.routing.block_size
        self.key_scheme = cfg.routing.key_scheme
        self.ns_seed = cfg.routing.ns_seed
        self.lease_ttl_s = cfg.leases.ttl_s
        co = cfg.coordinator
        dc = cfg.disagg_cluster
        mins = cfg.health_minimums
        self.minimal = {CONTEXT: mins.context_servers, GENERATION: mins.generation_servers}
        # The index keys event tokens under the same namespace salt the fleet keys prompts with.
        self.index = KvIndex(block_size=self.block_size, namespace=cfg.routing.namespace)
        self.leases = LeaseTable(prefill_ttl=cfg.leases.prefill_ttl_s)
        self.identities = IdentityTable(co.identity_ttl_s)
        self.stats = Stats(leases=self.leases)
        self.registry = Registry(
            block_size=self.block_size, key_scheme=self.key_scheme,
            failure_threshold=co.health_failure_threshold,
            min_ejection_s=co.health_check_interval_s,
            default_ttl_s=dc.inactive_timeout_sec if dc is not None else 30.0,
            on_change=self._on_state_change, on_remove=self._on_removed)
        groups = cfg.server_groups()
        self.router_types = {role: groups[role].router.type for role in ROLES}
        self.router_args = {role: dict(groups[role].router.args) for role in ROLES}
        self.policies = {role: make_policy(self.router_types[role], self.router_args[role],
                                           block_size=self.block_size) for role in ROLES}
        self._kv_aware = {role: self.router_types[role] == PolicyKind.KV_CACHE_AWARE for role in ROLES}
        # each role's policy's first-token hook, looked up once (None: it learns nothing from them)
        self._observe_ttft = {role: getattr(self.policies[role], "observe_ttft", None)
                              for role in ROLES}
        self.pair_rules = PairRules.of(cfg)
        # Routed-but-unconfirmed blocks count for the chosen server until a BlockStored confirms
        # them or they expire (covers the window between placement and the engine's event).
        self._spec_ttl = {role: (getattr(self.policies[role], "speculative_ttl_s", None)
                                 if getattr(self.policies[role], "track_routed_blocks", False)
                                 else None) for role in ROLES}
        self._static_kv: dict[str, FeedSource] = {}
        now = clock()
        for role in ROLES:
            g = groups[role]
            for url in g.urls:
                self.registry.add_static(url, role, now)
            for src in g.kv_events:
                self._static_kv[normalize_url(src.server)] = static_source(src)
        self.kv = KvIngest(self.index, block_size=self.block_size, key_scheme=self.key_scheme,
                           replay_timeout_s=co.event_ingest.replay_timeout_s,
                           rebuild_timeout_s=co.event_ingest.rebuild_timeout_s,
                           bind_endpoint=co.event_ingest.bind_endpoint,
                           http=lambda: self.health.session, on_ready=self._on_kv_ready,
                           on_restart=self._drop_leases, on_disconnect=self._on_feed_lost)
        self.health = HealthMonitor(self.registry, interval_s=co.health_check_interval_s,
                                    timeout_s=co.server_info_timeout_s, on_prepared=self._on_prepared,
                                    clock=clock)
        self.diag = Diagnostics(cfg, block_size=self.block_size, key_scheme=self.key_scheme,
                                ns_seed=self.ns_seed, enabled=any(self._kv_aware.values()),
                                session=lambda: self.health.session, clock=clock,
                                on_change=self._bump)
        self._view = _LoadView(self.leases, self.index)
        # The index's capacity model (router/kv_capacity.py): the blocks running requests
        # brought pin their server's cache (servers with a known capacity only).
        self.routed_prompts = RoutedPrompts()
        self.index.set_pinned_source(self.routed_prompts.pinned_source())
        self._cand_version = -1
        self._kv_version = 0
        self._cands: dict[str, list] = {CONTEXT: [], GENERATION: []}
        self._entries: dict[str, ServerEntry] = {}
        self._kv_traffic: dict[str, int] = {}       # kv-aware placements since the last check
        self._kv_traffic_since: dict[str, float] = {}
        self._empty_warned: dict[str, float] = {}
        self.empty_index_servers: set[str] = set()
        self.empty_index_grace_s = EMPTY_INDEX_GRACE_S
        self.empty_index_check_s = 1.0
        self.started_at = now
        self.version = VERSION
        self.election: Election = make_election(cfg)
        self.leases_reregistered = 0
        self.leases_ended_by_announcement = 0
        self._maint: asyncio.Task | None = None
        self._started = False
        self.membership = None
        if dc is not None and dc.cluster_uri.startswith("etcd://"):
            from coordinator.etcd_membership import EtcdMembership
            self.membership = EtcdMembership(self, dc.cluster_uri, dc.cluster_name,
                                             start_timeout_s=cfg.server_start_timeout)

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.started_at = self.clock()
        if self.membership is not None:
            try:
                await self.membership.start()   # raises when etcd does not answer in time
            except BaseException:
                self._started = False
                raise
        await self.kv.start()
        await self.health.start()
        await self.election.start()
        self._maint = asyncio.create_task(self._maintenance(), name="coordinator-maintenance")
        log.info("coordinator started: %d context / %d generation servers known, ready=%s",
                 len(self.registry.in_role(CONTEXT)), len(self.registry.in_role(GENERATION)),
                 self.is_ready())

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._maint is not None:
            self._maint.cancel()
            await asyncio.gather(self._maint, return_exceptions=True)
            self._maint = None
        await self.election.stop()
        if self.membership is not None:
            await self.membership.stop()
        await self.diag.stop()
        await self.kv.stop()       # first: its rebuilds use the health monitor's HTTP session
        await self.health.stop()

    async def _maintenance(self) -> None:
        next_check = 0.0
        tick = max(0.02, min(1.0, self.lease_ttl_s / 4, self.empty_index_check_s))
        next_tick = 0.0
        while True:
            # A speculative backlog is drained in short slices between ticks.
            backlog = self.index.speculative_due(self.clock())
            await asyncio.sleep(SPEC_EXPIRE_SLICE_S if backlog else tick)
            try:
                now = self.clock()
                if now < next_tick:
                    self.index.expire_speculative(now, max_keys=SPEC_EXPIRE_KEYS_PER_SLICE)
                    continue
                next_tick = now + tick
                self.expire(now)
                if now >= next_check:
                    next_check = now + self.empty_index_check_s
                    self._check_empty_indexes(now)
                    self.diag.check(now)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("coordinator maintenance failed")

    def expire(self, now: float) -> int:
        """Release expired leases, identities and speculative index entries; returns leases expired."""
        gone = self.leases.expire(now)
        for lease in gone:
            self.stats.leases_expired[lease.role] += 1
            self.routed_prompts.ended(lease.role, lease.req_id)
        if gone:
            log.warning("%d lease(s) expired without /finish (e.g. %s %s on %s)", len(gone),
                        gone[0].role, gone[0].req_id, gone[0].server)
        self.identities.expire(now)
        # One bounded slice: under traffic each placement already expires two due entries, and
        # the maintenance loop comes back for the rest within SPEC_EXPIRE_SLICE_S.
        self.index.expire_speculative(now, max_keys=SPEC_EXPIRE_KEYS_PER_SLICE)
        return len(gone)

    # ---- registry hooks ---------------------------------------------------------------------
    def _on_prepared(self, entry: ServerEntry, info: dict) -> None:
        old_inc = _incarnation(entry.server_info)
        old_info = entry.server_info
        old_state = entry.state
        now = self.clock()
        self.registry.prepared(entry.url, info, now)
        if entry.state is not ServerState.HEALTHY:
            return
        self.index.set_capacity(entry.url, self.kv_capacity(entry.url))
        new_inc = _incarnation(entry.server_info)
        self.diag.admitted(entry.url, entry.server_info, entry.worker_id)
        # A restart behind the url (docs/failover.md "Worker restarts"): a new start id or worker
        # id; for an engine that names no incarnation, a health flap (it was ejected and answers
        # again) counts as one, since its cache may be gone.
        restarted = old_info is not None and (
            (old_inc is not None and new_inc is not None and old_inc != new_inc)
            or (new_inc is None and old_state is ServerState.UNHEALTHY))
        src = self._feed_source(entry)
        if src is not None:
            self.kv.attach(entry.url, src)
        if restarted:
            log.warning("server %s restarted (%s -> %s); its leases are dropped and its KV index "
                        "rebuilt", entry.url, old_inc or "ejected", new_inc or "readmitted")
            self._drop_leases(entry.url, "worker_restart")
            self.kv.fence(entry.url, _epoch(entry.server_info), "worker_restart")
        else:
            self.kv.set_epoch(entry.url, _epoch(entry.server_info))
        self._bump()

    def kv_capacity(self, server: str) -> int | None:
        """The server's KV capacity in routing blocks, for the index's capacity model: its
        group's `kv_capacity_blocks` (stock engines that publish none), else its `/server_info`
        `kv_capacity_blocks` of its own `block_size` (our worker), else None (unknown)."""
        entry = self.registry.servers.get(server)
        if entry is None:
            return None
        groups = self.config.server_groups()
        for role in entry.roles:
            cap = groups[role].kv_capacity_blocks
            if cap:
                return cap
        info = entry.server_info or {}
        cap, bs = info.get("kv_capacity_blocks"), info.get("block_size")
        if type(cap) is int and cap > 0 and type(bs) is int and bs > 0:
            return max(1, cap * bs // self.block_size)
        return None

        # The index's capacity model (router/kv_capacity.py): each placed prompt's keys until its
        # lease ends, when the engine frees them (only for servers with a known capacity).
    def _drop_leases(self, server: str, cause: str) -> None:
        """The server's process was replaced: the requests it held died with it, so their load
        stops counting now (their fleet's finishes find nothing and are no-ops)."""
        gone = self.leases.drop_server(server)
        for lease in gone:
            self.routed_prompts.ended(lease.role, lease.req_id)
        self.stats.restarts[cause] = self.stats.restarts.get(cause, 0) + 1
        if gone:
            self.stats.leases_fenced += len(gone)
            log.warning("server %s restarted (%s): dropped its %d lease(s)", server, cause, len(gone))
        self._bump()

    def _on_feed_lost(self, server: str) -> None:
        """Its KV-event connection dropped: if the process was replaced, its new `/server_info`
        (a new start id) says so at the next health check, not at the periodic re-read."""
        self.health.reread(server)

    def _feed_source(self, entry: ServerEntry) -> FeedSource | None:
        """An explicit static `kv_events` entry wins; else what `/server_info` advertises, read
        as the engine writes it (`coordinator/kv_sources.py`)."""
        static = self._static_kv.get(entry.url)
        if static is not None:
            return static
        info = entry.server_info or {}
        # Its snapshot keys are our canonical keys only at the same block size, scheme and namespace.
        snapshot_ok = (info.get("block_size") == self.block_size
                       and info.get("key_scheme") == self.key_scheme
                       and int(info.get("ns_seed") or 0) == self.ns_seed)
        return advertised_source(info, entry.url, snapshot_ok=snapshot_ok)

    def _on_state_change(self, entry: ServerEntry, old: ServerState, new: ServerState) -> None:
        if new is ServerState.REFUSED:
            # Its events cannot be keyed under this routing config.
            self.kv.detach(entry.url, remove=True)
        self._bump()

    def _on_removed(self, entry: ServerEntry) -> None:
        self.kv.detach(entry.url, remove=True)
        self.index.set_capacity(entry.url, None)
        for policy in self.policies.values():
            policy.remove_server(entry.url)
        self._kv_traffic.pop(entry.url, None)
        self.empty_index_servers.discard(entry.url)
        self.diag.removed(entry.url)
        self._bump()

    def _on_kv_ready(self, server: str) -> None:
        self._bump()

    def _bump(self) -> None:
        self._kv_version += 1

    # ---- placement --------------------------------------------------------------------------
    def _candidates(self, role: str) -> list:
        version = self.registry.version + self._kv_version
        if version != self._cand_version:
            self._rebuild_candidates(version)
        return self._cands[role]

    def _rebuild_candidates(self, version: int) -> None:
        entries = {}
        for role in ROLES:
            healthy = self.registry.healthy(role)
            if self._kv_aware[role]:
                ready = [e for e in healthy if self.kv.kv_ready(e.url)]
                healthy = ready or healthy
            self._cands[role] = [Candidate(server=e.url, healthy=True, info=e.server_info or {},
                                           kv_unknown=self.diag.kv_unknown(e.url))
                                 for e in healthy]
            for e in healthy:
                entries[e.url] = e
        self._entries = entries
        self._cand_version = version

    def _place(self, role: str, key: RoutingKey | None, excluded: set[str]):
        # `_candidates`, its usual case inline (one Python call fewer per leg)
        if self.registry.version + self._kv_version == self._cand_version:
            cands = self._cands[role]
        else:
            cands = self._candidates(role)
        if excluded:
            cands = [c for c in cands if c.server not in excluded]
        if not cands:
            n = len(self._cands[role])
            reason = (f"no healthy {role} server" if n == 0 else
                      f"no healthy {role} server left after excluding {sorted(excluded)}")
            self._reject(role, "no_server" if n == 0 else "all_excluded")
            raise NoServerAvailable(reason)
        try:
            return self.policies[role].select(cands, key, self._view)
        except NoServerAvailable:
            self._reject(role, "policy")
            raise

    def _reject(self, role: str, reason: str) -> None:
        k = (role, reason)
        self.stats.select_rejected[k] = self.stats.select_rejected.get(k, 0) + 1

    # Placement and lease calls take validated arguments: every transport checks a request once,
    # where it decodes it (HTTP bodies in coordinator/api.py, channel frames in
    # coordinator/channel.py, Python values in `select`/`select_pair`/`finish`/`renew` below).
    def place(self, role: str, req_id: int, key: RoutingKey | None, excluded: set[str], *,
              server_info: bool = True) -> dict:
        """Place one leg and lease it (`role` canonical, `req_id` a u64, `key` checked by
        `checks.routing_key`). Raises `NoServerAvailable`. `server_info=False` is the fleet
        channel's answer: the server's `/server_info` is left out of `info` (the fleet has its own
        copy, and an SGLang worker's is kilobytes of server arguments, encoded and decoded per
        leg), and a `kv_cache_aware` explanation travels as the numbers it is built from
        (`info["kv"]`, protocol/channel.py `KvChoice`), which the channel's client expands."""
        if not self.election.serving:
            self._not_serving()
        t0 = time.perf_counter()
        ans = self._select(role, req_id, key, excluded, server_info)
        self.stats.select_latency.observe(time.perf_counter() - t0)
        return ans

    def _not_serving(self) -> None:
        """Refuse a call only the serving replica answers; the backend re-checks at once (the
        caller may have just seen the serving replica die)."""
        el = self.election
        el.kick()
        self.stats.not_serving += 1
        raise NotServing(f"this coordinator replica is not serving placements"
                         + (f"; {el.serving_url} is" if el.serving_url else ""), el.serving_url)

    def _select(self, role: str, req_id: int, key: RoutingKey | None, excluded: set[str],
                server_info: bool = True) -> dict:
        decision = self._place(role, key, excluded)
        server = decision.server
        now = self.clock()
        # a live lease of the same key (a retry re-placing its leg) is replaced, its load moved;
        # it is in prefill with the tokens the server must compute until its first token
        self.leases.acquire(role, req_id, server, now, self.lease_ttl_s,
                            key.num_tokens if key is not None else 0, decision.uncached,
                            decision.learn_s)
        self.stats.selects[role] += 1
        if self._kv_aware[role] and key is not None:
            keys = key.block_keys
            if keys is not None and keys.size:
                self._kv_traffic[server] = self._kv_traffic.get(server, 0) + 1
                ttl = self._spec_ttl[role]
                have = decision.matched_blocks
                # None: the server's cache match is unknown (its keys are not ours), so entries
                # for it would feed a match the policy never reads.
                if ttl and have is not None:
                    # Only the blocks the chosen server does not hold yet are predicted (the
                    # index's own depth, not the reported match, which stops one token short of a
                    # fully cached prompt): re-adding matched speculative blocks would keep
                    # unconfirmed entries alive forever under steady traffic (upstream's
                    # never-expiring optimistic insertion). The whole prompt is stamped as used
                    # there for the index's capacity model (router/kv_capacity.py), and the blocks
                    # it brings pin that server's cache while it runs.
                    index = self.index
                    if have < keys.size:
                        index.routed(server, keys, have, now, ttl)
                        # Two due entries out per entry in: expiry keeps pace with placements in
                        # small steps instead of one burst per maintenance tick (a select stall).
                        index.expire_speculative(now, 2)
                    elif server in index.capacities:
                        index.used(server, keys, have)      # what `routed` does for it
        if server_info:
            info = decision.explanation
            entry = self._entries.get(server)
            info["server_info"] = entry.server_info if entry is not None else None
        elif decision.choice is not None:   # the fleet channel: its client builds the explanation
            info = {"kv": decision.choice}
        else:
            info = decision.explanation
        info["lease_ttl_s"] = self.lease_ttl_s
        return {"server": server, "req_id": req_id, "info": info}

    def place_pair(self, req_id: int, key: RoutingKey | None, ex_ctx: set[str],
                   ex_gen: set[str], *, server_info: bool = True) -> dict:
        """Both legs in one call: `{"context": answer|None, "generation": answer, "mode", "reason"}`,
        placed by the pairing rules (router/pairing.py `pair`: the generation leg first, so
        conditional disaggregation can use its cache match; `no_context_fallback` when no context
        server fits, the generation lease ended before a rejection is raised)."""
        if not self.election.serving:
            self._not_serving()
        t0 = time.perf_counter()
        select = self._select
        ctx, gen, mode, reason = pair(
            self.pair_rules, key.num_tokens if key is not None else 0,
            partial(select, GENERATION, req_id, key, ex_gen, server_info), _matched_tokens,
            partial(select, CONTEXT, req_id, key, ex_ctx, server_info), self._unplace_generation)
        if ctx is not None:
            # the generation leg receives the context leg's KV: it queues no prefill of its own
            self.leases.set_prefill(GENERATION, req_id, 0)
        modes = self.stats.pair_modes
        modes[mode] = modes.get(mode, 0) + 1
        self.stats.select_latency.observe(time.perf_counter() - t0)
        return {"context": ctx, "generation": gen, "mode": mode, "reason": reason}

    def _unplace_generation(self, answer: dict) -> None:
        """End the lease of a generation leg placed by `place_pair` whose context leg was refused."""
        self.leases.finish(GENERATION, answer["req_id"])

    def end_lease(self, role: str, req_id: int, success: bool,
                  usage: tuple[int, int, int] | None = None) -> bool:
        """Release a lease (idempotent; False when none was live). `success=False` means the
        server failed the request and counts toward its ejection. `usage` is `(prompt,
        predicted, cached)` tokens (`wire.finish_usage`): what the worker reported against what
        the route receipt predicted, for the predicted-vs-actual diagnosis."""
        lease = self.leases.finish(role, req_id)
        if lease is None:
            self.stats.finish_unknown += 1
            return False
        if self.routed_prompts.live:
            self.routed_prompts.ended(role, req_id)
        if usage is not None and self._kv_aware[role]:
            self.diag.report(lease.server, *usage)
        fin = self.stats.finishes
        k = (role, success)
        fin[k] = fin.get(k, 0) + 1
        if success:
            self.registry.report_success(lease.server)
        else:
            self.registry.report(lease.server, False, self.clock())
        return True

    def lease_first_token(self, role: str, req_id: int) -> bool:
        """The fleet saw the leg's first token (a context leg: its answer, the KV ready): the
        lease leaves the prefill phase (idempotent; False when it was not live or already past
        it). Its time since placement is the policy's actual against the placement's estimate."""
        return self.leases_first_tokens((FirstToken(role, req_id),)) == 1

    def leases_first_tokens(self, reports) -> int:
        """`lease_first_token` for each of ``reports`` (items with ``role`` and ``req_id``: a
        channel frame's), in order; returns how many leases left prefill. One call per frame:
        the per-report work is the lease table's loop (`LeaseTable.first_tokens_of`) and this
        one, over the leases that left prefill."""
        gone, unknown = self.leases.first_tokens_of(reports)
        if unknown:
            self.stats.first_token_unknown += unknown
        caps = self.index.capacities
        started = self.routed_prompts.started
        observers = self._observe_ttft
        bs = self.block_size
        clock = self.clock
        for lease in gone:
            # (a prompt that brought no whole block pins nothing: RoutedPrompts.started's rule,
            # its call skipped)
            if caps and lease.prefill >= bs and lease.server in caps:
                started(lease.role, lease.req_id, lease.server, lease.prefill // bs)
            if lease.predicted_s:
                observe = observers[lease.role]
                if observe is not None:
                    observe(lease.server, lease.predicted_s, clock() - lease.acquired_at)
        return len(gone)

    def renew_lease(self, role: str, req_id: int) -> bool:
        ok = self.leases.renew(role, req_id, self.clock(), self.lease_ttl_s)
        if ok:
            self.stats.renewed += 1
        else:
            self.stats.renew_unknown += 1
        return ok

    # The same calls with plain Python values (the in-process client, tools): checked here.
    def select(self, role: str, req_id: int, routing_key: Any = None, exclude: Any = None) -> dict:
        """Place one leg and lease it. Raises `BadRequest` or `NoServerAvailable`."""
        return self.place(wire.parse_role(role), wire.check_req_id(req_id),
                          checks.routing_key(routing_key, self.block_size),
                          checks.exclusions(exclude, "exclude"))

    def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                    exclude_gen: Any = None) -> dict:
        """`place_pair` with its arguments checked. Raises `BadRequest` or `NoServerAvailable`."""
        return self.place_pair(wire.check_req_id(req_id), checks.routing_key(routing_key, self.block_size),
                               checks.exclusions(exclude_ctx, "exclude_ctx"),
                               checks.exclusions(exclude_gen, "exclude_gen"))

    def finish(self, role: str, req_id: int, success: bool = True, usage: Any = None) -> bool:
        """`end_lease` with its arguments checked (`usage`: a dict or `wire.FinishUsage`)."""
        role = wire.parse_role(role)
        wire.check_req_id(req_id)
        if type(success) is not bool:
            raise BadRequest(f"success must be a boolean, got {success!r}", "success")
        return self.end_lease(role, req_id, success, wire.finish_usage(usage))

    def first_token(self, role: str, req_id: int) -> bool:
        """`lease_first_token` with plain Python values, checked (BadRequest naming the field)."""
        return self.lease_first_token(wire.parse_role(role), wire.check_req_id(req_id))

    def renew(self, role: str, req_id: int) -> bool:
        return self.renew_lease(wire.parse_role(role), wire.check_req_id(req_id))

    # ---- membership -------------------------------------------------------------------------
    def register(self, url: str, role: str | None = None, ttl_s: float | None = None,
                 worker_id: str | None = None, source: str = "registered") -> dict:
        e, created = self.registry.register(url, role, ttl_s, self.clock(), worker_id, source)
        if created or e.state is ServerState.PENDING:
            self.health.kick(e.url)
        return self._registration(e)

    def heartbeat(self, url: str, role: str | None = None, ttl_s: float | None = None,
                  worker_id: str | None = None) -> dict | None:
        e = self.registry.heartbeat(url, self.clock(), role, ttl_s, worker_id)
        if e is None:
            return None
        if e.state is ServerState.PENDING:
            self.health.kick(e.url)
        return self._registration(e)

    def _registration(self, e: ServerEntry) -> dict:
        ttl = e.ttl_s if e.ttl_s is not None else self.registry.default_ttl_s
        every = ttl / 3
        dc = self.config.disagg_cluster
        if dc is not None:   # upstream's worker heartbeat period: workers follow the answer
            every = min(every, dc.heartbeat_interval_sec)
        return {"url": e.url, "roles": list(e.roles), "state": e.state.value, "source": e.source,
                "ttl_s": ttl, "heartbeat_interval_s": round(every, 3)}

    def deregister(self, url: str) -> bool:
        return self.registry.deregister(url) is not None

    def lease_identity(self, holder: str, node_id: int | None = None,
                       process_id: int | None = None) -> dict:
        if not isinstance(holder, str) or not holder:
            raise BadRequest("holder must be a non-empty string", "holder")
        if not self.election.serving:
            self._not_serving()     # pairs are unique only within the serving replica's table
        try:
            lease = self.identities.lease(holder, self.clock(), node_id, process_id)
        except ValueError as exc:
            raise BadRequest(str(exc), "node_id") from None
        return {"node_id": lease.node_id, "process_id": lease.process_id,
                "ttl_s": self.identities.ttl_s}

    def release_identity(self, holder: str, end_leases: bool = False) -> bool:
        """Free `holder`'s pair. `end_leases`: its process is gone (the fleet's restart
        announcement), so every lease whose request id carries its pair ends now, not at
        `leases.ttl_s`. Answered by every replica: a standby holds no lease of it, a serving one
        releases them."""
        lease = self.identities.get(holder)
        released = self.identities.release(holder)
        if end_leases and lease is not None:
            slot = lease.slot
            gone = self.leases.drop_if(lambda l: identity_slot(l.req_id) == slot)
            for lease_ in gone:
                self.routed_prompts.ended(lease_.role, lease_.req_id)
            if gone:
                self.leases_ended_by_announcement += len(gone)
                log.warning("fleet process %s is gone: ended its %d lease(s)", holder, len(gone))
        return released

    def register_leases(self, leases) -> dict:
        """`POST /leases`: the leases a fleet process holds, re-registered after it moved to this
        replica (`protocol.coord.LeasesBody`). Idempotent by `(role, req_id)`; a lease on a
        server this replica does not know is skipped (it left the cluster meanwhile)."""
        if not self.election.serving:
            self._not_serving()
        now = self.clock()
        n = skipped = 0
        known = self.registry.servers
        for rec in leases:
            role = wire.parse_role(rec.role, "leases.role")
            req_id = wire.check_req_id(rec.req_id, "leases.req_id")
            server = normalize_url(rec.server, "leases.server")
            if server not in known:
                skipped += 1
                continue
            # Not started: its whole prompt counts as queued prefill (the placement's cache match,
            # which would lower it, is not known here).
            self.leases.acquire(role, req_id, server, now, self.lease_ttl_s, rec.tokens)
            if rec.started:
                self.leases.first_token(role, req_id)
            n += 1
        self.leases_reregistered += n
        return {"registered": n, "skipped": skipped}

    def replica_info(self) -> dict:
        """`GET /replica`: this replica's part in the election, and whether it is warm (every
        healthy server's KV index rebuilt, or given up on): what a replica behind it reads."""
        ready = self._started and all(self.kv.kv_ready(e.url) for role in ROLES
                                      for e in self.registry.healthy(role))
        return {"ready": ready, **self.election.describe()}

    # ---- views ------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        missing = []
        for role in ROLES:
            have, need = self.registry.count_healthy(role), self.minimal[role]
            if have < need:
                missing.append(f"{have}/{need} healthy {role} servers")
        return ("need " + ", ".join(missing)) if missing else None

    def in_flight(self) -> dict[str, int]:
        """Live leases per role, counted by the lease table itself."""
        return {role: self.leases.count(role) for role in ROLES}

    def load(self, server: str) -> tuple[int, int]:
        r, t = self.leases.load(server)
        return int(r), int(t)

    def index_size(self, server: str | None = None) -> int:
        if server is None:
            return int(self.index.size)
        return int(self.index.worker_size(server))

    def routing_info(self) -> dict:
        return {"block_size": self.block_size, "key_scheme": self.key_scheme,
                "namespace": self.config.routing.namespace, "ns_seed": self.ns_seed}

    def snapshot(self, listeners: snapshot_mod.ListenerCounters | None = None) -> snapshot_mod.ClusterSnapshot:
        """One read of this state, with what the listeners serving it counted (coordinator/snapshot.py):
        what `/cluster_info` and `/metrics` are built from."""
        return snapshot_mod.take(self, listeners)

    def cluster_info(self) -> dict:
        """`/cluster_info`: built from the same snapshot as the metrics (coordinator/snapshot.py)."""
        return snapshot_mod.take(self).cluster_info()

    # ---- silent-degradation guard (upstream #14882) -------------------------------------------
    def _check_empty_indexes(self, now: float) -> None:
        traffic, self._kv_traffic = self._kv_traffic, {}
        for server in list(self.empty_index_servers):
            if self.index_size(server) > 0 or server not in self.registry.servers:
                self.empty_index_servers.discard(server)
                self._kv_traffic_since.pop(server, None)
        for server, n in traffic.items():
            e = self.registry.get(server)
            if e is None or not e.healthy:
                continue
            if self.index_size(server) > 0:   # confirmed entries only: speculation excluded
                self._kv_traffic_since.pop(server, None)
                self.empty_index_servers.discard(server)
                continue
            since = self._kv_traffic_since.setdefault(server, now)
            if now - since < self.empty_index_grace_s:
                continue
            self.empty_index_servers.add(server)
            if now - self._empty_warned.get(server, -1e18) >= EMPTY_INDEX_WARN_EVERY_S:
                self._empty_warned[server] = now
                self.stats.empty_index_warnings += 1
                feed = self.kv.feeds.get(server)
                where = ("it advertises no KV-event publisher" if feed is None else
                         f"no events applied from {feed.source.endpoint or feed.source.topic!r}")
                log.warning("server %s has received kv-aware placements for %.1fs (%d in the last "
                            "%.1fs) but its KV index is empty (%s): kv_cache_aware routing is "
                            "degrading to load-only for it", server, now - since, n,
                            self.empty_index_check_s, where)

