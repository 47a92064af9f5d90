"""The fleet channel carries a ``kv_cache_aware`` decision as the numbers it was made from
(protocol/channel.py ``KvChoice``) and its client rebuilds the explanation with the same function
the HTTP API uses (router/policy_kv.py ``explain``): for every kind of row and reason, the record
rebuilt after the channel's own encoding is the one the coordinator would have answered, types
included (``score`` stays an int when the weights are ints)."""

from __future__ import annotations

import itertools
import json

import msgspec
import numpy as np
import pytest

from coordinator.channel_client import _expanded
from protocol import channel as cw
from router.block_keys import block_keys_list
from router.events import BlocksStored
from router.kv_index import KvIndex
from router.leases import LeaseTable
from router.policies import Candidate, IndexLoadView, RoutingKey, make_policy
from router.policy_kv import ROW_KEYS, explain

B = 16
_ids = itertools.count(1)


def _prompt(seed: int, n: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


def _key(tokens, conv=None) -> RoutingKey:
    return RoutingKey(np.array(block_keys_list(tokens, B), dtype=np.uint64), len(tokens), conv)


def _cluster(n: int):
    idx, leases = KvIndex(B), LeaseTable()
    return [f"http://s{i}" for i in range(n)], idx, leases, IndexLoadView(idx, leases)


def _cache(idx, server, tokens):
    n = len(tokens) // B
    idx.apply(server, BlocksStored(block_keys_list(tokens, B), None, tokens[:n * B], B))


def _load(leases, server, n, tokens=0):
    for _ in range(n):
        leases.acquire("context", next(_ids), server, 0.0, 60.0, tokens)


def _over_the_channel(d) -> dict:
    """The leg as the channel client hands it on: encoded by the channel's encoder, decoded, expanded."""
    leg = {"server": d.server, "req_id": 1, "info": {"kv": d.choice, "lease_ttl_s": 30.0}}
    wire = cw.decode_replies(cw.frame(cw.Replies(1, [cw.Result(1, cw.OK, leg)]))[4:]).results[0].body
    return _expanded(wire)["info"]


def _states():
    t = _prompt(1)
    # prefixes of different lengths, loads, an unhealthy candidate
    servers, idx, leases, view = _cluster(3)
    _cache(idx, servers[1], t[:384])
    _cache(idx, servers[2], t[:128])
    _load(leases, servers[2], 2, 100)
    yield "prefixes", make_policy("kv_cache_aware", {}), \
        [Candidate(s) for s in servers] + [Candidate("http://down", healthy=False)], _key(t), view
    # a tie, broken in turn
    servers, idx, leases, view = _cluster(2)
    yield "tie", make_policy("kv_cache_aware", {}), [Candidate(s) for s in servers], _key(t), view
    # a hot server skipped, integer weights (scores stay ints)
    servers, idx, leases, view = _cluster(3)
    _cache(idx, servers[0], t)
    _load(leases, servers[0], 9)
    yield "hot", make_policy("kv_cache_aware", {"prefill_weight": 1, "load_tokens_weight": 0,
                                               "load_requests_weight": 0}), \
        [Candidate(s) for s in servers], _key(t), view
    # every candidate hot (the cap ignored)
    servers, idx, leases, view = _cluster(3)
    for s in servers:
        _load(leases, s, 3)
    yield "all hot", make_policy("kv_cache_aware", {"max_batch_size": 4, "load_cap": 0.5,
                                                   "hotspot_factor": None}), \
        [Candidate(s) for s in servers], _key(t), view
    # a server whose cache match is unknown (kv_mismatch)
    servers, idx, leases, view = _cluster(3)
    _cache(idx, servers[1], t[:256])
    yield "unknown", make_policy("kv_cache_aware", {}), \
        [Candidate(servers[0], kv_unknown=True), Candidate(servers[1]), Candidate(servers[2])], _key(t), view
    # more candidates than explanation rows, and a conversation pinned to its server
    servers, idx, leases, view = _cluster(12)
    for i, s in enumerate(servers):
        _cache(idx, s, t[:16 * i])
    p = make_policy("kv_cache_aware", {"explain_rows": 4})
    p.select([Candidate(s) for s in servers], _key(t, "conv-1"), view)
    yield "pinned, 12 servers", p, [Candidate(s) for s in servers], _key(t, "conv-1"), view
    # no routing key at all
    servers, idx, leases, view = _cluster(2)
    yield "no key", make_policy("kv_cache_aware", {}), [Candidate(s) for s in servers], None, view


@pytest.mark.parametrize("state", list(_states()), ids=lambda s: s[0])
def test_the_rebuilt_explanation_is_the_http_apis(state):
    _, policy, cands, key, view = state
    d = policy.select(cands, key, view)
    assert isinstance(d.choice, cw.KvChoice)
    http = dict(d.explanation, lease_ttl_s=30.0)
    assert http["chosen"] == d.server and http["policy"] == "kv_cache_aware"
    text = json.dumps(http)
    # each state shows what it is there for
    assert {"prefixes": '"why": "unhealthy"', "tie": "tie, in turn", "hot": '"why": "hot: 9',
            "all hot": "every candidate hot", "unknown": "kv_mismatch",
            "pinned, 12 servers": "conversation affinity", "no key": '"num_tokens": 0'}[state[0]] in text
    if state[0] == "hot":
        assert all(type(r["score"]) is int for r in http["candidates"])
    if state[0] == "pinned, 12 servers":
        assert len(http["candidates"]) == 4 and http["candidates_total"] == 12
    got = _over_the_channel(d)
    assert got == http
    assert json.dumps(got) == json.dumps(http)      # same types and key order
    assert explain(d.choice) == d.explanation       # built again from the same numbers
    # the row keys the fleet's route header relies on (router/policy_kv.py ROW_KEYS)
    assert all(tuple(r) == ROW_KEYS for r in http["candidates"] if r["why"] != "unhealthy")


def test_numbers_that_do_not_fit_the_schema_are_a_bad_answer():
    from protocol.failures import BadAnswer
    with pytest.raises(BadAnswer, match="KvChoice"):
        _expanded({"server": "http://a", "req_id": 1, "info": {"kv": ["http://a"], "lease_ttl_s": 1.0}})
    # a leg without numbers (another policy's explanation) passes through unchanged
    leg = {"server": "http://a", "req_id": 1, "info": {"policy": "round_robin", "lease_ttl_s": 1.0}}
    assert _expanded(dict(leg)) == leg
    assert msgspec.convert(msgspec.to_builtins(cw.KvChoice(["http://a"], [0], [(0, 0)], [1.0], 0)),
                           cw.KvChoice).servers == ["http://a"]
