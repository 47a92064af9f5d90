"""``kv_cache_aware``: the lowest estimated cost wins — by default the estimated time to first
token, else (``cost: tokens``) token weights (router/policy_base.py has the records and the
interface)."""

from __future__ import annotations


from array import array

from protocol.channel import KvChoice

from .policy_base import Decision, PinLru, Policy, healthy_candidates, server_loads
from .prefix_pins import PrefixPins, session_credit

try:    # router/_kv_cost.c, built by setup.py; `_core`, `_time_core` below: the same in Python
    from ._kv_cost import core as _native_core, time_core as _native_time_core, \
        time_core_table as _native_time_core_table
except ImportError:     # no C compiler at install time
    _native_core = _native_time_core = _native_time_core_table = None

NATIVE = _native_core is not None

__all__ = ["KvCacheAwarePolicy", "NATIVE", "ROW_KEYS", "explain", "model_of", "PRIOR_MODEL"]

# What a server that publishes no `routing_model` in /server_info is assumed to do until its
# first-token reports correct it (`KvCacheAwarePolicy.observe_ttft`): 20k prefill tokens/s,
# 8192-token prefill chunks, 10 ms decode steps. Only the ratios between servers and against the
# time-valued arguments (hotspot_slack_s) matter, and the online scale corrects both.
PRIOR_MODEL = {"prefill_s_per_token": 5e-5, "chunk_tokens": 8192, "decode_s_per_step": 0.01,
               "decode_s_per_request": 0.0, "decode_s_per_context_token": 0.0,
               "kv_capacity_tokens": 0}
_MODEL_KEYS = tuple(PRIOR_MODEL)
# doubles per server in the time core's `params` (router/_kv_cost.c P_*): the model, then the scale
PARAMS = len(_MODEL_KEYS) + 1
# the tokens cost's weights: giving any of them (or cost: tokens) selects that cost
TOKEN_WEIGHTS = ("prefill_weight", "load_tokens_weight", "load_requests_weight")
# The affinity slack's default (time cost): a session's server (a conversation's pin, or an
# implicit session's with a credit) is kept while its cost is at most 1 + this times another
# server's. The greedy time cost left a prefix tree's server for a few percent less estimated
# time (docs/routing.md, "Phase-aware load and the time cost"): its next requests then followed
# the tree elsewhere and recomputed it, where `conversation` kept the tree and cached more.
AFFINITY_SLACK = 0.5


def model_of(info: dict | None, prefill_tokens_per_s: float | None = None,
             decode_step_s: float | None = None) -> tuple[float, ...]:
    """A server's model ``(prefill s/token, chunk tokens, decode s/step, decode s/request,
    decode s/context token, KV capacity tokens)`` from its ``/server_info`` (``routing_model``,
    which our worker publishes; ``max_num_tokens`` for the chunk; ``kv_capacity_blocks`` ×
    ``block_size`` for the capacity, 0: unknown), the policy's overrides, else ``PRIOR_MODEL``.
    Malformed fields are ignored (the prior stands)."""
    info = info if isinstance(info, dict) else {}
    rm = info.get("routing_model")
    m = dict(PRIOR_MODEL)
    mnt = info.get("max_num_tokens")
    if type(mnt) is int and mnt > 0:
        m["chunk_tokens"] = mnt
    cap, bs = info.get("kv_capacity_blocks"), info.get("block_size")
    if type(cap) is int and cap > 0 and type(bs) is int and bs > 0:
        m["kv_capacity_tokens"] = cap * bs
    if isinstance(rm, dict):
        for k in _MODEL_KEYS:
            v = rm.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and v == v \
                    and v != float("inf") and (k != "chunk_tokens" or v > 0) \
                    and (k != "prefill_s_per_token" or v > 0):
                m[k] = v
    if prefill_tokens_per_s:
        m["prefill_s_per_token"] = 1.0 / prefill_tokens_per_s
    if decode_step_s is not None:
        m["decode_s_per_step"] = decode_step_s
    return tuple(float(m[k]) for k in _MODEL_KEYS)

