"""The KV index's capacity bound (router/kv_capacity.py) through `KvIndex`: routed prompts age a
server's cache, a walk's match is cut where the blocks routed there since have evicted it, the
engine's stores and removals stay the truth, and the invariants hold after every step. Both owner
tables (router/_owner_map.c and the dict recipes) run every test."""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import numpy as np
import pytest

import router.kv_owners as kv_owners
from router.events import AllCleared, BlocksRemoved, BlocksStored
from router.block_keys import block_keys_list
from router.kv_capacity import STRIDE
from router.kv_index import KvIndex

B = 16


@pytest.fixture
def index(owner_map) -> KvIndex:
    ix = KvIndex(block_size=B)
    assert ix.owners.native == (owner_map == "native")
    return ix


def chain(tag: int, n: int, prefix: list | None = None) -> list[int]:
    """n block keys: ``prefix`` then new keys of tree ``tag`` (distinct across tags)."""
    prefix = list(prefix or [])
    return prefix + [(tag << 32) + i + 1 for i in range(len(prefix), n)]


def route(ix: KvIndex, w: str, keys: list[int]) -> int:
    """What the coordinator does per placement: the walk's depth, then the routed insert."""
    have = ix.longest_prefix(np.array(keys, dtype=np.uint64)).get(w, 0)
    ix.routed(w, np.array(keys, dtype=np.uint64), have, 0.0, 30.0)
    ix.check_invariants()
    return have


def match(ix: KvIndex, w: str, keys: list[int]) -> int:
    return ix.longest_prefix(np.array(keys, dtype=np.uint64)).get(w, 0)


def test_routed_blocks_evict_the_oldest_prompt_tail_first(index):
    ix = index
    ix.set_capacity("a", 32)
    p = [chain(t, 8) for t in range(6)]
    for k in range(4):                      # 32 blocks: all fit
        assert route(ix, "a", p[k]) == 0
    assert [match(ix, "a", x) for x in p[:4]] == [8, 8, 8, 8]
    route(ix, "a", p[4][:3])                # 3 new blocks evict p0's 3 deepest
    assert match(ix, "a", p[0]) == 5 and match(ix, "a", p[1]) == 8
    route(ix, "a", p[4])                    # 5 more: p0 is gone
    assert match(ix, "a", p[0]) == 0 and match(ix, "a", p[1]) == 8
    # the owner masks still say the slot predicts p0's keys: only the model cut them
    assert ix.speculative_size() == 40
    ix.check_invariants()


def test_a_prefix_used_again_stays_while_the_others_go(index):
    ix = index
    ix.set_capacity("a", 40)
    system = chain(99, 8)
    route(ix, "a", chain(1, 16, system))
    route(ix, "a", chain(2, 16, system))
    for t in range(3, 9):                   # each turn uses the system prompt again
        assert route(ix, "a", chain(t, 16, system)) == 8
    assert match(ix, "a", chain(1, 16, system)) == 8     # its own tail is gone, the prefix not
    assert match(ix, "a", chain(8, 16, system)) == 16
    # another worker's matches are its own: no capacity there, nothing cut
    route(ix, "b", chain(1, 16, system))
    assert ix.longest_prefix(np.array(chain(1, 16, system), dtype=np.uint64)) == {"a": 8, "b": 16}


