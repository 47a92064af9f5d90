"""The placement fast paths decide exactly what a straightforward reference decides.

`KvIndex` memoises its prefix walks (router/kv_memo.py) and `KvCacheAwarePolicy` keeps what
depends only on the candidate list between calls (router/policies.py). These properties drive
random streams of events (stored with and without cache salts, removed, moved, cleared, snapshots),
speculative inserts made the way the coordinator makes them (walk, pick, insert the chosen slot's
unmatched tail, expire a few), expiry and worker removal, and after every step compare:

- per-server and per-(server, dp rank) match lengths with a plain per-slot scan of what the
  slot holds (its confirmed keys and its speculative keys), prompt by prompt, in both
  namespaces, repeated (the memo's path) and after a fresh index walk;
- the policy's choice, matched tokens and score rows with a reference written as a per-server
  loop over the cost formula (docs/routing.md "Policies"), with the same tie cursor.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import router.kv_owners as kv_owners_mod
from router.block_keys import block_keys_list, salt_seed
from router.events import AllCleared, BlocksMoved, BlocksRemoved, BlocksStored, Tier
from router.kv_index import KvIndex
from router.leases import LeaseTable
from router.policies import Candidate, IndexLoadView, KvCacheAwarePolicy, RoutingKey

B = 4
WORKERS = ["http://a", "http://b", "http://c"]
NS = "tenant-1"          # the index's cluster namespace
SALT = "other-salt"      # events that carry their own cache salt key in another namespace
# three prompts sharing a first block, two of them sharing four
TOKS = [
    [1, 2, 3, 4] + [5, 6, 7, 8] * 3 + [9] * 8,
    [1, 2, 3, 4] + [5, 6, 7, 8] * 3 + [10] * 8,
    [1, 2, 3, 4] + [11] * 20,
]
NSEEDS = {"cluster": salt_seed(NS), "salted": salt_seed(SALT)}
PROMPTS = {(ns, i): block_keys_list(t, B, seed) for ns, seed in NSEEDS.items()
           for i, t in enumerate(TOKS)}


def reference_ranks(idx: KvIndex, keys: list[int]) -> dict[tuple[str, int], int]:
    """Matched leading keys per slot from what each slot holds, one slot at a time."""
    out = {}
    for (w, r), s in idx.slots.by_key.items():
        held = set(s.owned) | set(s.spec)
        d = 0
        while d < len(keys) and keys[d] in held:
            d += 1
        if d:
            out[(w, r)] = d
    return out


def reference_workers(ranks: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for (w, _), d in ranks.items():
        out[w] = max(out.get(w, 0), d)
    return out


class ReferencePolicy:
    """kv_cache_aware written as a plain loop: cost, hot-spot cap, unknown matches, ties."""

    def __init__(self, policy: KvCacheAwarePolicy):
        self.p = policy
        self.cursor = 0

    def select(self, cands, key: RoutingKey, idx: KvIndex, leases: LeaseTable):
        p = self.p
        ok, seen = [], set()
        for c in cands:
            if c.server not in seen and c.healthy:
                ok.append(c)
            seen.add(c.server)
        n_tok = key.num_tokens or len(key.block_keys) * p.block_size
        cap = max(n_tok - 1, 0)
        depth = reference_workers(reference_ranks(idx, list(key.block_keys)))
        matched = {c.server: min(depth.get(c.server, 0) * p.block_size, cap) for c in ok}
        known = [matched[c.server] for c in ok if not c.kv_unknown]
        mean = int(sum(known) / len(known)) if known else 0
        cost = {}
        for c in ok:
            req, tok = leases.load(c.server)
            est = mean if c.kv_unknown else matched[c.server]
            cost[c.server] = (p.prefill_weight * (n_tok - est) + p.load_tokens_weight * tok
                              + p.load_requests_weight * req)
        reqs = [leases.load(c.server)[0] for c in ok]
        hot = set()
        if p.hotspot_factor:
            limit = p.hotspot_factor * sum(reqs) / len(ok) + p.hotspot_slack
            hot = {c.server for c, r in zip(ok, reqs) if r > limit}
        if p.max_batch_size and p.load_cap is not None:
            hot |= {c.server for c, r in zip(ok, reqs) if r / p.max_batch_size >= p.load_cap}
        pool = [c.server for c in ok if c.server not in hot] or [c.server for c in ok]
        best = min(cost[s] for s in pool)
        tol = best + 1e-9 * (abs(best) if abs(best) > 1.0 else 1.0)
        tied = [s for s in pool if cost[s] <= tol]
        pick = tied[self.cursor % len(tied)]
        if len(tied) > 1:
            self.cursor += 1
        shown = 0 if next(c for c in ok if c.server == pick).kv_unknown else matched[pick]
        return pick, shown, cost


def _store(data, idx, w, rank, hashes_of, counter):
    ns = data.draw(st.sampled_from(["cluster", "salted"]))
    i = data.draw(st.integers(0, len(TOKS) - 1))
    start = data.draw(st.integers(0, 3))
    end = data.draw(st.integers(start + 1, len(TOKS[i]) // B))
    toks = TOKS[i]
    keys = PROMPTS[(ns, i)]
    parent = None
    if start:
        parent = hashes_of.get((w, rank, ns, i, start - 1))
        if parent is None:
            start, parent = 0, None
    hashes = []
    for j in range(start, end):
        counter[0] += 1
        # identity hashes (our workers) in the cluster namespace, opaque ones otherwise
        h = keys[j] if ns == "cluster" and data.draw(st.booleans()) else counter[0]
        hashes.append(h)
        hashes_of[(w, rank, ns, i, j)] = h
    tier = data.draw(st.sampled_from([Tier.GPU, Tier.GPU, Tier.HOST]))
    idx.apply(w, BlocksStored(hashes, parent, toks[start * B:end * B], B, tier,
                              cache_salt=SALT if ns == "salted" else None), rank)
    return tier, hashes


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_walk_memo_and_policy_match_references(data):
    # the change log trimmed often (memos outliving trims), or at its real length
    trim = data.draw(st.sampled_from([kv_owners_mod.LOG_TRIM, 3, 40]))
    saved = kv_owners_mod.LOG_TRIM
    kv_owners_mod.LOG_TRIM = trim
    try:
        _walk_memo_and_policy_match_references(data)
    finally:
        kv_owners_mod.LOG_TRIM = saved


def _walk_memo_and_policy_match_references(data):
    # small memo strides (reuse between the prompts, which share leading blocks) and memo caps
    idx = KvIndex(B, namespace=NS, memo_stride=data.draw(st.sampled_from([1, 2, 32])),
                  memo_cap=data.draw(st.sampled_from([1, 3, 1024])))
    # the memo's cost control: lookups on every placement, or on 1 in 16 (as after many stale ones)
    idx.memo.score = data.draw(st.sampled_from([1.0, 0.0]))
    leases = LeaseTable()
    view = IndexLoadView(idx, leases)
    kw = data.draw(st.fixed_dictionaries({
        "hotspot_factor": st.sampled_from([None, 1.0, 2.0]),
        "load_tokens_weight": st.sampled_from([0.0, 1.0]),
        "load_requests_weight": st.sampled_from([0.0, 4.0, 32.0]),
    }))
    policy = KvCacheAwarePolicy(B, explain_rows=2, **kw)
    ref = ReferencePolicy(policy)
    hashes_of: dict = {}
    stored: list = []          # (worker, rank, tier, hash)
    counter = [10_000]
    now = 0.0
    unknown = set()
    cands = [Candidate(w) for w in WORKERS]
    req = 0
    for _ in range(data.draw(st.integers(5, 40))):
        op = data.draw(st.sampled_from(
            ["store", "store", "store", "place", "place", "place", "remove", "move", "clear",
             "snapshot", "expire", "finish", "unknown", "remove_worker"]))
        w = data.draw(st.sampled_from(WORKERS))
        rank = data.draw(st.sampled_from([0, 0, 1]))
        if op == "store":
            tier, hashes = _store(data, idx, w, rank, hashes_of, counter)
            stored += [(w, rank, tier, h) for h in hashes]
        elif op == "remove" and stored:
            sw, sr, t, h = data.draw(st.sampled_from(stored))
            idx.apply(sw, BlocksRemoved([h], t), sr)
        elif op == "move" and stored:
            sw, sr, t, h = data.draw(st.sampled_from(stored))
            idx.apply(sw, BlocksMoved([h], t, Tier.HOST if t is Tier.GPU else Tier.GPU), sr)
        elif op == "clear":
            idx.apply(w, AllCleared(data.draw(st.sampled_from([None, Tier.GPU]))), rank)
        elif op == "snapshot":
            keys = PROMPTS[("cluster", data.draw(st.integers(0, len(TOKS) - 1)))]
            idx.load_snapshot(w, keys[:data.draw(st.integers(0, len(keys)))], rank,
                              append=data.draw(st.booleans()))
        elif op == "expire":
            now += data.draw(st.sampled_from([0.5, 1.0, 3.0]))
            idx.expire_speculative(now, data.draw(st.sampled_from([None, 1, 2])))
        elif op == "finish" and req:
            leases.finish("ctx", data.draw(st.integers(1, req)))
        elif op == "unknown":
            unknown ^= {w}
            cands = [Candidate(s, kv_unknown=s in unknown) for s in WORKERS]
        elif op == "remove_worker":
            idx.remove_worker(w)
        elif op == "place":
            # what the coordinator does per leg: walk + pick, lease, insert the chosen
            # server's unmatched tail (none for a server whose match is unknown), expire two
            # due entries; sometimes twice (select_pair)
            prompt = PROMPTS[(data.draw(st.sampled_from(["cluster", "salted"])),
                              data.draw(st.integers(0, len(TOKS) - 1)))]
            # as the coordinator gets them: a read-only array over the wire payload's bytes
            arr = np.frombuffer(np.array(prompt, dtype="<u8").tobytes(), dtype=np.uint64)
            n_tok = len(prompt) * B + data.draw(st.integers(0, B - 1))
            for _leg in range(data.draw(st.integers(1, 2))):
                key = RoutingKey(arr, n_tok)
                assert idx.longest_prefix(arr) == reference_workers(reference_ranks(idx, prompt))
                want, want_matched, want_cost = ref.select(cands, key, idx, leases)
                d = policy.select(cands, key, view)
                assert d.server == want
                assert d.explanation["matched_tokens"] == want_matched
                # the chosen server's uncapped index depth, what the coordinator's insert skips
                assert d.matched_blocks == (None if want in unknown else reference_workers(
                    reference_ranks(idx, prompt)).get(want, 0))
                for row in d.explanation["candidates"]:
                    assert row["score"] == want_cost[row["server"]]
                req += 1
                leases.acquire("ctx", req, d.server, now, 1e9, n_tok)
                have = d.matched_blocks
                if have is not None and have < len(prompt) and data.draw(st.booleans()):
                    idx.add_speculative(d.server, arr[have:], now, data.draw(
                        st.sampled_from([1.0, 5.0])))
                    idx.expire_speculative(now, 2)
        idx.check_invariants()
        for keys in PROMPTS.values():
            ranks = reference_ranks(idx, keys)
            workers = reference_workers(ranks)
            arr = np.array(keys, dtype=np.uint64)
            assert idx.longest_prefix(arr) == workers        # maybe from the memo
            assert idx.longest_prefix(arr) == workers        # from the memo
            wire = np.frombuffer(arr.tobytes(), dtype=np.uint64)
            assert idx.longest_prefix(wire) == workers       # bytes-backed: kept by identity
            assert idx.longest_prefix(wire) == workers
            assert idx.longest_prefix_ranks(keys) == ranks    # list input: another memo key
            assert idx.longest_prefix(keys, WORKERS[:2]) == {
                s: workers.get(s, 0) for s in WORKERS[:2]}


def test_memo_survives_unrelated_changes_and_sees_related_ones():
    """The memo is reused across changes to other prompts' keys and dropped by changes to the
    walked ones (so repeated placements of one prompt walk once)."""
    idx = KvIndex(B)
    a, b = block_keys_list(TOKS[0], B), block_keys_list(TOKS[2], B)
    idx.load_snapshot("http://a", a[:3])
    idx.load_snapshot("http://b", [])       # slots exist before the walk (a new slot re-walks)
    assert idx.longest_prefix(a) == {"http://a": 3}
    memo = idx.memo.latest
    idx.add_speculative("http://b", b[1:3], now=0.0, ttl=5.0)       # other keys: memo kept
    assert idx.longest_prefix(a) == {"http://a": 3} and idx.memo.latest is memo
    # the chosen server's tail insert right after the walk is folded in
    idx.add_speculative("http://a", a[3:], now=0.0, ttl=5.0)
    assert idx.longest_prefix(a) == {"http://a": len(a)} and idx.memo.latest is memo
    idx.apply("http://a", BlocksRemoved([a[1]]))                    # a walked key: re-walk
    assert idx.longest_prefix(a) == {"http://a": 1} and idx.memo.latest is not memo
    idx.expire_speculative(10.0)
    assert idx.longest_prefix(a) == {"http://a": 1}
    idx.check_invariants()


def test_an_expiry_that_takes_nothing_keeps_the_slots_memos():
    """A due entry whose keys were predicted again since (a later deadline) removes nothing: the
    slot's loss count stays, so memos of prompts it matched are still reused."""
    idx = KvIndex(B, memo_stride=1)
    a = block_keys_list(TOKS[0], B)
    idx.load_snapshot("http://a", a[:2])
    idx.add_speculative("http://a", a[2:], now=0.0, ttl=1.0)
    idx.add_speculative("http://a", a[2:], now=0.5, ttl=1.0)      # re-predicted: due at 1.5
    idx.load_snapshot("http://b", [])
    assert idx.longest_prefix(a) == {"http://a": len(a)}
    memo, losses = idx.memo.registered(a[-1]), list(idx.slots.losses)
    assert idx.expire_speculative(1.2) == 0                      # the first entry: nothing left
    assert idx.slots.losses == losses
    assert idx.longest_prefix(a[:-1]) == {"http://a": len(a) - 1}   # another latest walk
    assert idx.longest_prefix(a) == {"http://a": len(a)} and idx.memo.latest is memo   # found again
    assert idx.expire_speculative(1.6) == len(a) - 2             # the second: the slot loses
    assert idx.slots.losses != losses
    assert idx.longest_prefix(a) == {"http://a": 2}
    idx.check_invariants()


