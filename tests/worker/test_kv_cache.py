"""BlockPool: reference counts, LRU prefix cache, pins, events; invariants under random operations."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.block_keys import block_keys_list
from router.events import AllCleared, BlocksRemoved, BlocksStored
from worker.kv_cache import BlockPool, BlockPoolError, NoFreeBlocks

B = 4


def keys_of(tokens, parent=None):
    return block_keys_list(tokens, B, 0, parent)


def apply_events(resident: set, events) -> set:
    for ev in events:
        if isinstance(ev, BlocksStored):
            assert ev.parent_engine_hash is None or ev.parent_engine_hash in resident, \
                "a stored block's parent must be resident when it is published"
            assert len(ev.token_ids) == B * len(ev.engine_hashes)
            resident.update(ev.engine_hashes)
        elif isinstance(ev, BlocksRemoved):
            for h in ev.engine_hashes:
                assert h in resident, "removal of a key that was never stored"
                resident.discard(h)
        elif isinstance(ev, AllCleared):
            resident.clear()
    return resident


def test_allocate_free_counts():
    p = BlockPool(8, B)
    a = p.allocate(3)
    assert p.num_used == 3 and p.num_free == 5 and p.num_cached == 0
    p.free(a)
    assert p.num_used == 0 and p.num_free == 8
    with pytest.raises(NoFreeBlocks) as e:
        p.allocate(9)
    assert e.value.requested == 9 and e.value.available == 8
    with pytest.raises(BlockPoolError, match="freed more often"):
        p.free([a[0]])
    p.check_invariants()


def test_commit_match_and_lru_eviction_order():
    p = BlockPool(4, B)
    toks = list(range(12))
    ks = keys_of(toks)
    blocks = p.allocate(3)
    for i, b in enumerate(blocks):
        assert p.commit(b, ks[i], ks[i - 1] if i else None, toks[i * B:(i + 1) * B])
    evs = p.drain_events()
    assert len(evs) == 1 and evs[0].engine_hashes == ks and evs[0].parent_engine_hash is None
    assert evs[0].token_ids == toks
    p.free(blocks)
    assert p.num_cached == 3 and p.num_used == 0
    # the prefix hit comes back incref'd, in chain order
    hit = p.match_prefix(ks[:2] + [12345])
    assert hit == blocks[:2] and p.num_used == 2 and p.num_cached == 1
    p.free(hit)
    # the tail of a freed sequence is evicted first, so its prefix survives longest
    got = p.allocate(2)  # one free block + one eviction
    evs = p.drain_events()
    assert evs == [BlocksRemoved(engine_hashes=[ks[2]], group=0)]
    assert set(p.resident_keys()) == set(ks[:2])
    p.free(got)
    p.check_invariants()


def test_commit_refuses_duplicates_orphans_and_partial_blocks():
    p = BlockPool(6, B)
    toks = list(range(8))
    ks = keys_of(toks)
    a, b = p.allocate(2)
    assert p.commit(a, ks[0], None, toks[:4])
    c = p.allocate(1)[0]
    assert not p.commit(c, ks[0], None, toks[:4]), "a key names one block only"
    assert p.key_of(c) is None
    assert not p.commit(b, 999, 12345, toks[4:]), "parent not resident: unreachable block"
    with pytest.raises(BlockPoolError, match="only full blocks"):
        p.commit(b, ks[1], ks[0], toks[4:7])
    free_block = p.allocate(1)[0]
    p.free([free_block])
    with pytest.raises(BlockPoolError, match="holds no reference"):
        p.commit(free_block, ks[1], ks[0], toks[4:])
    p.free([a, b, c])
    assert p.num_cached == 1 and p.num_free == 5
    p.check_invariants()


def test_pins_are_references():
    p = BlockPool(4, B)
    toks = list(range(4))
    k = keys_of(toks)[0]
    (b,) = p.allocate(1)
    p.commit(b, k, None, toks)
    p.pin([b])
    p.free([b])  # the request lets go; the pin holds the block
    assert p.num_used == 1 and p.num_pinned == 1 and p.num_cached == 0
    with pytest.raises(NoFreeBlocks):
        p.allocate(4)
    p.unpin([b])
    assert p.num_used == 0 and p.num_cached == 1 and p.num_pinned == 0
    with pytest.raises(BlockPoolError, match="pinned 0x"):
        p.unpin([b])
    free_id = next(i for i in range(4) if p.ref_count(i) == 0 and p.key_of(i) is None)
    with pytest.raises(BlockPoolError, match="free block"):
        p.pin([free_id])
    p.pin([b])  # a cached block can be pinned (it is taken off the LRU list)
    assert p.num_cached == 0 and p.num_pinned == 1
    p.unpin([b])
    p.check_invariants()


def test_clear_forgets_keys_but_not_references():
    p = BlockPool(4, B)
    toks = list(range(8))
    ks = keys_of(toks)
    a, b = p.allocate(2)
    p.commit(a, ks[0], None, toks[:4])
    p.commit(b, ks[1], ks[0], toks[4:])
    p.free([b])
    p.drain_events()
    p.clear()
    assert p.drain_events() == [AllCleared()]
    assert p.resident_keys() == [] and p.num_used == 1 and p.num_cached == 0
    p.free([a])
    assert p.num_free == 4
    p.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """Random request-like traffic; invariants after every step; events replayed onto a set
    always equal the pool's resident keys."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, B)
        self.seqs: list[tuple[list[int], list[int]]] = []  # (blocks, tokens) held by "requests"
        self.pins: list[list[int]] = []
        self.resident: set[int] = set()

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def run_request(self, prompt):
        # 4 distinct token values and short prompts: many shared prefixes
        p = self.pool
        n_full = len(prompt) // B
        ks = keys_of(prompt[:n_full * B])
        cap = (len(prompt) - 1) // B
        hit = p.match_prefix(ks[:cap])
        need = -(-len(prompt) // B) - len(hit)
        try:
            new = p.allocate(need)
        except NoFreeBlocks:
            p.free(hit)
            return
        blocks = hit + new
        for i in range(len(hit), n_full):
            p.commit(blocks[i], ks[i], ks[i - 1] if i else None, prompt[i * B:(i + 1) * B])
        self.seqs.append((blocks, prompt))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        blocks, _ = self.seqs.pop(i % len(self.seqs))
        self.pool.free(blocks)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def finish_pinned(self, i):
        blocks, _ = self.seqs.pop(i % len(self.seqs))
        self.pool.pin(blocks)
        self.pool.free(blocks)
        self.pins.append(blocks)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        self.pool.unpin(self.pins.pop(i % len(self.pins)))

    @rule()
    def clear(self):
        self.pool.clear()

    @rule()
    def drain(self):
        apply_events(self.resident, self.pool.drain_events())
        assert self.resident == set(self.pool.resident_keys())

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        held = sum(len(b) for b, _ in self.seqs) + sum(len(b) for b in self.pins)
        assert held >= self.pool.num_used

    def teardown(self):
        for b, _ in self.seqs:
            self.pool.free(b)
        for b in self.pins:
            self.pool.unpin(b)
        assert self.pool.num_used == 0, "every reference returned: nothing in use"
        apply_events(self.resident, self.pool.drain_events())
        assert self.resident == set(self.pool.resident_keys())
        self.pool.check_invariants()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("seed", range(20))
def test_commit_run_equals_one_commit_per_block(seed):
    """The batched path (the scheduler's) changes the pool and emits events exactly as one
    ``commit`` per block would, including keys already resident in other blocks and a chain
    whose parent is gone; a malformed run is refused before anything changes."""
    import random

    rng = random.Random(seed)
    toks = [rng.randrange(50) for _ in range(B * 12)]
    ks = keys_of(toks)
    pools = []
    for batched in (False, True):
        p = BlockPool(40, B)
        rng2 = random.Random(seed)
        # some keys of the chain are resident already, in blocks of another request
        other = p.allocate(12)
        for i in range(12):
            if rng2.random() < 0.3:
                p.commit(other[i], ks[i], ks[i - 1] if i else None, toks[i * B:(i + 1) * B])
        p.drain_events()
        blocks = p.allocate(12)
        start = rng2.randrange(12)
        parent = ks[start - 1] if start else None
        if batched:
            n = p.commit_run(blocks[start:], ks[start:], parent, toks[start * B:])
        else:
            n = sum(p.commit(blocks[i], ks[i], ks[i - 1] if i else None, toks[i * B:(i + 1) * B])
                    for i in range(start, 12))
        pools.append((n, [p.key_of(b) for b in blocks + other], p.drain_events(),
                      sorted(p.resident_keys())))
        p.check_invariants()
    assert pools[0] == pools[1]
    p = BlockPool(4, B)
    bl = p.allocate(2)
    with pytest.raises(BlockPoolError, match="expected 2 keys and 8 tokens"):
        p.commit_run(bl, ks[:2], None, toks[:7])
