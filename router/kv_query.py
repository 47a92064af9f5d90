"""Prefix-match queries of the KV index: one walk over a prompt's keys for every slot.

A mixin of `router.kv_index.KvIndex` (see its docstring for the owner-bitmask layout).

The walk is memory-bound (one dict probe per key into an index of 10^4-10^6 keys, ~150-300 ns
each on a busy host: cache misses), so walks are memoised and reused by later prompts with the
same leading keys: a placement walks the prompt, inserts the chosen slot's speculative tail and,
for ``select_pair``, walks it again for the other role (unless nothing changed in between: the
coordinator's view then hands the other leg the same answer, ``walk_version``); a prompt placed again, or one extending
an earlier one (a conversation's next turn), walks only what may have changed. Memos are exact,
never a heuristic:

- the latest walk is reused for the same keys when nothing was logged since, or when no key
  logged since (``_log``: every owner-mask change) is one its walk read;
- any memo is reused for the leading keys a prompt shares with it (found by its keys at every
  ``_memo_stride``-th position and its last key, then compared byte for byte), in the same
  ``_epoch`` (bumped by changes the log does not describe key by key: a slot cleared, created or
  freed, a snapshot loaded), when none of the slots that matched part of that
  prefix lost a key since (``_losses``, per slot): a slot that lost nothing still holds what it held,
  and its match can only have grown at the key that ended it, which is probed again (one probe
  per group of the walk). From the first group that grew, the walk goes on from that depth for
  the slots still matching there;
- the one change a placement itself makes, the chosen slot's speculative insert of the prompt's
  unmatched tail, is applied to the latest memo instead (that slot now matches the whole prompt),
  when it comes right after the walk with nothing logged in between.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from operator import itemgetter

import numpy as np

from .kv_types import _COUNT, NATIVE  # noqa: F401  (NATIVE: router/_owner_map.c's walk runs)

# A memo with more keys logged since it was taken than this many times the keys its walk read is
# dropped: checking them would cost about as much as walking again.
_MEMO_CHECK_RATIO = 2
LOG_TRIM = 1 << 16      # mutation-log length that trims it (its positions go on counting)
MEMO_STRIDE = 32        # memos are found by their keys at every 32nd position (and their last)
MEMO_CAP = 1024         # memos kept, least recently used dropped first (~2 KiB each at 256 keys)
_MEMO_SCORE_MIN = 0.25 # below this share of memos found still exact, look up 1 in 16 only
_MEMO_SCORE_DECAY = 1 / 64


_U64 = np.dtype(np.uint64)


def _u64_bytes(keys) -> bytes | None:
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


class WalkMemo:
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
        self.lcounts = None         # ... and their loss counts (``_loss_getter(lmask)``)
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


class QueryMixin:
    """`KvIndex` read methods: `longest_prefix`, `longest_prefix_ranks`, invariants."""

    __slots__ = ()

    def _mask(self, workers: Iterable[str] | None) -> int:
        if workers is None:
            return self._all_bits
        m = 0
        for w in workers:
            for s in self._worker_slots.get(w, ()):
                m |= s.bit
        return m

    def _walk(self, keys, active: int) -> list[tuple[int, int]]:
        """[(bits, depth)]: the slots in ``bits`` matched exactly ``depth`` leading keys.

        One dict lookup and one AND per key; the list grows only when the active set shrinks
        (at most once per slot). A plain loop measured ~17% faster here than the equivalent
        ``takewhile(accumulate(map(...)))`` chain, whose per-key cost is three C-level calls.
        router/_owner_map.c `OwnerMap.walk` is this loop, native.
        """
        owners = self._owners
        if type(owners) is not dict:    # router/_owner_map.c: this loop over u64 bytes or a list
            if isinstance(keys, np.ndarray):
                keys = keys.tobytes() if keys.dtype is _U64 else keys.tolist()
            return owners.walk(keys if type(keys) in (bytes, list) else list(keys), active)
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        elif type(keys) is bytes:
            keys = np.frombuffer(keys, _U64).tolist()
        get = owners.get
        out = []
        m = active
        i = 0
        for k in keys:
            x = m & get(k, 0)
            if x != m:
                out.append((m ^ x, i))
                if not x:
                    return out
                m = x
            i += 1
        out.append((m, i))
        return out

    def _groups(self, keys) -> list[tuple[int, int]]:
        """``_walk(keys, every slot)``, reusing memoised walks where exact (module docstring)."""
        if not self._all_bits:
            return []
        if not isinstance(keys, (list, np.ndarray)):
            keys = list(keys)
        raw = _u64_bytes(keys)
        if raw is None:     # not u64 keys (no memo is for them): a plain walk
            return self._walk(keys, self._all_bits)
        log = self._log
        epoch = self._epoch
        memo = self._memo
        if memo is not None and memo.epoch == epoch and memo.raw == raw:
            base = self._log_base
            pos, end = memo.pos, base + len(log)
            if pos == end:
                return memo.groups
            r = memo.read()
            # pos < base: entries it would need were trimmed away
            if base <= pos and end - pos <= _MEMO_CHECK_RATIO * r and \
                    set(np.frombuffer(raw, np.uint64, r).tolist()).isdisjoint(log[pos - base:]):
                memo.pos = end
                return memo.groups
        self._trim_log()
        qa = keys if isinstance(keys, np.ndarray) else np.frombuffer(raw, _U64)
        n = len(qa)
        groups = None
        marks = None
        # Cost control, never a change of result: while the memos found are seldom still exact
        # (distinct prompts sharing a prefix, their servers losing routed tails all the time),
        # only every 16th placement looks one up and registers its own walk; the latest walk is
        # always kept. A lookup that finds no memo at all (a prompt not seen yet) does not count.
        self._memo_tick += 1
        if n and (self._memo_score >= _MEMO_SCORE_MIN or not self._memo_tick & 15):
            plist, parr = self._mark_positions(n)
            marks = qa[parr].tolist()
            z, cut = self._find_memo(marks, plist, raw, epoch)
            if z is not None:
                groups = self._reuse(z, qa, cut)
                self._memo_score += ((groups is not None) - self._memo_score) * _MEMO_SCORE_DECAY
            if groups is not None:
                if z.raw == raw:
                    # the same prompt: the memo itself is exact again, at this log position
                    z.pos = self._log_end()
                    z.groups = groups
                    self._snapshot_losses(z)
                    order = self._memo_order
                    del order[z]
                    order[z] = None
                    self._memo = z
                    return groups
        if groups is None:
            groups = self._walk(raw, self._all_bits)
        memo = WalkMemo(raw, groups, epoch, self._log_end())
        if marks is None:
            self._memo = memo       # the latest walk only (select_pair's second leg, tail insert)
        else:
            self._remember(memo, marks)
        return groups

    def _mark_positions(self, n: int) -> tuple[list, np.ndarray]:
        """Where a memo of ``n`` keys is registered (and a prompt of ``n`` keys looks for one):
        every ``_memo_stride``-th key and the last, in increasing order."""
        got = self._memo_pos.get(n)
        if got is None:
            st = self._memo_stride
            plist = list(range(st - 1, n, st))
            if n % st:
                plist.append(n - 1)
            if len(self._memo_pos) >= 1024:     # bounded: one entry per prompt length seen
                self._memo_pos.clear()
            got = self._memo_pos[n] = (plist, np.array(plist, dtype=np.intp))
        return got

    def _find_memo(self, marks: list, plist: list, raw: bytes, epoch: int):
        """(memo, c): a memo of this epoch whose first ``c`` keys are the prompt's (``marks``: the
        prompt's keys at positions ``plist``), ``c`` as large as those positions allow;
        (None, 0) when there is none."""
        pm = self._pmemo
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

    def _reuse(self, z: WalkMemo, qa: np.ndarray, cut: int) -> list | None:
        """The prompt's groups from memo ``z``, whose first ``cut`` keys are the prompt's ``qa``;
        None when a slot that matched part of ``z`` lost a key since (then walk from scratch)."""
        if z.lmask and self._loss_getter(z.lmask)(self._losses) != z.lcounts:
            return None
        read = z.read()
        if cut > read:
            cut = read
        get = self._owners.get
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
            out += [(b, d + p) for b, d in self._walk(qa[p:], active)]
        return out

    def _snapshot_losses(self, memo: WalkMemo) -> None:
        m = 0
        for bits, d in memo.groups:
            if d:
                m |= bits
        memo.lmask = m
        memo.lcounts = self._loss_getter(m)(self._losses) if m else None

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

    def _remember(self, memo: WalkMemo, marks: list) -> None:
        self._snapshot_losses(memo)
        pm = self._pmemo
        for k in marks:
            pm[k] = memo
        memo.marks = marks
        order = self._memo_order
        order[memo] = None
        self._memo = memo
        if len(order) > self._memo_cap:
            old = next(iter(order))
            del order[old]
            for k in old.marks:
                if pm.get(k) is old:
                    del pm[k]

    def drop_walk_memo(self) -> None:
        """Make the next query walk (benchmarks measuring the walk itself; never needed for
        correctness)."""
        self._memo = None
        self._pmemo.clear()
        self._memo_order.clear()

    def _log_end(self) -> int:
        """The log's position after its last entry (positions go on counting past a trim)."""
        return self._log_base + len(self._log)

    def _trim_log(self) -> None:
        """Past LOG_TRIM entries, drop the log's entries, keeping its positions: only the latest
        memo reads the log (and finds its own position trimmed away); the registered memos are
        checked by loss counts and stay reusable. A trim used to bump the epoch, dropping every
        memo once per ~65k owner-mask changes: twice a second under 1k-token tails routed at
        1,000/s."""
        log = self._log
        if len(log) > LOG_TRIM:
            self._log_base += len(log)
            log.clear()

    def _memo_tail(self, keys, bit: int) -> None:
        """Called by a speculative insert of ``keys`` for slot ``bit`` *before* it logs its
        changes: when ``keys`` is the unmatched tail of the latest walk and nothing was logged
        since that walk, that memo takes the insert in (see ``WalkMemo.deepen``); else no-op."""
        memo = self._memo
        if memo is None or memo.epoch != self._epoch or memo.pos != self._log_end():
            return
        tail = _u64_bytes(keys)
        if tail is None:
            return
        have = memo.n - (len(tail) >> 3)
        if have < 0 or memo.raw[8 * have:] != tail or not memo.deepen(bit, have):
            return
        self._snapshot_losses(memo)     # the slot may be new among the memo's matching slots
        memo.pos = -1   # marks "advance past the insert's own log entries" for _memo_logged

    def _memo_logged(self) -> None:
        memo = self._memo
        if memo is not None and memo.pos == -1:
            memo.pos = self._log_end()

    def _workers_of(self, bits: int) -> tuple[str, ...]:
        """Worker names of the slots in ``bits`` (memoised: the same groups of workers keep
        dropping out together, e.g. every worker holding only a shared system prompt)."""
        ws = self._mask_cache.get(bits)
        if ws is None:
            by_bit = self._by_bit
            out = []
            b = bits
            while b:
                low = b & -b
                out.append(by_bit[low.bit_length() - 1].worker)
                b ^= low
            ws = tuple(out)
            if len(self._mask_cache) >= 4096:
                self._mask_cache.clear()
            self._mask_cache[bits] = ws
        return ws

    def walk_version(self) -> tuple[int, int]:
        """Changes whenever the answer of a walk may: the epoch and the log's position (every
        owner-mask change is logged or bumps the epoch, the memos' own test)."""
        return self._epoch, self._log_end()

    def longest_prefix(self, keys, workers: Iterable[str] | None = None) -> dict[str, int]:
        """Matched leading blocks per worker (best dp rank), in one walk over ``keys``.

        With ``workers`` given, every named worker is in the answer (0 when nothing matched);
        otherwise only workers that matched at least one block are.
        """
        if workers is None:
            res: dict[str, int] = {}
            active = self._all_bits
        else:
            workers = list(workers)
            res = dict.fromkeys(workers, 0)
            active = self._mask(workers)
        if not active:
            return res
        # groups come in increasing depth, so a later update is a deeper match (best dp rank)
        full = active == self._all_bits
        for bits, depth in self._groups(keys):
            if depth:
                if not full:
                    bits &= active
                    if not bits:
                        continue
                res.update(zip(self._workers_of(bits), repeat(depth)))
        return res

    def longest_prefix_ranks(self, keys, workers: Iterable[str] | None = None
                             ) -> dict[tuple[str, int], int]:
        """Like :meth:`longest_prefix` but per ``(worker, dp_rank)``, nonzero matches only."""
        active = self._mask(workers)
        res: dict[tuple[str, int], int] = {}
        by_bit = self._by_bit
        for bits, depth in self._groups(keys) if active else ():
            bits &= active
            while depth and bits:
                low = bits & -bits
                s = by_bit[low.bit_length() - 1]
                res[(s.worker, s.dp_rank)] = depth
                bits ^= low
        return res

    def check_invariants(self) -> None:
        """Assert the ownership invariants (tests and debugging; O(index size))."""
        seen: dict[int, int] = {}
        spec: dict[int, int] = {}
        for s in self._slots.values():
            for ck, c in s.owned.items():
                assert c & _COUNT > 0, (s.worker, ck, c)
                seen[ck] = seen.get(ck, 0) | s.bit
            for ck in s.spec:
                assert ck not in s.owned, (s.worker, ck)
                spec[ck] = spec.get(ck, 0) | s.bit
        assert self._n_spec == sum(len(s.spec) for s in self._slots.values()), \
            ("speculative entry count", self._n_spec)
        combined = dict(seen)
        for ck, m in spec.items():
            combined[ck] = combined.get(ck, 0) | m
        assert combined == self._owners, "owners bitmasks disagree with slot ownership"
        assert self._n_keys == len(seen), ("confirmed key count", self._n_keys, len(seen))
