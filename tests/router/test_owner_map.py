"""router/_owner_map.c, the KV index's owner masks as a native table, against what it replaces:

- the table behaves as a dict of its keys (u64 ints inline; negative, wider and non-int keys, and
  masks past one machine word, through its other paths) under random sets, deletes, lookups,
  copies and clears, growing and shrinking;
- its `walk` gives the Python loop's groups (router/kv_owners.py `OwnerTable.walk`) for keys as a
  list or as u64 bytes, over up to 70 slots and at the 64-bit boundary;
- two indexes fed the same stores, removals, speculative inserts and expiries, one on the table
  and its native loops, one on a dict and the Python loops (`router.kv_owners.OwnerMap` patched
  away when it is built), hold the same owner masks, slot maps, change log and counters after
  every step and answer every prefix query alike, over more than 64 slots;
- the index's model test of speculation passes on the Python loops too.
"""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.kv_owners as kt
from router.block_keys import block_keys_list
from router.events import BlocksRemoved, BlocksStored
from router.kv_index import KvIndex

from . import test_kv_index

# CI installs with a C compiler: there a build that silently fell back to Python is a failure
if os.environ.get("CI"):
    import router._owner_map as native
else:
    native = pytest.importorskip("router._owner_map")

B = 16


def python_index(monkeypatch, *a, **kw) -> KvIndex:
    """An index on a dict and the Python loops (what runs where the module did not build)."""
    with monkeypatch.context() as m:
        m.setattr(kt, "OwnerMap", None)
        idx = KvIndex(*a, **kw)
    assert type(idx.owners.masks) is dict
    return idx


def test_the_table_is_what_the_index_uses():
    assert kt.NATIVE and kt.OwnerMap is native.OwnerMap
    assert type(KvIndex(B).owners.masks) is native.OwnerMap


def _python_walk(keys, owners: dict, active: int) -> list:
    out, m = [], active
    for i, k in enumerate(keys):
        x = m & owners.get(k, 0)
        if x != m:
            out.append((m ^ x, i))
            if not x:
                return out
            m = x
    out.append((m, len(keys)))
    return out


_KEYS = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 40), st.integers(-5, -1),
                  st.integers(2**64, 2**64 + 3), st.sampled_from(["a", (1, 2)]))
_MASKS = st.one_of(st.integers(1, 2**20), st.integers(1, 2**64 - 1), st.integers(2**64, 2**72))


# 100 sequences of up to 300 operations (200 were ~17 s of a 2-core CI suite run): growth and
# deletion shifts at scale are test_growing_and_shrinking_keeps_every_key's, the walk's edge cases
# test_walk_matches_the_python_loop's (300 examples).
@settings(max_examples=100, deadline=None)
@given(keys=st.lists(_KEYS, min_size=1, max_size=60, unique_by=repr), data=st.data())
def test_the_table_behaves_as_a_dict(keys, data):
    m, d = native.OwnerMap(), {}
    for _ in range(data.draw(st.integers(1, 300))):
        k = data.draw(st.sampled_from(keys))
        op = data.draw(st.sampled_from(["set", "set", "del", "get"]))
        if op == "set":
            v = data.draw(_MASKS)
            m[k] = v
            d[k] = v
        elif op == "del":
            if k in d:
                del d[k]
                del m[k]
            else:
                with pytest.raises(KeyError):
                    del m[k]
        else:
            assert m.get(k, 0) == d.get(k, 0) and m.get(k) == d.get(k)
            assert (k in m) == (k in d)
            if k not in d:
                with pytest.raises(KeyError):
                    m[k]
            else:
                assert m[k] == d[k] and type(m[k]) is int
        assert len(m) == len(d)
    assert m == d and d == m and not m != d
    assert sorted(m.items(), key=repr) == sorted(d.items(), key=repr)
    assert sorted(m, key=repr) == sorted(d, key=repr) == sorted(m.keys(), key=repr)
    assert sorted(m.values()) == sorted(d.values())
    assert copy.deepcopy(m) == d and m.copy() == d and copy.copy(m) == d
    active = data.draw(st.sampled_from([1, 2**20 - 1, 2**64 - 1, 2**72 - 1]))
    walk = [data.draw(st.sampled_from(keys)) for _ in range(data.draw(st.integers(0, 20)))]
    assert m.walk(walk, active) == _python_walk(walk, d, active)
    u64 = [k for k in walk if type(k) is int and 0 <= k < 2**64]
    assert m.walk(np.array(u64, dtype=np.uint64).tobytes(), active) == _python_walk(u64, d, active)
    m.clear()
    assert len(m) == 0 and m == {} and m.items() == []


