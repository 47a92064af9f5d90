"""The four routing policies behind one interface, each explaining its decision.

``Policy.select(candidates, key, view) -> Decision``; the explanation record is
``{"policy", "candidates": [{"server", "matched_tokens", "load_requests", "load_tokens",
"score", "why"}], "chosen", "reason", "num_tokens", "matched_tokens"}`` (plus policy-specific
keys such as ``"conversation"``). ``score`` is a cost where lower wins (``kv_cache_aware``), the
load metric (``load_balancing``), or None where no score applies.

Policies are synchronous and deterministic given their inputs: the only state is what they
must remember (round-robin cursors, conversation pins, a seeded rng for power-of-two choices).
``make_policy`` validates arguments strictly; upstream ``trtllm-serve`` router arguments are
accepted with the meaning documented in docs/routing.md ("Policies").
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from protocol.failures import NoServerAvailable

__all__ = [
    "Candidate", "RoutingKey", "LoadView", "Decision", "NoServerAvailable", "Policy",
    "RoundRobinPolicy", "LoadBalancingPolicy", "KvCacheAwarePolicy", "ConversationPolicy",
    "IndexLoadView", "make_policy", "POLICY_TYPES",
]




@dataclass(frozen=True, slots=True)
class Candidate:
    server: str
    healthy: bool = True
    info: dict = field(default_factory=dict)
    # The server's block keys are known not to match ours (the coordinator's key parity probe):
    # its index matches mean nothing, so kv_cache_aware neither trusts nor penalises them.
    kv_unknown: bool = False


@dataclass(slots=True)
class RoutingKey:
    block_keys: np.ndarray | list | None = None
    num_tokens: int = 0
    conversation_id: str | None = None


class LoadView(Protocol):
    def requests(self, server: str) -> int: ...

    def tokens(self, server: str) -> int: ...

    def matched_blocks(self, keys) -> dict[str, int]: ...


@dataclass(slots=True)
class Decision:
    server: str
    explanation: dict
    # Leading prompt blocks the KV index holds for the chosen server (speculation included),
    # uncapped: what the coordinator's speculative insert skips. None when the policy did not
    # read the index or the server's match is unknown (`Candidate.kv_unknown`).
    matched_blocks: int | None = None


class IndexLoadView:
    """A LoadView over a ``KvIndex`` and a ``LeaseTable`` (what the coordinator holds)."""

    def __init__(self, index, leases):
        self.index = index
        self.leases = leases

    def requests(self, server: str) -> int:
        return self.leases.requests(server)

    def tokens(self, server: str) -> int:
        return self.leases.tokens(server)

    def matched_blocks(self, keys) -> dict[str, int]:
        return self.index.longest_prefix(keys)

    def loads(self, servers: Sequence[str]) -> list[tuple[int, int]]:
        """(requests, tokens) per server in one call (the hot path of every select)."""
        return self.leases.loads_for(servers)


def _loads(view, servers: Sequence[str]) -> list[tuple[int, int]]:
    bulk = getattr(view, "loads", None)
    if bulk is not None:
        return bulk(servers)
    return [(view.requests(s), view.tokens(s)) for s in servers]


def _n_keys(keys) -> int:
    return 0 if keys is None else len(keys)


def _healthy(policy: str, candidates: Sequence[Candidate]) -> tuple[list[Candidate], list[dict]]:
    """Healthy candidates (first occurrence of each server) and rows for the rest."""
    if candidates and False not in [c.healthy for c in candidates] and \
            len({c.server for c in candidates}) == len(candidates):
        return list(candidates), []
    seen = set()
    ok, rows = [], []
    for c in candidates:
        if c.server in seen:
            continue
        seen.add(c.server)
        if c.healthy:
            ok.append(c)
        else:
            rows.append({"server": c.server, "matched_tokens": 0, "load_requests": None,
                         "load_tokens": None, "score": None, "why": "unhealthy"})
    if not ok:
        raise NoServerAvailable(
            f"{policy}: no healthy server among {len(seen)} candidate(s)" if seen
            else f"{policy}: no candidate servers")
    return ok, rows


def _row(server: str, matched: int, req: int, tok: int, score, why: str) -> dict:
    return {"server": server, "matched_tokens": matched, "load_requests": req,
            "load_tokens": tok, "score": score, "why": why}


class _Lru:
    """Bounded conversation -> server pins with a reverse index for server departures."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._map: OrderedDict[str, str] = OrderedDict()
        self._by_server: dict[str, set[str]] = {}

    def get(self, key: str) -> str | None:
        server = self._map.get(key)
        if server is not None:
            self._map.move_to_end(key)
        return server

    def put(self, key: str, server: str) -> None:
        old = self._map.get(key)
        if old is not None and old != server:
            self._by_server[old].discard(key)
        self._map[key] = server
        self._map.move_to_end(key)
        self._by_server.setdefault(server, set()).add(key)
        while len(self._map) > self.max_entries:
            k, s = self._map.popitem(last=False)
            self._by_server[s].discard(k)

    def remove_server(self, server: str) -> list[str]:
        keys = self._by_server.pop(server, set())
        for k in keys:
            self._map.pop(k, None)
        return list(keys)

    def __len__(self) -> int:
        return len(self._map)


