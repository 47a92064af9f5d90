"""Routing policies over a real KvIndex + LeaseTable: affinity, balancing, cap, ties, args."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from router.block_keys import block_keys_list
from router.events import BlocksStored
from router.kv_index import KvIndex
from router.leases import LeaseTable
from router.policies import (Candidate, ConversationPolicy, IndexLoadView, KvCacheAwarePolicy,
                             NoServerAvailable, RoutingKey, make_policy)

B = 16
SERVERS = ["http://a", "http://b", "http://c"]
CANDS = [Candidate(s) for s in SERVERS]


def prompt(seed: int, n_tokens: int = 512) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, size=n_tokens).tolist()


def key_of(tokens, conv=None):
    return RoutingKey(np.array(block_keys_list(tokens, B), dtype=np.uint64), len(tokens), conv)


@pytest.fixture
def env():
    idx, leases = KvIndex(B), LeaseTable()
    return idx, leases, IndexLoadView(idx, leases)


def cache(idx, server, tokens):
    keys = block_keys_list(tokens, B)
    n = len(tokens) // B
    idx.apply(server, BlocksStored(keys, None, tokens[:n * B], B))


_req_ids = itertools.count(1_000_000)


def load(leases, server, n, tokens_each=0):
    """n in-flight requests on ``server`` (unique req ids)."""
    for _ in range(n):
        leases.acquire("ctx", next(_req_ids), server, 0.0, 60.0, tokens_each)


# ---- round robin / load balancing -----------------------------------------------------------

def test_round_robin_cycles_and_skips_unhealthy(env):
    _, _, view = env
    p = make_policy("round_robin", {})
    got = [p.select(CANDS, None, view).server for _ in range(6)]
    assert got == SERVERS * 2
    cands = [Candidate("http://a"), Candidate("http://b", healthy=False), Candidate("http://c")]
    d = p.select(cands, None, view)
    assert d.server in ("http://a", "http://c")
    assert {r["server"]: r["why"] for r in d.explanation["candidates"]}["http://b"] == "unhealthy"
    with pytest.raises(NoServerAvailable, match="no healthy server among 1"):
        p.select([Candidate("x", healthy=False)], None, view)
    with pytest.raises(NoServerAvailable, match="no candidate"):
        p.select([], None, view)


def test_load_balancing_least_loaded_with_ties_in_turn(env):
    _, leases, view = env
    p = make_policy("load_balancing", {})
    load(leases, "http://a", 2)
    got = [p.select(CANDS, None, view).server for _ in range(4)]
    assert got == ["http://b", "http://c", "http://b", "http://c"]
    d = p.select(CANDS, None, view)
    assert "tie of 2" in d.explanation["reason"]


def test_load_balancing_by_tokens_counts_any_request(env):
    _, leases, view = env
    p = make_policy("load_balancing", {"use_tokens": True})
    load(leases, "http://a", 1, tokens_each=10)
    load(leases, "http://b", 3, tokens_each=1)
    load(leases, "http://c", 1, tokens_each=50)
    d = p.select(CANDS, None, view)
    assert d.server == "http://b" and d.explanation["candidates"][1]["score"] == 3


def test_power_of_two_choices_is_seeded_and_never_picks_the_worse_of_two(env):
    _, leases, view = env
    cands = [Candidate(f"s{i}") for i in range(8)]
    for i in range(8):
        load(leases, f"s{i}", i)
    a = make_policy("load_balancing", {"power_of_two_choices": True}, seed=7)
    b = make_policy("load_balancing", {"power_of_two_choices": True, "seed": 7})
    seq_a = [a.select(cands, None, view).server for _ in range(50)]
    seq_b = [b.select(cands, None, view).server for _ in range(50)]
    assert seq_a == seq_b
    assert "s7" not in seq_a  # the most loaded server loses every pairing
    assert len(set(seq_a)) > 2  # but not always the global minimum
    two = make_policy("load_balancing", {"power_of_two_choices": True}, seed=1)
    assert {two.select(cands[:2], None, view).server for _ in range(5)} == {"s0"}


# ---- kv_cache_aware --------------------------------------------------------------------------

def test_kv_prefers_the_server_with_the_prefix(env):
    idx, _, view = env
    t = prompt(1)
    cache(idx, "http://b", t[:384])
    cache(idx, "http://c", t[:128])
    p = make_policy("kv_cache_aware", {})
    d = p.select(CANDS, key_of(t), view)
    assert d.server == "http://b"
    ex = d.explanation
    assert ex["matched_tokens"] == 384 and ex["num_tokens"] == 512 and ex["policy"] == "kv_cache_aware"
    rows = {r["server"]: r for r in ex["candidates"]}
    assert rows["http://c"]["matched_tokens"] == 128 and rows["http://a"]["matched_tokens"] == 0
    assert rows["http://b"]["score"] < rows["http://c"]["score"] < rows["http://a"]["score"]
    assert set(rows["http://a"]) == {"server", "matched_tokens", "load_requests", "load_tokens",
                                     "score", "why"}


def test_kv_explanation_lists_the_chosen_server_then_the_cheapest(env):
    idx, leases, view = env
    servers = [f"http://s{i}" for i in range(20)]
    t = prompt(7)
    for i, s in enumerate(servers):
        cache(idx, s, t[:16 * (i % 10)])     # s9 and s19 hold the most
    load(leases, "http://s9", 2)           # 2 x 32 tokens of load: now behind s8, s18, s7, s17
    cands = [Candidate(s) for s in servers] + [Candidate("http://down", healthy=False)]
    d = make_policy("kv_cache_aware", {"explain_rows": 5, "cost": "tokens"}).select(
        cands, key_of(t), view)
    ex = d.explanation
    assert d.server == "http://s19" and ex["candidates_total"] == 21 and ex["hot"] == 0
    rows = ex["candidates"]
    assert rows[0] == {"server": "http://down", "matched_tokens": 0, "load_requests": None,
                       "load_tokens": None, "score": None, "why": "unhealthy"}
    assert [r["server"] for r in rows[1:]] == ["http://s19", "http://s8", "http://s18",
                                               "http://s7", "http://s17"]
    assert rows[1]["why"].startswith("chosen") and rows[2]["why"] == "higher cost"
    scores = [r["score"] for r in rows[1:]]
    assert scores == sorted(scores)
    with pytest.raises(ValueError, match="explain_rows"):
        make_policy("kv_cache_aware", {"explain_rows": 0})


def test_kv_fully_cached_prompt_still_prefills_one_token(env):
    idx, _, view = env
    t = prompt(2, 256)
    cache(idx, "http://a", t)
    d = make_policy("kv_cache_aware", {}).select(CANDS, key_of(t), view)
    assert d.explanation["matched_tokens"] == 255


def test_kv_load_outweighs_a_small_cache_hit(env):
    idx, leases, view = env
    t = prompt(3)
    cache(idx, "http://a", t[:64])
    load(leases, "http://a", 1, tokens_each=4000)
    assert make_policy("kv_cache_aware", {}).select(CANDS, key_of(t), view).server != "http://a"


def test_kv_hotspot_cap_spreads_a_hot_prefix(env):
    idx, leases, view = env
    t = prompt(4)
    cache(idx, "http://a", t)
    p = make_policy("kv_cache_aware", {"load_tokens_weight": 0.0, "load_requests_weight": 0.0})
    saw_hot = False
    # identical prompts, load ignored by the cost: only the cap keeps a from taking all of them
    for i in range(30):
        d = p.select(CANDS, key_of(t), view)
        leases.acquire("ctx", i, d.server, 0.0, 60.0, 512)
        saw_hot |= any(r["why"].startswith("hot") for r in d.explanation["candidates"])
        reqs = [leases.requests(s) for s in SERVERS]
        assert reqs[0] <= 2.0 * sum(reqs) / 3 + 2.0 + 1  # never far above the cap
    assert saw_hot and leases.requests("http://b") + leases.requests("http://c") >= 5
    d2 = make_policy("kv_cache_aware", {"hotspot_factor": None, "load_tokens_weight": 0.0,
                                        "load_requests_weight": 0.0}).select(CANDS, key_of(t), view)
    assert d2.server == "http://a"  # cap disabled: the cache wins regardless of load


def test_kv_cap_ignored_when_every_candidate_is_hot(env):
    _, leases, view = env
    p = make_policy("kv_cache_aware", {"max_batch_size": 4, "load_cap": 0.5, "hotspot_factor": None})
    for s in SERVERS:
        load(leases, s, 3)
    d = p.select(CANDS, key_of(prompt(5)), view)
    assert "every candidate hot" in d.explanation["reason"]


def test_kv_upstream_load_cap(env):
    _, leases, view = env
    p = make_policy("kv_cache_aware", {"max_batch_size": 4, "load_cap": 0.5,
                                       "hotspot_factor": None, "load_requests_weight": 0.0,
                                       "load_tokens_weight": 0.0})
    load(leases, "http://a", 2)
    rows = {r["server"]: r["why"] for r in p.select(CANDS, key_of(prompt(6)), view)
            .explanation["candidates"]}
    assert rows["http://a"].startswith("hot: 2/4")


def test_kv_ties_rotate(env):
    # distinct prompts, nothing cached, no load: every server costs the same (a repeated prompt
    # would be an implicit session: test_kv_implicit_session_*)
    _, _, view = env
    p = make_policy("kv_cache_aware", {})
    got = [p.select(CANDS, key_of(prompt(7 + i)), view).server for i in range(6)]
    assert got == SERVERS * 2
    p = make_policy("kv_cache_aware", {"implicit_sessions": False})
    got = [p.select(CANDS, key_of(prompt(7)), view).server for _ in range(6)]
    assert got == SERVERS * 2


def test_kv_conversation_affinity_is_a_bonus_not_an_override(env):
    idx, _, view = env
    p = make_policy("kv_cache_aware", {"affinity_bonus": 0.1})
    t = prompt(8)
    assert p.select(CANDS, key_of(t, "conv-1"), view).server == "http://a"  # tie -> first
    # next turn: no cache anywhere yet (events lag): affinity breaks the tie toward a
    for _ in range(3):
        d = p.select(CANDS, key_of(t, "conv-1"), view)
        assert d.server == "http://a" and "affinity" in d.explanation["reason"]
    # but a much better cache elsewhere wins over the bonus
    cache(idx, "http://c", t)
    d = p.select(CANDS, key_of(t, "conv-1"), view)
    assert d.server == "http://c" and d.explanation["pinned"] == "http://a"
    p.remove_server("http://c")
    assert p._pins.get("conv-1") is None


def test_kv_implicit_session_keeps_a_prefix_tree_where_its_cache_was_lost(env):
    """A prompt's next request (its first 384 tokens shared) while the index matches nothing
    anywhere (its server's LRU evicted the prefix, or the events have not come): it goes to the
    server its prefix was placed on, credited the prefix there as if cached, not to the next
    server in turn; the prediction (matched tokens, the speculative insert's skip) stays the
    index's: nothing."""
    idx, _, view = env
    p = make_policy("kv_cache_aware", {})
    q = make_policy("kv_cache_aware", {"implicit_sessions": False})
    t = prompt(21, 512)
    assert p.select(CANDS, key_of(t), view).server == "http://a"      # tie -> first
    assert q.select(CANDS, key_of(t), view).server == "http://a"
    nxt = t[:384] + prompt(22, 128)
    d = p.select(CANDS, key_of(nxt), view)
    assert d.server == "http://a" and "implicit session affinity" in d.explanation["reason"]
    assert d.explanation["pinned"] == "http://a" and d.explanation["conversation"] is None
    assert d.explanation["matched_tokens"] == 0 and d.matched_blocks == 0
    assert q.select(CANDS, key_of(nxt), view).server == "http://b"    # without: in turn
    # a real cache elsewhere outweighs the session's credit; the tree then goes with it
    other = t[:384] + prompt(23, 128)
    cache(idx, "http://c", other)
    d = p.select(CANDS, key_of(other), view)
    assert d.server == "http://c" and d.explanation["pinned"] == "http://a"
    d = p.select(CANDS, key_of(t[:384] + prompt(24, 128)), view)
    assert d.server == "http://c" and d.explanation["matched_tokens"] == 384
    assert "implicit session affinity" in d.explanation["reason"]
    # a server that leaves takes its sessions along
    p.remove_server("http://c")
    assert p._sessions.find(key_of(other).block_keys) == (None, 0)


def test_kv_implicit_session_bonus_only_where_the_server_holds_more_than_the_others(env):
    """A system prompt every server caches: the latest conversation's server gets no bonus for
    it (every new conversation went there), so the next new one goes in turn; that
    conversation's next turn, whose history only its server holds, keeps the bonus."""
    idx, _, view = env
    system = prompt(51, 384)
    for s in SERVERS:
        cache(idx, s, system)
    p = make_policy("kv_cache_aware", {})
    first = system + prompt(52, 128)
    assert p.select(CANDS, key_of(first), view).server == "http://a"
    d = p.select(CANDS, key_of(system + prompt(53, 128)), view)
    assert d.server == "http://b" and "implicit session" not in d.explanation["reason"]
    cache(idx, "http://a", first)
    d = p.select(CANDS, key_of(first + prompt(54, 64)), view)
    assert d.server == "http://a" and "implicit session affinity" in d.explanation["reason"]


@pytest.mark.parametrize("args", [{}, {"cost": "tokens"}])
def test_kv_implicit_session_yields_to_a_prefill_queue(env, args):
    """The session's credit is in the cost's unit: 8k tokens of prefill queued on its server
    outweigh its 384-token prefix, and the next request goes elsewhere."""
    _, leases, view = env
    p = make_policy("kv_cache_aware", args)
    t = prompt(31, 512)
    first = p.select(CANDS, key_of(t), view).server
    load(leases, first, 4, 2000)
    d = p.select(CANDS, key_of(t[:384] + prompt(32, 128)), view)
    assert d.server != first and d.explanation["pinned"] == first


def test_kv_explicit_conversation_id_is_not_an_implicit_session(env):
    """With a conversation id the id's pin decides; the prompt's prefixes are not registered."""
    _, _, view = env
    p = make_policy("kv_cache_aware", {})
    t = prompt(41, 512)
    p.select(CANDS, key_of(t, "conv-9"), view)
    assert len(p._sessions) == 0
    assert make_policy("kv_cache_aware", {}).describe()["implicit_sessions"] is True
    with pytest.raises(ValueError, match="implicit_sessions"):
        make_policy("kv_cache_aware", {"implicit_sessions": 1})


def test_affinity_slack_is_a_non_negative_number_defaulting_to_half():
    """`affinity_slack` (the session's server's cost divided by 1 + it: router/_kv_cost.c,
    tests/router/test_kv_cost_native.py for the rule itself): 0.5 by default, 0 allowed (off),
    a negative or non-number refused naming it."""
    assert make_policy("kv_cache_aware", {}).describe()["affinity_slack"] == 0.5
    assert make_policy("kv_cache_aware", {"affinity_slack": 0})._div == 1.0
    for bad in (-0.5, "1", True):
        with pytest.raises(ValueError, match="affinity_slack"):
            make_policy("kv_cache_aware", {"affinity_slack": bad})


@pytest.mark.parametrize("cost, tokens_each", [("tokens", 0), ("time", 32)])
def test_kv_without_routing_key_balances(env, cost, tokens_each):
    # tokens: a request weighs load_requests_weight; time: its queued prefill tokens
    _, leases, view = env
    load(leases, "http://a", 1, tokens_each)
    d = make_policy("kv_cache_aware", {"cost": cost}).select(CANDS, None, view)
    assert d.server == "http://b" and d.explanation["num_tokens"] == 0


# ---- conversation ----------------------------------------------------------------------------

def test_explicit_conversation_is_sticky_and_repins(env):
    _, leases, view = env
    p = make_policy("conversation", {})
    first = p.select(CANDS, RoutingKey(None, 0, "c1"), view).server
    load(leases, first, 5)  # no overload gate for a sticky session
    for _ in range(3):
        d = p.select(CANDS, RoutingKey(None, 0, "c1"), view)
        assert d.server == first and d.explanation["reason"].startswith("sticky")
    others = [c for c in CANDS if c.server != first]
    d = p.select(others + [Candidate(first, healthy=False)], RoutingKey(None, 0, "c1"), view)
    assert d.server != first and "re-pinned" in d.explanation["reason"]
    assert p.select(CANDS, RoutingKey(None, 0, "c1"), view).server == d.server


def test_conversation_lru_bound_and_server_eviction(env):
    _, _, view = env
    p = make_policy("conversation", {"max_sessions": 2})
    s1 = p.select(CANDS, RoutingKey(None, 0, "c1"), view).server
    p.select(CANDS, RoutingKey(None, 0, "c2"), view)
    p.select(CANDS, RoutingKey(None, 0, "c3"), view)  # evicts c1
    assert len(p._pins) == 2 and p._pins.get("c1") is None
    s3 = p._pins.get("c3")
    p.remove_server(s3)
    assert p._pins.get("c3") is None
    assert s1 in SERVERS


def test_implicit_sessions_follow_the_prefix(env):
    _, leases, view = env
    p: ConversationPolicy = make_policy("conversation", {"match_threshold": 0.6})
    turn1 = prompt(9, 1024)
    d1 = p.select(CANDS, key_of(turn1), view)
    sid = d1.explanation["conversation"]
    assert sid.startswith("implicit-")
    load(leases, d1.server, 3)  # even when busier, the session stays
    turn2 = turn1 + prompt(10, 300)
    d2 = p.select(CANDS, key_of(turn2), view)
    assert d2.server == d1.server and d2.explanation["conversation"] == sid
    assert d2.explanation["matched_tokens"] == 1024
    # a different conversation (or too little overlap) starts a new session
    d3 = p.select(CANDS, key_of(turn1[:200] + prompt(11, 824)), view)
    assert d3.explanation["conversation"] != sid and d3.server != d1.server
    p.remove_server(d1.server)
    d4 = p.select(CANDS, key_of(turn2 + prompt(12, 16)), view)
    assert d4.explanation["conversation"] != sid


def test_implicit_session_match_between_stride_marks(env):
    _, _, view = env
    p = make_policy("conversation", {"match_threshold": 0.9})
    t = prompt(13, 16 * 13)  # 13 blocks: last block is not a stride (8) mark
    d1 = p.select(CANDS, key_of(t), view)
    d2 = p.select(CANDS, key_of(t + prompt(14, 8)), view)
    assert d2.explanation["conversation"] == d1.explanation["conversation"]
    assert d2.explanation["matched_tokens"] == 16 * 13


# ---- make_policy -----------------------------------------------------------------------------

def test_make_policy_rejects_unknown_and_mistyped_args():
    with pytest.raises(ValueError, match="unknown router type 'fastest'"):
        make_policy("fastest", {})
    with pytest.raises(ValueError, match="unknown argument 'use_tokenz'"):
        make_policy("load_balancing", {"use_tokenz": True})
    with pytest.raises(ValueError, match="unknown argument 'x'.*expected one of"):
        make_policy("round_robin", {"x": 1})
    with pytest.raises(ValueError, match="'use_tokens' must be bool, found 'yes'"):
        make_policy("load_balancing", {"use_tokens": "yes"})
    with pytest.raises(ValueError, match="'prefill_weight' must be a number"):
        make_policy("kv_cache_aware", {"prefill_weight": True})
    with pytest.raises(ValueError, match="'max_sessions' must be positive"):
        make_policy("conversation", {"max_sessions": 0})
    with pytest.raises(ValueError, match="'load_tokens_weight' must be non-negative"):
        make_policy("kv_cache_aware", {"load_tokens_weight": -1})
    with pytest.raises(ValueError, match="match_threshold"):
        make_policy("conversation", {"match_threshold": 1.5})
    with pytest.raises(ValueError, match="hash_skip_count=3 is not supported"):
        make_policy("conversation", {"hash_skip_count": 3})
    with pytest.raises(ValueError, match="not both"):
        make_policy("kv_cache_aware", {"load_weight": 0.25, "load_requests_weight": 1.0})


def test_make_policy_accepts_upstream_trtllm_args():
    p = make_policy("kv_cache_aware", {
        "use_tokens": False, "max_batch_size": 64, "tokens_per_block": 32,
        "tokenizer_dir": "/m", "model_path": "/m", "custom_tokenizer": None, "use_harmony": False,
        "track_routed_blocks": True, "load_weight": 0.25, "load_cap": 0.9,
        "max_num_tokens": 8192}, block_size=32)
    assert isinstance(p, KvCacheAwarePolicy)
    assert p.load_requests_weight == 8.0 and p.load_tokens_weight == 0.0 and p.load_cap == 0.9
    assert p.passthrough == {"tokens_per_block": 32, "tokenizer_dir": "/m", "model_path": "/m",
                             "custom_tokenizer": None, "use_harmony": False,
                             "max_num_tokens": 8192}
    c = make_policy("conversation", {"match_threshold": 0.75, "tokens_per_block": 128,
                                     "use_token_ids": True, "hash_skip_count": 0,
                                     "max_sessions": 10})
    assert c.describe()["match_threshold"] == 0.75
    assert make_policy("load_balancing", {"use_tokens": True, "max_batch_size": 8}).use_tokens
    assert make_policy("round_robin", None).describe() == {"type": "round_robin"}
    assert make_policy("kv_cache_aware", {}).needs_block_keys
    assert not make_policy("round_robin", {}).needs_block_keys


def test_kv_unknown_server_is_placed_by_load_not_by_a_zero_match():
    """A server whose keys are known not to match (key parity probe) neither wins nor loses on
    its index matches: it is costed with the verified servers' mean match, reported as 0."""
    from router.kv_index import KvIndex
    from router.leases import LeaseTable
    from router.policies import Candidate, IndexLoadView, KvCacheAwarePolicy, RoutingKey

    idx, leases = KvIndex(block_size=16), LeaseTable()
    view = IndexLoadView(idx, leases)
    keys = np.asarray(block_keys_list(list(range(256)), 16), dtype=np.uint64)
    pol = KvCacheAwarePolicy(16, track_routed_blocks=False)
    key = RoutingKey(block_keys=keys, num_tokens=256)
    cands = [Candidate("http://a"), Candidate("http://b"), Candidate("http://c", kv_unknown=True)]
    # nobody caches: a and b match 0, c's mean-of-the-others estimate is 0 too; load decides
    for i in range(2):
        leases.acquire("generation", i, "http://a", 0.0, 60.0, 256)
        leases.acquire("generation", 10 + i, "http://b", 0.0, 60.0, 256)
    d = pol.select(cands, key, view)
    assert d.server == "http://c"
    row = next(r for r in d.explanation["candidates"] if r["server"] == "http://c")
    assert "kv_mismatch" in row["why"] and row["matched_tokens"] == 0
    assert d.explanation["matched_tokens"] == 0     # nothing predicted cached on c


# ---- kv_cache_aware's time cost -----------------------------------------------------------------

MODEL = {"prefill_s_per_token": 1e-4, "chunk_tokens": 512, "decode_s_per_step": 0.01,
         "decode_s_per_request": 1e-4, "decode_s_per_context_token": 1e-6}


def _cands(servers, model=MODEL):
    return [Candidate(s, info={"routing_model": model}) for s in servers]


def test_time_cost_tells_queued_prefill_from_decoding(env):
    """The server holding the prompt's prefix has 6k tokens of prefill queued: the match is worth
    less than the queue, so the prompt goes elsewhere; once those leases report their first token
    (now decoding), the match wins. The token cost cannot tell the two states apart."""
    idx, leases, view = env
    t = prompt(11, 1024)
    cache(idx, "http://a", t[:896])
    rids = [next(_req_ids) for _ in range(3)]
    for r in rids:
        leases.acquire("gen", r, "http://a", 0.0, 60.0, 2000)
    # without implicit sessions: the first placement would pin the prompt to the server it chose
    # (in the coordinator, its speculative insert predicts the prompt there as well)
    p = make_policy("kv_cache_aware", {"implicit_sessions": False})
    assert p.cost == "time" and p.uncached_weight == 2.0
    cands = _cands(SERVERS)
    assert p.select(cands, key_of(t), view).server != "http://a"
    for r in rids:
        assert leases.first_token("gen", r) is not None
    d = p.select(cands, key_of(t), view)
    assert d.server == "http://a" and d.uncached == 1024 - 896
    # the estimate for the chosen server: its uncached tokens at 1e-4 s, in one chunk sharing a
    # step with its 3 decoding leases (6,000 context tokens): the whole step, though 128 tokens
    # are a quarter of a chunk (the first token waits for one step at least)
    step = 0.01 + 3 * 1e-4 + 6000 * 1e-6
    assert d.predicted_s == pytest.approx(128 * 1e-4 + step)
    tok = make_policy("kv_cache_aware", {"cost": "tokens"})
    assert tok.select(cands, key_of(t), view).server != "http://a"


def test_a_server_busy_on_an_idle_cluster_is_not_hot_by_default(env):
    """Hot means a decode step above twice the mean plus two idle steps (the default slack): on a
    cluster otherwise idle, the server holding the prompt's prefix with 20 requests decoding (a
    42 ms step against 10 ms idle ones) keeps its match; relative to the mean alone (slack 0) it
    was hot and its match went elsewhere."""
    idx, leases, view = env
    t = prompt(13, 1024)
    cache(idx, "http://a", t[:896])
    for _ in range(20):
        r = next(_req_ids)
        leases.acquire("gen", r, "http://a", 0.0, 60.0, 1500)
        leases.first_token("gen", r)
    cands = _cands(SERVERS)
    d = make_policy("kv_cache_aware", {}).select(cands, key_of(t), view)
    assert d.server == "http://a" and d.explanation["hot"] == 0
    d = make_policy("kv_cache_aware", {"hotspot_slack_s": 0.0}).select(cands, key_of(t), view)
    assert d.server != "http://a" and d.explanation["hot"] == 1


def test_time_cost_learns_a_slow_server_from_first_token_reports(env):
    _, leases, view = env
    # one prompt placed again and again: without implicit sessions, which would keep it on its server
    p = make_policy("kv_cache_aware", {"hotspot_factor": None, "implicit_sessions": False})
    cands = _cands(["http://a", "http://b"], model=None)    # no routing_model: the prior, learned
    t = prompt(12, 2048)
    # equal costs: ties in turn
    picks = {p.select(cands, key_of(t), view).server for _ in range(2)}
    assert picks == {"http://a", "http://b"}
    for _ in range(60):     # a's first tokens come 3x later than its model says
        p.observe_ttft("http://a", 0.2 * p.scale("http://a"), 0.6)    # estimates include the scale
        p.observe_ttft("http://b", 0.2 * p.scale("http://b"), 0.2)
    assert 2.5 < p.scale("http://a") <= 3.1 and p.scale("http://b") == pytest.approx(1.0)
    assert {p.select(cands, key_of(t), view).server for _ in range(4)} == {"http://b"}
    p.observe_ttft("http://b", 0.001, 5.0)      # too small an estimate to learn from
    assert p.scale("http://b") == pytest.approx(1.0)
    p.remove_server("http://a")
    assert p.scale("http://a") == 1.0
    # a server that publishes its own model keeps it: its reports are not learned from
    q = make_policy("kv_cache_aware", {})
    q.select(_cands(["http://a", "http://b"]), key_of(t), view)
    for _ in range(20):
        q.observe_ttft("http://a", 0.2, 0.6)
    assert q.scale("http://a") == 1.0


def test_a_placement_carries_only_estimates_its_report_can_teach(env):
    """A decision's learn_s (what the coordinator keeps for the leg's first-token report) is the
    estimate where observe_ttft learns from it, else 0.0 (the report's call is then skipped): a
    learned server's long enough estimate is carried and teaches its scale; a server publishing
    its model, a short estimate, or learning off carry 0.0, and those would not have taught
    anything. predicted_s stays the estimate."""
    _, leases, view = env
    t = prompt(13, 2048)
    learned = make_policy("kv_cache_aware", {"hotspot_factor": None, "implicit_sessions": False})
    d = learned.select(_cands(["http://a"], model=None), key_of(t), view)
    assert d.learn_s == d.predicted_s >= learned._LEARN_MIN_S     # 2,048 uncached at the prior
    learned.observe_ttft("http://a", d.learn_s, 3 * d.learn_s)
    assert learned.scale("http://a") > 1.0
    k = learned.scale("http://a")
    short = learned.select(_cands(["http://a"], model=None), key_of(t[:16]), view)
    assert short.learn_s == 0.0 < short.predicted_s < learned._LEARN_MIN_S
    learned.observe_ttft("http://a", short.predicted_s, 3 * short.predicted_s)
    assert learned.scale("http://a") == k                       # it would not have taught
    published = make_policy("kv_cache_aware", {"implicit_sessions": False})
    d = published.select(_cands(["http://a"]), key_of(t), view)
    assert d.learn_s == 0.0 < d.predicted_s
    published.observe_ttft("http://a", d.predicted_s, 3 * d.predicted_s)
    assert published.scale("http://a") == 1.0
    off = make_policy("kv_cache_aware", {"learn_rates": False, "implicit_sessions": False})
    d = off.select(_cands(["http://a"], model=None), key_of(t), view)
    assert d.learn_s == 0.0 < d.predicted_s


def test_routing_model_from_server_info_or_the_prior():
    from router.policy_kv import PRIOR_MODEL, model_of
    assert model_of({"routing_model": MODEL}) == (1e-4, 512.0, 0.01, 1e-4, 1e-6, 0.0)
    assert model_of({"routing_model": MODEL, "kv_capacity_blocks": 100, "block_size": 16})[5] == 1600.0
    prior = tuple(float(v) for v in PRIOR_MODEL.values())
    assert model_of(None) == prior and model_of({"routing_model": "x"}) == prior
    bad = {"routing_model": {"prefill_s_per_token": -1, "chunk_tokens": 0, "decode_s_per_step": "x"},
           "max_num_tokens": 2048}
    assert model_of(bad) == (prior[0], 2048.0, *prior[2:])
    assert model_of({"routing_model": MODEL}, prefill_tokens_per_s=1000.0, decode_step_s=0.0)[:3] == \
        (1e-3, 512.0, 0.0)


@pytest.mark.parametrize("args, field", [
    ({"load_tokens_weight": 0.5, "cost": "time"}, "load_tokens_weight"),
    ({"cost": "fast"}, "cost"),
    ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
    ({"uncached_weight": -1}, "uncached_weight"),
])
def test_time_cost_arguments_are_checked(args, field):
    with pytest.raises(ValueError, match=field):
        make_policy("kv_cache_aware", args)
    # a token weight alone selects the token cost (configs written for it keep their meaning)
    assert make_policy("kv_cache_aware", {"load_tokens_weight": 0.5}).cost == "tokens"
    assert make_policy("kv_cache_aware", {"use_tokens": False}).cost == "tokens"


def test_siblings_of_a_prefix_tree_keep_its_server_under_the_kv_full_rule(env):
    """The KV-full rule (a server whose KV cannot hold this prompt's uncached tokens beside what
    its in-flight requests hold is passed over) counts a prefix its in-flight requests share once:
    three siblings of a 4,096-token tree running on its server (12,672 prompt tokens in flight,
    4,480 held) leave room for a fourth's 128-token tail in 6,400 tokens of KV, so the fourth
    stays with the tree. In-flight prompts of other trees that fill the KV still push it off."""
    idx, leases, view = env
    info = {"routing_model": MODEL, "kv_capacity_blocks": 400, "block_size": B}
    cands = [Candidate(s, info=info) for s in SERVERS]
    p = make_policy("kv_cache_aware", {"implicit_sessions": False})
    tree = prompt(40, 4096)
    cache(idx, "http://a", tree)
    sibling = [tree + prompt(41 + i, 128) for i in range(4)]
    for t in sibling[:3]:       # placed as the coordinator does: a lease with its uncached tokens
        d = p.select(cands, key_of(t), view)
        assert d.server == "http://a" and d.uncached == 128
        leases.acquire("gen", next(_req_ids), d.server, 0.0, 60.0, len(t), d.uncached)
    assert leases.load("http://a") == (3, 3 * 4224) and leases.states()["http://a"][4] == 4480
    d = p.select(cands, key_of(sibling[3]), view)
    assert d.server == "http://a", d.explanation
    # another tree's prompts in flight there: 4,480 + 2,000 held, + 128 > 6,400
    leases.acquire("gen", next(_req_ids), "http://a", 0.0, 60.0, 2000, 2000)
    d = p.select(cands, key_of(sibling[3]), view)
    assert d.server != "http://a"
    row = next(r for r in d.explanation["candidates"] if r["server"] == "http://a")
    assert "KV full (6480 held KV tokens" in row["why"], row