def test_memos_outlive_a_log_trim_and_still_see_every_change(monkeypatch):
    """A trim drops the change log's entries but not its positions: the latest memo, which reads
    the log, sees what changed before and after the trim (its entries gone: it walks again); the
    registered memos, checked by loss counts, are reused across the trim."""
    monkeypatch.setattr(kv_owners_mod, "LOG_TRIM", 4)
    idx = KvIndex(B, memo_stride=1)
    a, b = block_keys_list(TOKS[0], B), block_keys_list(TOKS[2], B)[1:]    # b shares no key with a
    idx.load_snapshot("http://a", a[:3])
    for w in ("http://b", "http://c0", "http://c1", "http://c2", "http://c3"):
        idx.load_snapshot(w, [])
    assert idx.longest_prefix(a) == {"http://a": 3}
    pos = idx.walk_version()
    idx.add_speculative("http://b", b, now=0.0, ttl=5.0)       # other keys, past the trim length
    idx.apply("http://a", BlocksRemoved([a[2]]))               # a walked key: logged...
    idx.add_speculative("http://b", b, now=1.0, ttl=5.0)       # ... then more, then a trim
    assert idx.longest_prefix(b) == {"http://b": len(b)}       # trims: the log held > 4 entries
    assert idx.walk_version() > pos and len(idx.owners.log) <= 4 + len(b)
    assert idx.longest_prefix(a) == {"http://a": 2}            # the removal is seen
    # a registered memo is reused after trims when its slots lost nothing
    memo_a = idx.memo.registered(a[1])
    before = idx.walk_version()[1]
    for i in range(4):      # predicted for other slots: logged, past the trim length
        idx.add_speculative(f"http://c{i}", b, now=2.0 + i, ttl=0.5)
        idx.longest_prefix(b)
    idx.apply("http://b", BlocksRemoved([b[0]]))   # the event trims the log first
    assert idx.walk_version()[1] - before > 3 * 4 and len(idx.owners.log) <= 1
    assert idx.longest_prefix(a) == {"http://a": 2}
    assert idx.memo.registered(a[1]) is memo_a
    idx.check_invariants()


