"""The KV index's walk memo: prefix walks kept and reused, exactly, by later prompts.

The walk is memory-bound (one probe per key into an owner table of 10^4-10^6 keys, ~150-300 ns
each on a busy host: cache misses), so walks are memoised and reused by later prompts with the
same leading keys: a placement walks the prompt, inserts the chosen slot's speculative tail and,
for ``select_pair``, walks it again for the other role (unless nothing changed in between: the
coordinator's view then hands the other leg the same answer, ``KvIndex.walk_version``); a prompt
placed again, or one extending an earlier one (a conversation's next turn), walks only what may
have changed. Memos are exact, never a heuristic:

- the latest walk is reused for the same keys when nothing was logged since, or when no key
  logged since (router/kv_owners.py ``log``: every owner-mask change) is one its walk read;
- any memo is reused for the leading keys a prompt shares with it (found by its keys at every
  ``stride``-th position and its last key, then compared byte for byte), in the same owner-table
  ``epoch`` (bumped by changes the log does not describe key by key: a slot cleared, created or
  freed, a snapshot loaded), when none of the slots that matched part of that prefix lost a key
  since (router/kv_slots.py ``losses``, per slot): a slot that lost nothing still holds what it
  held, and its match can only have grown at the key that ended it, which is probed again (one
  probe per group of the walk). From the first group that grew, the walk goes on from that depth
  for the slots still matching there;
- the one change a placement itself makes, the chosen slot's speculative insert of the prompt's
  unmatched tail, is applied to the latest memo instead (that slot now matches the whole prompt),
  when it comes right after the walk with nothing logged in between (`before_tail_insert`,
  `after_tail_insert`).

Invariant: for any keys, `WalkMemo.groups(keys)` equals ``OwnerTable.walk(keys, all slots)`` at
that moment (tests/router/test_kv_parts.py and the index's property tests check it).
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from .kv_owners import OwnerTable
from .kv_slots import SlotTable

__all__ = ["MEMO_CAP", "MEMO_STRIDE", "Walk", "WalkMemo"]

# A memo with more keys logged since it was taken than this many times the keys its walk read is
# dropped: checking them would cost about as much as walking again.
_CHECK_RATIO = 2
MEMO_STRIDE = 32        # memos are found by their keys at every 32nd position (and their last)
MEMO_CAP = 1024         # memos kept, least recently used dropped first (~2 KiB each at 256 keys)
_SCORE_MIN = 0.25       # below this share of memos found still exact, look up 1 in 16 only
_SCORE_DECAY = 1 / 64

_U64 = np.dtype(np.uint64)


def u64_bytes(keys) -> bytes | None:
    """The keys (a uint64 array or a list) as bytes of native u64 (a memo's identity), or None
    when they are not all u64 values (an int array, floats, negative ints...)."""
    if isinstance(keys, np.ndarray):
        # identity first: builtin dtypes are singletons, and `==` against the scalar type costs 3x
        return keys.tobytes() if keys.dtype is _U64 or keys.dtype == np.uint64 else None
    if not all(type(k) is int for k in keys):
        return None
    try:
        return np.array(keys, dtype=np.uint64).tobytes()
    except (OverflowError, TypeError, ValueError):
        return None


class Walk:
    """One walk: its keys (bytes of native u64), its groups over every slot, the epoch and log
    position it was taken at, and the loss counters of the slots that matched part of it."""

    __slots__ = ("raw", "n", "groups", "epoch", "pos", "lmask", "lcounts", "marks")

    def __init__(self, raw: bytes, groups: list, epoch: int, pos: int):
        self.raw = raw
        self.n = len(raw) >> 3
        self.groups = groups
        self.epoch = epoch
        self.pos = pos
        self.lmask = 0              # the slots of groups with depth > 0 ...
        self.lcounts = None         # ... and their loss counts
        self.marks: list = []       # the keys it is registered under

    def read(self) -> int:
        """How many leading keys the walk read (the matched prefix and the key that ended it)."""
        last = self.groups[-1][1] if self.groups else self.n
        return self.n if last >= self.n else last + 1

    def deepen(self, bit: int, have: int) -> bool:
        """The slot ``bit`` now also holds every key after its first ``have``: if it matched at
        least ``have`` before, it matches the whole prompt now (False: memo left as it was)."""
        n = self.n
        groups = self.groups
        for j, (bits, depth) in enumerate(groups):
            if bits & bit:
                break
        else:
            return False
        if depth < have:
            return False
        if depth == n:
            return True
        out = [(b, d) for b, d in groups[:j]]
        rest = bits ^ bit
        if rest:
            out.append((rest, depth))
        out += groups[j + 1:]
        if out and out[-1][1] == n:
            out[-1] = (out[-1][0] | bit, n)
        else:
            out.append((bit, n))
        self.groups = out
        return True



class WalkMemo:
    """The walks kept for reuse: the latest one, and up to ``cap`` registered ones found by their
    keys at every ``stride``-th position. Reads the owner table and the slots' loss counts; writes
    nothing but its own state."""

    def __init__(self, owners: OwnerTable, slots: SlotTable, *, stride: int = MEMO_STRIDE,
                 cap: int = MEMO_CAP) -> None:
        for name, v in (("memo_stride", stride), ("memo_cap", cap)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive int, found {v!r}")
        self._owners = owners
        self._slots = slots
        self.stride = stride
        self.cap = cap
        self.latest: Walk | None = None
        self._by_mark: dict[int, Walk] = {}     # registered key -> walk
        self._order: dict[Walk, None] = {}      # registered walks, least recently used first
        self._positions: dict[int, tuple] = {}  # prompt length -> registration positions
        self._loss_getters: dict[int, object] = {}
        self._tick = 0                          # placements walked (the cost control's clock)
        # decayed share of lookups that found a memo still exact (the cost control's input)
        self.score = 1.0

    def registered(self, key: int) -> Walk | None:
        """The walk registered under ``key`` (tests and debugging)."""
        return self._by_mark.get(key)

    def drop(self) -> None:
        """Forget every walk (benchmarks measuring the walk itself; never needed for
        correctness)."""
        self.latest = None
        self._by_mark.clear()
        self._order.clear()

    def groups(self, keys) -> list[tuple[int, int]]:
        """``OwnerTable.walk(keys, every slot)``, reusing memoised walks where exact."""
        owners = self._owners
        all_bits = self._slots.all_bits
        if not all_bits:
            return []
        if not isinstance(keys, (list, np.ndarray)):
            keys = list(keys)
        raw = u64_bytes(keys)
        if raw is None:     # not u64 keys (no memo is for them): a plain walk
            return owners.walk(keys, all_bits)
        log = owners.log
        epoch = owners.epoch
        memo = self.latest
        if memo is not None and memo.epoch == epoch and memo.raw == raw:
            base = owners.log_base
            pos, end = memo.pos, base + len(log)
            if pos == end:
                return memo.groups
            r = memo.read()
            # pos < base: entries it would need were trimmed away
            if base <= pos and end - pos <= _CHECK_RATIO * r and \
                    set(np.frombuffer(raw, np.uint64, r).tolist()).isdisjoint(log[pos - base:]):
                memo.pos = end
                return memo.groups
        owners.trim_log()
        qa = keys if isinstance(keys, np.ndarray) else np.frombuffer(raw, _U64)
        n = len(qa)
        groups = None
        marks = None
        # Cost control, never a change of result: while the memos found are seldom still exact
        # (distinct prompts sharing a prefix, their servers losing routed tails all the time),
        # only every 16th placement looks one up and registers its own walk; the latest walk is
        # always kept. A lookup that finds no memo at all (a prompt not seen yet) does not count.
        self._tick += 1
        if n and (self.score >= _SCORE_MIN or not self._tick & 15):
            plist, parr = self._mark_positions(n)
            marks = qa[parr].tolist()
            z, cut = self._find(marks, plist, raw, epoch)
            if z is not None:
                groups = self._reuse(z, qa, cut)
                self.score += ((groups is not None) - self.score) * _SCORE_DECAY
            if groups is not None:
                if z.raw == raw:
                    # the same prompt: the memo itself is exact again, at this log position
                    z.pos = owners.log_end()
                    z.groups = groups
                    self._snapshot_losses(z)
                    order = self._order
                    del order[z]
                    order[z] = None
                    self.latest = z
                    return groups
        if groups is None:
            groups = owners.walk(raw, all_bits)
        memo = Walk(raw, groups, epoch, owners.log_end())
        if marks is None:
            self.latest = memo      # the latest walk only (select_pair's second leg, tail insert)
        else:
            self._remember(memo, marks)
        return groups

    def _mark_positions(self, n: int) -> tuple[list, np.ndarray]:
        """Where a memo of ``n`` keys is registered (and a prompt of ``n`` keys looks for one):
        every ``stride``-th key and the last, in increasing order."""
        got = self._positions.get(n)
        if got is None:
            st = self.stride
            plist = list(range(st - 1, n, st))
            if n % st:
                plist.append(n - 1)
            if len(self._positions) >= 1024:     # bounded: one entry per prompt length seen
                self._positions.clear()
            got = self._positions[n] = (plist, np.array(plist, dtype=np.intp))
        return got

    def _find(self, marks: list, plist: list, raw: bytes, epoch: int):
        """(memo, c): a memo of this epoch whose first ``c`` keys are the prompt's (``marks``: the
        prompt's keys at positions ``plist``), ``c`` as large as those positions allow;
        (None, 0) when there is none."""
        pm = self._by_mark
        n = len(raw) >> 3
        for i in range(len(marks) - 1, -1, -1):
            z = pm.get(marks[i])
            if z is None or z.epoch != epoch:
                continue
            c = plist[i] + 1
            if c == n:
                if z.raw == raw if z.n == n else z.n > n and z.raw[:8 * n] == raw:
                    return z, n
            elif z.n >= c and z.raw[:8 * c] == raw[:8 * c]:
                return z, c
        return None, 0

    def _reuse(self, z: Walk, qa: np.ndarray, cut: int) -> list | None:
        """The prompt's groups from memo ``z``, whose first ``cut`` keys are the prompt's ``qa``;
        None when a slot that matched part of ``z`` lost a key since (then walk from scratch)."""
        if z.lmask and self._loss_getter(z.lmask)(self._slots.losses) != z.lcounts:
            return None
        read = z.read()
        if cut > read:
            cut = read
        owners = self._owners
        get = owners.masks.get
        out = []
        p = cut
        groups = z.groups
        # the key after each group's depth, as ints: a few `item` calls, where fancy indexing with
        # a list of two or three positions costs ~4x (bench/routing/placement.py `select`: 2.8 groups)
        key_at = qa.item
        ends = [key_at(d) for _, d in groups if d < cut]
        for (bits, d), k in zip(groups, ends):
            # these slots held the first d keys and lost nothing; they match exactly d keys
            # still unless one of them now holds key d
            if get(k, 0) & bits:
                p = d
                break
            out.append((bits, d))
        active = 0
        for bits, _ in groups[len(out):]:
            active |= bits
        if active:
            out += [(b, d + p) for b, d in owners.walk(qa[p:], active)]
        return out

    def _snapshot_losses(self, memo: Walk) -> None:
        m = 0
        for bits, d in memo.groups:
            if d:
                m |= bits
        memo.lmask = m
        memo.lcounts = self._loss_getter(m)(self._slots.losses) if m else None

    def _loss_getter(self, mask: int):
        """The loss counts of the slots in ``mask``, read in one C call (cached per mask)."""
        g = self._loss_getters.get(mask)
        if g is None:
            idxs = []
            b = mask
            while b:
                low = b & -b
                idxs.append(low.bit_length() - 1)
                b ^= low
            g = itemgetter(*idxs)
            if len(self._loss_getters) >= 4096:
                self._loss_getters.clear()
            self._loss_getters[mask] = g
        return g

    def _remember(self, memo: Walk, marks: list) -> None:
        self._snapshot_losses(memo)
        pm = self._by_mark
        for k in marks:
            pm[k] = memo
        memo.marks = marks
        order = self._order
        order[memo] = None
        self.latest = memo
        if len(order) > self.cap:
            old = next(iter(order))
            del order[old]
            for k in old.marks:
                if pm.get(k) is old:
                    del pm[k]

    def before_tail_insert(self, keys, bit: int) -> None:
        """Called before slot ``bit`` predicts ``keys``: when they are the unmatched tail of the
        latest walk and nothing was logged since it, that walk takes the insert in (the slot then
        holds or predicts every key of it: `Walk.deepen`); `after_tail_insert`, called once the
        insert is logged, moves it past the insert's own log entries."""
        memo = self.latest
        owners = self._owners
        if memo is None or memo.epoch != owners.epoch or memo.pos != owners.log_end():
            return
        tail = u64_bytes(keys)
        if tail is None:
            return
        have = memo.n - (len(tail) >> 3)
        if have < 0 or memo.raw[8 * have:] != tail or not memo.deepen(bit, have):
            return
        self._snapshot_losses(memo)     # the slot may be new among the memo's matching slots
        memo.pos = -1   # "advance past the insert's own log entries" for after_tail_insert

    def after_tail_insert(self) -> None:
        memo = self.latest
        if memo is not None and memo.pos == -1:
            memo.pos = self._owners.log_end()