class Policy(ABC):
    name: str = ""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.passthrough: dict[str, Any] = {}  # upstream args another component consumes

    @abstractmethod
    def select(self, candidates: Sequence[Candidate], key: RoutingKey | None,
               view: LoadView) -> Decision: ...

    def remove_server(self, server: str) -> None:
        """Forget per-server state (conversation pins) when a server leaves the cluster."""

    @property
    def needs_block_keys(self) -> bool:
        return False

    def describe(self) -> dict:
        return {"type": self.name}


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, block_size: int = 16):
        super().__init__(block_size)
        self._cursor = 0

    def select(self, candidates, key, view) -> Decision:
        ok, rows = _healthy(self.name, candidates)
        chosen = ok[self._cursor % len(ok)]
        self._cursor += 1
        for c in ok:
            rows.append(_row(c.server, 0, view.requests(c.server), view.tokens(c.server), None,
                             "chosen: next in turn" if c is chosen else "not its turn"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server,
            "reason": "round robin", "num_tokens": key.num_tokens if key else 0,
            "matched_tokens": 0})


class LoadBalancingPolicy(Policy):
    """Least in-flight requests (or tokens), ties in turn; optionally power-of-two choices."""

    name = "load_balancing"

    def __init__(self, block_size: int = 16, use_tokens: bool = False,
                 power_of_two_choices: bool = False, seed: int | None = None):
        super().__init__(block_size)
        self.use_tokens = use_tokens
        self.power_of_two_choices = power_of_two_choices
        self._rng = random.Random(seed)
        self._cursor = 0

    def describe(self) -> dict:
        return {"type": self.name, "use_tokens": self.use_tokens,
                "power_of_two_choices": self.power_of_two_choices}

    def _pick(self, ok: list[Candidate], view) -> tuple[Candidate, dict, str]:
        loads = dict(zip((c.server for c in ok), _loads(view, [c.server for c in ok])))
        metric = (lambda s: loads[s][1]) if self.use_tokens else (lambda s: loads[s][0])
        unit = "tokens" if self.use_tokens else "requests"
        if self.power_of_two_choices and len(ok) > 2:
            a, b = self._rng.sample(ok, 2)
            chosen = a if metric(a.server) <= metric(b.server) else b
            return chosen, loads, f"power of two choices: {a.server} vs {b.server} by {unit}"
        best = min(metric(c.server) for c in ok)
        tied = [c for c in ok if metric(c.server) == best]
        chosen = tied[self._cursor % len(tied)]
        self._cursor += 1
        reason = f"least in-flight {unit}" + (f" (tie of {len(tied)}, in turn)" if len(tied) > 1 else "")
        return chosen, loads, reason

    def select(self, candidates, key, view) -> Decision:
        ok, rows = _healthy(self.name, candidates)
        chosen, loads, reason = self._pick(ok, view)
        for c in ok:
            req, tok = loads[c.server]
            rows.append(_row(c.server, 0, req, tok, tok if self.use_tokens else req,
                             "chosen" if c is chosen else "more loaded or not sampled"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server, "reason": reason,
            "num_tokens": key.num_tokens if key else 0, "matched_tokens": 0})