def test_a_fully_matched_prompt_used_again_stamps_as_routed_does(owner_map, monkeypatch):
    """`KvIndex.used` (the coordinator's call when all of a placed prompt matched) leaves the
    model as `routed` does for it: the same stamps, lowest stamps, pressed slots and answers,
    the young prefix skipped and the sweep run alike (its slack cut so that it runs here)."""
    from router import kv_capacity
    monkeypatch.setattr(kv_capacity, "_SWEEP_SLACK", 4)
    runs = []
    for full in ("routed", "used"):
        ix = KvIndex(block_size=B)
        ix.set_capacity("a", 24)
        trees = [chain(t, 12, chain(99, 4)) for t in range(1, 9)]
        answers, full_matches = [], 0
        for step in range(60):
            if step == 30:      # every prediction gone: their stamps are garbage to sweep
                ix.expire_speculative(100.0)
            keys = np.array(trees[(step * 5) % len(trees)][:4 + step % 9], dtype=np.uint64)
            have = ix.longest_prefix(keys).get("a", 0)
            if have < len(keys):
                ix.routed("a", keys, have, 0.0, 30.0)
                continue
            full_matches += 1
            if full == "used":
                ix.used("a", keys, have)
            else:
                ix.routed("a", keys, have, 0.0, 30.0)
            ix.check_invariants()
            answers.append(have)
        s = ix.slots.rank0["a"]
        runs.append((answers, ix.capacity.stamps_of(s), s.low, s.clock, ix.slots.pressed))
        # the case, and the sweep ran (55 stamps are left without it)
        assert full_matches >= 10 and len(runs[-1][1]) < 40
    assert runs[0] == runs[1]
    ix.used("b", np.array(chain(1, 4), dtype=np.uint64), 4)       # no slot: nothing to stamp


def _store(ix: KvIndex, w: str, keys: list[int]) -> None:
    """Our worker's events: engine hash == canonical key of the prompt's tokens."""
    tokens = [int(x) for x in np.random.default_rng(keys[0] & 0xFFFF).integers(0, 1000, len(keys) * B)]
    ks = block_keys_list(tokens, B, ix.ledger._ns, None)
    ix.apply(w, BlocksStored(engine_hashes=ks, parent_engine_hash=None, token_ids=tokens,
                             engine_block_size=B))
    return ks


def test_held_blocks_are_cut_and_the_engines_events_stay_the_truth(index):
    ix = index
    ix.set_capacity("a", 16)
    held = _store(ix, "a", [1] * 8)         # 8 blocks the engine stored (no routing)
    assert ix.slots.get("a", 0).clock == 8
    assert route(ix, "a", held) == 8        # routed: stamped
    other = _store(ix, "a", [2] * 8)        # 8 more come in by events: 16, the cache is full
    assert match(ix, "a", held) == 8
    route(ix, "a", chain(5, 6))             # 6 routed blocks will evict the 6 oldest held ones
    assert match(ix, "a", held) == 2
    assert set(held) <= ix.keys_of("a")     # still held per the events
    # the engine evicts them: the removal is applied as always, and the cut stays consistent
    ix.apply("a", BlocksRemoved(engine_hashes=held[2:]))
    assert match(ix, "a", held) == 2 and not set(held[2:]) & ix.keys_of("a")
    # a store confirming a prediction brings nothing new; an unpredicted one advances the clock
    clock = ix.slots.get("a", 0).clock
    ix.apply("a", BlocksStored(engine_hashes=[chain(5, 6)[0]], parent_engine_hash=None,
                               token_ids=None, engine_block_size=B))
    assert ix.slots.get("a", 0).clock == clock
    ix.check_invariants()
    # a cleared cache has no ages: what the events then store is matched as they say
    ix.apply("a", AllCleared())
    assert not ix.slots.pressed
    again = _store(ix, "a", [2] * 8)
    assert again == other and match(ix, "a", other) == 8
    ix.check_invariants()


def test_without_a_capacity_the_answers_are_the_walks(index):
    rng = random.Random(5)
    ix = index
    ref = KvIndex(block_size=B)
    ix.set_capacity("a", 4096)              # never full: nothing cut either
    trees = [chain(t, 40) for t in range(12)]
    for _ in range(200):
        w = rng.choice("abc")
        keys = trees[rng.randrange(12)][:rng.randrange(1, 41)]
        for x in (ix, ref):
            route(x, w, keys)
        probe = np.array(trees[rng.randrange(12)], dtype=np.uint64)
        assert ix.longest_prefix(probe) == ref.longest_prefix(probe)
        assert ix.longest_prefix_ranks(probe) == ref.longest_prefix_ranks(probe)
    ix.set_capacity("a", None)
    assert ix.capacity_of("a") is None and not ix.slots.pressed
    ix.check_invariants()


