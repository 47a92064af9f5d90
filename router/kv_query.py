"""Prefix-match queries of the KV index: one walk over a prompt's keys for every slot.

A mixin of `router.kv_index.KvIndex` (see its docstring for the owner-bitmask layout).

The walk is memory-bound (one dict probe per key into an index of 10^4-10^6 keys, ~100-300 ns
each on a busy host), so the last walk is memoised: a placement walks the prompt, inserts its
speculative keys for the chosen slot and, for ``select_pair``, walks the same prompt again for
the other role. The memo is exact, never a heuristic:

- every change of an owner mask appends the key to ``_log`` (stores, removals, speculative
  inserts and drops); changes the log does not describe one key at a time (a slot cleared, a
  snapshot loaded, a slot created or freed, the log trimmed) bump ``_epoch`` instead;
- the memo is reused only for the same keys, in the same epoch, when no key logged since it was
  taken is one of the keys its walk read (the walked prefix and the key that ended it): the
  other keys cannot change any slot's match;
- the one change a placement itself makes, the chosen slot's speculative insert of the prompt's
  unmatched tail, is applied to the memo instead (that slot now matches the whole prompt), when
  it comes right after the walk with nothing logged in between.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

import numpy as np

from .kv_types import _COUNT

# A memo with more keys logged since it was taken than this many times the keys its walk read is
# dropped: checking them would cost about as much as walking again.
_MEMO_CHECK_RATIO = 2
LOG_TRIM = 1 << 16      # mutation-log length that trims it (and bumps the epoch)


def _immutable(arr: np.ndarray) -> bool:
    """The array's memory belongs to a ``bytes`` object (a wire payload), so it cannot change."""
    b = arr.base
    while isinstance(b, np.ndarray):
        b = b.base
    return isinstance(b, bytes)


class WalkMemo:
    """The last walk: its keys (a list; for a uint64 array over a ``bytes`` payload also the
    array), its groups over every slot, and the epoch and log position it is valid at. Another
    array is compared byte for byte, and only when its last key agrees."""

    __slots__ = ("keys", "arr", "_raw", "groups", "epoch", "pos", "kset")

    def __init__(self, keys: list, arr, groups: list, epoch: int, pos: int):
        self.keys = keys
        self.arr = arr
        self._raw: bytes | None = None
        self.groups = groups
        self.epoch = epoch
        self.pos = pos
        self.kset: set | None = None    # the keys the walk read, built on first need

    def same(self, keys, kl: list | None) -> bool:
        """Whether ``keys`` (a list ``kl``, or a uint64 array) are the memoised keys."""
        mk = self.keys
        if kl is not None:
            return mk == kl
        if len(keys) != len(mk) or not mk or keys[-1] != mk[-1] or keys.dtype != np.uint64:
            return False
        if keys is self.arr:
            return True
        if self._raw is None:
            self._raw = (self.arr.tobytes() if self.arr is not None
                         else np.array(mk, dtype=np.uint64).tobytes())
        return keys.tobytes() == self._raw

    def read_keys(self) -> set:
        ks = self.kset
        if ks is None:
            ks = self.kset = set(self.keys[:self.groups[-1][1] + 1])
        return ks

    def deepen(self, bit: int, have: int) -> bool:
        """The slot ``bit`` now also holds every key after its first ``have``: if it matched at
        least ``have`` before, it matches the whole prompt now (False: memo left as it was)."""
        n = len(self.keys)
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
        self.kset = None
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
        """
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        get = self._owners.get
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
        """``_walk(keys, every slot)``, from the memo when it is still exact (module docstring)."""
        if type(keys) is list:
            kl, arr = keys, None
        elif isinstance(keys, np.ndarray):
            kl, arr = None, keys
        else:
            kl = list(keys)
            arr = None
        memo = self._memo
        log = self._log
        if memo is not None and memo.epoch == self._epoch and memo.same(keys, kl):
            pos, end = memo.pos, len(log)
            if pos == end:
                return memo.groups
            if end - pos <= _MEMO_CHECK_RATIO * (memo.groups[-1][1] + 1) and \
                    memo.read_keys().isdisjoint(log[pos:]):
                memo.pos = end
                return memo.groups
        if len(log) > LOG_TRIM:
            self._trim_log()
        if not self._all_bits:
            return []
        if kl is None:
            kl = keys.tolist()
        groups = self._walk(kl, self._all_bits)
        # keep the array only when its content cannot change behind the memo's back
        self._memo = WalkMemo(kl, arr if arr is not None and arr.dtype == np.uint64
                              and _immutable(arr) else None, groups, self._epoch, len(log))
        return groups

    def drop_walk_memo(self) -> None:
        """Make the next query walk (benchmarks measuring the walk itself; never needed for
        correctness)."""
        self._memo = None

    def _trim_log(self) -> None:
        if len(self._log) > LOG_TRIM:
            self._log.clear()
            self._epoch += 1

    def _memo_tail(self, keys: list, bit: int) -> None:
        """Called by a speculative insert of ``keys`` for slot ``bit`` *before* it logs its
        changes: when ``keys`` is the unmatched tail of the memoised walk and nothing was logged
        since that walk, the memo takes the insert in (see ``WalkMemo.deepen``); else no-op."""
        memo = self._memo
        if memo is None or memo.epoch != self._epoch or memo.pos != len(self._log):
            return
        have = len(memo.keys) - len(keys)
        if have < 0 or memo.keys[have:] != keys or not memo.deepen(bit, have):
            return
        memo.pos = -1   # marks "advance past the insert's own log entries" for _memo_logged

    def _memo_logged(self) -> None:
        memo = self._memo
        if memo is not None and memo.pos == -1:
            memo.pos = len(self._log)

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
        assert spec == self._spec_owners, "speculative bitmasks disagree with slot speculation"
        combined = dict(seen)
        for ck, m in spec.items():
            combined[ck] = combined.get(ck, 0) | m
        assert combined == self._owners, "owners bitmasks disagree with slot ownership"
        assert self._n_keys == len(seen), ("confirmed key count", self._n_keys, len(seen))