class KvCacheAwarePolicy(Policy):
    """Lowest estimated cost wins:

        cost = prefill_weight * uncached_prompt_tokens
             + load_tokens_weight * in_flight_tokens + load_requests_weight * in_flight_requests
             - affinity_bonus * prompt_tokens        (only on the conversation's pinned server)

    ``uncached = num_tokens - min(matched_blocks * block_size, num_tokens - 1)`` (the last prompt
    token is always recomputed). A server is *hot* when its in-flight requests exceed
    ``hotspot_factor * mean + hotspot_slack`` over the candidates (or ``requests /
    max_batch_size >= load_cap``); hot servers are skipped unless every candidate is hot. Equal
    costs are broken in turn.

    The explanation's ``candidates`` rows: unhealthy candidates first, then the chosen server,
    then the next-lowest costs, ``explain_rows`` healthy rows at most; ``candidates_total``
    counts every candidate and ``hot`` the hot ones.
    """

    name = "kv_cache_aware"

    def __init__(self, block_size: int = 16, *, prefill_weight: float = 1.0,
                 load_tokens_weight: float = 1.0, load_requests_weight: float = 32.0,
                 affinity_bonus: float = 0.25, hotspot_factor: float | None = 2.0,
                 hotspot_slack: float = 2.0, max_batch_size: int | None = None,
                 load_cap: float | None = None, max_conversations: int = 100_000,
                 track_routed_blocks: bool = True, speculative_ttl_s: float = 30.0,
                 explain_rows: int = 8):
        super().__init__(block_size)
        if type(explain_rows) is not int or explain_rows < 1:
            raise ValueError(f"explain_rows must be a positive int, found {explain_rows!r}")
        self.explain_rows = explain_rows
        self.prefill_weight = prefill_weight
        self.load_tokens_weight = load_tokens_weight
        self.load_requests_weight = load_requests_weight
        self.affinity_bonus = affinity_bonus
        self.hotspot_factor = hotspot_factor
        self.hotspot_slack = hotspot_slack
        self.max_batch_size = max_batch_size
        self.load_cap = load_cap
        self.track_routed_blocks = track_routed_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self._pins = _Lru(max_conversations)
        self._cursor = 0
        self._cands: tuple | None = None
        self._bulk: tuple | None = None     # (view, its bulk `loads` or None)

    @property
    def needs_block_keys(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"type": self.name, "prefill_weight": self.prefill_weight,
                "load_tokens_weight": self.load_tokens_weight,
                "load_requests_weight": self.load_requests_weight,
                "affinity_bonus": self.affinity_bonus, "hotspot_factor": self.hotspot_factor,
                "hotspot_slack": self.hotspot_slack, "max_batch_size": self.max_batch_size,
                "load_cap": self.load_cap, "track_routed_blocks": self.track_routed_blocks,
                "speculative_ttl_s": self.speculative_ttl_s, "explain_rows": self.explain_rows}

    def remove_server(self, server: str) -> None:
        self._pins.remove_server(server)

    def select(self, candidates, key, view) -> Decision:
        # Written for speed (it runs once per leg of every request over every candidate): list
        # comprehensions instead of per-candidate branches; rows are built in one pass.
        # The candidate list is the coordinator's cached one until membership changes: what
        # depends on it alone (healthy subset, server names, unknown-match servers) is kept.
        memo = self._cands
        if memo is not None and memo[0] == candidates:
            _, ok, unhealthy, servers, unknown, all_unknown = memo
            rows = [dict(r) for r in unhealthy] if unhealthy else []
        else:
            ok, rows = _healthy(self.name, candidates)
            servers = [c.server for c in ok]
            unknown = [i for i, c in enumerate(ok) if c.kv_unknown]
            all_unknown = len(unknown) == len(ok)
            self._cands = (list(candidates), ok, [dict(r) for r in rows], servers, unknown,
                           all_unknown)
        n = len(servers)
        if key is not None:
            keys = key.block_keys
            nk = 0 if keys is None else len(keys)
            num_tokens = key.num_tokens or nk * self.block_size
            conv = key.conversation_id
        else:
            keys, nk, num_tokens, conv = None, 0, 0, None
        pinned = self._pins.get(conv) if conv else None
        bulk = self._bulk
        if bulk is None or bulk[0] is not view:
            bulk = self._bulk = (view, getattr(view, "loads", None))
        loads = bulk[1](servers) if bulk[1] is not None else _loads(view, servers)
        B = self.block_size
        cap = num_tokens - 1 if num_tokens > 0 else 0
        mget = None
        if not nk:
            matched = est = [0] * n
        elif all_unknown:
            # Every match is unknown: reported 0, estimated as the mean of no verified one (0),
            # so the index walk would decide nothing (`_unknown_matches`).
            matched = est = [0] * n
        else:
            mget = view.matched_blocks(keys).get
            matched = [mt if (mt := mget(s, 0) * B) < cap else cap for s in servers]
            est = matched
            if unknown:
                matched, est = _unknown_matches(matched, unknown)
        pw, tw, rw = self.prefill_weight, self.load_tokens_weight, self.load_requests_weight
        costs = [pw * (num_tokens - mt) + tw * tok + rw * req
                 for mt, (req, tok) in zip(est, loads)]
        if pinned is not None and pinned in servers:
            costs[servers.index(pinned)] -= self.affinity_bonus * num_tokens
        hot: dict[int, str] = {}
        if self.hotspot_factor or (self.max_batch_size and self.load_cap is not None):
            reqs = [l[0] for l in loads]
            if self.hotspot_factor:
                limit = self.hotspot_factor * sum(reqs) / n + self.hotspot_slack
                if max(reqs) > limit:
                    hot = {i: f"hot: {r} in-flight requests > cap {limit:.1f}"
                           for i, r in enumerate(reqs) if r > limit}
            if self.max_batch_size and self.load_cap is not None:
                mbs, lcap = self.max_batch_size, self.load_cap
                for i, r in enumerate(reqs):
                    if i not in hot and r / mbs >= lcap:
                        hot[i] = f"hot: {r}/{mbs} requests >= load_cap {lcap}"
        all_hot = len(hot) == n
        skip_hot = bool(hot) and not all_hot
        if skip_hot:
            best = min([c for i, c in enumerate(costs) if i not in hot])
        else:
            best = min(costs)
        tol = best + 1e-9 * (abs(best) if abs(best) > 1.0 else 1.0)
        if skip_hot:
            tied = [i for i, c in enumerate(costs) if c <= tol and i not in hot]
        else:
            tied = [i for i, c in enumerate(costs) if c <= tol]
        tie = len(tied) > 1
        if tie:
            pick = tied[self._cursor % len(tied)]
            self._cursor += 1
        else:
            pick = tied[0]
        server = servers[pick]
        if conv:
            self._pins.put(conv, server)
        # Rows for the chosen server and the next-cheapest ones only: building and encoding a
        # row per candidate cost more than the decision itself at tens of servers.
        n_unhealthy = len(rows)
        if n > 1:
            # a sort of a few dozen floats is cheaper than heapq.nsmallest's bookkeeping
            rest = sorted(range(n), key=costs.__getitem__)
            rest.remove(pick)
            shown = [pick, *rest[:self.explain_rows - 1]]
        else:
            shown = [pick]
        tied_set = set(tied) if tie else ()
        append = rows.append
        for i in shown:
            if i == pick:
                w = ("chosen: lowest cost (tie, in turn)" if tie else "chosen: lowest cost") + (
                    ", conversation affinity bonus" if server == pinned else "")
            elif skip_hot and i in hot:
                w = hot[i]
            elif i in tied_set:
                w = "tied, not its turn"
            else:
                w = "higher cost"
            req, tok = loads[i]
            if unknown and ok[i].kv_unknown:
                w += " (kv_mismatch: cache match unknown, mean of the others assumed)"
            append({"server": servers[i], "matched_tokens": matched[i], "load_requests": req,
                    "load_tokens": tok, "score": costs[i], "why": w})
        reason = f"lowest cost: {matched[pick]} of {num_tokens} prompt tokens cached"
        if all_hot:
            reason += ", every candidate hot: cap ignored"
        if pinned == server:
            reason += ", conversation affinity"
        return Decision(server, {
            "policy": self.name, "candidates": rows, "chosen": server, "reason": reason,
            "num_tokens": num_tokens, "matched_tokens": matched[pick],
            "conversation": conv, "pinned": pinned, "candidates_total": n + n_unhealthy,
            "hot": len(hot)}, None if unknown and ok[pick].kv_unknown
            else mget(server, 0) if mget is not None else 0)


