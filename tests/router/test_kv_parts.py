"""The KV index's parts, each alone (router/kv_slots.py, kv_owners.py, kv_streams.py,
kv_speculation.py, kv_memo.py, kv_ledger.py): built directly, fed directly, checked against their
stated invariants and a model, without a `KvIndex` around them. The owner table runs on the
native table and on a dict (`router.kv_owners.OwnerMap` patched away: the Python recipes).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.kv_owners as kv_owners
from router.block_keys import block_keys_list
from router.events import BlocksMoved, BlocksRemoved, BlocksStored, Tier
from router.kv_ledger import BlockLedger, IndexStats
from router.kv_memo import WalkMemo
from router.kv_owners import OwnerTable
from router.kv_slots import SlotTable
from router.kv_speculation import SpeculativeEntries
from router.kv_streams import StreamOrder, StreamVerdict

B = 16


@pytest.fixture
def owners(owner_map) -> OwnerTable:
    t = OwnerTable()
    assert t.native == (owner_map == "native")
    return t


# -- SlotTable --------------------------------------------------------------------------------

def test_slot_table_hands_out_the_lowest_free_bit_and_names_masks():
    t = SlotTable()
    a0, a1, b0 = t.add("a", 0), t.add("a", 1), t.add("b", 0)
    assert (a0.bit, a1.bit, b0.bit) == (1, 2, 4) and t.all_bits == 7
    assert t.names(7) == ("a", "a", "b") and t.names(4) == ("b",)
    assert t.mask(["a"]) == 3 and t.mask(None) == 7 and t.mask(["nobody"]) == 0
    with pytest.raises(ValueError, match="exists already"):
        t.add("a", 1)
    with pytest.raises(ValueError, match="non-empty string"):
        t.add("", 0)
    t.losses[a1.idx] += 3
    assert t.remove_worker("a") == [a0, a1] and t.all_bits == 4 and t.get("a", 0) is None
    # freed bits are reused lowest first, and a mask's names follow the new owner of the bit
    c = t.add("c", 0)
    assert c.bit == 1 and t.names(5) == ("c", "b")
    d = t.add("d", 0)
    assert d.bit == 2 and t.losses[d.idx] == 3          # loss counts never go back
    assert t.workers() == ["b", "c", "d"] and t.remove_worker("nobody") == []
    t.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from("abcdef"), st.integers(0, 2)),
                max_size=60))
def test_slot_table_invariants_hold_under_any_adds_and_removals(ops):
    t = SlotTable()
    live: set = set()
    for add, w, r in ops:
        if add and (w, r) not in live:
            t.add(w, r)
            live.add((w, r))
        elif not add:
            t.remove_worker(w)
            live = {k for k in live if k[0] != w}
        t.check_invariants()
        assert set(t.by_key) == live
        assert bin(t.all_bits).count("1") == len(live)


# -- OwnerTable -------------------------------------------------------------------------------

def test_owner_table_logs_every_mask_change(owners):
    t = owners
    v0 = t.version()
    spec: dict = {}
    t.masks[2] = 4      # what the ledger writes when the slot holds 2 (and logs it)
    t.log.append(2)
    added = t.predict([1, 2, 3], {2: 1}, spec, 4, 9.0)     # key 2 is held: skipped
    assert added == [1, 3] and spec == {1: 9.0, 3: 9.0} and t.log[-3:] == [2, 1, 3]
    assert t.version() != v0
    # predicting again moves deadlines only: no mask changes, nothing logged
    end = t.log_end()
    assert t.predict([1, 3], {}, spec, 4, 12.0) == [1, 3] and spec[1] == 12.0
    assert t.log_end() == end
    assert t.unpredict((1, 3), spec, 4, 11.0) == 0       # not due yet
    assert t.unpredict((1, 3), spec, 4, 12.0) == 2 and not spec
    assert t.masks.get(1) is None and t.masks.get(3) is None and t.log[-2:] == [1, 3]
    assert t.clear_bit(2, 4) == 0 and t.masks.get(2) is None
    e = t.version()[0]
    t.bump_epoch()
    assert t.version()[0] == e + 1
    t.check_invariants()


def test_owner_table_walk_narrows_the_active_mask(owners):
    t = owners
    for k, m in {10: 0b111, 11: 0b011, 12: 0b001}.items():
        t.masks[k] = m
    assert t.walk([10, 11, 12, 13], 0b111) == [(0b100, 1), (0b010, 2), (0b001, 3)]
    assert t.walk(np.array([10, 11], dtype=np.uint64), 0b110) == [(0b100, 1), (0b010, 2)]
    assert t.walk([99], 0b111) == [(0b111, 0)]
    assert t.walk([], 0b1) == [(0b1, 0)]


def test_owner_table_log_trim_keeps_positions(owners, monkeypatch):
    monkeypatch.setattr(kv_owners, "LOG_TRIM", 3)
    t = owners
    t.predict([1, 2, 3, 4], {}, {}, 1, 1.0)
    end = t.log_end()
    t.trim_log()
    assert t.log == [] and t.log_end() == end == 4


# -- StreamOrder ------------------------------------------------------------------------------

def test_stream_order_verdicts():
    o = StreamOrder()
    assert o.expected("w", 0) is None
    assert o.verdict("w", 0, 7) == StreamVerdict.APPLIED        # the first batch: any seq
    o.applied("w", 0, 7)
    assert o.expected("w", 0) == 8 and o.expected("w", 1) is None
    assert o.verdict("w", 0, 8) == StreamVerdict.APPLIED
    assert o.verdict("w", 0, 5) == StreamVerdict.DUPLICATE
    assert o.verdict("w", 0, 9) == StreamVerdict.GAP
    assert o.verdict("w", 0, 0) == StreamVerdict.RESTART
    assert o.verdict("w", 0, 0, restart_at_zero=False) == StreamVerdict.DUPLICATE
    o.reset("w", 0, 1)
    assert o.verdict("w", 0, 0) == StreamVerdict.DUPLICATE      # expected 1: no restart
    o.reset("w", 0)
    assert o.expected("w", 0) is None and o.verdict("w", 0, 3) == StreamVerdict.APPLIED


# -- SpeculativeEntries -----------------------------------------------------------------------

def _spec(owners):
    slots = SlotTable()
    stats = IndexStats()
    return slots, SpeculativeEntries(owners, slots, stats), stats


def test_speculative_entries_add_confirm_expire_and_drop(owners):
    slots, spec, stats = _spec(owners)
    a, b = slots.add("a", 0), slots.add("b", 0)
    assert spec.add(a, [1, 2, 3], 5.0) == 3 and spec.size == 3
    assert spec.add(b, np.array([3, 4], dtype=np.uint64), 6.0) == 2 and spec.size == 5
    assert owners.masks[3] == a.bit | b.bit
    spec.confirm(a, 1)          # a store made key 1 held: the entry goes, the bit stays
    a.owned[1] = 1
    assert spec.size == 4 and owners.masks[1] == a.bit and stats.speculative_confirmed == 1
    spec.check_invariants()
    assert not spec.due(4.9) and spec.due(5.0)
    losses = list(slots.losses)
    assert spec.expire(5.0) == 2 and spec.size == 2        # a's 2 and 3; 1 was confirmed
    assert slots.losses[a.idx] > losses[a.idx] and slots.losses[b.idx] == losses[b.idx]
    assert owners.masks[3] == b.bit and 2 not in owners.masks
    spec.drop_slot(b)
    assert spec.size == 0 and 3 not in owners.masks and 4 not in owners.masks
    assert spec.expire(10.0) == 0 and not spec.due(10.0)      # b's record takes nothing now
    assert (stats.speculative_added, stats.speculative_expired) == (5, 2)
    spec.check_invariants()


def test_speculative_expiry_is_bounded_per_whole_record(owners):
    slots, spec, _ = _spec(owners)
    a = slots.add("a", 0)
    for i in range(4):
        spec.add(a, list(range(10 * i, 10 * i + 10)), 1.0 + i)
    assert spec.expire(9.0, max_entries=1) == 10
    assert spec.expire(9.0, max_keys=15) == 20         # two whole records: never half of one
    assert spec.due(9.0) and spec.expire(9.0) == 10 and spec.size == 0
    # a record of a removed slot expires nothing (a new slot's entries carry their own deadline)
    spec.add(a, [100], 1.0)
    slots.remove_worker("a")
    a2 = slots.add("a", 0)
    spec.add(a2, [200], 20.0)
    assert spec.expire(9.0) == 0 and spec.size == 2     # a's entry was never cleared by a ledger


# -- WalkMemo ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_walk_memo_answers_as_a_fresh_walk(owners, seed):
    """Mutations straight on the owner table (logged, or with an epoch bump and loss counts as
    the ledger and speculation write them): the memo's groups equal a walk every time."""
    rng = random.Random(seed)
    slots = SlotTable()
    for w in "abcde":
        slots.add(w, 0)
    memo = WalkMemo(owners, slots, stride=rng.choice([1, 2, 4]), cap=rng.choice([1, 8]))
    prompts = [[rng.randrange(40) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    prompts += [p + [rng.randrange(40)] for p in prompts]      # next turns share a prefix
    for step in range(300):
        op = rng.random()
        s = slots.by_bit[rng.randrange(5)]
        k = rng.randrange(40)
        if op < 0.35:
            if not owners.masks.get(k, 0) & s.bit:
                owners.masks[k] = owners.masks.get(k, 0) | s.bit
                owners.log.append(k)
        elif op < 0.6:
            if owners.masks.get(k, 0) & s.bit:
                slots.losses[s.idx] += 1
                owners.clear_bit(k, s.bit)
        elif op < 0.65:
            memo.drop() if rng.random() < 0.5 else owners.bump_epoch()
        elif op < 0.8:
            # the tail insert right after a walk, as KvIndex.add_speculative makes it
            p = rng.choice(prompts)
            memo.groups(p)
            have = rng.randrange(len(p) + 1)
            memo.before_tail_insert(p[have:], s.bit)
            owners.predict(p[have:], {}, {}, s.bit, 1.0)
            memo.after_tail_insert()
        p = rng.choice(prompts)
        got = memo.groups(p if step % 3 else np.array(p, dtype=np.uint64))
        assert got == owners.walk(p, slots.all_bits), (step, p)


def test_walk_memo_reuses_an_unchanged_walk(owners):
    slots = SlotTable()
    a = slots.add("a", 0)
    memo = WalkMemo(owners, slots, stride=1)
    owners.predict([1, 2, 3], {}, {}, a.bit, 1.0)
    walks = []
    walk = owners.walk
    owners.walk = lambda keys, active: walks.append(1) or walk(keys, active)
    assert memo.groups([1, 2, 3, 4]) == [(a.bit, 3)] and len(walks) == 1
    owners.predict([50], {}, {}, a.bit, 1.0)        # a key the walk did not read
    assert memo.groups([1, 2, 3, 4]) == [(a.bit, 3)] and len(walks) == 1
    assert memo.registered(4) is memo.latest
    owners.predict([4], {}, {}, a.bit, 1.0)         # one it read: walked again
    assert memo.groups([1, 2, 3, 4]) == [(a.bit, 4)]
    with pytest.raises(ValueError, match="memo_stride must be a positive int"):
        WalkMemo(owners, slots, stride=0)


# -- BlockLedger ------------------------------------------------------------------------------

def _ledger(owners, ns=None):
    slots = SlotTable()
    stats = IndexStats()
    spec = SpeculativeEntries(owners, slots, stats)
    return slots, spec, BlockLedger(B, ns, owners, slots, spec, stats), stats


def test_ledger_refcounts_confirmations_and_restores(owners):
    slots, spec, led, stats = _ledger(owners)
    a, b = slots.add("a", 0), slots.add("b", 0)
    toks = list(range(4 * B))
    keys = block_keys_list(toks, B)
    spec.add(b, keys[:2], 5.0)
    led.store(a, BlocksStored([11, 12, 13, 14], None, toks, B))
    assert led.n_keys == 4 and all(owners.masks[k] & a.bit for k in keys)
    # b's prediction confirmed by its own store; the confirmed count does not double
    led.store(b, BlocksStored([21], None, toks[:B], B))
    assert spec.size == 1 and stats.speculative_confirmed == 1 and led.n_keys == 4
    # the same blocks under a second tier: a second reference, removed without losing the key
    led.store(a, BlocksStored([11, 12], None, None, B, tier=Tier.HOST))
    assert a.owned[keys[0]] == 2
    led.remove(a, BlocksRemoved([11, 12]))
    assert a.owned[keys[0]] == 1 and led.n_keys == 4
    led.move(a, BlocksMoved([13], Tier.GPU, Tier.HOST))
    led.check_invariants()
    led.remove(a, BlocksRemoved([11, 12], tier=Tier.HOST))
    led.remove(a, BlocksRemoved([13], tier=Tier.HOST))
    led.remove(a, BlocksRemoved([14, 99]))
    assert not a.owned and led.n_keys == 1 and stats.unknown_removals == 1    # b's keys[0]
    led.clear(b, None)
    assert led.n_keys == 0 and spec.size == 0 and not dict(owners.masks.items())
    led.check_invariants()
    spec.check_invariants()


def test_ledger_identity_entries_and_snapshots(owners):
    slots, _, led, _ = _ledger(owners)
    a = slots.add("a", 0)
    toks = list(range(3 * B))
    keys = block_keys_list(toks, B)
    led.store(a, BlocksStored(keys, None, toks, B))      # our workers: engine hash == key
    assert not a.emaps.get((Tier.GPU, 0)) and led.n_keys == 3
    led.load_snapshot(a, np.array(keys[:2] + [7], dtype=np.uint64))
    assert led.n_keys == 4           # 7 is new; the others were identity entries already
    led.check_invariants()
    led.clear(a, Tier.GPU)
    assert not a.owned and led.n_keys == 0
    led.check_invariants()
