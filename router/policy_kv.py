"""``kv_cache_aware``: the lowest estimated prefill + load cost wins (router/policy_base.py has the
records and the interface)."""

from __future__ import annotations


from protocol.channel import KvChoice

from .policy_base import Decision, Policy, _Lru, _healthy, _loads

try:    # router/_kv_cost.c, built by setup.py; `_core` below is the same recipe in Python
    from ._kv_cost import core as _native_core
except ImportError:     # no C compiler at install time
    _native_core = None

NATIVE = _native_core is not None

__all__ = ["KvCacheAwarePolicy", "NATIVE", "ROW_KEYS", "explain"]

# The keys of an explanation row that `explain` writes for a healthy candidate, in their order
# (the fleet's route header keeps a row as a copy less `load_tokens` when it has exactly these:
# fleet/legs/plan.py).
ROW_KEYS = ("server", "matched_tokens", "load_requests", "load_tokens", "score", "why")


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
        # The native core gives float costs: it stands in for `_core` only where the Python
        # expression gives floats too (an int weight keeps int scores in the explanation).
        self._native = NATIVE and all(type(w) is float for w in (
            prefill_weight, load_tokens_weight, load_requests_weight, affinity_bonus))

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
        # Written for speed (it runs once per leg of every request over every candidate): the
        # numbers come from one native call (router/_kv_cost.c; `_core` where it does not apply).
        # The candidate list is the coordinator's cached one until membership changes: what
        # depends on it alone (healthy subset, server names, unknown-match servers) is kept.
        memo = self._cands
        if memo is not None and memo[0] == candidates:
            _, ok, unhealthy, servers, unknown, all_unknown = memo
        else:
            ok, unhealthy = _healthy(self.name, candidates)
            servers = [c.server for c in ok]
            unknown = [i for i, c in enumerate(ok) if c.kv_unknown]
            all_unknown = len(unknown) == len(ok)
            self._cands = (list(candidates), ok, unhealthy, servers, unknown, all_unknown)
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
        cap = num_tokens - 1 if num_tokens > 0 else 0
        # Every match unknown: reported 0, estimated as the mean of no verified one (0), so the
        # index walk would decide nothing (`_unknown_matches`).
        md = None if not nk or all_unknown else view.matched_blocks(keys)
        pin = servers.index(pinned) if pinned is not None and pinned in servers else -1
        hf = self.hotspot_factor or 0.0
        mbs = self.max_batch_size if self.max_batch_size and self.load_cap is not None else 0
        args = (servers, md, loads, self.block_size, cap, num_tokens, self.prefill_weight,
                self.load_tokens_weight, self.load_requests_weight, pin, self.affinity_bonus, hf,
                self.hotspot_slack, mbs, self.load_cap if mbs else 0.0)
        # the Python recipe for int weights, unknown matches to estimate, and what the native
        # core does not take (a view answering a Mapping or numpy ints: TypeError)
        res = None
        if self._native and (md is None or not unknown):
            try:
                res = _native_core(*args)
            except TypeError:
                pass
        matched, costs, tied, hs, lc, limit = res or _core(*args, unknown)
        if hs or lc:
            hot = {i: f"hot: {loads[i][0]} in-flight requests > cap {limit:.1f}" for i in hs}
            for i in lc:
                hot[i] = f"hot: {loads[i][0]}/{mbs} requests >= load_cap {self.load_cap}"
            skip_hot = len(hot) != n
        else:
            hot, skip_hot = _NO_HOT, False
        if len(tied) > 1:
            pick = tied[self._cursor % len(tied)]
            self._cursor += 1
        else:
            pick = tied[0]
        server = servers[pick]
        if conv:
            self._pins.put(conv, server)
        # The explanation is built from these numbers when it is read (`explain`): the fleet
        # channel carries them and its client builds it (protocol/channel.py `KvChoice`).
        choice = KvChoice(servers, matched, loads, costs, pick, tied if len(tied) > 1 else _NONE,
                          list(hot.items()) if hot else _NONE, skip_hot, unknown, unhealthy,
                          num_tokens, conv, pinned, self.explain_rows)
        return Decision(server, None, None if unknown and ok[pick].kv_unknown
                        else md.get(server, 0) if md is not None else 0, choice, explain)


_NONE: list = []    # shared empty list of a KvChoice (never changed: explain only reads it)
_NO_HOT: dict = {}