class LruEngine:
    """A reference cache: an engine's LRU of ``cap`` blocks. A request pins its cached prefix,
    brings its tail in (evicting the least recently used blocks), and frees its blocks tail
    first; `run` answers (cached blocks, evicted keys) as the worker reports and publishes them."""

    def __init__(self, cap: int):
        self.cap = cap
        self.lru: OrderedDict = OrderedDict()      # oldest first

    def match(self, keys: list) -> int:
        n = 0
        for k in keys:
            if k not in self.lru:
                break
            n += 1
        return n

    def run(self, keys: list) -> tuple[int, list]:
        have = self.match(keys)
        evicted = []
        for k in keys[:have]:
            del self.lru[k]                 # pinned while the request runs
        for k in keys[have:]:
            self.lru.pop(k, None)           # a deeper key cached past a hole is recomputed
        used = have
        for _ in keys[have:]:
            if len(self.lru) + used >= self.cap and self.lru:
                evicted.append(self.lru.popitem(last=False)[0])
            used += 1
        for k in reversed(keys):            # freed tail first: the prompt's first key is the newest
            self.lru[k] = None
        return have, evicted


def replay(ix: KvIndex, cap: int, lag: int, seed: int, n_trees: int = 30, length: int = 24,
           steps: int = 300) -> tuple[int, int]:
    """Requests over ``n_trees`` prefix trees (popular ones more often) routed to one server and
    run ``lag`` placements later, in order, the engine's stores and removals applied to the
    index as they happen; returns (predicted, actually cached) blocks summed."""
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    eng = LruEngine(cap)
    trees = []
    for _ in range(n_trees):
        tokens = np_rng.integers(0, 50_000, length * B).tolist()
        trees.append((tokens, block_keys_list(tokens, B, ix.ledger._ns, None)))
    queue: deque = deque()
    predicted = actual = 0
    for i in range(steps + lag):
        if i < steps:
            tokens, keys = trees[min(int(rng.expovariate(3 / n_trees)), n_trees - 1)]
            n = rng.randrange(2, length + 1)
            arr = np.array(keys[:n], dtype=np.uint64)
            have = ix.longest_prefix(arr).get("a", 0)
            ix.routed("a", arr, have, 0.0, 1e9)
            queue.append((tokens[:n * B], keys[:n], have))
        if len(queue) > lag or i >= steps:
            tokens, keys, have = queue.popleft()
            got, evicted = eng.run(keys)
            predicted += have
            actual += got
            if evicted:
                ix.apply("a", BlocksRemoved(engine_hashes=evicted))
            if got < len(keys):
                ix.apply("a", BlocksStored(engine_hashes=keys[got:],
                                           parent_engine_hash=keys[got - 1] if got else None,
                                           token_ids=tokens[got * B:], engine_block_size=B))
    ix.check_invariants()
    return predicted, actual


@pytest.mark.parametrize("cap,lag", [(64, 2), (200, 8), (200, 2)])
def test_predictions_follow_an_lru_engine_behind_a_queue(index, cap, lag):
    """With requests queued behind the routing, the index without a capacity promises blocks the
    queue's own tails evict; with it, what it predicts is what the engine then reuses (actual /
    predicted >= 0.9), without giving up more than 10% of it (<= 1.1). No queue: the events say
    it all, and the model takes away almost nothing."""
    base = KvIndex(block_size=B)
    p0, a0 = replay(base, cap, lag, seed=cap + lag)
    index.set_capacity("a", cap)
    p1, a1 = replay(index, cap, lag, seed=cap + lag)
    assert a0 == a1                         # one server: the engine's hits do not depend on it
    assert a0 / p0 < 0.97 and 0.9 <= a1 / p1 <= 1.1, (a0 / p0, a1 / p1)
    fresh = KvIndex(block_size=B)
    fresh.set_capacity("a", cap)
    p2, a2 = replay(fresh, cap, 0, seed=1)
    assert 1.0 <= a2 / p2 <= 1.06, a2 / p2


