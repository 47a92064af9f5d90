"""The server registry: which workers exist, in which role, and whether traffic may go to them.

Pure state (no I/O, `now` is always a parameter); the health loop (`coordinator.health`) drives it.

States and transitions (invariants):
- `pending`   — known but not prepared: `/server_info` not fetched yet, or fetching it fails.
- `healthy`   — prepared, compatible, passing probes. Only these receive traffic.
- `unhealthy` — ejected after `failure_threshold` consecutive failed probes, or as many consecutive
                failures reported through `/finish success=false`. A successful probe at least
                `min_ejection_s` after the ejection, followed by a fresh `/server_info`, readmits it.
- `refused`   — `/server_info` cannot match the routing config (role, block size, key scheme). It is
                re-checked on every health tick and admitted as soon as it matches.
Static servers (config `urls`) are never removed; registered ones disappear on `/deregister` or when
no heartbeat arrives within their TTL. A url is one entry even when it serves both roles.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable, Iterable
from urllib.parse import urlsplit

from protocol.coord import BadRequest
from protocol.roles import Role

log = logging.getLogger("splitserve.coordinator.registry")

CONTEXT = Role.CONTEXT.value
GENERATION = Role.GENERATION.value
BOTH = (CONTEXT, GENERATION)


class ServerState(str, enum.Enum):
    PENDING = "pending"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    REFUSED = "refused"


def canonical_url(url: object, *, origin: bool = False) -> str:
    """A server's one spelling: `host:port`, `http://host:port/` → `http://host:port` (scheme and
    host lower-cased, a trailing slash dropped, a path prefix kept). `origin`: nothing but scheme,
    host and a non-zero port (the config's server lists). The one normaliser of server urls: the
    config's lists, registrations and exclusions all go through it, so one server is one entry.
    Raises ValueError saying what was expected and what was found."""
    want = "host:port or http(s)://host:port" + ("" if origin else "[/path]")
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"expected a server url ({want}), found {url!r}")
    raw = url.strip()
    try:
        parts = urlsplit(raw if "://" in raw else "http://" + raw)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"expected {want}, found {url!r} ({e})") from None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or (origin and (
            not port or parts.path not in ("", "/") or parts.query or parts.fragment)):
        raise ValueError(f"expected {want}, found {url!r}")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"


def normalize_url(url: str, field_name: str = "url") -> str:
    """`canonical_url` for an API request: BadRequest naming `field_name` otherwise."""
    try:
        return canonical_url(url)
    except ValueError as e:
        raise BadRequest(str(e), field_name) from None


def roles_of(role: str | None, field_name: str = "role") -> tuple[str, ...]:
    """Registry roles of a registration role: `both` (or none given) serves both legs."""
    if role is None or role in ("both", "context_and_generation", "mixed"):
        return BOTH
    if role in ("context", "ctx", "prefill"):
        return (CONTEXT,)
    if role in ("generation", "gen", "decode"):
        return (GENERATION,)
    raise BadRequest(f"invalid role {role!r}: expected context, generation or both", field_name)


@dataclass(slots=True, eq=False)
class ServerEntry:
    url: str
    roles: tuple[str, ...]
    source: str                      # "static" | "registered" | "etcd"
    state: ServerState = ServerState.PENDING
    reason: str = "not prepared yet"
    server_info: dict | None = None
    worker_id: str | None = None
    since: float = 0.0               # time of the last state change
    active_failures: int = 0
    passive_failures: int = 0
    ejected_at: float | None = None
    ejections: int = 0
    readmissions: int = 0
    ttl_s: float | None = None       # registered servers only
    expires_at: float | None = None
    last_probe_ok: float | None = None
    last_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.state is ServerState.HEALTHY

    def describe(self, now: float) -> dict:
        d = {
            "url": self.url,
            "roles": list(self.roles),
            "source": self.source,
            "state": self.state.value,
            "healthy": self.state is ServerState.HEALTHY,
            "reason": self.reason,
            "worker_id": self.worker_id,
            "since_s": round(max(0.0, now - self.since), 3),
            "consecutive_failures": {"probe": self.active_failures, "reported": self.passive_failures},
            "ejections": self.ejections,
            "readmissions": self.readmissions,
            "last_error": self.last_error,
        }
        if self.expires_at is not None:
            d["registration"] = {"ttl_s": self.ttl_s, "expires_in_s": round(self.expires_at - now, 3)}
        if self.server_info is not None:
            si = self.server_info
            d["model"] = si.get("model")
            d["block_size"] = si.get("block_size", si.get("tokens_per_block"))
            d["key_scheme"] = si.get("key_scheme")
        return d


def compatibility_problem(info: dict, roles: Iterable[str], block_size: int, key_scheme: str) -> str | None:
    """Why a worker described by `/server_info` cannot serve under this routing config, or None.

    A worker's cache blocks must split into (or be unions of) canonical blocks, so its block size must
    divide or be divided by the routing block size; a worker that states a key scheme must state ours
    (its snapshot keys are only usable then). Foreign engines that state neither are accepted: their
    canonical keys are computed from the token ids in their events.
    """
    if not isinstance(info, dict):
        return f"/server_info is not a JSON object (got {type(info).__name__})"
    wrole = info.get("role")
    if wrole is not None:
        if wrole not in ("context", "generation", "both"):
            return f"/server_info role {wrole!r} is not one of context, generation, both"
        if wrole != "both":
            wrong = [r for r in roles if r != wrole]
            if wrong:
                return f"configured as {'+'.join(roles)} but /server_info says role={wrole}"
    bs = info.get("block_size", info.get("tokens_per_block"))
    if bs is not None:
        if type(bs) is not int or bs <= 0:
            return f"/server_info block_size {bs!r} is not a positive integer"
        if bs % block_size and block_size % bs:
            return (f"block size {bs} cannot map onto the routing block size {block_size} "
                    f"(one must divide the other)")
    ks = info.get("key_scheme")
    if ks is not None and ks != key_scheme:
        return f"key scheme {ks!r} differs from the routing key scheme {key_scheme!r}"
    return None


ChangeHook = Callable[[ServerEntry, ServerState, ServerState], None]


class Registry:
    """All servers by url, with the transitions listed in the module docstring.

    `on_change(entry, old, new)` is called after every state change, and with old == new == the
    current state when an entry is removed (`entry.state` is then left as it was, `removed` True in
    `entry.reason`). It must not raise.
    """

    def __init__(self, *, block_size: int, key_scheme: str, failure_threshold: int = 3,
                 min_ejection_s: float = 1.0, default_ttl_s: float = 30.0, max_ttl_s: float = 3600.0,
                 on_change: ChangeHook | None = None, on_remove: Callable[[ServerEntry], None] | None = None):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.block_size = block_size
        self.key_scheme = key_scheme
        self.failure_threshold = failure_threshold
        self.min_ejection_s = min_ejection_s
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.on_change = on_change
        self.on_remove = on_remove
        self.servers: dict[str, ServerEntry] = {}
        self.version = 0  # bumped on every change that can alter the candidate lists
        self.registrations_total = 0
        self.registrations_expired = 0

    # ---- membership ---------------------------------------------------------------------------
    def add_static(self, url: str, role: str, now: float) -> ServerEntry:
        url = normalize_url(url)
        e = self.servers.get(url)
        if e is None:
            e = self.servers[url] = ServerEntry(url=url, roles=(role,), source="static", since=now)
        elif role not in e.roles:
            e.roles = tuple(r for r in BOTH if r in e.roles or r == role)
        self.version += 1
        return e

    def register(self, url: str, role: str | None, ttl_s: float | None, now: float,
                 worker_id: str | None = None, source: str = "registered"
                 ) -> tuple[ServerEntry, bool]:
        """Add or refresh a registered server; returns (entry, created). `source="etcd"`: the
        store's lease decides its life (it never expires here; etcd_membership removes it)."""
        url = normalize_url(url)
        roles = roles_of(role)
        if source == "etcd":
            ttl = None
        else:
            ttl = self.default_ttl_s if ttl_s is None else min(float(ttl_s), self.max_ttl_s)
        e = self.servers.get(url)
        if e is not None:
            if e.source == "static":
                # Static entries keep their configured roles; a registration only proves liveness.
                return e, False
            if e.roles != roles:
                # etcd: a worker of both roles puts one key per role, so its roles grow in two steps
                (log.info if source == "etcd" else log.warning)(
                    "server %s re-registered with roles %s (was %s)", url, roles, e.roles)
                e.roles = roles
                self.version += 1
            e.ttl_s = ttl
            e.expires_at = None if ttl is None else now + ttl
            if worker_id is not None and e.worker_id not in (None, worker_id):
                # A different process behind the same url: prepare it afresh.
                self._set(e, ServerState.PENDING, f"worker id changed to {worker_id}", now)
            return e, False
        e = self.servers[url] = ServerEntry(url=url, roles=roles, source=source, since=now,
                                            ttl_s=ttl,
                                            expires_at=None if ttl is None else now + ttl)
        self.registrations_total += 1
        self.version += 1
        log.info("registered %s as %s (%s)", url, "+".join(roles),
                 "etcd lease" if ttl is None else f"ttl {ttl:.1f}s")
        return e, True

    def heartbeat(self, url: str, now: float, role: str | None = None, ttl_s: float | None = None,
                  worker_id: str | None = None) -> ServerEntry | None:
        """Refresh a registration; an unknown url with a role re-registers (coordinator restarted)."""
        url = normalize_url(url)
        e = self.servers.get(url)
        if e is None:
            if role is None:
                return None
            return self.register(url, role, ttl_s, now, worker_id)[0]
        if e.source == "registered":
            if ttl_s is not None:
                e.ttl_s = min(float(ttl_s), self.max_ttl_s)
            e.expires_at = now + (e.ttl_s or self.default_ttl_s)
        return e

    def deregister(self, url: str) -> ServerEntry | None:
        url = normalize_url(url)
        e = self.servers.get(url)
        if e is None or e.source == "static":
            return None
        log.info("server %s (%s) deregistered", e.url, "+".join(e.roles))
        self._remove(e, "deregistered")
        return e

    def expire_registrations(self, now: float) -> list[ServerEntry]:
        gone = [e for e in self.servers.values()
                if e.source == "registered" and e.expires_at is not None and e.expires_at <= now]
        for e in gone:
            self.registrations_expired += 1
            log.warning("registration of %s expired (no heartbeat for %.1fs)", e.url, e.ttl_s or 0.0)
            self._remove(e, "registration expired")
        return gone

    def _remove(self, e: ServerEntry, why: str) -> None:
        del self.servers[e.url]
        e.reason = f"removed: {why}"
        self.version += 1
        if self.on_remove is not None:
            self.on_remove(e)

    # ---- preparation and health ---------------------------------------------------------------
    def prepared(self, url: str, info: dict, now: float) -> ServerEntry | None:
        """Record a fetched `/server_info`; admits the server or refuses it."""
        e = self.servers.get(url)
        if e is None:
            return None
        problem = compatibility_problem(info, e.roles, self.block_size, self.key_scheme)
        e.server_info = info if isinstance(info, dict) else None
        wid = info.get("worker_id") if isinstance(info, dict) else None
        e.worker_id = str(wid) if wid is not None else e.worker_id
        if problem is not None:
            if e.state is not ServerState.REFUSED or e.reason != problem:
                log.error("refusing server %s: %s", url, problem)
            self._set(e, ServerState.REFUSED, problem, now)
            return e
        e.active_failures = 0
        e.passive_failures = 0
        e.last_probe_ok = now
        e.last_error = None
        if e.state is not ServerState.HEALTHY:
            if e.state is ServerState.UNHEALTHY:
                e.readmissions += 1
                log.info("server %s recovered; readmitted", url)
            else:
                log.info("server %s ready (%s)", url, "+".join(e.roles))
            self._set(e, ServerState.HEALTHY, "ok", now)
        return e

    def prepare_failed(self, url: str, error: str, now: float) -> None:
        e = self.servers.get(url)
        if e is None:
            return
        e.last_error = error
        if e.state is ServerState.PENDING:
            e.reason = f"preparing: {error}"

    def probe_ok(self, url: str, now: float) -> None:
        e = self.servers.get(url)
        if e is not None and e.state is ServerState.HEALTHY:
            e.active_failures = 0
            e.last_probe_ok = now
            e.last_error = None

    def may_readmit(self, e: ServerEntry, now: float) -> bool:
        return e.state is ServerState.UNHEALTHY and (
            e.ejected_at is None or now - e.ejected_at >= self.min_ejection_s)

    def probe_failed(self, url: str, error: str, now: float) -> bool:
        """Count a failed active probe; returns True when it ejected the server."""
        e = self.servers.get(url)
        if e is None:
            return False
        e.last_error = error
        if e.state is not ServerState.HEALTHY:
            return False
        e.active_failures += 1
        if e.active_failures >= self.failure_threshold:
            self._eject(e, f"{e.active_failures} consecutive failed health probes: {error}", now)
            return True
        return False

    def report(self, url: str, success: bool, now: float) -> bool:
        """A request outcome reported through `/finish`; returns True when it ejected the server."""
        e = self.servers.get(url)
        if e is None or e.state is not ServerState.HEALTHY:
            return False
        if success:
            e.passive_failures = 0
            return False
        e.passive_failures += 1
        if e.passive_failures >= self.failure_threshold:
            self._eject(e, f"{e.passive_failures} consecutive failed requests reported by the fleet", now)
            return True
        return False

    def report_success(self, url: str) -> None:
        """`report(url, True, now)` without the clock read: a success only resets the count."""
        e = self.servers.get(url)
        if e is not None and e.passive_failures and e.state is ServerState.HEALTHY:
            e.passive_failures = 0

    def _eject(self, e: ServerEntry, why: str, now: float) -> None:
        e.ejections += 1
        e.ejected_at = now
        log.warning("ejecting server %s: %s", e.url, why)
        self._set(e, ServerState.UNHEALTHY, why, now)

    def _set(self, e: ServerEntry, state: ServerState, reason: str, now: float) -> None:
        old = e.state
        e.reason = reason
        if old is state:
            return
        e.state = state
        e.since = now
        self.version += 1
        if self.on_change is not None:
            self.on_change(e, old, state)

    # ---- queries -----------------------------------------------------------------------------
    def healthy(self, role: str) -> list[ServerEntry]:
        return [e for e in self.servers.values() if e.state is ServerState.HEALTHY and role in e.roles]

    def count_healthy(self, role: str) -> int:
        return sum(1 for e in self.servers.values() if e.state is ServerState.HEALTHY and role in e.roles)

    def in_role(self, role: str) -> list[ServerEntry]:
        return [e for e in self.servers.values() if role in e.roles]

    def get(self, url: str) -> ServerEntry | None:
        return self.servers.get(url)
