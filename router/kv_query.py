"""Prefix-match queries of the KV index: one walk over a prompt's keys for every slot.

A mixin of `router.kv_index.KvIndex` (see its docstring for the owner-bitmask layout).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

import numpy as np

from .kv_types import _COUNT


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
        active = self._mask(workers)
        res: dict[str, int] = dict.fromkeys(workers, 0) if workers is not None else {}
        if not active:
            return res
        # groups come in increasing depth, so a later update is a deeper match (best dp rank)
        for bits, depth in self._walk(keys, active):
            if depth:
                res.update(zip(self._workers_of(bits), repeat(depth)))
        return res

    def longest_prefix_ranks(self, keys, workers: Iterable[str] | None = None
                             ) -> dict[tuple[str, int], int]:
        """Like :meth:`longest_prefix` but per ``(worker, dp_rank)``, nonzero matches only."""
        active = self._mask(workers)
        res: dict[tuple[str, int], int] = {}
        by_bit = self._by_bit
        for bits, depth in self._walk(keys, active) if active else ():
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
