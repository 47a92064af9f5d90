"""LeaseTable: deadlines, idempotent finish, renew, expiry, per-server load."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import leases as leases_mod
from router.leases import LeaseTable


def test_acquire_finish_load():
    t = LeaseTable()
    t.acquire("ctx", 1, "s1", now=0.0, ttl=10.0, tokens=100)
    t.acquire("gen", 1, "s1", now=0.0, ttl=10.0, tokens=5)  # same req_id, other role: distinct
    t.acquire("ctx", 2, "s2", now=0.0, ttl=10.0)
    assert t.load("s1") == (2, 105) and t.load("s2") == (1, 0) and t.load("s3") == (0, 0)
    assert t.total() == 3 and len(t) == 3
    lease = t.finish("ctx", 1)
    assert lease.server == "s1" and lease.tokens == 100
    assert t.finish("ctx", 1) is None  # idempotent
    assert t.load("s1") == (1, 5) and t.requests("s1") == 1 and t.tokens("s1") == 5
    assert t.loads() == {"s1": (1, 5), "s2": (1, 0)}
    assert t.loads_for(["s2", "zz", "s1"]) == [(1, 0), (0, 0), (1, 5)]


def test_reacquire_replaces_and_moves_load():
    t = LeaseTable()
    t.acquire("ctx", 1, "s1", 0.0, 10.0, tokens=10)
    t.acquire("ctx", 1, "s2", 1.0, 10.0, tokens=20)  # retry elsewhere
    assert t.load("s1") == (0, 0) and t.load("s2") == (1, 20) and t.total() == 1
    assert t.expire(10.5) == []  # the replaced lease's deadline is stale
    assert [l.server for l in t.expire(11.0)] == ["s2"]


def test_expire_renew_and_finish_after_expiry():
    t = LeaseTable()
    t.acquire("ctx", 1, "s", 0.0, 5.0)
    t.acquire("ctx", 2, "s", 0.0, 5.0)
    assert t.next_deadline() == 5.0
    assert t.renew("ctx", 1, now=4.0, ttl=5.0)
    assert not t.renew("ctx", 99, now=4.0, ttl=5.0)
    expired = t.expire(5.0)
    assert [l.req_id for l in expired] == [2]
    assert t.finish("ctx", 2) is None
    assert t.expire(8.9) == []
    assert [l.req_id for l in t.expire(9.0)] == [1]
    assert t.load("s") == (0, 0) and t.loads() == {}


def test_validation():
    t = LeaseTable()
    with pytest.raises(ValueError, match="ttl"):
        t.acquire("ctx", 1, "s", 0.0, 0.0)
    with pytest.raises(ValueError, match="tokens"):
        t.acquire("ctx", 1, "s", 0.0, 1.0, tokens=-1)
    with pytest.raises(ValueError, match="ttl"):
        t.renew("ctx", 1, 0.0, -1.0)


def test_drop_server():
    t = LeaseTable()
    t.acquire("ctx", 1, "a", 0.0, 5.0, 3)
    t.acquire("ctx", 2, "b", 0.0, 5.0, 4)
    assert [l.req_id for l in t.drop_server("a")] == [1]
    assert t.loads() == {"b": (1, 4)} and t.expire(100.0)[0].req_id == 2


def test_heap_compaction_keeps_deadlines():
    t = LeaseTable()
    t.acquire("ctx", 1, "s", 0.0, 1.0)
    for i in range(5000):  # many renewals strand heap entries
        t.renew("ctx", 1, now=float(i), ttl=1.0)
    assert len(t._fifo) + len(t._heap) < 5000
    assert t.expire(4999.5) == []
    assert len(t.expire(5000.0)) == 1


_ops = st.lists(st.tuples(
    st.sampled_from(["acquire", "finish", "renew", "expire"]),
    st.sampled_from(["ctx", "gen"]), st.integers(0, 6), st.sampled_from(["a", "b", "c"]),
    st.floats(0.0, 3.0), st.floats(0.1, 5.0), st.integers(0, 1000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_loads_never_negative_and_return_to_zero(ops):
    t = LeaseTable()
    now = 0.0
    live: dict[tuple, tuple] = {}  # model: key -> (server, tokens, deadline)
    for op, role, rid, server, dt, ttl, tokens in ops:
        now += dt
        if op == "acquire":
            t.acquire(role, rid, server, now, ttl, tokens)
            live[(role, rid)] = (server, tokens, now + ttl)
        elif op == "finish":
            got = t.finish(role, rid)
            assert (got is not None) == ((role, rid) in live)
            live.pop((role, rid), None)
        elif op == "renew":
            ok = t.renew(role, rid, now, ttl)
            assert ok == ((role, rid) in live)
            if ok:
                s, tok, _ = live[(role, rid)]
                live[(role, rid)] = (s, tok, now + ttl)
        else:
            gone = {(l.role, l.req_id) for l in t.expire(now)}
            assert gone == {k for k, v in live.items() if v[2] <= now}
            for k in gone:
                del live[k]
        for s in ("a", "b", "c"):
            req, tok = t.load(s)
            assert req >= 0 and tok >= 0
            assert req == sum(1 for v in live.values() if v[0] == s)
            assert tok == sum(v[1] for v in live.values() if v[0] == s)
    assert len(t.expire(now + 10.0)) == len(live)
    assert t.loads() == {} and t.total() == 0


# ---- phases: queued prefill apart from decoding -------------------------------------------------

def test_first_token_moves_a_lease_out_of_prefill_once():
    t = LeaseTable(prefill_ttl=10.0)
    t.acquire("gen", 1, "s", 0.0, 60.0, tokens=1000, prefill=300, predicted_s=0.2)
    t.acquire("gen", 2, "s", 0.0, 60.0, tokens=500)        # no prefill given: all of it
    # held KV tokens: 300 + 500 brought, the 700-token cached prefix once
    assert t.phases_for(["s", "x"]) == [(800, 2, 1500, 1500), (0, 0, 0, 0)]
    lease = t.first_token("gen", 1)
    assert lease is not None and lease.predicted_s == 0.2 and not lease.in_prefill
    assert t.first_token("gen", 1) is None and t.first_token("gen", 9) is None   # idempotent
    assert t.phase("s") == (500, 1, 500) and t.load("s") == (2, 1500)
    t.finish("gen", 2)                       # a finish ends the phase too
    assert t.phase("s") == (0, 0, 0) and t.first_token("gen", 2) is None
    assert t.first_tokens == 1 and t.prefill_timeouts == 0


def test_a_frames_first_tokens_apply_as_one_report_each():
    """`first_tokens_of` (a channel frame's reports in one call) leaves the table as
    `first_token` per report does, in order, and counts the reports that found no lease in
    prefill (unknown, repeated in the frame, or already reported)."""
    from types import SimpleNamespace as R
    t1, t2 = LeaseTable(), LeaseTable()
    for t in (t1, t2):
        t.acquire("gen", 1, "s", 0.0, 60.0, tokens=1000, prefill=300)
        t.acquire("ctx", 1, "s", 0.0, 60.0, tokens=400, prefill=400)
        t.acquire("gen", 2, "b", 0.0, 60.0, tokens=500)
        t.first_token("gen", 2)
    reports = [R(role="gen", req_id=1), R(role="gen", req_id=1), R(role="gen", req_id=2),
               R(role="ctx", req_id=9), R(role="ctx", req_id=1)]
    got, unknown = t1.first_tokens_of(reports)
    want = [t2.first_token(r.role, r.req_id) for r in reports]
    assert [(l.role, l.req_id) for l in got] == [(l.role, l.req_id) for l in want if l is not None]
    assert unknown == 3 and all(not l.in_prefill for l in got)
    for s in ("s", "b"):
        assert t1.phase(s) == t2.phase(s) and t1.load(s) == t2.load(s)
    assert t1.first_tokens == t2.first_tokens == 3
    assert t1.first_tokens_of([]) == ([], 0)


def test_held_kv_tokens_count_a_shared_prefix_once():
    """The KV-full rule's input (the state's fifth item): each lease's uncached tokens at
    placement plus the deepest cached prefix a lease was placed on, not the sum of whole prompts:
    siblings of a prefix tree hold its prefix once. The deepest prefix stays until the server's
    last lease ends (it errs toward full); phases and set_prefill leave it alone."""
    t = LeaseTable()
    t.acquire("gen", 1, "s", 0.0, 60.0, tokens=10_000, prefill=10_000)   # the tree's first
    t.acquire("gen", 2, "s", 0.0, 60.0, tokens=10_200, prefill=200)      # siblings: a tail each
    t.acquire("gen", 3, "s", 0.0, 60.0, tokens=10_300, prefill=300)
    assert t.load("s") == (3, 30_500)
    # the first brought the prefix (its private tokens), the siblings placed on it name it:
    # counted twice, not once per sibling
    assert t.states()["s"][4] == 10_000 + 200 + 300 + 10_000
    t.first_token("gen", 2)
    assert t.set_prefill("gen", 3, 0) and t.states()["s"][4] == 20_500
    t.finish("gen", 3)
    assert t.states()["s"][4] == 10_000 + 200 + 10_000       # the deepest prefix kept
    t.acquire("gen", 4, "s", 0.0, 60.0, tokens=500, prefill=100)   # another tree's
    assert t.states()["s"][4] == 10_000 + 200 + 100 + 10_000
    for r in (1, 2, 4):
        t.finish("gen", r)
    assert "s" not in t.states()
    t.acquire("gen", 5, "s", 0.0, 60.0, tokens=500, prefill=100)   # reset with the last lease
    assert t.states()["s"][4] == 500


def test_set_prefill_changes_only_the_queued_tokens():
    t = LeaseTable()
    t.acquire("gen", 1, "s", 0.0, 60.0, tokens=1000, prefill=800)
    assert t.set_prefill("gen", 1, 0) and t.phase("s") == (0, 1, 1000)
    assert t.set_prefill("gen", 1, 5000) and t.phase("s") == (1000, 1, 1000)   # at most its tokens
    t.first_token("gen", 1)
    assert not t.set_prefill("gen", 1, 10) and not t.set_prefill("gen", 2, 10)
    assert t.phase("s") == (0, 0, 0)


def test_a_lost_report_ends_prefill_at_the_prefill_ttl():
    t = LeaseTable(prefill_ttl=5.0)
    t.acquire("ctx", 1, "s", 0.0, 60.0, tokens=100, prefill=100)
    t.acquire("ctx", 2, "s", 1.0, 60.0, tokens=50, prefill=20)
    assert t.expire(4.9) == [] and t.phase("s") == (120, 2, 150)
    assert t.expire(5.0) == [] and t.phase("s") == (20, 1, 50)     # counted as decoding now
    assert t.load("s") == (2, 150) and t.prefill_timeouts == 1
    assert t.first_token("ctx", 1) is None                         # late report: ignored
    t.acquire("ctx", 2, "b", 2.0, 60.0, tokens=50, prefill=0)      # re-placed: phase moves
    assert t.phase("s") == (0, 0, 0) and t.phase("b") == (0, 1, 50)
    assert t.expire(6.0) == [] and t.phase("b") == (0, 1, 50)      # its own ttl, from 2.0
    t.expire(7.0)
    assert t.phase("b") == (0, 0, 0) and t.prefill_timeouts == 2


def test_prefill_queue_compacts():
    t = LeaseTable(prefill_ttl=1e9)
    for i in range(5000):
        t.acquire("gen", i, "s", float(i), 1e9, tokens=10)
        t.finish("gen", i)
    assert len(t._prefill_q) < 2000 and t.phase("s") == (0, 0, 0)
    with pytest.raises(ValueError, match="prefill_ttl"):
        LeaseTable(prefill_ttl=0)


_phase_ops = st.lists(st.tuples(
    st.sampled_from(["acquire", "finish", "first", "expire"]), st.integers(0, 5),
    st.sampled_from(["a", "b"]), st.floats(0.0, 3.0), st.integers(0, 100), st.integers(0, 120)),
    max_size=60)


@settings(max_examples=150, deadline=None)
@given(_phase_ops)
def test_phases_are_the_sums_over_leases_in_prefill(ops):
    t = LeaseTable(prefill_ttl=4.0)
    now = 0.0
    live: dict[int, list] = {}  # rid -> [server, tokens, prefill, in_prefill, acquired]
    for op, rid, server, dt, tokens, prefill in ops:
        now += dt
        if op == "acquire":
            t.acquire("gen", rid, server, now, 100.0, tokens, prefill)
            live[rid] = [server, tokens, min(prefill, tokens), True, now]
        elif op == "finish":
            t.finish("gen", rid)
            live.pop(rid, None)
        elif op == "first":
            got = t.first_token("gen", rid)
            assert (got is not None) == (rid in live and live[rid][3])
            if rid in live:
                live[rid][3] = False
        else:
            t.expire(now)
            for v in live.values():
                if v[4] + 4.0 <= now:
                    v[3] = False
        for s in ("a", "b"):
            mine = [v for v in live.values() if v[0] == s and v[3]]
            assert t.phase(s) == (sum(v[2] for v in mine), len(mine), sum(v[1] for v in mine))


# ---- the maps' updates: router/_kv_cost.c `lease_add` / `lease_remove` against their recipes ----

needs_native = pytest.mark.skipif(not leases_mod.NATIVE, reason="router/_kv_cost.c not built "
                                  "(installed without a C compiler; CI builds the modules)")

_map_ops = st.lists(st.tuples(
    st.sampled_from(["acquire", "acquire", "finish", "first", "set_prefill", "expire"]),
    st.sampled_from(["context", "generation"]), st.integers(0, 7), st.sampled_from(["a", "b", "c"]),
    st.floats(0.0, 3.0), st.one_of(st.integers(0, 5000), st.integers(2**62, 2**64)),
    st.one_of(st.none(), st.integers(-5, 6000))), max_size=80)


@needs_native
@settings(max_examples=200, deadline=None)
@given(_map_ops)
def test_native_map_updates_equal_the_recipes(ops):
    """Every lease operation leaves the same maps (states and held KV tokens, object types
    included) with the native updates as with the Python recipes; numbers beyond a long long
    (here tokens past 2**62, whose sums overflow) fall back to the recipe on the native side."""
    fast, slow = LeaseTable(prefill_ttl=4.0), LeaseTable(prefill_ttl=4.0, native=False)
    assert fast._add is leases_mod._native_add and slow._add is leases_mod._add
    now = 0.0
    for op, role, rid, server, dt, tokens, prefill in ops:
        now += dt
        for t in (fast, slow):
            if op == "acquire":
                t.acquire(role, rid, server, now, 10.0, tokens, prefill)
            elif op == "finish":
                t.finish(role, rid)
            elif op == "first":
                t.first_token(role, rid)
            elif op == "set_prefill":
                t.set_prefill(role, rid, prefill or 0)
            else:
                t.expire(now)
        for a, b in ((fast._state, slow._state), (fast._kv, slow._kv)):
            assert a == b
            assert [type(x) for v in a.values() for x in v] == \
                [type(x) for v in b.values() for x in v]
    for t in (fast, slow):
        t.expire(now + 100.0)
        assert t.states() == {} and t._kv == {}


@needs_native
def test_native_map_updates_refuse_what_they_cannot_compute():
    """The native calls raise (OverflowError, TypeError) and change nothing where the recipe's
    Python ints would be needed: the table then runs the recipe."""
    states, kv = {"s": ((1, 2**63 - 1), 0, 1, 2**63 - 1, 2**63 - 1)}, {"s": (0, 2**63 - 1)}
    before = (dict(states), dict(kv))
    with pytest.raises(OverflowError):
        leases_mod._native_add(states, kv, "s", 1, 1)
    with pytest.raises(TypeError):
        leases_mod._native_add(states, kv, "s", 1.0, 1)
    with pytest.raises(TypeError):
        leases_mod._native_remove({"s": [(2, 1), 0, 0, 0, 0]}, {"s": (0, 0)}, "s", 1, 0, 0, False)
    assert (states, kv) == before
    t = LeaseTable()
    t.acquire("context", 1, "s", 0.0, 1.0, 2**63 - 1)
    t.acquire("context", 2, "s", 0.0, 1.0, 2**63 - 1)    # the sums pass 2**63: the recipe
    assert t.states()["s"] == ((2, 2**64 - 2), 2**64 - 2, 2, 2**64 - 2, 2**64 - 2)
    t.finish("context", 1)
    assert t.states()["s"] == ((1, 2**63 - 1), 2**63 - 1, 1, 2**63 - 1, 2**63 - 1)