def _unknown_matches(matched: list[int], unknown: list[int]) -> tuple[list[int], list[int]]:
    """(reported, estimated) matched tokens when some servers' matches are unknown: reported as
    0 (nothing is predicted cached there: conditional disaggregation and the predicted-vs-actual
    check must not rely on it), estimated as the mean over the servers whose keys are verified,
    so placement between an unknown server and the others falls to load, not to a match of 0
    that would starve it (or, when every server is unknown, to load alone)."""
    u = set(unknown)
    known = [m for i, m in enumerate(matched) if i not in u]
    mean = int(sum(known) / len(known)) if known else 0
    return ([0 if i in u else m for i, m in enumerate(matched)],
            [mean if i in u else m for i, m in enumerate(matched)])


class _PrefixSessions:
    """Implicit sessions: canonical keys at every ``stride``-th block (and a session's last
    block) map to the session that registered them. Keys are chained, so membership at stride
    positions is monotone along a prompt and the deepest match is a binary search."""

    def __init__(self, stride: int, max_sessions: int):
        self.stride = stride
        self.max_sessions = max_sessions
        self._by_key: dict[int, str] = {}
        self._sessions: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def match(self, keys: list[int]) -> tuple[str | None, int]:
        """(session id, matched blocks) of the deepest registered prefix of ``keys``."""
        by_key = self._by_key
        st = self.stride
        lo, hi = 0, len(keys) // st  # stride positions st*i - 1 for i in 1..hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid * st - 1] in by_key:
                lo = mid
            else:
                hi = mid - 1
        best, depth = (by_key[keys[lo * st - 1]], lo * st) if lo else (None, 0)
        # session ends (registered last blocks) between stride positions
        for q in range(lo * st, min(len(keys), (lo + 1) * st)):
            sid = by_key.get(keys[q])
            if sid is not None:
                best, depth = sid, q + 1
        return best, depth

    def register(self, sid: str, server: str, keys: list[int]) -> None:
        st = self.stride
        marks = [keys[i] for i in range(st - 1, len(keys), st)]
        if keys and (len(keys) % st):
            marks.append(keys[-1])
        old = self._sessions.pop(sid, None)
        if old is not None:
            for k in old[1]:
                if self._by_key.get(k) == sid:
                    del self._by_key[k]
        for k in marks:
            self._by_key[k] = sid
        self._sessions[sid] = (server, marks)
        while len(self._sessions) > self.max_sessions:
            old_sid, (_, old_marks) = self._sessions.popitem(last=False)
            for k in old_marks:
                if self._by_key.get(k) == old_sid:
                    del self._by_key[k]

    def server_of(self, sid: str) -> str | None:
        v = self._sessions.get(sid)
        if v is None:
            return None
        self._sessions.move_to_end(sid)
        return v[0]

    def remove_server(self, server: str) -> None:
        for sid in [s for s, (srv, _) in self._sessions.items() if srv == server]:
            _, marks = self._sessions.pop(sid)
            for k in marks:
                if self._by_key.get(k) == sid:
                    del self._by_key[k]

    def __len__(self) -> int:
        return len(self._sessions)