def test_blocks_pinned_by_running_requests_shrink_the_room(index):
    ix = index
    ix.set_capacity("a", 32)
    p = [chain(t, 8) for t in range(3)]
    for k in range(3):
        route(ix, "a", p[k])
    assert match(ix, "a", p[0]) == 8
    # 16 of the 32 blocks held by running requests: 24 routed blocks since p0 evicted it
    ix.set_pinned_source(lambda w: 16)
    assert match(ix, "a", p[0]) == 0 and match(ix, "a", p[2]) == 8
    ix.set_pinned_source(lambda w: 10_000)      # never below cap / FLOOR
    assert match(ix, "a", p[2]) == 4
    ix.set_pinned_source(None)
    assert match(ix, "a", p[0]) == 8
    ix.check_invariants()


@pytest.mark.skipif(not kv_owners.NATIVE, reason="router/_owner_map.c did not build")
@pytest.mark.parametrize("seed", range(4))
def test_native_age_loops_are_the_python_recipes(seed):
    """router/_owner_map.c's age_stamp and age_cut against kv_capacity.py's _stamp_py and _cut_py
    on the same random calls: the same stamps, the same cuts."""
    from router.kv_capacity import AGE_OFFSET, _cut_py, _stamp_py
    rng = random.Random(seed)
    native, plain = kv_owners.OwnerMap(), {}
    trees = [chain(t, 60) for t in range(6)]
    clock = 0
    for _ in range(300):
        keys = trees[rng.randrange(6)][:rng.randrange(1, 61)]
        arr = np.array(keys, dtype=np.uint64)
        stride = rng.choice((1, 2, 4, 7))
        clock += rng.randrange(0, 40)
        args = (stride, clock, rng.randrange(0, len(keys) + 1), rng.randrange(0, 60))
        assert native.age_stamp(arr, *args) == _stamp_py(plain, keys, *args)
        assert {k: v - AGE_OFFSET for k, v in native.items()} == plain
        depth = rng.randrange(1, len(keys) + 1)
        limit = clock - rng.randrange(1, 120)
        scan = rng.choice((0, 2, 16))
        assert native.age_cut(arr, depth, limit, stride, scan) == \
            _cut_py(plain, keys, depth, limit, stride, scan)
    with pytest.raises(ValueError, match="depth"):
        native.age_cut(np.array([1, 2], dtype=np.uint64), 3, 0, 4, 16)
    with pytest.raises(ValueError, match="u64"):
        native.age_stamp(b"123", 4, 0, 0, 0)


def test_routed_prompts_pin_what_running_requests_brought():
    from router.kv_capacity import RoutedPrompts
    r = RoutedPrompts()
    r.started("generation", 1, "a", 5)
    r.started("generation", 1, "a", 5)                  # idempotent
    r.started("context", 1, "a", 2)
    r.started("generation", 2, "b", 7)
    r.started("generation", 3, "a", 0)                  # fully cached: brings nothing
    assert (r.pinned("a"), r.pinned("b"), r.pinned("c")) == (7, 7, 0)
    source = r.pinned_source()          # what the coordinator gives KvIndex.set_pinned_source
    assert (source("a"), source("b"), source("c")) == (7, 7, None)
    r.check_invariants()
    r.ended("generation", 1)
    r.ended("generation", 1)                            # idempotent
    r.ended("generation", 3)
    assert r.pinned("a") == 2
    r.ended("context", 1)
    r.ended("generation", 2)
    assert not r.live and r.pinned("a") == r.pinned("b") == 0
    r.check_invariants()