def explain(c: KvChoice) -> dict:
    """The explanation record of a ``kv_cache_aware`` decision (module docstring of
    router/policy_base.py; ``KvCacheAwarePolicy``'s docstring for the rows): the unhealthy
    candidates, then the chosen server, then the next-lowest costs, ``explain_rows`` healthy rows
    at most. Rows for the chosen and next-cheapest servers only: building and encoding a row per
    candidate cost more than the decision itself at tens of servers."""
    servers, matched, loads, costs, pick = c.servers, c.matched, c.loads, c.costs, c.pick
    n = len(servers)
    server = servers[pick]
    pinned = c.pinned
    tied = c.tied
    tie = len(tied) > 1
    hot = dict(c.hot) if c.hot else _NO_HOT
    skip_hot = c.skip_hot
    unknown = c.unknown
    rows = [dict(r) for r in c.unhealthy] if c.unhealthy else []
    n_unhealthy = len(rows)
    if n == 2 and c.explain_rows > 1:
        shown = (pick, 1 - pick)
    elif n > 1:
        # a sort of a few dozen floats is cheaper than heapq.nsmallest's bookkeeping
        rest = sorted(range(n), key=costs.__getitem__)
        rest.remove(pick)
        shown = [pick, *rest[:c.explain_rows - 1]]
    else:
        shown = (pick,)
    append = rows.append
    for i in shown:
        if i == pick:
            w = ("chosen: lowest cost (tie, in turn)" if tie else "chosen: lowest cost") + (
                ", conversation affinity bonus" if server == pinned else "")
        elif skip_hot and i in hot:
            w = hot[i]
        elif tie and i in tied:
            w = "tied, not its turn"
        else:
            w = "higher cost"
        req, tok = loads[i]
        if unknown and i in unknown:
            w += " (kv_mismatch: cache match unknown, mean of the others assumed)"
        append({"server": servers[i], "matched_tokens": matched[i], "load_requests": req,
                "load_tokens": tok, "score": costs[i], "why": w})
    reason = f"lowest cost: {c.matched_tokens} of {c.num_tokens} prompt tokens cached"
    if len(hot) == n:
        reason += ", every candidate hot: cap ignored"
    if pinned == server:
        reason += ", conversation affinity"
    return {"policy": KvCacheAwarePolicy.name, "candidates": rows, "chosen": server, "reason": reason,
            "num_tokens": c.num_tokens, "matched_tokens": c.matched_tokens,
            "conversation": c.conversation, "pinned": pinned, "candidates_total": n + n_unhealthy,
            "hot": len(hot)}


def _core(servers: list, md: dict | None, loads: list, block_size: int, cap: int, num_tokens: int,
          pw, tw, rw, pin: int, bonus, hf, slack, mbs: int, lcap, unknown: list | None = None):
    """The numbers of a decision, ``(matched, costs, tied, hotspot, load_capped, limit)``
    (router/_kv_cost.c computes the same ones):

    - ``matched``: each server's reported match in tokens, ``md[server] * block_size`` capped at
      ``cap``, 0 for servers in ``unknown`` (``_unknown_matches``) or when ``md`` is None;
    - ``costs``: ``pw * (num_tokens - estimated match) + tw * tokens + rw * requests`` in
      flight, less ``bonus * num_tokens`` at index ``pin`` (-1: none);
    - ``hotspot``: indices whose in-flight requests exceed ``limit = hf * mean + slack`` (``hf``
      0: off); ``load_capped``: the others with ``requests / mbs >= lcap`` (``mbs`` 0: off);
    - ``tied``: the indices within 1e-9 (relative) of the lowest cost, the hot ones left out
      unless every server is hot.
    """
    n = len(servers)
    if md is None:
        matched = est = [0] * n
    else:
        mget = md.get
        matched = [mt if (mt := mget(s, 0) * block_size) < cap else cap for s in servers]
        est = matched
        if unknown:
            matched, est = _unknown_matches(matched, unknown)
    costs = [pw * (num_tokens - mt) + tw * tok + rw * req for mt, (req, tok) in zip(est, loads)]
    if pin >= 0:
        costs[pin] -= bonus * num_tokens
    hs: list = []
    lc: list = []
    limit = 0.0
    hot: set = set()
    if hf or mbs:
        reqs = [l[0] for l in loads]
        if hf:
            limit = hf * sum(reqs) / n + slack
            if max(reqs) > limit:
                hs = [i for i, r in enumerate(reqs) if r > limit]
                hot.update(hs)
        if mbs:
            lc = [i for i, r in enumerate(reqs) if i not in hot and r / mbs >= lcap]
            hot.update(lc)
    skip = hot if hot and len(hot) != n else ()      # every server hot: none is skipped
    best = min([c for i, c in enumerate(costs) if i not in skip])
    tol = best + 1e-9 * (abs(best) if abs(best) > 1.0 else 1.0)
    tied = [i for i, c in enumerate(costs) if c <= tol and i not in skip]
    return matched, costs, tied, hs, lc, limit


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
