"""router/_kv_cost.c, the native numeric core of kv_cache_aware placement, against its Python
recipe (router/policy_kv.py `_core`): the same matched tokens, the same costs to the bit, the
same ties and hot servers on random inputs; and whole decisions of `KvCacheAwarePolicy` over a real
KvIndex + LeaseTable identical with the native core and without it, including where it must not
run (int weights, servers of unknown match) and where it cannot (a view answering numpy ints)."""

from __future__ import annotations

import os
import random
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.policy_kv as pk
from router.block_keys import block_keys_list
from router.events import BlocksStored
from router.kv_index import KvIndex
from router.leases import LeaseTable
from router.policies import Candidate, IndexLoadView, KvCacheAwarePolicy, RoutingKey

# CI installs with a C compiler: there a build that silently fell back to Python is a failure
if os.environ.get("CI"):
    import router._kv_cost as native
else:
    native = pytest.importorskip("router._kv_cost")

B = 16


def test_native_core_is_what_the_policy_uses():
    assert pk.NATIVE and pk._native_core is native.core and pk._native_time_core is native.time_core
    assert pk._native_time_core_table is native.time_core_table
    assert KvCacheAwarePolicy(B)._native and KvCacheAwarePolicy(B).cost == "time"
    # int weights keep int scores in the explanation: the Python recipe runs for them
    assert not KvCacheAwarePolicy(B, prefill_weight=1)._native
    assert KvCacheAwarePolicy(B, prefill_weight=1.0).cost == "tokens"


def _bits(xs):
    return [x.hex() if isinstance(x, float) else x for x in xs]


_weight = st.floats(0.0, 1e4, allow_nan=False) | st.sampled_from([0.0, 1.0, 32.0, 0.25, 1e-9])