class ConversationPolicy(Policy):
    """Sticky sessions: an explicit conversation id stays on its server while that server is a
    healthy candidate; without an id, a prompt whose prefix covers ``match_threshold`` of an
    earlier session's prefix continues that session. New sessions go to the least loaded."""

    name = "conversation"

    def __init__(self, block_size: int = 16, *, match_threshold: float = 0.75,
                 max_sessions: int = 100_000, implicit_sessions: bool = True,
                 tokens_per_block: int = 128, use_tokens: bool = False):
        super().__init__(block_size)
        self.match_threshold = match_threshold
        self.implicit_sessions = implicit_sessions
        self.use_tokens = use_tokens
        self._pins = _Lru(max_sessions)
        self._implicit = _PrefixSessions(max(1, tokens_per_block // block_size), max_sessions)
        self._lb = LoadBalancingPolicy(block_size, use_tokens=use_tokens)
        self._counter = 0

    @property
    def needs_block_keys(self) -> bool:
        return self.implicit_sessions

    def describe(self) -> dict:
        return {"type": self.name, "match_threshold": self.match_threshold,
                "implicit_sessions": self.implicit_sessions, "use_tokens": self.use_tokens,
                "sessions": len(self._pins), "implicit": len(self._implicit)}

    def remove_server(self, server: str) -> None:
        self._pins.remove_server(server)
        self._implicit.remove_server(server)

    def select(self, candidates, key, view) -> Decision:
        ok, rows = _healthy(self.name, candidates)
        by_server = {c.server: c for c in ok}
        conv = key.conversation_id if key is not None else None
        keys = key.block_keys if key is not None else None
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        nk = _n_keys(keys)
        num_tokens = key.num_tokens if key is not None and key.num_tokens else nk * self.block_size
        session, chosen, reason, matched = conv, None, "", 0
        if conv:
            pinned = self._pins.get(conv)
            if pinned in by_server:
                chosen, reason = by_server[pinned], "sticky: conversation pinned here"
            else:
                reason = ("pinned server unavailable: re-pinned to least loaded" if pinned
                          else "new conversation: least loaded")
        elif self.implicit_sessions and nk:
            sid, depth = self._implicit.match(keys)
            matched = min(depth * self.block_size, num_tokens)
            server = self._implicit.server_of(sid) if sid else None
            if sid and num_tokens and matched / num_tokens >= self.match_threshold \
                    and server in by_server:
                session, chosen = sid, by_server[server]
                reason = f"implicit session {sid}: {matched}/{num_tokens} prompt tokens match"
            else:
                self._counter += 1
                session = f"implicit-{self._counter}"
                reason = "new implicit session: least loaded"
        else:
            reason = "no conversation id: least loaded"
        if chosen is None:
            chosen, _, _ = self._lb._pick(ok, view)
        if conv:
            self._pins.put(conv, chosen.server)
        elif session and nk:
            self._implicit.register(session, chosen.server, keys)
        for c in ok:
            rows.append(_row(c.server, matched if c is chosen else 0, view.requests(c.server),
                             view.tokens(c.server), None,
                             "chosen" if c is chosen else "not the session's server"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server, "reason": reason,
            "num_tokens": num_tokens, "matched_tokens": matched, "conversation": session})


# ---------------------------------------------------------------------------------------------
# make_policy: strict argument validation

_NUM = (int, float)


def _check_type(ptype: str, name: str, value: Any, kind) -> Any:
    ok = True
    if kind is bool:
        ok = type(value) is bool
    elif kind is int:
        ok = type(value) is int
    elif kind == "num":
        ok = isinstance(value, _NUM) and type(value) is not bool
    elif kind == "num?":
        ok = value is None or (isinstance(value, _NUM) and type(value) is not bool)
    elif kind == "int?":
        ok = value is None or type(value) is int
    elif kind is str:
        ok = isinstance(value, str)
    elif kind == "str?":
        ok = value is None or isinstance(value, str)
    if not ok:
        want = {"num": "a number", "num?": "a number or null", "int?": "an int or null",
                "str?": "a string or null"}.get(kind, getattr(kind, "__name__", str(kind)))
        raise ValueError(f"router {ptype!r}: argument {name!r} must be {want}, "
                         f"found {value!r} ({type(value).__name__})")
    return value


# upstream trtllm-serve copies these into every router's args
_COMMON_UPSTREAM = {"max_batch_size": "int?", "max_num_tokens": "int?"}
# consumed by the fleet's tokenizer, not by the policy
_TOKENIZER_ARGS = {"custom_tokenizer": "str?", "tokenizer_dir": "str?", "use_harmony": bool,
                   "model_path": "str?"}

_SPECS: dict[str, dict[str, Any]] = {
    "round_robin": {},
    "load_balancing": {"use_tokens": bool, "power_of_two_choices": bool, "seed": "int?"},
    "kv_cache_aware": {
        "prefill_weight": "num", "load_tokens_weight": "num", "load_requests_weight": "num",
        "affinity_bonus": "num", "hotspot_factor": "num?", "hotspot_slack": "num",
        "max_conversations": int, "track_routed_blocks": bool, "speculative_ttl_s": "num",
        "explain_rows": int,
        # upstream KvCacheAwareRouter
        "use_tokens": bool, "load_weight": "num", "load_cap": "num?",
        "tokens_per_block": "int?", **_TOKENIZER_ARGS,
    },
    "conversation": {
        "match_threshold": "num", "max_sessions": int, "implicit_sessions": bool,
        "tokens_per_block": "int?", "use_tokens": bool,
        # upstream ConversationRouter
        "use_token_ids": bool, "hash_skip_count": int,
    },
}
POLICY_TYPES = tuple(_SPECS)


def _positive(ptype: str, name: str, v, allow_zero: bool = False):
    if v is not None and (v < 0 or (v == 0 and not allow_zero)):
        raise ValueError(f"router {ptype!r}: argument {name!r} must be "
                         f"{'non-negative' if allow_zero else 'positive'}, found {v!r}")


def make_policy(type: str, args: dict | None = None, *, block_size: int = 16,
                seed: int | None = None) -> Policy:
    """Build a policy; unknown or mistyped arguments raise ValueError naming the argument."""
    ptype = type
    if ptype not in _SPECS:
        raise ValueError(f"unknown router type {ptype!r}; expected one of {', '.join(POLICY_TYPES)}")
    args = dict(args or {})
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, found {block_size!r}")
    spec = {**_COMMON_UPSTREAM, **_SPECS[ptype]}
    for name, value in args.items():
        if name not in spec:
            raise ValueError(f"router {ptype!r}: unknown argument {name!r}; expected one of "
                             f"{', '.join(sorted(spec)) or '(none)'}")
        _check_type(ptype, name, value, spec[name])
    for name in ("prefill_weight", "load_tokens_weight", "load_requests_weight", "affinity_bonus",
                 "hotspot_slack", "load_weight", "hotspot_factor", "load_cap"):
        _positive(ptype, name, args.get(name), allow_zero=True)
    for name in ("max_conversations", "max_sessions", "speculative_ttl_s", "max_batch_size",
                 "explain_rows",
                 "tokens_per_block", "max_num_tokens"):
        _positive(ptype, name, args.get(name))
    passthrough = {k: args.pop(k) for k in list(args) if k in _TOKENIZER_ARGS or k in (
        "max_num_tokens", "tokens_per_block")}
    policy: Policy
    if ptype == "round_robin":
        args.pop("max_batch_size", None)
        policy = RoundRobinPolicy(block_size)
    elif ptype == "load_balancing":
        args.pop("max_batch_size", None)
        if "seed" not in args:
            args["seed"] = seed
        policy = LoadBalancingPolicy(block_size, **args)
    elif ptype == "kv_cache_aware":
        if "load_weight" in args:
            if "load_requests_weight" in args:
                raise ValueError(f"router {ptype!r}: give 'load_weight' (upstream, in matched "
                                 "blocks per request) or 'load_requests_weight' (tokens per "
                                 "request), not both")
            args["load_requests_weight"] = float(args.pop("load_weight")) * block_size
        use_tokens = args.pop("use_tokens", None)
        if use_tokens is False and "load_tokens_weight" not in args:
            args["load_tokens_weight"] = 0.0
        policy = KvCacheAwarePolicy(block_size, **args)
    else:
        skip = args.pop("hash_skip_count", 0)
        if skip:
            raise ValueError(
                f"router {ptype!r}: hash_skip_count={skip} is not supported: block keys are "
                "chained from the first token, so a prefix cannot be skipped; raise "
                "match_threshold instead so a shared system prompt alone does not match")
        args.pop("use_token_ids", None)  # we always match on token ids
        args.pop("max_batch_size", None)
        tpb = passthrough.pop("tokens_per_block", None)
        if tpb is not None:
            args["tokens_per_block"] = tpb
        if not 0 < args.get("match_threshold", 0.75) <= 1:
            raise ValueError(f"router {ptype!r}: argument 'match_threshold' must be in (0, 1], "
                             f"found {args['match_threshold']!r}")
        policy = ConversationPolicy(block_size, **args)
    policy.passthrough = passthrough
    return policy
