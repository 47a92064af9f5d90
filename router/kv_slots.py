"""The KV index's slots: one per ``(worker, dp_rank)``, each owning one bit of the owner masks.

`SlotTable` hands out bits (the lowest free one first, so masks stay narrow), finds a slot by its
key or its bit, names the workers of a mask, and keeps a loss counter per bit that the walk memo
(router/kv_memo.py) reads.

Invariants (`SlotTable.check_invariants`):
- ``by_bit[s.idx] is s`` for every live slot ``s``, ``s.bit == 1 << s.idx``; the free bit
  positions are exactly the ``None`` entries of ``by_bit``;
- ``all_bits`` is the OR of the live slots' bits;
- every live slot is listed once under its worker, and a worker is listed iff it has a slot;
- ``losses`` has one counter per bit position ever handed out; a counter never goes down.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

__all__ = ["Slot", "SlotTable"]


class Slot:
    """One ``(worker, dp_rank)`` and what it holds. Its maps belong to the objects that write
    them: ``owned`` (key -> refcount) and ``emaps`` ((tier, group) -> {engine hash: entry}) to
    router/kv_ledger.py `BlockLedger`, ``spec`` (key -> deadline) to router/kv_speculation.py
    `SpeculativeEntries`; router/_owner_map.c's loops take ``owned`` and ``spec`` as they are;
    ``cap``, ``clock``, ``base``, ``low`` and ``stamps`` (the cache-age model) to router/kv_capacity.py
    `CapacityBound`."""

    __slots__ = ("worker", "dp_rank", "bit", "idx", "owned", "emaps", "spec", "cap", "clock",
                 "base", "low", "stamps")

    def __init__(self, worker: str, dp_rank: int, idx: int):
        self.worker = worker
        self.dp_rank = dp_rank
        self.idx = idx                  # its position in the table's per-bit lists
        self.bit = 1 << idx
        self.owned: dict[int, int] = {}
        self.emaps: dict[tuple, dict] = {}
        self.spec: dict[int, float] = {}
        self.cap = 0                    # KV capacity in blocks (0: unknown)
        self.clock = 0                  # keys brought in since the slot was created
        self.base = 0                   # the clock when it was last cleared
        self.low = 0                    # its lowest stamp since (the base when none)
        self.stamps: dict[int, int] = {}


class SlotTable:
    """The live slots, by ``(worker, dp_rank)``, by bit position and by worker."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, int], Slot] = {}
        # worker -> its rank-0 slot (a placement's lookup without building the (worker, 0) key:
        # most workers have that one slot)
        self.rank0: dict[str, Slot] = {}
        self.by_bit: list[Slot | None] = []
        # per bit position: bumped whenever its slot may have stopped holding a key (its bit
        # cleared somewhere); a walk memo stays exact for a slot while its count has not moved
        self.losses: list[int] = []
        self.all_bits = 0
        # the slots whose cache-age clock ran past their capacity: their matches may be cut
        # (router/kv_capacity.py; written there)
        self.pressed = 0
        self._free: list[int] = []      # heap of free bit positions
        self._of_worker: dict[str, list[Slot]] = {}
        # mask -> worker names (the same groups of workers keep dropping out of walks together)
        self._names: dict[int, tuple[str, ...]] = {}

    def get(self, worker: str, dp_rank: int) -> Slot | None:
        return self.by_key.get((worker, dp_rank))

    def add(self, worker: str, dp_rank: int) -> Slot:
        """A new slot for ``(worker, dp_rank)`` (which has none), on the lowest free bit."""
        if not isinstance(worker, str) or not worker:
            raise ValueError(f"worker must be a non-empty string, found {worker!r}")
        if (worker, dp_rank) in self.by_key:
            raise ValueError(f"slot ({worker!r}, {dp_rank}) exists already")
        if self._free:
            idx = heapq.heappop(self._free)
        else:
            idx = len(self.by_bit)
            self.by_bit.append(None)
            self.losses.append(0)
        s = Slot(worker, dp_rank, idx)
        self.by_bit[idx] = s
        self.by_key[(worker, dp_rank)] = s
        if dp_rank == 0:
            self.rank0[worker] = s
        self._of_worker.setdefault(worker, []).append(s)
        self.all_bits |= s.bit
        self._names.clear()
        return s

    def remove_worker(self, worker: str) -> list[Slot]:
        """Free the worker's slots' bits; returns the slots (empty: the caller cleared them)."""
        slots = self._of_worker.pop(worker, [])
        for s in slots:
            del self.by_key[(s.worker, s.dp_rank)]
            if s.dp_rank == 0:
                del self.rank0[s.worker]
            self.by_bit[s.idx] = None
            heapq.heappush(self._free, s.idx)
            self.all_bits &= ~s.bit
            self.pressed &= ~s.bit
        self._names.clear()
        return slots

    def of_worker(self, worker: str) -> list[Slot]:
        return self._of_worker.get(worker, [])

    def workers(self) -> list[str]:
        return list(self._of_worker)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.by_key.values())

    def mask(self, workers: Iterable[str] | None) -> int:
        """The bits of the named workers' slots (every slot's for ``None``)."""
        if workers is None:
            return self.all_bits
        m = 0
        for w in workers:
            for s in self._of_worker.get(w, ()):
                m |= s.bit
        return m

    def names(self, bits: int) -> tuple[str, ...]:
        """Worker names of the slots in ``bits``, in bit order (memoised per mask)."""
        ws = self._names.get(bits)
        if ws is None:
            by_bit = self.by_bit
            out = []
            b = bits
            while b:
                low = b & -b
                out.append(by_bit[low.bit_length() - 1].worker)
                b ^= low
            ws = tuple(out)
            if len(self._names) >= 4096:
                self._names.clear()
            self._names[bits] = ws
        return ws

    def check_invariants(self) -> None:
        bits = 0
        for (w, r), s in self.by_key.items():
            assert (s.worker, s.dp_rank) == (w, r) and s.bit == 1 << s.idx, (w, r, s.idx)
            assert self.by_bit[s.idx] is s, ("by_bit", w, r)
            assert not bits & s.bit, ("bit used twice", s.idx)
            bits |= s.bit
            assert self._of_worker[w].count(s) == 1, ("worker list", w, r)
        assert bits == self.all_bits, ("all_bits", bits, self.all_bits)
        assert not self.pressed & ~bits, ("pressed bits of no slot", self.pressed, bits)
        assert sorted(self._free) == [i for i, s in enumerate(self.by_bit) if s is None]
        assert sum(map(len, self._of_worker.values())) == len(self.by_key)
        assert self.rank0 == {w: s for (w, r), s in self.by_key.items() if r == 0}, "rank0"
        assert all(self._of_worker.values()), "a worker listed without slots"
        assert len(self.losses) == len(self.by_bit)
