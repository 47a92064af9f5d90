"""router/_kv_walk.c, the KV index's prefix walk, against the Python loop of router/kv_query.py
`QueryMixin._walk`: the same groups for random owner maps over up to 70 slots (masks past one
machine word: the native code's second path), keys missing from the map, owner masks holding bits
outside the active set, and the 64-bit boundary itself; and two indexes fed the same stores,
removals, speculative inserts and expiries (one walking natively, one in Python) answer every
prefix query alike."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.kv_query as kq
from router.block_keys import block_keys_list
from router.events import BlocksStored
from router.kv_index import KvIndex

# CI installs with a C compiler: there a build that silently fell back to Python is a failure
if os.environ.get("CI"):
    import router._kv_walk as native
else:
    native = pytest.importorskip("router._kv_walk")

B = 16


def _python_walk(keys, owners, active):
    idx = KvIndex(B)
    idx._owners = owners
    saved, kq._native_walk = kq._native_walk, None
    try:
        return idx._walk(keys, active)
    finally:
        kq._native_walk = saved


def test_native_walk_is_what_the_index_uses():
    assert kq.NATIVE and kq._native_walk is native.walk


@settings(max_examples=300, deadline=None)
@given(nslots=st.sampled_from([1, 3, 63, 64, 65, 70]), seed=st.integers(0, 2**32 - 1),
       n=st.integers(0, 40), missing=st.floats(0, 0.5))
def test_native_walk_matches_the_python_loop(nslots, seed, n, missing):
    rng = random.Random(seed)
    keys = [rng.randrange(2**64) for _ in range(n)]
    owners = {}
    full = (1 << nslots) - 1
    m = full
    for k in keys:      # masks shrink along the prompt, as a real index's do, with noise bits
        if rng.random() < missing:
            continue
        if rng.random() < 0.2:
            m &= rng.randrange(1 << nslots)
        owners[k] = m | (rng.randrange(1 << nslots) if rng.random() < 0.1 else 0)
    active = full if rng.random() < 0.5 else rng.randrange(1 << nslots)
    got = native.walk(keys, owners, active)
    assert got == _python_walk(keys, owners, active)
    assert all(type(b) is int and type(d) is int for b, d in got)


def test_bit_63_and_64_slot_masks():
    keys = [1, 2, 3]
    for active in (1 << 63, (1 << 64) - 1, 1 << 64, (1 << 64) | 1):
        owners = {1: active, 2: active & ~1, 3: 0}
        assert native.walk(keys, owners, active) == _python_walk(keys, owners, active)


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError):
        native.walk((1, 2), {}, 1)
    with pytest.raises(TypeError):
        native.walk([1], {1: "x"}, 1)


@pytest.mark.parametrize("seed", range(4))
def test_indexes_walking_natively_and_in_python_answer_alike(seed, monkeypatch):
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(70)]
    docs = [[rng.randrange(50_000) for _ in range(24 * B)] for _ in range(5)]
    keys = [block_keys_list(d, B) for d in docs]
    fast, slow = KvIndex(B), KvIndex(B)
    now = 0.0
    for step in range(300):
        w = rng.choice(workers)
        d = rng.randrange(len(docs))
        i = rng.randrange(0, 20)
        if step % 3 == 0:
            ev = BlocksStored(keys[d][:i + 4], None, docs[d][:(i + 4) * B], B)
            for x in (fast, slow):
                x.apply(w, ev)
        else:
            now += rng.random() * 0.5
            for x in (fast, slow):
                x.add_speculative(w, keys[d][i:], now, 1.0)
                x.expire_speculative(now, 3)
        q = keys[rng.randrange(len(docs))][:rng.randrange(1, 24)]
        with monkeypatch.context() as m:
            m.setattr(kq, "_native_walk", None)
            want = slow.longest_prefix(q)
        assert fast.longest_prefix(q) == want, step
    fast.check_invariants()
