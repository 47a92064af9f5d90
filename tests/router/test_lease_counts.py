"""`LeaseTable.count(role)`: the coordinator's in-flight numbers per role (/cluster_info, metrics)
come from the table itself; after any mix of acquire, replace, finish, renew, expiry and dropped
servers they equal the live leases of each role."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.leases import LeaseTable

ROLES = ("context", "generation")
op = st.tuples(st.sampled_from(["acquire", "finish", "renew", "expire", "drop"]),
               st.sampled_from(ROLES), st.integers(0, 6), st.sampled_from(["a", "b"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=60))
def test_counts_per_role_follow_the_live_leases(ops):
    t = LeaseTable()
    now = 0.0
    for kind, role, rid, server in ops:
        now += 1.0
        if kind == "acquire":
            t.acquire(role, rid, server, now, ttl=3.0, tokens=rid)
        elif kind == "finish":
            t.finish(role, rid)
        elif kind == "renew":
            t.renew(role, rid, now, 3.0)
        elif kind == "expire":
            t.expire(now)
        else:
            t.drop_server(server)
        live = {r: sum(1 for x in ROLES for i in range(7) if x == r and t.get(x, i)) for r in ROLES}
        assert {r: t.count(r) for r in ROLES} == live
    assert t.count("context") + t.count("generation") == len(t)
