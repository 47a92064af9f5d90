"""KvIndex: ownership, engine-hash mapping, ratios, partial blocks, speculation, properties."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.block_keys import block_keys_list, salt_seed
from router.events import (AllCleared, BlocksMoved, BlocksRemoved, BlocksStored, EventBatch,
                           Tier, decode_zmq, encode_vllm_batch)
from router.kv_index import KvIndex, StreamVerdict

B = 16
TOKS = [(i * 7919 + 13) % 152064 for i in range(16 * 12)]
KEYS = block_keys_list(TOKS, B)


def stored(hashes, parent, tokens, bs=B, **kw):
    return BlocksStored(list(hashes), parent, list(tokens), bs, **kw)


def state(idx: KvIndex):
    """Everything observable about the index (for restore/equality properties)."""
    return (copy.deepcopy(idx.owners.masks),
            {k: dict(s.owned) for k, s in idx.slots.by_key.items() if s.owned},
            {k: {e: dict(m) for e, m in s.emaps.items() if m} for k, s in idx.slots.by_key.items()
             if any(s.emaps.values())})


def test_store_chain_and_match():
    idx = KvIndex(B)
    idx.apply("w", stored([101, 102, 103], None, TOKS[:48]))
    idx.apply("w", stored([104], 103, TOKS[48:64]))
    assert idx.longest_prefix(KEYS) == {"w": 4}
    assert idx.longest_prefix(KEYS[:2]) == {"w": 2}
    assert idx.worker_size("w") == 4 and idx.size == 4
    assert idx.keys_of("w") == set(KEYS[:4])
    idx.check_invariants()


def test_one_walk_reports_every_worker():
    idx = KvIndex(B)
    for w, n in (("a", 2), ("b", 5), ("c", 12)):
        idx.apply(w, stored([7000 + i for i in range(n)], None, TOKS[:n * B]))
    idx.apply("d", stored([1], None, [9] * B))  # unrelated content
    assert idx.longest_prefix(KEYS) == {"a": 2, "b": 5, "c": 12}
    assert idx.longest_prefix(np.array(KEYS, dtype=np.uint64)) == {"a": 2, "b": 5, "c": 12}
    assert idx.longest_prefix(KEYS, workers=["a", "d", "zz"]) == {"a": 2, "d": 0, "zz": 0}
    assert idx.longest_prefix([]) == {}
    # a key missing in the middle ends the run even if later keys are present
    idx.apply("c", BlocksRemoved([7003]))
    assert idx.longest_prefix(KEYS)["c"] == 3


def test_more_than_64_workers():
    idx = KvIndex(B)
    for i in range(130):
        idx.apply(f"w{i}", stored([1 + j for j in range(1 + i % 7)], None, TOKS[:(1 + i % 7) * B]))
    got = idx.longest_prefix(KEYS)
    assert got == {f"w{i}": 1 + i % 7 for i in range(130)}
    idx.check_invariants()


def test_idempotent_store_and_unknown_removal():
    idx = KvIndex(B)
    ev = stored([1, 2], None, TOKS[:32])
    idx.apply("w", ev)
    before = state(idx)
    idx.apply("w", ev)  # kv_cache_report_mode=full re-emits hits
    assert state(idx) == before and idx.stats.duplicate_stores == 2
    idx.apply("w", BlocksRemoved([99]))
    assert idx.stats.unknown_removals == 1 and state(idx) == before


def test_dangling_parent_is_counted_and_skipped():
    idx = KvIndex(B)
    idx.apply("w", stored([5], 12345, TOKS[:16]))
    assert idx.size == 0 and idx.stats.dangling_parents == 1


def test_parent_resolution_is_per_worker():
    idx = KvIndex(B)
    idx.apply("a", stored([1], None, TOKS[:16]))
    idx.apply("b", stored([2], 1, TOKS[16:32]))  # b never stored hash 1
    assert idx.longest_prefix(KEYS) == {"a": 1} and idx.stats.dangling_parents == 1


def test_all_cleared_and_clear_worker():
    idx = KvIndex(B)
    idx.apply("a", stored([1, 2], None, TOKS[:32]))
    idx.apply("b", stored([1, 2], None, TOKS[:32]))
    idx.apply("a", AllCleared())
    assert idx.worker_size("a") == 0 and idx.longest_prefix(KEYS) == {"b": 2}
    idx.clear_worker("b")
    assert idx.size == 0 and idx.longest_prefix(KEYS) == {}
    assert idx.stats.clears == 2
    idx.check_invariants()


def test_remove_worker_frees_and_reuses_bits():
    idx = KvIndex(B)
    idx.apply("a", stored([1], None, TOKS[:16]))
    idx.apply("b", stored([1], None, TOKS[:16]))
    idx.remove_worker("a")
    assert idx.workers() == ["b"] and idx.longest_prefix(KEYS) == {"b": 1}
    idx.apply("c", stored([1, 2], None, TOKS[:32]))
    assert idx.longest_prefix(KEYS) == {"b": 1, "c": 2}
    idx.check_invariants()


def test_dp_ranks_are_separate_slots():
    idx = KvIndex(B)
    idx.apply("w", stored([1, 2, 3], None, TOKS[:48]), dp_rank=1)
    idx.apply("w", stored([1], None, TOKS[:16]), dp_rank=0)
    assert idx.longest_prefix(KEYS) == {"w": 3}
    assert idx.longest_prefix_ranks(KEYS) == {("w", 0): 1, ("w", 1): 3}
    idx.apply("w", BlocksRemoved([3]), dp_rank=0)  # rank 0 never had it
    assert idx.longest_prefix_ranks(KEYS)[("w", 1)] == 3
    assert idx.worker_size("w") == 4


def test_tiers_and_groups():
    idx = KvIndex(B)
    idx.apply("w", stored([1, 2], None, TOKS[:32], group=0))
    idx.apply("w", stored([1, 2], None, TOKS[:32], tier=Tier.HOST))
    idx.apply("w", BlocksRemoved([2], Tier.GPU, None))  # group None == 0
    assert idx.longest_prefix(KEYS) == {"w": 2}  # still on the host tier
    idx.apply("w", BlocksRemoved([2], Tier.HOST))
    assert idx.longest_prefix(KEYS) == {"w": 1}
    idx.apply("w", AllCleared(Tier.HOST))
    assert idx.longest_prefix(KEYS) == {"w": 1}
    idx.apply("w", BlocksMoved([1], Tier.GPU, Tier.DISK))
    assert idx.longest_prefix(KEYS) == {"w": 1}
    idx.apply("w", BlocksRemoved([1], Tier.DISK))
    assert idx.size == 0
    idx.check_invariants()


def test_tier_only_store_copies_known_blocks():
    idx = KvIndex(B)
    idx.apply("w", stored([1, 2], None, TOKS[:32]))
    idx.apply("w", BlocksStored([1, 2, 77], None, None, B, Tier.HOST))
    assert idx.stats.tier_only_updates == 2 and idx.stats.dangling_parents == 1
    idx.apply("w", BlocksRemoved([1, 2]))
    assert idx.longest_prefix(KEYS) == {"w": 2}


@pytest.mark.parametrize("engine_bs", [32, 48, 64])
def test_engine_blocks_larger_than_canonical(engine_bs):
    idx = KvIndex(B)
    per = engine_bs // B
    n = len(TOKS) // engine_bs
    hashes = [500 + i for i in range(n)]
    idx.apply("w", stored(hashes, None, TOKS[:n * engine_bs], engine_bs))
    assert idx.longest_prefix(KEYS) == {"w": n * per}
    idx.apply("w", BlocksRemoved([hashes[-1]]))  # one engine block evicts `per` keys
    assert idx.longest_prefix(KEYS) == {"w": (n - 1) * per}
    idx.check_invariants()


def test_engine_blocks_smaller_than_canonical():
    idx = KvIndex(B)
    hashes = [900 + i for i in range(len(TOKS) // 4)]
    # in pieces, each event chained to the previous one's last hash
    for j in range(0, len(hashes), 6):
        idx.apply("w", stored(hashes[j:j + 6], hashes[j - 1] if j else None,
                              TOKS[j * 4:(j + 6) * 4], 4))
    assert idx.longest_prefix(KEYS) == {"w": len(KEYS)}
    # the leaf engine block completing canonical block 11 owns it
    idx.apply("w", BlocksRemoved([hashes[-1]]))
    assert idx.longest_prefix(KEYS) == {"w": len(KEYS) - 1}
    idx.apply("w", BlocksRemoved([hashes[-2]]))  # not a completing block: no key change
    assert idx.longest_prefix(KEYS) == {"w": len(KEYS) - 1}
    idx.check_invariants()


def test_partial_last_page_resumes_in_child_event():
    """SGLang: a trailing partial page, later used as the parent of the next event."""
    idx = KvIndex(B)
    idx.apply("w", stored([1, 2], None, TOKS[:16 + 10]))        # 1 full + 10 pending
    assert idx.longest_prefix(KEYS) == {"w": 1}
    idx.apply("w", stored([3, 4], 2, TOKS[26:26 + 16 + 6]))     # continues from the partial
    assert idx.longest_prefix(KEYS) == {"w": 3}
    idx.apply("w", BlocksRemoved([2]))  # the partial page owned no key
    assert idx.longest_prefix(KEYS) == {"w": 3}
    idx.check_invariants()


def test_namespaced_chains_match_namespaced_request_keys():
    idx = KvIndex(B)
    idx.apply("w", stored([1, 2], None, TOKS[:32], lora_name="lora-a"))
    idx.apply("w", stored([3], 2, TOKS[32:48]))  # child inherits the namespace
    assert idx.longest_prefix(KEYS) == {}
    ns_keys = block_keys_list(TOKS, B, salt_seed(None, "lora-a"))
    assert idx.longest_prefix(ns_keys) == {"w": 3}
    salted = block_keys_list(TOKS, B, salt_seed("tenant", None))
    idx.apply("v", stored([1], None, TOKS[:16], cache_salt="tenant"))
    assert idx.longest_prefix(salted) == {"v": 1}


def test_cluster_namespace_keys_events_like_the_fleet_keys_prompts():
    ns_keys = block_keys_list(TOKS, B, salt_seed("prod", None))
    idx = KvIndex(B, namespace="prod")
    idx.apply("w", stored(ns_keys[:3], None, TOKS[:48]))          # our worker, same namespace
    idx.apply("w", stored(ns_keys[3:4], ns_keys[2], TOKS[48:64]))
    assert idx.longest_prefix(ns_keys) == {"w": 4}
    assert not idx.slots.get("w", 0).emaps.get((Tier.GPU, 0))      # identity entries
    idx.apply("v", stored([1], None, TOKS[:16], cache_salt="tenant"))  # own salt wins
    assert idx.longest_prefix(block_keys_list(TOKS, B, salt_seed("tenant", None))) == {"v": 1}
    idx.apply("u", stored([1], None, TOKS[:16], lora_name="l"))
    assert idx.longest_prefix(block_keys_list(TOKS, B, salt_seed("prod", "l"))) == {"u": 1}
    assert idx.longest_prefix(KEYS) == {}


def test_identity_entries_of_our_workers():
    idx = KvIndex(B)
    idx.apply("w", stored(KEYS[:4], None, TOKS[:64]))           # engine hash == key
    idx.apply("w", stored(KEYS[4:6], KEYS[3], TOKS[64:96]))
    assert idx.longest_prefix(KEYS) == {"w": 6}
    assert not idx.slots.get("w", 0).emaps.get((Tier.GPU, 0))    # no emap entries needed
    idx.apply("w", stored(KEYS[:2], None, TOKS[:32]))           # duplicate
    assert idx.stats.duplicate_stores == 2
    idx.apply("w", BlocksMoved([KEYS[5]], Tier.GPU, Tier.HOST))
    idx.apply("w", BlocksRemoved([KEYS[5]]))                    # gone from GPU already
    assert idx.longest_prefix(KEYS) == {"w": 6}
    idx.apply("w", BlocksRemoved([KEYS[5]], Tier.HOST))
    idx.apply("w", BlocksRemoved([KEYS[4]]))
    assert idx.longest_prefix(KEYS) == {"w": 4}
    idx.apply("w", AllCleared(Tier.GPU))
    assert idx.size == 0
    idx.check_invariants()


def test_tier_only_store_of_a_resident_identity_block_is_a_duplicate():
    idx = KvIndex(B)
    idx.apply("w", stored(KEYS[:2], None, TOKS[:32]))
    idx.apply("w", BlocksStored([KEYS[1]], None, None, B))  # GPU again, no tokens
    assert idx.stats.duplicate_stores == 1
    idx.apply("w", BlocksRemoved([KEYS[1]]))
    assert idx.longest_prefix(KEYS) == {"w": 1}
    idx.check_invariants()


def test_load_snapshot_replaces_worker_state():
    idx = KvIndex(B)
    idx.apply("w", stored([1], None, [5] * 16))
    idx.load_snapshot("w", np.array(KEYS[:5], dtype=np.uint64))
    assert idx.longest_prefix(KEYS) == {"w": 5} and idx.worker_size("w") == 5
    # later events of that worker resolve parents against the snapshot (hash == key)
    idx.apply("w", stored([KEYS[5]], KEYS[4], TOKS[80:96]))
    idx.apply("w", BlocksRemoved([KEYS[0]]))
    assert idx.longest_prefix(KEYS) == {}
    assert idx.worker_size("w") == 5
    idx.check_invariants()


def test_speculative_entries():
    idx = KvIndex(B)
    idx.apply("a", stored([1], None, TOKS[:16]))
    assert idx.add_speculative("a", KEYS[:4], now=10.0, ttl=5.0) == 3  # key 0 already held
    assert idx.longest_prefix(KEYS) == {"a": 4}
    assert idx.worker_size("a") == 1 and idx.speculative_size() == 3
    idx.apply("a", stored([2], 1, TOKS[16:32]))  # confirms key 1
    assert idx.stats.speculative_confirmed == 1 and idx.speculative_size() == 2
    assert idx.expire_speculative(14.9) == 0
    idx.add_speculative("a", KEYS[2:3], now=12.0, ttl=5.0)  # refresh key 2 until 17
    assert idx.expire_speculative(15.0) == 1               # key 3 expired
    assert idx.longest_prefix(KEYS) == {"a": 3}
    idx.clear_worker("a")
    assert idx.speculative_size() == 0 and idx.longest_prefix(KEYS) == {}
    assert idx.expire_speculative(100.0) == 0
    idx.check_invariants()
    with pytest.raises(ValueError, match="ttl"):
        idx.add_speculative("a", KEYS, now=0, ttl=0)


def test_speculative_expiry_in_key_bounded_slices():
    """A backlog of due entries is expired in slices of about ``max_keys`` keys, whole entries at a
    time, until none is due; what a slice leaves still matches (coordinator/service.py's loop)."""
    idx = KvIndex(B)
    keys = list(range(1000, 1000 + 60))
    for i in range(6):                                  # 6 routed prompts of 10 keys, due at 1.0
        idx.add_speculative("a", keys[10 * i:10 * i + 10], now=0.0, ttl=1.0)
    assert idx.speculative_size() == 60 and not idx.speculative_due(0.5)
    assert idx.speculative_due(1.0)
    assert idx.expire_speculative(1.0, max_keys=15) == 20   # two whole entries: 10 < 15, then 20
    assert idx.speculative_size() == 40 and idx.speculative_due(1.0)
    assert idx.longest_prefix(keys[20:30]) == {"a": 10}     # not expired yet: still predicted
    assert idx.expire_speculative(1.0, max_keys=10) == 10   # one entry
    assert idx.expire_speculative(1.0, max_keys=1000) == 30
    assert idx.speculative_size() == 0 and not idx.speculative_due(1.0)
    idx.check_invariants()


def test_apply_batch_sequencing():
    idx = KvIndex(B)
    mk = lambda seq, evs: EventBatch(seq, 0.0, 0, evs)
    assert idx.apply_batch("w", mk(5, [stored([1], None, TOKS[:16])])) == StreamVerdict.APPLIED
    assert idx.expected_seq("w") == 6
    assert idx.apply_batch("w", mk(5, [stored([1], None, TOKS[:16])])) == StreamVerdict.DUPLICATE
    gap = mk(8, [stored([3], 2, TOKS[32:48])])
    assert idx.apply_batch("w", gap) == StreamVerdict.GAP
    assert idx.longest_prefix(KEYS) == {"w": 1}  # nothing applied on a gap
    # replay fills 6 and 7, then the held batch applies
    assert idx.apply_batch("w", mk(6, [stored([2], 1, TOKS[16:32])])) == StreamVerdict.APPLIED
    assert idx.apply_batch("w", mk(7, [])) == StreamVerdict.APPLIED
    assert idx.apply_batch("w", gap) == StreamVerdict.APPLIED
    assert idx.longest_prefix(KEYS) == {"w": 3}
    # engine restart: seq back to 0 clears the worker first
    assert idx.apply_batch("w", mk(0, [stored([9], None, TOKS[:16])])) == StreamVerdict.RESTART
    assert idx.longest_prefix(KEYS) == {"w": 1}
    idx.reset_stream("w", 0, next_seq=40)
    assert idx.apply_batch("w", mk(41, [])) == StreamVerdict.GAP
    idx.reset_stream("w")
    assert idx.apply_batch("w", mk(41, [])) == StreamVerdict.APPLIED
    with pytest.raises(ValueError, match="end marker"):
        idx.apply_batch("w", EventBatch(-1, 0.0, None))


def test_apply_rejects_non_events_and_bad_workers():
    idx = KvIndex(B)
    with pytest.raises(TypeError, match="canonical event"):
        idx.apply("w", {"type": "BlockStored"})
    with pytest.raises(ValueError, match="worker"):
        idx.apply("", AllCleared())
    with pytest.raises(ValueError, match="block_size"):
        KvIndex(0)


def test_wire_round_trip_into_index():
    """What our worker publishes (encoder) is what the coordinator indexes (decoder)."""
    payload = encode_vllm_batch(1.0, [stored(KEYS[:3], None, TOKS[:48])], 0)
    batch = decode_zmq([b"kv", (0).to_bytes(8, "big"), payload])
    idx = KvIndex(B)
    assert idx.apply_batch("w", batch) == StreamVerdict.APPLIED
    assert idx.longest_prefix(KEYS) == {"w": 3}


# ---- properties ------------------------------------------------------------------------------

# Random chains: each op stores a run of blocks extending a random existing chain (or a new root)
# for a random worker; hashes are opaque and distinct per (worker, content).

_VOCAB = st.integers(0, 3)  # tiny vocabulary: chains share prefixes often


@st.composite
def _stores(draw, engine_bs=B):
    ops = []
    chains: dict[str, list[tuple[int, list[int]]]] = {}
    counter = 1000
    for _ in range(draw(st.integers(1, 12))):
        w = draw(st.sampled_from(["a", "b", "c"]))
        known = chains.setdefault(w, [])
        parent, prefix = (None, [])
        if known and draw(st.booleans()):
            parent, prefix = draw(st.sampled_from(known))
        n = draw(st.integers(1, 3))
        toks = [draw(_VOCAB) for _ in range(n * engine_bs)]
        hashes = []
        for i in range(n):
            counter += 1
            hashes.append(counter)
            known.append((counter, prefix + toks[:(i + 1) * engine_bs]))
        ops.append((w, BlocksStored(hashes, parent, toks, engine_bs)))
    if engine_bs != B:
        return ops, {w: [p for _, p in v] for w, v in chains.items()}
    return ops


@settings(max_examples=80, deadline=None)
@given(_stores(), st.integers(0, 2**32))
def test_store_then_remove_restores_the_index(ops, seed):
    rng = np.random.default_rng(seed)
    idx = KvIndex(B)
    split = int(rng.integers(0, len(ops)))
    for w, ev in ops[:split]:
        idx.apply(w, ev)
    before = state(idx)
    w, ev = ops[split]
    idx.apply(w, ev)
    idx.check_invariants()
    idx.apply(w, BlocksRemoved(list(ev.engine_hashes)))
    idx.check_invariants()
    if idx.stats.duplicate_stores == 0:
        assert state(idx) == before


@settings(max_examples=60, deadline=None)
@given(_stores())
def test_clear_empties_and_prefix_matches_model(ops):
    idx = KvIndex(B)
    model: dict[str, set[int]] = {}
    for w, ev in ops:
        idx.apply(w, ev)
    idx.check_invariants()
    # model: a worker holds the canonical keys of every chain it stored
    for w in idx.workers():
        model[w] = set().union(*(x.owned for x in idx.slots.of_worker(w)))
    for w in model:
        for key in model[w]:
            assert idx.owners.masks[key] & idx.slots.get(w, 0).bit
    for w in list(model):
        idx.apply(w, AllCleared())
    assert idx.size == 0 and all(idx.worker_size(w) == 0 for w in model)
    idx.check_invariants()


@settings(max_examples=60, deadline=None)
@given(_stores(engine_bs=8))
def test_ratio_mapping_matches_canonical_keys(ops_paths):
    """Engine blocks of 8 tokens chained across events: each worker holds exactly the canonical
    keys of every full 16-token block of every chain it stored."""
    ops, paths = ops_paths
    idx = KvIndex(B)
    for w, ev in ops:
        idx.apply(w, ev)
    for w, ps in paths.items():
        expect = set().union(*(block_keys_list(p, B) for p in ps)) if ps else set()
        assert idx.keys_of(w) == expect
    idx.check_invariants()
    for w, ev in reversed(ops):
        idx.apply(w, BlocksRemoved(list(ev.engine_hashes)))
    assert idx.size == 0


@settings(max_examples=60, deadline=None)
@given(_stores())
def test_event_order_within_a_worker_matters(ops):
    """Remove-then-store leaves blocks resident; store-then-remove leaves none."""
    w, ev = ops[0]
    rm = BlocksRemoved(list(ev.engine_hashes))
    a, b = KvIndex(B), KvIndex(B)
    for e in (ev, rm):
        a.apply(w, e)
    for e in (rm, ev):
        b.apply(w, e)
    assert a.worker_size(w) == 0
    assert b.worker_size(w) == len(set(block_keys_list(ev.token_ids, B)))
    # and apply_batch enforces the order even when batches arrive shuffled
    c = KvIndex(B)
    assert c.apply_batch(w, EventBatch(0, 0.0, 0, [ev])) == StreamVerdict.APPLIED
    assert c.apply_batch(w, EventBatch(2, 0.0, 0, [])) == StreamVerdict.GAP
    assert c.apply_batch(w, EventBatch(1, 0.0, 0, [rm])) == StreamVerdict.APPLIED
    assert c.worker_size(w) == 0


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_mixed_operations_match_a_naive_model(data):
    """Stores (foreign and identity hashes) on two tiers, removals, tier moves and clears,
    against a model that keeps one set of keys per (worker, tier, engine hash)."""
    idx = KvIndex(B)
    model: dict[tuple, tuple] = {}   # (worker, tier, hash) -> owned keys
    paths: dict[tuple, list] = {}    # (worker, hash) -> token path (for children)
    counter = [5000]
    tiers = [Tier.GPU, Tier.HOST]
    for _ in range(data.draw(st.integers(1, 25))):
        w = data.draw(st.sampled_from(["a", "b"]))
        op = data.draw(st.sampled_from(["store", "store", "store", "remove", "move", "clear"]))
        tier = data.draw(st.sampled_from(tiers))
        mine = [k for k in model if k[0] == w]
        if op == "store":
            parent = None
            prefix: list[int] = []
            known = [k for k in paths if k[0] == w]
            if known and data.draw(st.booleans()):
                _, parent = data.draw(st.sampled_from(known))
                prefix = paths[(w, parent)]
            if parent is not None and not any(k[0] == w and k[2] == parent for k in model):
                parent = None
                prefix = []
            n = data.draw(st.integers(1, 3))
            toks = [data.draw(st.integers(0, 2)) for _ in range(n * B)]
            keys = block_keys_list(prefix + toks, B)[len(prefix) // B:]
            identity = data.draw(st.booleans())
            hashes = []
            for i in range(n):
                counter[0] += 1
                hashes.append(keys[i] if identity else counter[0])
            idx.apply(w, BlocksStored(hashes, parent, toks, B, tier))
            for i, h in enumerate(hashes):
                model.setdefault((w, tier, h), (keys[i],))
                paths[(w, h)] = prefix + toks[:(i + 1) * B]
        elif op == "remove" and mine:
            _, t, h = data.draw(st.sampled_from(mine))
            idx.apply(w, BlocksRemoved([h], t))
            model.pop((w, t, h))
        elif op == "move" and mine:
            _, t, h = data.draw(st.sampled_from(mine))
            to = Tier.HOST if t is Tier.GPU else Tier.GPU
            idx.apply(w, BlocksMoved([h], t, to))
            e = model.pop((w, t, h))
            model.setdefault((w, to, h), e)
        elif op == "clear":
            idx.apply(w, AllCleared(None))
            for k in mine:
                model.pop(k)
        idx.check_invariants()
        for ww in ("a", "b"):
            expect = set()
            for k, v in model.items():
                if k[0] == ww:
                    expect.update(v)
            assert idx.keys_of(ww) == expect


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_speculation_mixed_with_events_matches_a_model(data):
    """Speculative entries share the owner map with confirmed ones: stores (identity and foreign
    engine hashes), removals, snapshots (whole and appended), speculation, expiry and clears
    against a model of entries and speculative deadlines per worker."""
    idx = KvIndex(B)
    ents: dict[str, set] = {w: set() for w in "ab"}   # ("id" | "f", key index)
    spec: dict[str, dict] = {w: {} for w in "ab"}    # key -> deadline
    now = 0.0
    n = len(KEYS)

    def fh(w, k):  # a foreign engine hash, distinct per worker and block
        return 1000 * ord(w) + k

    def conf(w):
        return {KEYS[k] for _, k in ents[w]}

    for _ in range(data.draw(st.integers(4, 30))):
        w = data.draw(st.sampled_from("ab"))
        op = data.draw(st.sampled_from(["fstore", "spec", "fremove", "store", "remove", "fstore",
                                        "spec", "fremove", "expire", "clear", "snap", "append"]))
        i = data.draw(st.integers(0, 3))
        j = data.draw(st.integers(i + 1, n))
        if op in ("store", "fstore"):
            kind = "id" if op == "store" else "f"
            hashes = KEYS[i:j] if kind == "id" else [fh(w, k) for k in range(i, j)]
            parent = None if not i else KEYS[i - 1] if kind == "id" else fh(w, i - 1)
            idx.apply(w, stored(hashes, parent, TOKS[i * B:j * B]))
            if parent is None or (kind, i - 1) in ents[w]:
                ents[w].update((kind, k) for k in range(i, j))
        elif op in ("remove", "fremove"):
            kind = "id" if op == "remove" else "f"
            present = sorted(k for kd, k in ents[w] if kd == kind)
            if present and data.draw(st.booleans()):
                i = data.draw(st.sampled_from(present))   # mostly entries that exist
            idx.apply(w, BlocksRemoved([KEYS[i] if kind == "id" else fh(w, i)]))
            ents[w].discard((kind, i))
        elif op == "spec":
            ttl = data.draw(st.sampled_from([1.0, 5.0]))
            idx.add_speculative(w, KEYS[i:j], now, ttl)
            held = conf(w)
            for k in KEYS[i:j]:
                if k not in held:
                    spec[w][k] = now + ttl
        elif op == "expire":
            now += data.draw(st.sampled_from([0.5, 1.0, 3.0]))
            idx.expire_speculative(now)
            for sw in spec.values():
                for k in [k for k, d in sw.items() if d <= now]:
                    del sw[k]
        elif op == "clear":
            idx.clear_worker(w)
            ents[w].clear()
            spec[w].clear()
        elif op == "snap":
            idx.load_snapshot(w, KEYS[i:j])
            ents[w] = {("id", k) for k in range(i, j)}
            spec[w].clear()
        else:
            held = conf(w)
            idx.load_snapshot(w, np.array(KEYS[i:j], dtype=np.uint64), append=True)
            ents[w].update(("id", k) for k in range(i, j) if KEYS[k] not in held)
        for ww in "ab":
            for k in conf(ww):
                spec[ww].pop(k, None)
        idx.check_invariants()
        assert idx.size == len(set().union(*(conf(ww) for ww in "ab")))
        assert idx.speculative_size() == sum(len(sw) for sw in spec.values())
        expect = {}
        for ww in "ab":
            held = conf(ww) | set(spec[ww])
            d = 0
            while d < n and KEYS[d] in held:
                d += 1
            if d:
                expect[ww] = d
        assert idx.longest_prefix(KEYS) == expect
        assert {ww: idx.worker_size(ww) for ww in "ab"} == {ww: len(conf(ww)) for ww in "ab"}


def test_load_snapshot_in_slices_equals_one_load():
    one, sliced = KvIndex(B), KvIndex(B)
    one.apply("w", stored([1, 2], None, TOKS[:32]))
    sliced.apply("w", stored([1, 2], None, TOKS[:32]))
    sliced.add_speculative("w", KEYS[8:], now=0.0, ttl=5.0)
    keys = np.array(KEYS[3:], dtype=np.uint64)
    one.load_snapshot("w", keys)
    sliced.load_snapshot("w", keys[:4])
    sliced.add_speculative("w", KEYS[:3], now=0.0, ttl=5.0)  # routed between two slices
    sliced.load_snapshot("w", keys[4:], append=True)
    assert sliced.keys_of("w") == one.keys_of("w") == set(KEYS[3:])
    assert sliced.size == one.size == len(KEYS) - 3
    assert sliced.stats.snapshots == one.stats.snapshots == 1
    assert sliced.speculative_size() == 3 and sliced.longest_prefix(KEYS) == {"w": len(KEYS)}
    assert one.longest_prefix(KEYS) == {}
    sliced.check_invariants()
    one.check_invariants()
