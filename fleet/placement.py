"""Where each leg of a request goes: local round robin, or the coordinator, or a local fallback.

- `round_robin` is placed here, per role, from the last-known server list: no coordinator call, no
  lease (the coordinator does not count round-robin load). The turn is router/policy_load.py's.
- `load_balancing`, `kv_cache_aware`, `conversation` are delegated to the coordinator (`select` /
  `select_pair`), so every fleet process sees one consistent placement. Each answer is a lease:
  `Placer.finish()` sends exactly one `/finish` for it, whatever path the request took.
- When the coordinator cannot be reached, placement falls back to this process's last-known server
  list (least local in-flight, ties in turn: router/policy_load.py's `LoadBalancingPolicy`), logged once
  per outage and counted in
  `splitserve_fleet_coordinator_fallback_total`; a background probe returns to delegated placement
  as soon as the coordinator answers again.
- A pair of legs placed here (both round robin, or the coordinator unreachable) follows the same
  pairing rules as the coordinator's `/select_pair`: router/pairing.py `pair`.

Local ejection, the per-server circuit breaker (`fleet.circuit_breaker`): a server that failed
`failure_threshold` times in a row (connect level, a connection dropped mid-request, or a retried
5xx) is kept out of placement for `open_s` (doubling on repeated failures, up to `max_open_s`), and
sent as `exclude` to the coordinator meanwhile, so a dead worker stops receiving traffic before the
coordinator's own health probes notice it. Once the time is up the server is half-open: traffic
goes to it again, a success closes the breaker and a failure reopens it for twice as long.

The only routing state held here is the round-robin cursors, the last-known server list and the
local ejection table (docs/design.md §1: the fleet holds no other routing state).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter

from protocol.coord import (ClusterInfo, CoordinatorRequestError, CoordinatorUnavailable,
                            NoServerAvailable, SelectAnswer, as_answer)
from protocol.roles import Mode, Role
from protocol.tasks import cancel_and_wait
from router.pairing import PairRules, PolicyKind, pair
from router.policy_load import LoadBalancingPolicy, RoundRobinPolicy

from . import metrics as M

log = logging.getLogger("splitserve.fleet.placement")

CTX = Role.CONTEXT.value
GEN = Role.GENERATION.value


@dataclass(slots=True)
class Placement:
    """One leg's server. `lease` is True when the coordinator holds a lease that needs a /finish."""
    role: str
    server: str
    req_id: int
    lease: bool
    policy: str
    explanation: dict = field(default_factory=dict)
    finished: bool = False
    last_renew: float = 0.0
    failed: bool = False     # the server failed this leg (its /finish says success=false)
    usage: tuple | None = None   # (prompt_tokens, cached_tokens) the worker reported
    started: bool = False    # its first token (a context leg: its answer) was reported

    @property
    def predicted_tokens(self) -> int:
        return int(self.explanation.get("matched_tokens") or 0)


_PREDICTED = attrgetter("predicted_tokens")


@dataclass(slots=True)
class _ServerState:
    url: str
    healthy: bool = True
    model: str | None = None
    info: dict = field(default_factory=dict)
    inflight: int = 0


def parse_cluster_info(ci: ClusterInfo) -> dict[str, list[_ServerState]]:
    """Servers per role from a coordinator `/cluster_info` answer."""
    return {role: [_ServerState(v.url, v.healthy,
                                (v.server_info or {}).get("model") or (v.model or None),
                                v.server_info or {})
                   for v in getattr(ci.servers, role)]
            for role in (CTX, GEN)}