def test_memo_compares_the_keys_not_the_array_object():
    """An array changed in place between two walks is a different prompt to the memo."""
    idx = KvIndex(B)
    a = block_keys_list(TOKS[0], B)
    idx.load_snapshot("http://a", a)
    arr = np.array(a, dtype=np.uint64)
    assert idx.longest_prefix(arr) == {"http://a": len(a)}
    arr[2] = 12345
    assert idx.longest_prefix(arr) == {"http://a": 2}
    wire = np.frombuffer(np.array(a, dtype="<u8").tobytes(), dtype=np.uint64)
    assert idx.longest_prefix(wire) == {"http://a": len(a)}
    assert idx.longest_prefix(wire[:3]) == {"http://a": 3}
    assert idx.longest_prefix(list(a[:2]) + [7]) == {"http://a": 2}


def _n_keys(keys) -> int:
    """How many keys a walk was given (u64 bytes for the native table, else a list or array)."""
    return len(keys) // 8 if isinstance(keys, bytes) else len(keys)


def test_memo_reuse_walks_only_what_may_have_changed():
    """A prompt extending an earlier one reuses that walk: it walks only from where a slot's
    match may have grown, and from scratch once a slot that matched part of it lost a key."""
    idx = KvIndex(B, memo_stride=2)
    p = block_keys_list(list(range(100, 100 + 10 * B)), B)
    idx.load_snapshot("http://a", p[:6])
    idx.load_snapshot("http://b", p[:2])
    walked = []
    walk = idx.owners.walk
    idx.owners.walk = lambda keys, active: walked.append(_n_keys(keys)) or walk(keys, active)
    assert idx.longest_prefix(p[:8]) == {"http://a": 6, "http://b": 2}
    assert walked == [8]
    # the next turn: the same leading keys, nothing changed on them: no probe beyond the ends
    assert idx.longest_prefix(p) == {"http://a": 6, "http://b": 2}
    assert walked == [8]
    # a grows past its end (a routed tail, after another walk: not folded into the memo): p is
    # walked again from there, for a alone
    other = block_keys_list(list(range(900, 900 + 3 * B)), B)
    assert idx.longest_prefix(other) == {}
    idx.add_speculative("http://a", p[6:], now=0.0, ttl=5.0)
    del walked[:]
    assert idx.longest_prefix(p) == {"http://a": 10, "http://b": 2}
    assert walked == [4]
    # b loses a key it matched: its old match is no longer known, the prompt is walked again
    assert idx.longest_prefix(other) == {}
    idx.apply("http://b", BlocksRemoved([p[1]]))
    del walked[:]
    assert idx.longest_prefix(p) == {"http://a": 10, "http://b": 1}
    assert walked == [10]
    idx.check_invariants()


def test_worker_names_of_wide_masks_follow_slots_freed_and_reused():
    """Masks over 20 slots, named through the index's mask -> names cache (router/kv_slots.py
    `SlotTable.names`): a freed slot's bit reused by a new worker must name the new worker."""
    idx = KvIndex(B)
    keys = block_keys_list(list(range(40 * B)), B)
    workers = [f"http://w{i}" for i in range(20)]
    for i, w in enumerate(workers):      # worker i holds the first i + 1 keys
        idx.load_snapshot(w, keys[:i + 1])
    want = {w: i + 1 for i, w in enumerate(workers)}
    assert idx.longest_prefix(keys) == want
    for w in workers[3:17:2]:           # every byte of the mask loses some bits, then regains them
        idx.remove_worker(w)
        del want[w]
    assert idx.longest_prefix(keys) == want
    for j in range(7):                  # the freed bits, reused by new workers deeper than all
        w = f"http://new{j}"
        idx.load_snapshot(w, keys[:30 + j])
        want[w] = 30 + j
    assert idx.longest_prefix(keys) == want
    assert idx.longest_prefix(keys[:2]) == {w: min(d, 2) for w, d in want.items()}
    idx.check_invariants()
