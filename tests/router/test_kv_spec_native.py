"""router/_kv_spec.c, the native loops of the KV index's speculative entries, against the Python
loops of router/kv_speculation.py: two indexes fed the same stores, removals, speculative inserts
and expiries (one with the native loops, one without) hold the same owner maps, slot maps, change
log and counters after every step, over more than 64 slots (owner bitmasks past one machine
word); and the index's model test of speculation passes on the Python loops too."""

from __future__ import annotations

import os
import random

import pytest

import router.kv_speculation as ks
from router.block_keys import block_keys_list
from router.events import BlocksRemoved, BlocksStored
from router.kv_index import KvIndex

from . import test_kv_index

# CI installs with a C compiler: there a build that silently fell back to Python is a failure
if os.environ.get("CI"):
    import router._kv_spec as native
else:
    native = pytest.importorskip("router._kv_spec")

B = 16


def test_native_loops_are_what_the_index_uses():
    assert ks.NATIVE and ks._native is native


def _state(idx: KvIndex):
    slots = {k: (s.bit, dict(s.owned), dict(s.spec)) for k, s in idx._slots.items()}
    return (dict(idx._owners), slots, list(idx._log), idx._n_spec, list(idx._losses),
            idx.stats.speculative_added, idx.stats.speculative_expired, idx.speculative_size())


@pytest.mark.parametrize("seed", range(8))
def test_native_and_python_loops_leave_the_same_index(seed, monkeypatch):
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(70)]      # slot bits past 64
    docs = [[rng.randrange(50_000) for _ in range(40 * B)] for _ in range(6)]
    keys = [block_keys_list(d, B) for d in docs]
    fast, slow = KvIndex(B), KvIndex(B)
    now = 0.0

    def both(op, *a, **kw):
        r1 = getattr(fast, op)(*a, **kw)
        with monkeypatch.context() as m:
            m.setattr(ks, "_native", None)
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
            ev = BlocksStored(keys[d][:j], None, docs[d][:j * B], B)
            both("apply", w, ev)
        elif op == "remove":
            both("apply", w, BlocksRemoved(keys[d][i:j]))
        elif op == "spec":
            ttl = rng.choice([0.5, 1.0, 3.0])
            both("add_speculative", w, keys[d][i:j], now, ttl)
        elif op == "expire":
            now += rng.choice([0.25, 0.5, 1.0])
            both("expire_speculative", now, max_entries=rng.choice([None, 1, 3]))
        else:
            both("clear_worker", w)
        assert _state(fast) == _state(slow), (step, op)
    fast.check_invariants()
    slow.check_invariants()
    assert fast.stats.speculative_added and fast.stats.speculative_expired


def test_speculation_model_on_the_python_loops(monkeypatch):
    monkeypatch.setattr(ks, "_native", None)
    test_kv_index.test_speculation_mixed_with_events_matches_a_model()


def test_bad_arguments_raise_type_errors():
    with pytest.raises(TypeError):
        native.add((1, 2), {}, {}, {}, 1, 1.0)          # keys must be a list
    with pytest.raises(TypeError):
        native.expire([1], {}, {}, [], -2, 1.0)         # keys must be a tuple
    with pytest.raises(TypeError):
        native.add([1], {}, {}, {}, 1)
    # a predicted key without owners breaks the index's invariant: said, not ignored
    with pytest.raises(KeyError):
        native.expire((7,), {7: 0.5}, {}, [], -2, 1.0)