@st.composite
def core_args(draw):
    n = draw(st.integers(1, 40))
    servers = [f"http://s{i}" for i in range(n)]
    bs = draw(st.sampled_from([1, 16, 32, 64]))
    num_tokens = draw(st.integers(0, 20_000))
    cap = num_tokens - 1 if num_tokens > 0 else 0
    md = draw(st.none() | st.dictionaries(st.sampled_from(servers + ["http://gone"]),
                                          st.integers(0, num_tokens // bs + 2)))
    # few distinct loads, so ties and hot servers are common
    req = st.integers(0, 6) | st.integers(0, 500)
    loads = [(draw(req), draw(st.integers(0, 200_000))) for _ in range(n)]
    pin = draw(st.integers(-1, n - 1))
    hf = draw(st.sampled_from([0.0, 2.0, 1.0]) | st.floats(0.01, 10))
    slack = draw(st.sampled_from([2.0, 0.0]) | st.floats(0, 50))
    mbs = draw(st.sampled_from([0, 1, 8, 256]))
    lcap = draw(st.sampled_from([0.0, 0.5, 1.0, 0.9]))
    return (servers, md, loads, bs, cap, num_tokens, draw(_weight), draw(_weight), draw(_weight),
            pin, draw(_weight), hf, slack, mbs, lcap)


@settings(max_examples=500, deadline=None)
@given(core_args())
def test_native_core_matches_the_python_recipe(args):
    m1, c1, t1, hs1, lc1, lim1 = native.core(*args)
    m2, c2, t2, hs2, lc2, lim2 = pk._core(*args)
    assert m1 == m2 and all(type(x) is int for x in m1)
    assert _bits(c1) == _bits(c2)
    assert (t1, hs1, lc1) == (t2, hs2, lc2)
    assert lim1.hex() == float(lim2).hex()


# Built once: a strategy made inside the draw loop is built and validated again for every server
# of every example, which was most of this test's time.
_secs = st.sampled_from([0.0, 5e-5, 0.01, 1e-6]) | st.floats(0, 1.0)
_per_token = st.sampled_from([5e-5, 3.2e-4]) | st.floats(1e-7, 1e-2)
_chunk = st.sampled_from([512, 8192]) | st.integers(1, 100_000)
_kv_cap = st.sampled_from([0, 20_000]) | st.integers(1, 300_000)
_scale = st.sampled_from([1.0, 0.5]) | st.floats(0.05, 20)
_slack = st.sampled_from([0.05, 0.0]) | st.floats(0, 5)
# 1 + affinity_slack: the session's server's cost divided by it (where credited and positive)
_div = st.sampled_from([1.0, 1.5, 2.0]) | st.floats(1.0, 10.0)


@st.composite
def time_core_args(draw):
    base = draw(core_args())
    servers, md, loads, bs, cap, num_tokens = base[:6]
    n = len(servers)
    phases = []
    for req, tok in loads:
        npf = draw(st.integers(0, req))
        tpf = draw(st.integers(0, tok))
        ph = (draw(st.integers(0, tpf) | st.just(0)), npf, tpf)
        # the held KV tokens (a lease table's phase), or none (the KV-full rule reads tok)
        held = draw(st.none() | st.integers(0, tok) | st.integers(0, 300_000))
        phases.append(ph if held is None else ph + (held,))
    secs = _secs
    models = [(draw(_per_token),
               float(draw(_chunk)),
               draw(secs), draw(secs), draw(secs),
               float(draw(_kv_cap)))
              for _ in range(n)]
    params = array("d")
    for m in models:
        params.extend(m)
        params.append(draw(_scale))
    hf, slack = base[11], draw(_slack)
    return (servers, md, loads, phases, params, bs, cap, num_tokens, draw(_weight),
            draw(_weight), base[9], draw(_weight), hf, slack, base[13], base[14], draw(_div))


# 200, not the token core's 500: each example draws ~650 values (a time model per server), and
# drawing them was ~20 s of a 2-core CI suite run. What both cores share (the matched tokens and the
# decision: match_of and decide in router/_kv_cost.c, `_matches` in Python) gets its 500 above,
# from the same core_args this strategy starts with.
@settings(max_examples=200, deadline=None)
@given(time_core_args())
def test_native_time_core_matches_the_python_recipe(args):
    m1, c1, t1, hs1, lc1, lim1 = native.time_core(*args)
    m2, c2, t2, hs2, lc2, lim2 = pk._time_core(*args)
    assert m1 == m2 and all(type(x) is int for x in m1)
    assert _bits(c1) == _bits(c2)
    assert (t1, hs1, lc1) == (t2, hs2, lc2)
    assert lim1.hex() == float(lim2).hex()


def _table_args(args, rnd, shuffle=False):
    """time_core's arguments as time_core_table's: the loads and phases as a lease table's map
    (a server with no lease absent, or present with zeros), positions of the servers."""
    servers, md, loads, phases = args[:4]
    states = {}
    for s, ld, ph in zip(servers, loads, phases):
        if ld != (0, 0) or any(ph) or rnd.random() < 0.5:
            states[s] = (ld, *ph)
    states["http://gone"] = ((3, 300), 300, 3, 300)   # servers that are not candidates: not read
    positions = {s: i for i, s in enumerate(servers)}
    if shuffle:
        positions = dict(rnd.sample(list(positions.items()), len(positions)))
    return (servers, md, states, positions, *args[4:], rnd.randrange(0, 1 << 40))


@settings(max_examples=300, deadline=None)
@given(time_core_args(), st.randoms(use_true_random=False), st.booleans())
def test_native_time_core_table_reads_the_lease_tables_map_as_the_lists(args, rnd, shuffle):
    """Loads and phases given as the lease table's own map (server -> ((requests, tokens),
    queued, in prefill, their tokens)), matches found through the servers' positions: the same
    answer as with the lists, plus the loads it read, the pick (the tied in turn by the cursor)
    and its estimated time to first token, to the bit of the Python recipe's."""
    targs = _table_args(args, rnd, shuffle)
    got = native.time_core_table(*targs)
    want = native.time_core(*args)
    assert len(got) == 9 and got[6] == args[2]
    assert _bits(got[1]) == _bits(want[1]) and got[:1] + got[2:6] == want[:1] + want[2:]
    tied, cursor = got[2], targs[-1]
    pick = tied[cursor % len(tied)] if len(tied) > 1 else tied[0]
    assert got[7] == pick
    est = pk._predicted_s(pick, args[3], args[2], args[4], args[7], got[0], args[9])
    assert got[8].hex() == float(est).hex()


def test_many_servers_and_wide_ints_match_the_python_recipe():
    """More candidates than the native core keeps on its stack (64), and ints of more than one
    30-bit digit (its in-place read covers one): the same answers."""
    rng = np.random.default_rng(7)
    n = 150
    servers = [f"http://s{i}" for i in range(n)]
    big = 1 << 40
    loads = [(int(rng.integers(0, 9)), int(rng.integers(0, 3)) * big + int(rng.integers(0, 9000)))
             for _ in range(n)]
    phases = [(min(t, 4000), min(r, 1), t // 2) for r, t in loads]
    md = {s: int(rng.integers(0, 300)) for s in servers[::3]}
    params = array("d")
    for i in range(n):
        params.extend((5e-5, 8192.0, 0.01, 1e-4, 1e-9, float(big) * (i % 3), 1.0 + i % 5))
    args = (servers, md, loads, phases, params, 16, 4095, 4096, 2.0, 1.0, 7, 0.25, 2.0, 0.0,
            0, 0.0, 1.5)
    got, want = native.time_core(*args), pk._time_core(*args)
    assert _bits(got[1]) == _bits(want[1]) and got[:1] + got[2:] == want[:1] + want[2:]
    table = native.time_core_table(*_table_args(args, random.Random(3)))
    assert table[:6] == got and table[6] == loads
    assert table[8] == pk._predicted_s(table[7], phases, loads, params, 4096, got[0], 1.0)
    targs = (servers, md, loads, 16, 4095, 4096, 1.0, 1.0, 32.0, 7, 0.25, 2.0, 2.0, 8, 0.5)
    assert native.core(*targs) == pk._core(*targs)


def test_native_time_core_table_arguments_are_checked():
    params = array("d", [1e-4, 512.0, 0.01, 0.0, 0.0, 0.0, 1.0])
    rest = (params, 16, 0, 0, 2.0, 1.0, -1, 0.0, 2.0, 0.0, 0, 0.0, 1.5)
    ans = native.time_core_table(["a"], None, {}, {"a": 0}, *rest, 0)
    assert ans[2] == [0] and ans[6] == [(0, 0)] and ans[7] == 0
    with pytest.raises(ValueError, match="affinity_div must be >= 1"):
        native.time_core_table(["a"], None, {}, {"a": 0}, *rest[:-1], 0.5, 0)
    rest = (*rest, 0)
    with pytest.raises(TypeError, match="18 arguments"):
        native.time_core_table(["a"], None, {}, {"a": 0}, *rest[:-1])
    with pytest.raises(ValueError, match="cursor"):
        native.time_core_table(["a"], None, {}, {"a": 0}, *rest[:-1], -1)
    with pytest.raises(TypeError, match="dicts"):
        native.time_core_table(["a"], None, [((0, 0), 0, 0, 0)], {"a": 0}, *rest)
    with pytest.raises(ValueError, match="one position per server"):
        native.time_core_table(["a"], None, {}, {"a": 0, "b": 1}, *rest)
    with pytest.raises(ValueError, match="position must be in"):
        native.time_core_table(["a"], {"a": 1}, {}, {"a": 5}, *rest)
    with pytest.raises(TypeError, match="lease state"):
        native.time_core_table(["a"], None, {"a": ((1, 2), 3)}, {"a": 0}, *rest)
    with pytest.raises(TypeError, match="pair"):
        native.time_core_table(["a"], None, {"a": ((1, 2, 3), 0, 0, 0)}, {"a": 0}, *rest)


def test_time_cost_prefers_queued_prefill_over_decoding_load():
    """Two servers with the same prefix cached; one has a long prefill queue, the other many
    decoding requests with more tokens in flight: the time cost sends the request to the
    decoding one (the tokens cost, blind to the phase, sends it to the queue)."""
    servers = ["q", "d"]
    md = {"q": 40, "d": 40}              # 640 of 700 tokens cached on both
    loads = [(2, 4000), (6, 12000)]
    phases = [(4000, 2, 4000), (0, 0, 0)]
    model = (5e-5, 8192.0, 0.01, 1e-4, 1e-7, 0.0, 1.0)
    args = (servers, md, loads, phases, array("d", model * 2), 16, 699, 700, 1.0, 1.0, -1,
            0.25, 2.0, 0.05, 0, 0.0, 1.5)
    _, costs, tied, *_ = native.time_core(*args)
    assert tied == [1] and costs[0] > costs[1]
    assert pk._core(servers, md, loads, 16, 699, 700, 1.0, 1.0, 32.0, -1, 0.25, 2.0, 2.0, 0,
                    0.0)[2] == [0]


def test_a_server_whose_kv_is_full_is_skipped():
    """KV capacity (tokens): a server whose in-flight prompts plus this prompt's uncached tokens
    exceed it would make the prompt wait for memory, whatever its cache match: passed over unless
    all are full. The matched tokens need no new memory there: 9,940 in flight + 60 uncached fit
    10,000."""
    servers = ["full", "free"]
    md = {"full": 40}
    fits = [(3, 9940), (3, 9940)]
    full = (5e-5, 8192.0, 0.01, 1e-4, 1e-7, 10_000.0, 1.0)
    free = (5e-5, 8192.0, 0.01, 1e-4, 1e-7, 20_000.0, 1.0)
    args = (servers, md, fits, [(0, 0, 0)] * 2, array("d", full + free), 16, 699, 700, 2.0, 1.0,
            -1, 0.25, 2.0, 0.0, 0, 0.0, 1.5)
    for core in (native.time_core, pk._time_core):
        assert core(*args)[2] == [0]
    loads = [(3, 9950), (3, 9950)]
    phases = [(0, 0, 0), (0, 0, 0)]
    args = (servers, md, loads, phases, array("d", full + free), 16, 699, 700, 2.0, 1.0, -1, 0.25,
            2.0, 0.0, 0, 0.0, 1.5)
    for core in (native.time_core, pk._time_core):
        _, costs, tied, hs, lc, _ = core(*args)
        assert costs[0] < costs[1] and lc == [0] and tied == [1]
    both_full = (servers, md, loads, phases, array("d", full * 2), *args[5:])
    assert native.time_core(*both_full)[2] == [0] == pk._time_core(*both_full)[2]


def test_the_kv_full_rule_reads_the_held_tokens_not_the_whole_prompts():
    """A prefix tree's home with three siblings in flight (30,000 prompt tokens, a 9,000-token
    prefix shared): its held KV tokens (the lease table's phase and state item, the prefix once:
    12,000) and this prompt's 100 uncached fit its 20,000 tokens; its in-flight prompt tokens
    would not. Both cores, the list and the lease table's map, keep the request there."""
    servers = ["home", "other"]
    md = {"home": 562}                    # 8,992 of 9,092 tokens cached at home
    loads = [(3, 30_000), (0, 0)]
    model = (5e-5, 8192.0, 0.01, 1e-4, 1e-7, 20_000.0, 1.0)
    rest = (array("d", model * 2), 16, 9091, 9092, 2.0, 1.0, -1, 0.25, 2.0, 0.0, 0, 0.0, 1.5)
    for phases, want in (([(0, 0, 30_000), (0, 0, 0)], [1]),            # whole prompts: full
                         ([(0, 0, 30_000, 12_000), (0, 0, 0, 0)], [0])):    # held: fits
        args = (servers, md, loads, phases, *rest)
        for core in (native.time_core, pk._time_core):
            assert core(*args)[2] == want, (core, phases)
        states = {s: (ld, *ph) for s, ld, ph in zip(servers, loads, phases)}
        assert native.time_core_table(servers, md, states, {"home": 0, "other": 1}, *rest,
                                      0)[2] == want


def test_equal_costs_tie_and_hot_servers_are_skipped():
    servers = ["a", "b", "c", "d"]
    loads = [(0, 0), (0, 0), (9, 0), (0, 0)]
    args = (servers, {"a": 2, "b": 2, "c": 4}, loads, 16, 63, 64, 1.0, 1.0, 32.0, -1, 0.25,
            2.0, 2.0, 0, 0.0)
    matched, costs, tied, hs, lc, limit = native.core(*args)
    assert matched == [32, 32, 63, 0]
    assert hs == [2] and lc == [] and limit == 2.0 * 9 / 4 + 2.0
    assert tied == [0, 1]                   # c is cheapest but hot, d has no match
    assert pk._core(*args) == (matched, costs, tied, hs, lc, limit)


def test_time_core_params_must_be_doubles_per_server():
    ok = (["a"], None, [(0, 0)], [(0, 0, 0)], array("d", [1e-4, 512.0, 0.01, 0.0, 0.0, 0.0, 1.0]),
          16, 0, 0, 2.0, 1.0, -1, 0.0, 2.0, 0.0, 0, 0.0, 1.5)
    assert native.time_core(*ok)[2] == [0]
    with pytest.raises(ValueError, match="7 doubles per server"):
        native.time_core(*ok[:4], array("d", [1.0] * 6), *ok[5:])
    with pytest.raises(TypeError, match="doubles"):
        native.time_core(*ok[:4], [1.0] * 7, *ok[5:])
    with pytest.raises(TypeError, match="phase"):
        native.time_core(*ok[:3], [(0, 0)], *ok[4:])


def test_bad_arguments_raise_type_or_value_errors():
    ok = (["a"], None, [(0, 0)], 16, 0, 0, 1.0, 1.0, 1.0, -1, 0.0, 0.0, 0.0, 0, 0.0)
    native.core(*ok)
    with pytest.raises(TypeError):
        native.core(*ok[:-1])
    with pytest.raises(ValueError, match="one load per server"):
        native.core(["a", "b"], *ok[1:])
    with pytest.raises(TypeError, match="pair"):
        native.core(ok[0], None, [(0, 0, 0)], *ok[3:])
    with pytest.raises(TypeError, match="int"):
        native.core(ok[0], {"a": np.int64(1)}, *ok[2:])
    with pytest.raises(TypeError, match="dict or None"):
        native.core(ok[0], [1], *ok[2:])


# ---- whole decisions, native and Python ------------------------------------------------------

def _cluster(seed: int, n: int):
    rng = np.random.default_rng(seed)
    idx, leases = KvIndex(B), LeaseTable()
    servers = [f"http://w{i}" for i in range(n)]
    docs = [rng.integers(0, 50_000, 512).tolist() for _ in range(4)]
    for i, s in enumerate(servers):
        for d in docs[i % 3:]:
            k = int(rng.integers(1, 33)) * B
            idx.apply(s, BlocksStored(block_keys_list(d[:k], B), None, d[:k], B))
        for r in range(int(rng.integers(0, 12))):
            tok = int(rng.integers(0, 900))
            leases.acquire("ctx", seed * 1000 + i * 100 + r, s, 0.0, 60.0, tok,
                           int(rng.integers(0, tok + 1)))
            if rng.integers(0, 2):      # past its first token: decoding
                leases.first_token("ctx", seed * 1000 + i * 100 + r)
    return idx, leases, servers, docs


def _decide(policy, cands, keys, view):
    d = policy.select(cands, keys, view)
    c = d.choice
    return (d.server, d.matched_blocks, c.servers, c.matched, c.loads, _bits(c.costs), c.pick,
            c.tied, c.hot, c.skip_hot, c.unknown, d.explanation, float(d.predicted_s).hex(),
            d.uncached)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kw", [{}, {"hotspot_factor": 1.0, "hotspot_slack_s": 0.0},
                                {"max_batch_size": 4, "load_cap": 0.5, "hotspot_factor": None},
                                {"cost": "tokens"},
                                {"hotspot_factor": 1.0, "hotspot_slack": 0.0, "cost": "tokens"},
                                {"load_requests_weight": 0.0, "load_tokens_weight": 0.0}])
def test_policy_decisions_are_the_same_with_the_native_core(seed, kw):
    idx, leases, servers, docs = _cluster(seed, 3 + seed % 6)
    view = IndexLoadView(idx, leases)
    unknown = {servers[0]} if seed % 4 == 3 else set()
    cands = [Candidate(s, kv_unknown=s in unknown) for s in servers]
    fast, slow = KvCacheAwarePolicy(B, **kw), KvCacheAwarePolicy(B, **kw)
    assert fast._native
    slow._native = False
    rng = np.random.default_rng(seed)
    for i in range(40):
        d = docs[i % 4]
        toks = d[:int(rng.integers(1, 512))] + rng.integers(0, 50_000, int(rng.integers(0, 64))).tolist()
        key = RoutingKey(np.array(block_keys_list(toks, B), dtype=np.uint64), len(toks),
                         f"conv{i % 5}" if i % 3 else None)
        a, b = _decide(fast, cands, key, view), _decide(slow, cands, key, view)
        assert a == b
        leases.acquire("ctx", 10**9 + seed * 100 + i, a[0], 0.0, 60.0, len(toks))


class _NumpyView(IndexLoadView):
    """A LoadView whose matches are numpy ints (a valid LoadView; the native core takes only
    Python ints, so the policy falls back to the Python recipe)."""

    def matched_blocks(self, keys):
        return {s: np.int64(v) for s, v in super().matched_blocks(keys).items()}


def test_int_weights_and_numpy_matches_take_the_python_recipe():
    idx, leases, servers, docs = _cluster(3, 4)
    key = RoutingKey(np.array(block_keys_list(docs[0][:300], B), dtype=np.uint64), 300, None)
    cands = [Candidate(s) for s in servers]
    ints = KvCacheAwarePolicy(B, prefill_weight=1, load_tokens_weight=1, load_requests_weight=32,
                              affinity_bonus=0)
    d = ints.select(cands, key, IndexLoadView(idx, leases))
    assert all(type(c) is int for c in d.choice.costs)      # int scores, as before
    floats = KvCacheAwarePolicy(B)
    want = _decide(floats, cands, key, IndexLoadView(idx, leases))
    got = _decide(KvCacheAwarePolicy(B), cands, key, _NumpyView(idx, leases))
    assert got[0] == want[0] and got[5] == want[5]


def test_the_affinity_slack_keeps_a_credited_sessions_server_within_its_factor():
    """The session's server (`pinned`) with a credit keeps the request while its cost is at most
    `div` (1 + affinity_slack) times another's; beyond that, or with no credit (bonus 0: a prefix
    every server holds as much of), the cheaper server wins. Both cores, to the bit."""
    servers = ["home", "other"]
    md = {"home": 40}                    # 640 of 700 tokens cached at home
    model = (5e-5, 8192.0, 0.01, 1e-4, 1e-7, 0.0, 1.0)
    # home: 1,500 queued prefill tokens (0.081 s with this prompt's 60 uncached twice, less the
    # bonus's 0.00875 s); other: none, nothing cached (0.07 s)
    loads, phases = [(1, 1500), (0, 0)], [(1500, 1, 1500), (0, 0, 0)]
    head = (servers, md, loads, phases, array("d", model * 2), 16, 699, 700, 2.0, 1.0, 0)
    for bonus, div, want in ((0.25, 1.0, [1]), (0.25, 1.5, [0]), (0.0, 1.5, [1]),
                             (0.25, 1.02, [1])):
        args = (*head, bonus, 0.0, 0.0, 0, 0.0, div)
        got, ref = native.time_core(*args), pk._time_core(*args)
        assert got[2] == want == ref[2], (bonus, div)
        assert _bits(got[1]) == _bits(ref[1])