class Placer:
    """`coordinator` is a `coordinator.client.CoordinatorClient` (in-process, or over the channel
    and HTTP); the placer uses its public calls only. `turn`: where the local turns (round robin, and least-loaded ties) start; None, a random
    one, so that the fleet's processes do not all begin on the same server."""

    def __init__(self, config, coordinator, *, refresh_s: float = 1.0, turn: int | None = None):
        self.config = config
        self.coord = coordinator
        self.policy = {CTX: config.context_servers.router.type, GEN: config.generation_servers.router.type}
        self._kind = {role: PolicyKind(t) for role, t in self.policy.items()}
        self.rules = PairRules.of(config)
        self.refresh_s = refresh_s
        cb = config.fleet.circuit_breaker   # the local ejection is the per-server circuit breaker
        self.eject_s = cb.open_s
        self.eject_max_s = cb.max_open_s
        self.fail_threshold = cb.failure_threshold
        self.servers: dict[str, list[_ServerState]] = {
            CTX: [_ServerState(u) for u in config.context_servers.urls],
            GEN: [_ServerState(u) for u in config.generation_servers.urls],
        }
        self._by_url: dict[str, _ServerState] = {}
        self._reindex()
        # The local choices are the router's own policies over this process's list: the turn of
        # `round_robin`, and least in-flight while the coordinator is unreachable.
        self._rr = {role: RoundRobinPolicy(start=random.randrange(1 << 16) if turn is None else turn)
                    for role in (CTX, GEN)}
        self._least = {role: LoadBalancingPolicy(start=random.randrange(1 << 16) if turn is None else turn)
                       for role in (CTX, GEN)}
        self._ejected: dict[str, float] = {}      # url -> monotonic deadline
        self._fails: dict[str, int] = {}
        self._eject_len: dict[str, float] = {}
        self.coord_ok = True
        self.coord_down_since: float | None = None
        self.cluster_info: dict = {}
        self.cluster_info_at = 0.0
        self.routing = {"block_size": config.routing.block_size, "key_scheme": config.routing.key_scheme,
                        "ns_seed": config.routing.ns_seed}
        self._task: asyncio.Task | None = None
        self._bg: set[asyncio.Task] = set()
        # The client's leases ended for cancelled callers count with ours (`_orphaned`).
        coordinator.count_abandoned(M.ORPHANED_LEASES.inc)
        self._rtt = {c: M.COORD_RTT.labels(c) for c in ("select", "select_pair", "finish", "renew", "cluster_info")}
        self.finish_pending = 0
        M.COORD_UP.set(1)

    # ------------------------------------------------------------------ server list
    def _reindex(self) -> None:
        self._by_url = {s.url: s for role in (CTX, GEN) for s in self.servers[role]}
        self._models = self._collect_models()
        # per role: (the server list, its healthy servers), for placements with nothing excluded
        # or ejected (round robin: every request, twice on the two-leg path)
        self._healthy = {role: (self.servers[role], [s for s in self.servers[role] if s.healthy])
                         for role in (CTX, GEN)}

    def delegated(self, role: str) -> bool:
        return self._kind[role].delegated

    def needs_key(self, role: str) -> bool:
        return self._kind[role].keyed

    def apply_cluster_info(self, raw: dict) -> None:
        """Adopt a `/cluster_info` answer (decoded as `protocol.coord.ClusterInfo`; the raw body is
        kept for the fleet's own `/cluster_info`)."""
        ci = as_answer(ClusterInfo, raw, "/cluster_info")
        parsed = parse_cluster_info(ci)
        for role in (CTX, GEN):
            old = {s.url: s for s in self.servers[role]}
            new = []
            for s in parsed[role]:
                prev = old.get(s.url)
                if prev is not None:
                    s.inflight = prev.inflight
                new.append(s)
            self.servers[role] = new
        self._reindex()
        rk = ci.routing
        self.routing.update(block_size=rk.block_size, key_scheme=rk.key_scheme, ns_seed=rk.ns_seed)
        self.cluster_info = raw
        self.cluster_info_at = time.monotonic()

    async def refresh(self) -> dict:
        t0 = time.perf_counter()
        ci = await self.coord.cluster_info()
        self._rtt["cluster_info"].observe(time.perf_counter() - t0)
        if not self.coord_ok and ci.get("is_ready") is False:
            # A coordinator that just (re)started has not probed its servers yet: its lists would say
            # "nothing healthy" and its placements 503. Keep placing locally until it is ready.
            return ci
        self.apply_cluster_info(ci)
        self._coord_back()
        return ci

    async def _refresher(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s if self.coord_ok else min(0.25, self.refresh_s))
            try:
                await self.refresh()
            except (CoordinatorUnavailable, OSError, asyncio.TimeoutError) as e:
                self._coord_lost(e)
            except asyncio.CancelledError:
                raise
            except Exception:   # a bad answer must not kill the refresher
                log.exception("cluster_info refresh failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresher())

    async def stop(self, drain_s: float = 5.0) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=drain_s)

    def _coord_lost(self, err: BaseException) -> None:
        if self.coord_ok:
            self.coord_ok = False
            self.coord_down_since = time.monotonic()
            M.COORD_UP.set(0)
            log.warning("coordinator unreachable (%s): placing locally from the last-known server list "
                        "(%d context, %d generation servers) until it answers again", err,
                        len(self.servers[CTX]), len(self.servers[GEN]))

    def _coord_back(self) -> None:
        if not self.coord_ok:
            down = time.monotonic() - (self.coord_down_since or time.monotonic())
            self.coord_ok = True
            self.coord_down_since = None
            M.COORD_UP.set(1)
            log.info("coordinator reachable again after %.1fs: back to delegated placement", down)

    # ------------------------------------------------------------------ health / ejection
    def usable(self, url: str, now: float | None = None) -> bool:
        s = self._by_url.get(url)
        if s is not None and not s.healthy:
            return False
        dl = self._ejected.get(url)
        if dl is None:
            return True
        if (now or time.monotonic()) >= dl:
            del self._ejected[url]   # half-open: the next request probes it
            return True
        return False

    def healthy_count(self, role: str) -> int:
        now = time.monotonic()
        return sum(1 for s in self.servers[role] if self.usable(s.url, now))

    def ejected(self) -> list[str]:
        if not self._ejected:
            return []
        now = time.monotonic()
        return [u for u, dl in self._ejected.items() if dl > now]

    def report_failure(self, role: str, url: str) -> None:
        n = self._fails.get(url, 0) + 1
        self._fails[url] = n
        if n >= self.fail_threshold:
            span = min(self.eject_max_s, self._eject_len.get(url, self.eject_s / 2) * 2)
            self._eject_len[url] = span
            if url not in self._ejected:
                M.EJECTIONS.labels(role, url).inc()
                log.warning("ejecting %s server %s for %.1fs after %d failure(s)", role, url, span, n)
            self._ejected[url] = time.monotonic() + span

    def report_success(self, url: str) -> None:
        if url in self._fails:
            del self._fails[url]
            self._eject_len.pop(url, None)
            self._ejected.pop(url, None)

    def models(self) -> list[str]:
        """Served model names: the config's, then those the servers report (cached per refresh)."""
        return self._models

    def _collect_models(self) -> list[str]:
        names = []
        if self.config.served_model:
            names.append(self.config.served_model)
        for role in (CTX, GEN):
            for s in self.servers[role]:
                if s.model and s.model not in names:
                    names.append(s.model)
        return names

    def server_info(self, url: str) -> dict:
        s = self._by_url.get(url)
        return s.info if s is not None else {}

    # ------------------------------------------------------------------ local placement
    def _local(self, role: str, req_id: int, exclude: set[str]) -> Placement:
        """A server from this process's list: the next in turn for `round_robin`; for a delegated
        policy (the coordinator unreachable) the least local in-flight."""
        hc = self._healthy[role] if not exclude and not self._ejected else None
        if hc is not None and hc[0] is self.servers[role]:
            cands = hc[1]          # what the scan below finds when nothing is excluded or ejected
        else:
            now = time.monotonic()
            cands = [s for s in self.servers[role] if s.url not in exclude and self.usable(s.url, now)]
        if not cands:
            # Every known server excluded or ejected: an ejected one is still better than a 503.
            cands = [s for s in self.servers[role] if s.url not in exclude and s.healthy]
        if not cands:
            raise NoServerAvailable(f"no healthy {role} server (known: {len(self.servers[role])}, "
                                    f"excluded: {len(exclude)})")
        if self._kind[role].delegated:
            why = "local_fallback"
            s = cands[self._least[role].pick([c.inflight for c in cands])]
        else:
            why = "round_robin"
            s = cands[self._rr[role].pick(len(cands))]
        return Placement(role, s.url, req_id, False, why, {"policy": why, "chosen": s.url,
                                                            "candidates": len(cands)})

    def track(self, p: Placement, delta: int) -> None:
        s = self._by_url.get(p.server)
        if s is not None:
            s.inflight += delta

    # ------------------------------------------------------------------ delegated placement
    def _answer(self, role: str, req_id: int, ans: SelectAnswer) -> Placement:
        return Placement(role, ans.server, req_id, True, self.policy[role], ans.info,
                         last_renew=time.monotonic())

    async def place(self, role: str, req_id: int, routing_key: dict | None, exclude: set[str]) -> Placement:
        if not self.delegated(role):
            return self._local(role, req_id, exclude)
        if self.coord_ok:
            ej = self.ejected()
            excl = sorted(exclude.union(ej)) if exclude or ej else None
            t0 = time.perf_counter()
            coord = self.coord
            try:
                if coord.cancel_safe:
                    ans = await coord.select_answer(role, req_id, routing_key, excl)
                else:
                    ans = await self._leased(coord.select_answer(role, req_id, routing_key, excl),
                                             (role,), req_id)
            except CoordinatorUnavailable as e:
                self._coord_lost(e)
            else:
                self._rtt["select"].observe(time.perf_counter() - t0)
                return self._answer(role, req_id, ans)
        M.COORD_FALLBACK.labels(role).inc()
        return self._local(role, req_id, exclude)

    async def place_pair(self, req_id: int, routing_key: dict | None, exclude_ctx: set[str],
                         exclude_gen: set[str]) -> tuple[Placement | None, Placement, Mode]:
        """Both legs → (context or None, generation, mode): in one coordinator call when both roles
        are delegated and it answers, else placed here by the same pairing rules (both round
        robin, or the coordinator unreachable). Both roles' policies are delegated, or neither.

        mode: DISAGGREGATED; LOCAL_PREFILL (conditional disaggregation: the generation server
        caches nearly all of the prompt); AGGREGATE_FALLBACK (no healthy context server). Raises
        `NoServerAvailable` (`pairing.NoContextServer` when the context leg found none under
        `no_context_fallback: reject`)."""
        if self._kind[GEN].delegated:
            if self.coord_ok:
                ej = self.ejected()
                ec = sorted(exclude_ctx.union(ej)) if exclude_ctx or ej else None
                eg = sorted(exclude_gen.union(ej)) if exclude_gen or ej else None
                t0 = time.perf_counter()
                coord = self.coord
                try:
                    if coord.cancel_safe:
                        ans = await coord.select_pair_answer(req_id, routing_key, ec, eg)
                    else:
                        ans = await self._leased(coord.select_pair_answer(req_id, routing_key, ec, eg),
                                                 (CTX, GEN), req_id)
                except CoordinatorUnavailable as e:
                    self._coord_lost(e)
                else:
                    self._rtt["select_pair"].observe(time.perf_counter() - t0)
                    gen = self._answer(GEN, req_id, ans.generation)
                    ctx = ans.context
                    return (self._answer(CTX, req_id, ctx) if ctx else None), gen, ans.mode
            M.COORD_FALLBACK.labels(CTX).inc()
            M.COORD_FALLBACK.labels(GEN).inc()
        # placed here: the same pairing rules over this process's list (partials, not lambdas:
        # no Python frame between `pair` and `_local`; round robin places every request here)
        local = self._local
        ctx, gen, mode, _ = pair(self.rules, routing_key.get("num_tokens") if routing_key else 0,
                                 partial(local, GEN, req_id, exclude_gen), _PREDICTED,
                                 partial(local, CTX, req_id, exclude_ctx))
        return ctx, gen, mode

    async def _leased(self, call, roles: tuple[str, ...], req_id: int):
        """Await a coordinator placement so that a cancelled caller never leaks the lease it creates,
        where the client does not see to it itself (`CoordinatorClient.cancel_safe` false: the
        in-process call and the connected channel need no Task and shield, ~9 µs a placement).

        The coordinator leases `(role, req_id)` while it answers, so a caller cancelled mid-call (the
        client hung up) would never learn of the lease and never `/finish` it. The call itself is
        shielded and runs to its end; if the caller is gone by then, every role it may have leased is
        finished here (`/finish` is idempotent: a lease that was never created is a no-op).
        """
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._orphaned(t, roles, req_id))
            raise

    def _orphaned(self, task: asyncio.Task, roles: tuple[str, ...], req_id: int) -> None:
        if not task.cancelled():
            task.exception()   # retrieved: a failed placement nobody waits for is not an error
        M.ORPHANED_LEASES.inc()
        for role in roles:
            self.finish(Placement(role, "", req_id, True, self.policy[role], {}), True)

    # ------------------------------------------------------------------ lease end
    def finish(self, p: Placement | None, success: bool) -> None:
        """Exactly one /finish per lease: idempotent, never blocks the request path."""
        if p is None or p.finished:
            return
        p.finished = True
        if not p.lease:
            return
        try:
            if self.coord.finish_nowait(p.role, p.req_id, success, self._usage(p)):
                return   # applied (in-process), or queued on the channel and acknowledged there
        except Exception as e:   # a bad lease must not fail the request that already completed
            log.warning("/finish of %s %d failed: %s", p.role, p.req_id, e)
            M.FINISH_DROPPED.inc()
            return
        t = asyncio.get_running_loop().create_task(self._finish(p, success))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    @staticmethod
    def _usage(p: Placement) -> dict | None:
        """The worker's report against the prediction, for the coordinator's diagnosis."""
        if p.usage is None:
            return None
        # clamped: a worker's odd numbers must never make the coordinator reject the /finish
        return {"prompt_tokens": max(0, p.usage[0]), "cached_tokens": max(0, p.usage[1]),
                "predicted_tokens": max(0, p.predicted_tokens)}

    async def _finish(self, p: Placement, success: bool) -> None:
        delay = 0.05
        usage = self._usage(p)
        for attempt in range(4):
            t0 = time.perf_counter()
            try:
                await self.coord.finish(p.role, p.req_id, success=success, usage=usage)
                self._rtt["finish"].observe(time.perf_counter() - t0)
                return
            except CoordinatorRequestError as e:
                log.warning("coordinator rejected /finish of %s %d: %s", p.role, p.req_id, e)
                break
            except (CoordinatorUnavailable, OSError, asyncio.TimeoutError):
                if attempt == 3:
                    break
                await asyncio.sleep(delay * (1 + random.random()))
                delay *= 2
        M.FINISH_DROPPED.inc()

    def first_token(self, p: Placement) -> None:
        """The leg's first token arrived (a context leg: its answer): told to the coordinator once,
        so its lease leaves the prefill phase (queued prefill load). Never blocks; a report that
        cannot go is dropped (the coordinator's prefill TTL or the finish stands in)."""
        if p.started or not p.lease or p.finished:
            return
        p.started = True
        try:
            if self.coord.first_token_nowait(p.role, p.req_id):
                return
        except Exception as e:   # a report must never fail the request
            log.debug("first-token report of %s %d failed: %s", p.role, p.req_id, e)
            return
        t = asyncio.get_running_loop().create_task(self._first_token(self.coord.first_token, p))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    @staticmethod
    async def _first_token(send, p: Placement) -> None:
        try:
            await send(p.role, p.req_id)
        except Exception as e:
            log.debug("first-token report of %s %d failed: %s", p.role, p.req_id, e)

    def renew_due(self, p: Placement, interval: float) -> bool:
        return p.lease and not p.finished and time.monotonic() - p.last_renew >= interval

    def renew(self, p: Placement) -> None:
        p.last_renew = time.monotonic()
        t = asyncio.get_running_loop().create_task(self._renew(p))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _renew(self, p: Placement) -> None:
        try:
            t0 = time.perf_counter()
            await self.coord.renew(p.role, p.req_id)
            self._rtt["renew"].observe(time.perf_counter() - t0)
        except Exception as e:   # a missed renew only risks an early expiry; the stream goes on
            log.debug("lease renew of %s %d failed: %s", p.role, p.req_id, e)
