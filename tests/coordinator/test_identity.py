"""Fleet identity leases: uniqueness, renewal, stability across a coordinator restart, expiry."""
from __future__ import annotations

import pytest

from coordinator.identity import SLOTS, IdentityExhausted, IdentityTable, home_slot


def pair(lease):
    return lease.node_id, lease.process_id


def test_unique_pairs_and_renewal():
    t = IdentityTable(ttl_s=10)
    got = {h: pair(t.lease(h, 0.0)) for h in (f"host-{i % 7}:8000:{i}" for i in range(2000))}
    assert len(set(got.values())) == 2000
    assert all(0 <= n < 256 and 0 <= p < 64 for n, p in got.values())
    assert pair(t.lease("host-3:8000:3", 5.0)) == got["host-3:8000:3"]   # renewal
    assert t.lease("host-3:8000:3", 5.0).expires_at == 15.0


def test_same_pair_after_a_coordinator_restart():
    holders = [f"fleet-{i}" for i in range(100)]
    before = IdentityTable(10)
    old = {h: pair(before.lease(h, 0.0)) for h in holders}
    after = IdentityTable(10)          # a new process: no state carried over
    # renewals arrive in another order; each holder still gets the pair it uses
    assert {h: pair(after.lease(h, 0.0)) for h in reversed(holders)} == old


def test_preferred_pair_and_conflicts():
    t = IdentityTable(10)
    assert pair(t.lease("a", 0.0, 200, 7)) == (200, 7)
    b = t.lease("b", 0.0, 200, 7)                 # taken: falls back to b's own slot
    assert pair(b) != (200, 7)
    with pytest.raises(ValueError, match="out of range"):
        t.lease("c", 0.0, 256, 0)


def test_expired_pairs_are_held_back_from_others_for_one_ttl():
    t = IdentityTable(ttl_s=10)
    a = t.lease("a", 0.0)
    slot = a.slot
    t.expire(10.0)
    assert len(t) == 0 and t.expired_total == 1
    # a newcomer whose home slot is a's does not get it while a may still be minting ids
    other = next(h for h in (f"x{i}" for i in range(200000)) if home_slot(h) == slot)
    assert t.lease(other, 12.0).slot != slot
    # a itself gets it back (a late renewal)
    assert t.lease("a", 13.0).slot == slot
    # released explicitly: free at once
    t.release("a")
    other2 = next(h for h in (f"z{i}" for i in range(200000)) if home_slot(h) == slot)
    assert t.lease(other2, 13.0).slot == slot


def test_exhaustion_is_typed():
    t = IdentityTable(ttl_s=10)
    for i in range(SLOTS):
        t.lease(f"h{i}", 0.0, i // 64, i % 64)
    with pytest.raises(IdentityExhausted):
        t.lease("one-too-many", 0.0)
    t.release("h0")
    assert t.lease("one-too-many", 0.0) is not None