def test_growing_and_shrinking_keeps_every_key():
    rng = random.Random(7)
    m, d = native.OwnerMap(), {}
    keys = [rng.randrange(2**64) for _ in range(50_000)] + list(range(2_000))  # clustered too
    for k in keys:
        d[k] = m[k] = rng.randrange(1, 2**64)
    assert len(m) == len(d) and m == d
    for k in keys[::2] + keys[1::4]:     # deletions shift later entries back into their gaps
        if k in d:
            del d[k]
            del m[k]
    assert len(m) == len(d) and m == d
    assert all(m.get(k) == d.get(k) for k in keys)


@settings(max_examples=300, deadline=None)
@given(nslots=st.sampled_from([1, 3, 63, 64, 65, 70]), seed=st.integers(0, 2**32 - 1),
       n=st.integers(0, 40), missing=st.floats(0, 0.5))
def test_walk_matches_the_python_loop(nslots, seed, n, missing):
    rng = random.Random(seed)
    keys = [rng.randrange(2**64) for _ in range(n)]
    owners = {}
    full = (1 << nslots) - 1
    mk = full
    for k in keys:      # masks shrink along the prompt, as a real index's do, with noise bits
        if rng.random() < missing:
            continue
        if rng.random() < 0.2:
            mk &= rng.randrange(1 << nslots)
        v = mk | (rng.randrange(1 << nslots) if rng.random() < 0.1 else 0)
        if v:
            owners[k] = v
    table = native.OwnerMap()
    for k, v in owners.items():
        table[k] = v
    active = full if rng.random() < 0.5 else rng.randrange(1 << nslots)
    want = _python_walk(keys, owners, active)
    for form in (keys, np.array(keys, dtype=np.uint64).tobytes()):
        got = table.walk(form, active)
        assert got == want
        assert all(type(b) is int and type(d) is int for b, d in got)


def test_bit_63_and_64_slot_masks():
    keys = [1, 2, 3]
    for active in (1 << 63, (1 << 64) - 1, 1 << 64, (1 << 64) | 1):
        owners = {1: active, 2: active & ~1 or 4}
        table = native.OwnerMap()
        for k, v in owners.items():
            table[k] = v
        assert table.walk(keys, active) == _python_walk(keys, owners, active)


