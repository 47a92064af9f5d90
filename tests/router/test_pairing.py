"""The pairing rules (router/pairing.py) on their own: conditional disaggregation, the
context-fallback rule, the mode once the legs are placed, the policy traits, and `pair` over leg
placers that place from a list. That the coordinator and a fleet process reach the same decisions
through it: tests/fleet/test_pairing_agreement.py."""
from __future__ import annotations

import pytest

from protocol.failures import NoServerAvailable
from protocol.roles import Mode
from router.pairing import (POLICY_TYPES, NoContextServer, PairRules, PolicyKind, pair, settle)
from router.policies import make_policy
from router.policy_load import LoadBalancingPolicy, RoundRobinPolicy


def test_policy_traits_are_one_table():
    assert POLICY_TYPES == ("round_robin", "load_balancing", "kv_cache_aware", "conversation")
    assert [k for k in PolicyKind if k.delegated] == [PolicyKind.LOAD_BALANCING,
                                                      PolicyKind.KV_CACHE_AWARE, PolicyKind.CONVERSATION]
    assert [k for k in PolicyKind if k.keyed] == [PolicyKind.KV_CACHE_AWARE, PolicyKind.CONVERSATION]
    assert PolicyKind("round_robin") == "round_robin" and str(PolicyKind.CONVERSATION) == "conversation"
    for t in POLICY_TYPES:      # every type of the table is a policy the router builds
        assert make_policy(t).name == t


def test_conditional_disaggregation():
    rules = PairRules(max_local_prefill_length=16)
    # 100 prompt tokens, 90 cached on the generation server: 10 left to prefill there
    assert rules.local_prefill(100, 90) == ("generation server caches 90 of 100 tokens; "
                                            "10 <= max_local_prefill_length 16")
    assert rules.local_prefill(100, 84) == ("generation server caches 84 of 100 tokens; "
                                            "16 <= max_local_prefill_length 16")
    assert rules.local_prefill(100, 83) is None
    # nothing cached never skips the context leg, however short the prompt; no prompt length known
    assert PairRules(max_local_prefill_length=1000).local_prefill(100, 0) is None
    assert rules.local_prefill(None, 50) is None and rules.local_prefill(0, 50) is None
    assert PairRules().local_prefill(100, 100) is None            # not configured


def test_context_fallback_rule():
    aggregate, reject = PairRules(), PairRules(no_context_fallback="reject")
    assert not aggregate.rejects and reject.rejects
    why = NoServerAvailable("no healthy context server")
    assert aggregate.without_context(why) == "no healthy context server; serving on the generation server alone"
    with pytest.raises(NoContextServer, match="no healthy context server") as e:
        reject.without_context(why)
    assert isinstance(e.value, NoServerAvailable)      # a 503 wherever a placement failure is
    # after a context leg that reached no server: aggregate only once no context server is usable
    assert aggregate.aggregates_after_context_loss(0)
    assert not aggregate.aggregates_after_context_loss(1)
    assert not reject.aggregates_after_context_loss(0)


def test_settle_mode_once_placed():
    for mode in (Mode.DISAGGREGATED, Mode.LOCAL_PREFILL, Mode.AGGREGATE_FALLBACK, Mode.AGGREGATED):
        has_ctx = mode == Mode.DISAGGREGATED
        assert settle(mode, has_ctx, True) == (mode, has_ctx)
    # the generation server cannot receive KV (a 501 before, or another engine family)
    assert settle(Mode.DISAGGREGATED, True, False) == (Mode.NO_KV_TRANSFER, False)
    assert settle(Mode.LOCAL_PREFILL, False, False) == (Mode.LOCAL_PREFILL, False)


class _Legs:
    """Leg placers over two server lists (round robin), recording what was placed and released."""

    def __init__(self, ctx: list[str], gen: list[str], matched: int = 0):
        self.servers = {"context": ctx, "generation": gen}
        self.rr = {r: RoundRobinPolicy() for r in self.servers}
        self.matched = matched
        self.released: list[str] = []
        self.calls: list[str] = []

    def place(self, role: str):
        def one() -> str:
            self.calls.append(role)
            s = self.servers[role]
            if not s:
                raise NoServerAvailable(f"no healthy {role} server")
            return s[self.rr[role].pick(len(s))]
        return one


def _pair(rules: PairRules, legs: _Legs, num_tokens: int = 100):
    return pair(rules, num_tokens, legs.place("generation"), lambda g: legs.matched,
                legs.place("context"), legs.released.append)


def test_pair_modes():
    legs = _Legs(["c0", "c1"], ["g0"])
    assert _pair(PairRules(max_local_prefill_length=16), legs) == ("c0", "g0", Mode.DISAGGREGATED, None)
    assert legs.calls == ["generation", "context"]          # the generation leg first
    legs.matched = 90
    ctx, gen, mode, reason = _pair(PairRules(max_local_prefill_length=16), legs)
    assert (ctx, gen, mode) == (None, "g0", Mode.LOCAL_PREFILL) and "90 of 100" in reason
    assert legs.calls[2:] == ["generation"]                 # no context leg placed at all
    # conditional disaggregation off
    assert _pair(PairRules(), legs) == ("c1", "g0", Mode.DISAGGREGATED, None)


def test_pair_without_context_servers():
    legs = _Legs([], ["g0", "g1"])
    assert _pair(PairRules(), legs) == (None, "g0", Mode.AGGREGATE_FALLBACK, "no healthy context "
                                        "server; serving on the generation server alone")
    with pytest.raises(NoContextServer):
        _pair(PairRules(no_context_fallback="reject"), legs)
    assert legs.released == ["g1"]                          # the generation placement undone
    with pytest.raises(NoServerAvailable, match="generation") as e:
        _pair(PairRules(), _Legs(["c0"], []))
    assert not isinstance(e.value, NoContextServer)


def test_turns_are_the_policies_own():
    rr = RoundRobinPolicy(start=5)
    assert [rr.pick(3) for _ in range(4)] == [2, 0, 1, 2]
    lb = LoadBalancingPolicy()
    assert [lb.pick([1, 0, 0]) for _ in range(3)] == [1, 2, 1]      # least, ties in turn
    assert lb.pick([3, 2, 4]) == 1
    p2c = LoadBalancingPolicy(power_of_two_choices=True, seed=7)
    picks = [p2c.pick([0, 1, 2, 3]) for _ in range(50)]
    assert 3 not in picks and 0 in picks       # the more loaded of each sampled pair never wins