def publishes_model(info: dict | None) -> bool:
    """Whether a server's ``/server_info`` carries its own ``routing_model`` (our worker measures
    and publishes one). Only the others' scales are learned (``observe_ttft``): a published model
    is the server's own measurement, and on one, first-token reports mostly carry the fleet hop
    and the host's noise, which a per-server scale turns into a standing preference between equal
    servers (every new prefix went to the one whose scale happened to be lowest)."""
    return isinstance(info, dict) and isinstance(info.get("routing_model"), dict)

# The keys of an explanation row that `explain` writes for a healthy candidate, in their order
# (the fleet's route header keeps a row as a copy less `load_tokens` when it has exactly these:
# fleet/legs/plan.py).
ROW_KEYS = ("server", "matched_tokens", "load_requests", "load_tokens", "score", "why")


class KvCacheAwarePolicy(Policy):
    """Lowest estimated cost wins. The default cost (``cost="time"``) is in seconds, per server:

        step  = decode_weight * (s_step + s_req * decoding + s_ctx * their_context_tokens)
                (0 when nothing decodes there)
        cost  = k * ((queued + uncached_weight * uncached) * s_tok
                     + max(1, (queued + uncached) / chunk) * step)
              - affinity_bonus * prompt_tokens * s_tok * k      (only on the conversation's pinned server)
        cost /= 1 + affinity_slack      (that server, where credited and its cost still positive)

    ``queued``: the prefill tokens of the server's leases not yet past their first token (the
    lease table's phase, router/leases.py); ``decoding``/``their_context_tokens``: its other
    leases and their prompt tokens; ``uncached``: this prompt's tokens the server must compute.
    With ``uncached_weight`` 1 the cost is the estimated time to first token: the prefill queue
    and this prompt at ``s_tok`` per token, in chunks of ``chunk`` tokens each sharing a step with
    the decoding requests (one step at least: a prompt whose prefix is cached still waits for
    one step, as long as its server's decoding batch makes it). The model ``(s_tok, chunk, s_step, s_req, s_ctx)`` is each server's
    ``routing_model`` from ``/server_info`` (``model_of``), and ``k`` a per-server scale learned
    from the fleet's first-token reports (``observe_ttft``: actual against predicted). A server is
    hot when its decode step (``k * decode_weight * (s_step + s_req * decoding + s_ctx *
    their_context_tokens)``, seconds: the time per output token there) exceeds
    ``hotspot_factor * mean + hotspot_slack_s`` (default: two idle decode steps, ``_slack_of``).

    ``cost="tokens"`` (or giving any of ``prefill_weight``, ``load_tokens_weight``,
    ``load_requests_weight``) keeps the token-weight cost:

        cost = prefill_weight * uncached_prompt_tokens
             + load_tokens_weight * in_flight_tokens + load_requests_weight * in_flight_requests
             - affinity_bonus * prompt_tokens        (only on the conversation's pinned server)

    with hot = in-flight requests > ``hotspot_factor * mean + hotspot_slack``.

    ``uncached = num_tokens - min(matched_blocks * block_size, num_tokens - 1)`` (the last prompt
    token is always recomputed). ``requests / max_batch_size >= load_cap`` also marks a server
    hot; hot servers are skipped unless every candidate is hot. Equal costs are broken in turn.

    The explanation's ``candidates`` rows: unhealthy candidates first, then the chosen server,
    then the next-lowest costs, ``explain_rows`` healthy rows at most; ``candidates_total``
    counts every candidate and ``hot`` the hot ones.
    """

    name = "kv_cache_aware"

    # Every attribute __init__ sets, as slots: past 30 attributes an instance's dict no longer
    # shares its keys with the class's other instances, and CPython 3.11 reads each `self.x`
    # through a dict lookup instead of a fixed index (~17 instructions more per read, ~35 reads
    # per placement). An attribute not listed still works (Policy's instances have a dict).
    __slots__ = ("block_size", "cost", "explain_rows", "prefill_weight", "load_tokens_weight",
                 "load_requests_weight", "uncached_weight", "decode_weight", "prefill_tokens_per_s",
                 "decode_step_s", "learn_rates", "hotspot_slack_s", "_slack", "_scale", "_learning",
                 "affinity_bonus", "affinity_slack", "_div", "hotspot_factor", "hotspot_slack",
                 "max_batch_size", "load_cap", "track_routed_blocks", "speculative_ttl_s", "_pins",
                 "implicit_sessions", "_stride", "_held_weight", "_sessions", "_cursor", "_cands",
                 "_bulk", "_native")

    def __init__(self, block_size: int = 16, *, cost: str | None = None,
                 prefill_weight: float | None = None, load_tokens_weight: float | None = None,
                 load_requests_weight: float | None = None, uncached_weight: float = 2.0,
                 decode_weight: float = 1.0, prefill_tokens_per_s: float | None = None,
                 decode_step_s: float | None = None, learn_rates: bool = True,
                 affinity_bonus: float = 0.25, affinity_slack: float = AFFINITY_SLACK,
                 hotspot_factor: float | None = 2.0,
                 hotspot_slack: float = 2.0, hotspot_slack_s: float | None = None,
                 max_batch_size: int | None = None,
                 load_cap: float | None = None, max_conversations: int = 100_000,
                 implicit_sessions: bool = True,
                 track_routed_blocks: bool = True, speculative_ttl_s: float = 30.0,
                 explain_rows: int = 8):
        super().__init__(block_size)
        if type(explain_rows) is not int or explain_rows < 1:
            raise ValueError(f"explain_rows must be a positive int, found {explain_rows!r}")
        given = [n for n, v in zip(TOKEN_WEIGHTS, (prefill_weight, load_tokens_weight,
                                                   load_requests_weight)) if v is not None]
        if cost is None:
            cost = "tokens" if given else "time"
        if cost not in ("time", "tokens"):
            raise ValueError(f"cost must be 'time' or 'tokens', found {cost!r}")
        if cost == "time" and given:
            raise ValueError(f"{', '.join(given)} weigh the tokens cost: give cost: tokens with "
                             "them, or leave them out for the time cost")
        self.cost = cost
        self.explain_rows = explain_rows
        self.prefill_weight = 1.0 if prefill_weight is None else prefill_weight
        self.load_tokens_weight = 1.0 if load_tokens_weight is None else load_tokens_weight
        self.load_requests_weight = 32.0 if load_requests_weight is None else load_requests_weight
        self.uncached_weight = float(uncached_weight)
        self.decode_weight = float(decode_weight)
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_step_s = decode_step_s
        self.learn_rates = learn_rates
        self.hotspot_slack_s = None if hotspot_slack_s is None else float(hotspot_slack_s)
        self._slack = 0.0 if hotspot_slack_s is None else float(hotspot_slack_s)  # `_slack_of`
        # per-server scale of the time model, learned from first-token reports (observe_ttft),
        # for the servers that publish no `routing_model` while learning is on with the time
        # cost (`_learning`, from the candidates: `_learns`)
        self._scale: dict[str, float] = {}
        self._learning: frozenset = frozenset()
        self.affinity_bonus = affinity_bonus
        if isinstance(affinity_slack, bool) or not isinstance(affinity_slack, (int, float)) \
                or not affinity_slack >= 0 or affinity_slack == float("inf"):
            raise ValueError(f"affinity_slack must be a number >= 0, found {affinity_slack!r}")
        self.affinity_slack = float(affinity_slack)
        # the time cores divide the session's server's cost by this (router/_kv_cost.c)
        self._div = 1.0 + self.affinity_slack
        self.hotspot_factor = hotspot_factor
        self.hotspot_slack = hotspot_slack
        self.max_batch_size = max_batch_size
        self.load_cap = load_cap
        self.track_routed_blocks = track_routed_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self._pins = PinLru(max_conversations)
        # implicit sessions (router/prefix_pins.py): a prompt prefix's latest server, credited
        # like a cached match there (`select`); marks every SESSION_TOKENS prompt tokens
        if type(implicit_sessions) is not bool:
            raise ValueError(f"implicit_sessions must be true or false, found {implicit_sessions!r}")
        self.implicit_sessions = implicit_sessions
        self._stride = max(1, self.SESSION_TOKENS // block_size)
        # a registered prefix is credited as cached: at the weight of the tokens it saves
        self._held_weight = self.uncached_weight if cost == "time" else self.prefill_weight
        self._sessions = PrefixPins(self._stride, max(2, max_conversations)) \
            if implicit_sessions else None
        self._cursor = 0
        self._cands: tuple | None = None
        # (view, its bulk `loads`, `phases`, and `lease_states()` answer; None where it has none)
        self._bulk: tuple | None = None
        # The native core gives float costs: it stands in for `_core` only where the Python
        # expression gives floats too (an int weight keeps int scores in the explanation).
        self._native = NATIVE and (cost == "time" or all(type(w) is float for w in (
            self.prefill_weight, self.load_tokens_weight, self.load_requests_weight,
            affinity_bonus)))

    @property
    def needs_block_keys(self) -> bool:
        return True

    def describe(self) -> dict:
        if self.cost == "time":
            weights = {"uncached_weight": self.uncached_weight, "decode_weight": self.decode_weight,
                       "prefill_tokens_per_s": self.prefill_tokens_per_s,
                       "decode_step_s": self.decode_step_s, "learn_rates": self.learn_rates,
                       "hotspot_slack_s": self.hotspot_slack_s}
        else:
            weights = {"prefill_weight": self.prefill_weight,
                       "load_tokens_weight": self.load_tokens_weight,
                       "load_requests_weight": self.load_requests_weight,
                       "hotspot_slack": self.hotspot_slack}
        return {"type": self.name, "cost": self.cost, **weights,
                "affinity_bonus": self.affinity_bonus, "affinity_slack": self.affinity_slack,
                "implicit_sessions": self.implicit_sessions,
                "hotspot_factor": self.hotspot_factor,
                "max_batch_size": self.max_batch_size,
                "load_cap": self.load_cap, "track_routed_blocks": self.track_routed_blocks,
                "speculative_ttl_s": self.speculative_ttl_s, "explain_rows": self.explain_rows}

    def remove_server(self, server: str) -> None:
        self._pins.remove_server(server)
        if self._sessions is not None:
            self._sessions.remove_server(server)
        self._scale.pop(server, None)
        self._cands = None

    # A report's actual/predicted moves the server's scale by this power of it (a geometric
    # moving average over ~1/_LEARN reports), each report's ratio clamped to [1/4, 4] and the
    # scale to [1/20, 20]; reports predicting less than _LEARN_MIN_S are left out (there the
    # fleet hop and step granularity, not the queue, make the time).
    _LEARN = 0.1
    _LEARN_MIN_S = 0.02

    def _learns(self, server: str, predicted_s: float | None) -> bool:
        """Whether a first-token report for a placement on ``server`` estimated at ``predicted_s``
        moves its scale: the one rule `observe_ttft` applies and `select` states in advance
        (`Decision.learn_s`)."""
        return server in self._learning and predicted_s is not None \
            and predicted_s >= self._LEARN_MIN_S

    def observe_ttft(self, server: str, predicted_s: float, actual_s: float) -> None:
        """The fleet reported a leg's first token ``actual_s`` after its placement, which had
        estimated ``predicted_s`` (the scale at the time included): the server's scale follows."""
        if not actual_s > 0 or not self._learns(server, predicted_s):
            return
        # clamped by comparisons, not min/max (two builtin calls each, on every report)
        r = actual_s / predicted_s
        if r > 4.0:
            r = 4.0
        elif r < 0.25:
            r = 0.25
        k = self._scale.get(server, 1.0) * r ** self._LEARN
        if k > 20.0:
            k = 20.0
        elif k < 0.05:
            k = 0.05
        self._scale[server] = k
        memo = self._cands
        if memo is not None:
            i = memo[7].get(server)     # its position among the candidates
            if i is not None:
                memo[6][i * PARAMS + PARAMS - 1] = k

    # an implicit session's granularity: a mark every this many prompt tokens (the conversation
    # policy's `tokens_per_block` default; router/prefix_pins.py)
    SESSION_TOKENS = 128

    # the default hot-spot slack, in idle decode steps (`_slack_of`)
    SLACK_STEPS = 2.0

    def _slack_of(self, params, n: int) -> float:
        """The time cost's hot-spot slack (seconds): ``hotspot_slack_s``, else ``SLACK_STEPS``
        idle decode steps (the candidates' mean ``decode_weight * k * s_step``). Relative to the
        mean alone, a server on a cluster mostly idle was hot with two or three requests decoding
        (twice an idle step): at 32 workers and light load that rule moved 4-8 next requests of a
        prefix tree off the server holding it per run, 9-19k cached tokens (2-core box)."""
        if self.hotspot_slack_s is not None:
            return self.hotspot_slack_s
        if not n:
            return 0.0
        idle = sum(params[i * PARAMS + 2] * params[i * PARAMS + PARAMS - 1] for i in range(n)) / n
        return self.SLACK_STEPS * self.decode_weight * idle

    def scale(self, server: str) -> float:
        """The server's learned scale of the time model (1.0: none learned)."""
        return self._scale.get(server, 1.0)

    def select(self, candidates, key, view) -> Decision:
        # Written for speed (it runs once per leg of every request over every candidate): the
        # numbers come from one native call (router/_kv_cost.c; `_core` where it does not apply).
        # The candidate list is the coordinator's cached one until membership changes: what
        # depends on it alone (healthy subset, server names, unknown-match servers) is kept.
        memo = self._cands
        if memo is not None and memo[0] == candidates:
            _, ok, unhealthy, servers, unknown, all_unknown, params, positions = memo
        else:
            ok, unhealthy = healthy_candidates(self.name, candidates)
            servers = [c.server for c in ok]
            unknown = [i for i, c in enumerate(ok) if c.kv_unknown]
            all_unknown = len(unknown) == len(ok)
            positions = {s: i for i, s in enumerate(servers)}
            # the model and learned scale of every candidate, as the native core reads them
            params = array("d")
            for c in ok:
                params.extend(model_of(c.info, self.prefill_tokens_per_s, self.decode_step_s))
                params.append(self._scale.get(c.server, 1.0))
            # `_learns`'s servers: learning on, the time cost, no published model
            self._learning = frozenset(c.server for c in ok if not publishes_model(c.info)) \
                if self.learn_rates and self.cost == "time" else frozenset()
            self._slack = self._slack_of(params, len(ok))
            self._cands = (list(candidates), ok, unhealthy, servers, unknown, all_unknown, params,
                           positions)
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
            states = getattr(view, "lease_states", None)
            bulk = self._bulk = (view, getattr(view, "loads", None), getattr(view, "phases", None),
                                 states() if states is not None else None)
        cap = num_tokens - 1 if num_tokens > 0 else 0
        # Every match unknown: reported 0, estimated as the mean of no verified one (0), so the
        # index walk would decide nothing (`_unknown_matches`).
        md = None if not nk or all_unknown else view.matched_blocks(keys)
        pin = servers.index(pinned) if pinned is not None and pinned in servers else -1
        bonus = self.affinity_bonus
        sessions = self._sessions
        implicit = False
        if sessions is not None and not conv and md is not None and nk >= self._stride:
            # Implicit session: the server of this prompt's deepest prefix placed before is
            # credited its registered prefix as if cached there (the index may have lost it:
            # evicted, or cut by the capacity model). The prefix tree then stays where its
            # requests went, as the `conversation` policy keeps it, unless load there outweighs
            # it in time. The affinity bonus is added only where that server holds more of the
            # prompt than every other one: a prefix cached everywhere (a shared system prompt)
            # pinned every new conversation to the server of the latest one using it (moves
            # 0.09 -> 0.18, TTFT p50 40 -> 118 ms on the conversation trace, 2-core box). Only
            # the cost sees it: `matched` (the prediction, the speculative insert) stays the
            # index's.
            implicit = True
            try:    # one native call: the server and its credit (router/_prefix_pins.c)
                pinned, bonus = sessions.credit(keys, md, self.block_size, cap, num_tokens,
                                                self._held_weight, bonus)
            except TypeError:   # `md` not a dict of ints: the same recipe in Python
                pinned, bonus = session_credit(sessions.find(keys), md, self.block_size, cap,
                                               num_tokens, self._held_weight, bonus)
            if pinned is not None:
                pin = positions.get(pinned, -1)
        hf = self.hotspot_factor or 0.0
        mbs = self.max_batch_size if self.max_batch_size and self.load_cap is not None else 0
        timed = self.cost == "time"
        # the Python recipe for int weights, unknown matches to estimate, and what the native
        # core does not take (a view answering a Mapping or numpy ints: TypeError)
        native = self._native and (md is None or not unknown)
        res = None
        states = bulk[3]
        if timed and native and states is not None:
            # the default path: the native core reads the lease table's map itself (no lists of
            # loads and phases built per placement) and answers the loads it read
            # and picks (the tied in turn) and estimates the pick's time to first token
            try:
                res = _native_time_core_table(
                    servers, md, states, positions, params, self.block_size, cap, num_tokens,
                    self.uncached_weight, self.decode_weight, pin, bonus, hf,
                    self._slack, mbs, self.load_cap if mbs else 0.0, self._div, self._cursor)
            except TypeError:
                pass
        if res is not None:
            matched, costs, tied, hs, lc, limit, loads, pick, predicted_s = res
            if len(tied) > 1:
                self._cursor += 1
        else:
            loads = bulk[1](servers) if bulk[1] is not None else server_loads(view, servers)
            if timed:
                ph = bulk[2]
                phases = ph(servers) if ph is not None else [(t, r, t) for r, t in loads]
                args = (servers, md, loads, phases, params, self.block_size, cap, num_tokens,
                        self.uncached_weight, self.decode_weight, pin, bonus, hf,
                        self._slack, mbs, self.load_cap if mbs else 0.0, self._div)
                core, python = _native_time_core, _time_core
            else:
                args = (servers, md, loads, self.block_size, cap, num_tokens,
                        self.prefill_weight, self.load_tokens_weight, self.load_requests_weight,
                        pin, bonus, hf, self.hotspot_slack, mbs,
                        self.load_cap if mbs else 0.0)
                core, python = _native_core, _core
            if native:
                try:
                    res = core(*args)
                except TypeError:
                    pass
            matched, costs, tied, hs, lc, limit = res or python(*args, unknown)
            if len(tied) > 1:
                pick = tied[self._cursor % len(tied)]
                self._cursor += 1
            else:
                pick = tied[0]
            predicted_s = _predicted_s(pick, phases, loads, params, num_tokens, matched,
                                       self.decode_weight) if timed else 0.0
        if hs or lc:
            # the time cost's reason is the same for every hot server: formatted once
            hot = dict.fromkeys(hs, f"hot: decode step > cap {limit * 1e3:.1f} ms") if timed \
                else {i: f"hot: {loads[i][0]} in-flight requests > cap {limit:.1f}" for i in hs}
            for i in lc:
                hot[i] = (f"hot: {loads[i][0]}/{mbs} requests >= load_cap {self.load_cap}"
                          if mbs and loads[i][0] / mbs >= self.load_cap else
                          f"hot: KV full ({_held(bulk[3], servers[i], loads[i])} held KV tokens + "
                          f"this prompt's "
                          f"{num_tokens - matched[i]} uncached > capacity "
                          f"{int(params[i * PARAMS + 5])})")
            skip_hot = len(hot) != n
        else:
            hot, skip_hot = _NO_HOT, False
        server = servers[pick]
        if conv:
            self._pins.put(conv, server)
        elif implicit:
            sessions.put(server)
        # The explanation is built from these numbers when it is read (`explain`): the fleet
        # channel carries them and its client builds it (protocol/channel.py `KvChoice`).
        choice = KvChoice(servers, matched, loads, costs, pick, tied if len(tied) > 1 else _NONE,
                          list(hot.items()) if hot else _NONE, skip_hot, unknown, unhealthy,
                          num_tokens, conv, pinned, self.explain_rows)
        # with the time cost, the chosen server's estimated time to first token (what its
        # first-token report is compared with: observe_ttft) and the tokens it must compute.
        # The estimate observe_ttft compares the leg's first-token report with (`learn_s`) is
        # 0.0 where it would not learn from it (its tests known at placement: learning on, the
        # estimate long enough, a server without a published model), so the coordinator skips
        # that report's call (~2k instructions each; every report on servers that publish their
        # model; the rule is `_learns`, which observe_ttft applies: here inline, as its call and
        # body were ~7% of the policy's bytecodes per placement; predicted_s is a float here).
        learn_s = predicted_s if server in self._learning and predicted_s >= self._LEARN_MIN_S \
            else 0.0
        return Decision(server, None, None if unknown and ok[pick].kv_unknown
                        else md.get(server, 0) if md is not None else 0, choice, explain,
                        predicted_s, num_tokens - matched[pick] if timed else None, learn_s)


def _held(states: dict | None, server: str, load: tuple) -> int:
    """The held KV tokens the KV-full rule read for ``server`` (a KV-full explanation's): its
    lease state's (router/leases.py), else its in-flight prompt tokens (``load[1]``)."""
    st = states.get(server) if states is not None else None
    return st[4] if st is not None and len(st) == 5 else load[1]


def _predicted_s(pick: int, phases: list, loads: list, params, num_tokens: int, matched: list,
                 dw: float) -> float:
    """Server ``pick``'s estimated time to first token: `_time_core`'s cost with
    ``uncached_weight`` 1 and no affinity bonus (router/_kv_cost.c `time_core_table` computes the
    same, operation for operation)."""
    ph = phases[pick]
    q, npf, tpf = ph[0], ph[1], ph[2]
    r, t = loads[pick]
    b = pick * PARAMS
    w = q + num_tokens - matched[pick]
    step = dw * (params[b + 2] + params[b + 3] * (r - npf) + params[b + 4] * (t - tpf)) \
        if r > npf else 0.0
    steps = w / params[b + 1]
    return params[b + 6] * (w * params[b] + (steps if steps > 1.0 else 1.0) * step)


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
    # a pin without a conversation id is an implicit session's (router/prefix_pins.py)
    affinity = "conversation affinity" if c.conversation else "implicit session affinity"
    for i in shown:
        if i == pick:
            w = ("chosen: lowest cost (tie, in turn)" if tie else "chosen: lowest cost") + (
                f", {affinity} bonus" if server == pinned else "")
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
        reason += f", {affinity}"
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
    matched, est = _matches(servers, md, block_size, cap, unknown)
    costs = [pw * (num_tokens - mt) + tw * tok + rw * req for mt, (req, tok) in zip(est, loads)]
    if pin >= 0:
        costs[pin] -= bonus * num_tokens
    reqs = [l[0] for l in loads]
    return (matched, costs) + _decide(costs, reqs, reqs, hf, slack, mbs, lcap)


def _matches(servers: list, md: dict | None, block_size: int, cap: int,
             unknown: list | None) -> tuple[list, list]:
    """``(matched, estimated)`` tokens per server, both cores' first step: the walk's blocks times
    the block size, capped at ``cap``; servers in ``unknown`` estimated by ``_unknown_matches``."""
    if md is None:
        matched = [0] * len(servers)
        return matched, matched
    mget = md.get
    matched = [mt if (mt := mget(s, 0) * block_size) < cap else cap for s in servers]
    if unknown:
        return _unknown_matches(matched, unknown)
    return matched, matched


def _time_core(servers: list, md: dict | None, loads: list, phases: list, params,
               block_size: int, cap: int, num_tokens: int, uw, dw, pin: int, bonus, hf, slack,
               mbs: int, lcap, div=1.0, unknown: list | None = None):
    """The numbers of a time-cost decision, ``(matched, costs, tied, hotspot, load_capped,
    limit)`` (router/_kv_cost.c `time_core` computes the same ones, operation for operation):

    - ``matched``: as in ``_core``;
    - ``costs`` (seconds): ``k * ((q + uw * p) * a + max(1, (q + p) / chunk) * step)`` with ``p`` this
      prompt's uncached tokens on the server, ``(q, in prefill, their tokens) = phases[i]``,
      ``(a, chunk, s0, s1, s2, kv capacity, k)`` the server's ``PARAMS`` doubles in ``params``
      (``model_of`` and its learned scale) and ``step = dw * (s0 + s1 * d + s2 * c)`` for its
      ``d`` decoding leases and their ``c`` prompt tokens (0.0 when ``d`` is 0); less ``bonus *
      num_tokens * (a * k)`` at index ``pin`` (-1: none), and there, where ``bonus`` is positive
      and the cost still is, divided by ``div`` (1 + ``affinity_slack``: the session's server
      kept while its cost is at most ``div`` times another's);
    - ``hotspot``: indices whose decode step ``k * dw * (s0 + s1 * d + s2 * c)`` (what a step
      there costs now: its decoding requests' time per output token, ``s0`` on an idle server)
      exceeds ``limit = hf * mean + slack`` (``hf`` 0: off);
      ``load_capped``: as in ``_core``, and the others whose held KV tokens plus this prompt's
      uncached tokens ``p`` exceed their KV capacity (0: unknown): the KV-full rule, held being
      a phase's fourth item (the distinct tokens its in-flight prompts hold, a prefix shared
      between them once: router/leases.py `_kv`), its in-flight prompt tokens where a phase has
      three; ``tied`` as in ``_core``. Queued prefill needs no hot rule: the cost already
      charges it in the same seconds.
    """
    matched, est = _matches(servers, md, block_size, cap, unknown)
    costs = []
    waits = []
    full = []
    for i, (mt, (req, tok), ph) in enumerate(zip(est, loads, phases)):
        q, npf, tpf = ph[0], ph[1], ph[2]
        held = ph[3] if len(ph) == 4 else tok
        a, chunk, s0, s1, s2, kvcap, k = params[i * PARAMS:(i + 1) * PARAMS]
        p = num_tokens - mt
        d = req - npf
        x = dw * (s0 + s1 * d + s2 * (tok - tpf))
        step = x if d > 0 else 0.0
        steps = (q + p) / chunk
        costs.append(k * ((q + uw * p) * a + (steps if steps > 1.0 else 1.0) * step))
        waits.append(k * x)
        full.append(kvcap > 0.0 and held + p > kvcap)
    if pin >= 0:
        c = costs[pin] - bonus * num_tokens * (params[pin * PARAMS] * params[pin * PARAMS + PARAMS - 1])
        costs[pin] = c / div if bonus > 0.0 and c > 0.0 else c
    return (matched, costs) + _decide(costs, waits, [l[0] for l in loads], hf, slack, mbs, lcap,
                                      full)


def _decide(costs: list, hl: list, reqs: list, hf, slack, mbs: int, lcap,
            full: list | None = None) -> tuple:
    """``(tied, hotspot, load_capped, limit)`` from the costs, each server's hot-spot load ``hl``
    and in-flight requests (the end of both cores; router/_kv_cost.c `decide`); ``full``: the
    servers whose KV is full, capped like ``load_cap``'s."""
    n = len(costs)
    hs: list = []
    lc: list = []
    limit = 0.0
    hot: set = set()
    if hf:
        total = 0.0
        for h in hl:
            total += h
        limit = hf * total / n + slack
        if max(hl) > limit:
            hs = [i for i, h in enumerate(hl) if h > limit]
            hot.update(hs)
    if mbs or (full and True in full):
        lc = [i for i, r in enumerate(reqs) if i not in hot and (
            (full is not None and full[i]) or (mbs and r / mbs >= lcap))]
        hot.update(lc)
    skip = hot if hot and len(hot) != n else ()      # every server hot: none is skipped
    best = min([c for i, c in enumerate(costs) if i not in skip])
    tol = best + 1e-9 * (abs(best) if abs(best) > 1.0 else 1.0)
    tied = [i for i, c in enumerate(costs) if c <= tol and i not in skip]
    return tied, hs, lc, limit


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