def test_bad_arguments_are_clear_errors():
    m = native.OwnerMap()
    for bad in (0, -3):
        with pytest.raises(ValueError, match="positive"):
            m[1] = bad
    with pytest.raises(TypeError, match="ints, found str"):
        m[1] = "x"
    with pytest.raises(TypeError, match="list or bytes"):
        m.walk((1, 2), 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        m.walk(b"123", 1)
    with pytest.raises(TypeError):
        m.spec_add((1, 2), {}, {}, 1, 1.0, [])          # keys must be a list
    with pytest.raises(TypeError):
        m.spec_expire([1], {}, [], 1, 1.0)              # keys must be a tuple
    # a predicted key without owners breaks the index's invariant: said, not ignored
    with pytest.raises(KeyError):
        m.spec_expire((7,), {7: 0.5}, [], 2, 1.0)
    assert len(m) == 0


def _state(idx: KvIndex):
    slots = {k: (s.bit, dict(s.owned), dict(s.spec)) for k, s in idx.slots.by_key.items()}
    return (dict(idx.owners.masks.items()), slots, list(idx.owners.log), idx.owners.log_base,
            idx.spec.size, list(idx.slots.losses), idx.stats.speculative_added, idx.stats.speculative_expired,
            idx.speculative_size())


@pytest.mark.parametrize("seed", range(8))
def test_native_and_python_indexes_stay_the_same(seed, monkeypatch):
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(70)]      # slot bits past 64
    docs = [[rng.randrange(50_000) for _ in range(40 * B)] for _ in range(6)]
    keys = [block_keys_list(d, B) for d in docs]
    fast, slow = KvIndex(B), python_index(monkeypatch, B)
    now = 0.0

    def both(op, *a, **kw):
        r1 = getattr(fast, op)(*a, **kw)
        r2 = getattr(slow, op)(*a, **kw)
        assert r1 == r2, op
        return r1

    for step in range(400):
        w = rng.choice(workers[:8] + workers[60:] if step % 2 else workers)
        d = rng.randrange(len(docs))
        i = rng.randrange(0, 30)
        j = rng.randrange(i + 1, 41)
        op = rng.choice(["store", "store", "spec", "spec", "spec", "remove", "expire", "clear"])
        if op == "store":
            both("apply", w, BlocksStored(keys[d][:j], None, docs[d][:j * B], B))
        elif op == "remove":
            both("apply", w, BlocksRemoved(keys[d][i:j]))
        elif op == "spec":
            # as a list and as an array (the coordinator passes arrays)
            ks_ = keys[d][i:j] if step % 3 else np.array(keys[d][i:j], dtype=np.uint64)
            both("add_speculative", w, ks_, now, rng.choice([0.5, 1.0, 3.0]))
        elif op == "expire":
            now += rng.choice([0.25, 0.5, 1.0])
            both("expire_speculative", now, max_entries=rng.choice([None, 1, 3]))
        else:
            both("clear_worker", w)
        assert _state(fast) == _state(slow), (step, op)
        q = keys[rng.randrange(len(docs))][:rng.randrange(1, 41)]
        assert fast.longest_prefix(q) == slow.longest_prefix(q), step
        assert fast.longest_prefix_ranks(np.array(q, dtype=np.uint64)) == slow.longest_prefix_ranks(q)
    fast.check_invariants()
    slow.check_invariants()
    assert fast.stats.speculative_added and fast.stats.speculative_expired


@pytest.mark.parametrize("native_owners", [True, False])
def test_a_refreshed_prediction_is_not_logged(native_owners, monkeypatch):
    """Predicting keys the slot already predicts moves their deadline only: no owner mask
    changes, so nothing is logged and the latest walk stays exact (no second walk)."""
    idx = KvIndex(B) if native_owners else python_index(monkeypatch, B)
    keys = block_keys_list(list(range(8 * B)), B)
    idx.apply("a", BlocksStored(keys[:3], None, list(range(3 * B)), B))
    assert idx.longest_prefix(keys) == {"a": 3}
    idx.add_speculative("b", keys, 0.0, 1.0)
    logged = idx.owners.log_end()
    version = idx.walk_version()
    assert idx.longest_prefix(keys) == {"a": 3, "b": 8}
    idx.add_speculative("b", keys, 0.5, 1.0)      # a refresh: deadlines move to 1.5
    assert idx.owners.log_end() == logged and idx.walk_version() == version
    walks = []
    monkeypatch.setattr(idx.owners, "walk", lambda *a: walks.append(a) or [])
    assert idx.longest_prefix(keys) == {"a": 3, "b": 8} and not walks
    monkeypatch.undo()
    assert idx.expire_speculative(1.2) == 0      # the first entry's keys were refreshed
    assert idx.longest_prefix(keys) == {"a": 3, "b": 8}
    assert idx.expire_speculative(1.5) == 8
    assert idx.longest_prefix(keys) == {"a": 3}
    idx.check_invariants()


def test_speculation_model_on_the_python_loops(monkeypatch):
    monkeypatch.setattr(kt, "OwnerMap", None)
    assert type(KvIndex(B).owners.masks) is dict
    test_kv_index.test_speculation_mixed_with_events_matches_a_model()
