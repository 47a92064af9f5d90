"""The KV index's speculative entries: predicted, unconfirmed ownership of a routed prompt's keys.

A routed prompt's unmatched keys count for the chosen slot until a store confirms them, they
expire, or the slot is cleared. An entry is the slot's ``spec[key] = deadline`` plus the slot's
bit in the key's owner mask (router/kv_owners.py); expiry is a heap of one record per routed
prompt, drained in bounded slices (issue 13). What limits predictions in time (a
deadline) is decided here; the second bound, a server's KV capacity, is router/kv_capacity.py's:
it cuts the matches of a slot's speculative and held keys alike where the blocks routed there
since have evicted them.

Invariants (`SpeculativeEntries.check_invariants`, with the index's cross-object checks):
- ``size`` is the number of speculative entries over all slots;
- a slot never predicts a key it holds (``key in spec`` excludes ``key in owned``), and its bit
  is set in the mask of every key it predicts;
- every entry's deadline is that of a heap record holding its key (a record whose keys were all
  confirmed, re-predicted later or cleared takes nothing when it comes due).
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from .kv_owners import OwnerTable
from .kv_slots import Slot, SlotTable

__all__ = ["SpeculativeEntries"]


class SpeculativeEntries:
    """Every slot's predicted keys, with their deadlines. Single writer, no I/O.

    ``stats`` is the index's `IndexStats` (router/kv_ledger.py): its ``speculative_*`` counters
    are this object's."""

    def __init__(self, owners: OwnerTable, slots: SlotTable, stats) -> None:
        self._owners = owners
        self._slots = slots
        self._stats = stats
        self.size = 0
        # (deadline, seq, worker, dp_rank, keys): only atomic values (no slot object), so the
        # collector untracks the tuples and 30 s of routed prompts add nothing to its full scans
        self._heap: list = []
        self._seq = itertools.count()

    def add(self, s: Slot, keys, deadline: float) -> int:
        """Predict that slot ``s`` holds ``keys`` until ``deadline``. Keys it holds are skipped;
        predicting again moves the deadline. Returns how many of ``keys`` it predicts now."""
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        spec = s.spec
        n_before = len(spec)
        added = self._owners.predict(keys, s.owned, spec, s.bit, deadline)
        self.size += len(spec) - n_before
        if added:
            heapq.heappush(self._heap, (deadline, next(self._seq), s.worker, s.dp_rank,
                                        tuple(added)))
            self._stats.speculative_added += len(added)
        return len(added)

    def confirm(self, s: Slot, ck: int) -> None:
        """A store made the predicted ``ck`` held by ``s``: the entry goes, the bit stays."""
        del s.spec[ck]
        self.size -= 1
        self._stats.speculative_confirmed += 1

    def drop_slot(self, s: Slot) -> None:
        """Forget every entry of slot ``s`` (it is being cleared)."""
        if not s.spec:
            return
        clear_bit = self._owners.clear_bit
        for ck in s.spec:
            clear_bit(ck, s.bit)
        self.size -= len(s.spec)
        s.spec.clear()
        self._slots.losses[s.idx] += 1

    def expire(self, now: float, max_entries: int | None = None,
               max_keys: int | None = None) -> int:
        """Drop the entries whose deadline is ``<= now``; returns how many keys expired.

        ``max_entries`` (heap records, one per routed prompt) and ``max_keys`` (keys looked at,
        counted per whole record: a record is never left half expired) bound the work of one
        call. A second's worth of routed prompts expiring at once cost tens of ms: 256 records of
        a 4k-token prompt are ~65,000 keys, a 15-40 ms stall of every select behind the
        maintenance tick (bench/results/history/coordinator.md, "coordinator · open-loop
        stall"); so the coordinator expires a few records per placement and its tick works
        through a backlog in key-bounded slices."""
        heap = self._heap
        slots = self._slots
        losses = slots.losses
        unpredict = self._owners.unpredict
        n = 0
        budget = -1 if max_entries is None else max_entries
        keys_left = -1 if max_keys is None else max_keys
        while heap and heap[0][0] <= now and budget and keys_left:
            budget -= 1
            _, _, worker, rank, keys = heapq.heappop(heap)
            if keys_left > 0:
                keys_left = max(0, keys_left - len(keys))
            s = slots.get(worker, rank)
            if s is None:
                continue  # slot removed since (a new slot's entries carry their own deadlines)
            k = unpredict(keys, s.spec, s.bit, now)
            # a record that took nothing from the slot leaves its walk memos exact
            if k:
                losses[s.idx] += 1
                n += k
        self._stats.speculative_expired += n
        self.size -= n
        return n

    def due(self, now: float) -> bool:
        """Whether an entry's deadline has passed (a backlog for the next slice)."""
        heap = self._heap
        return bool(heap) and heap[0][0] <= now

    def check_invariants(self) -> None:
        masks = self._owners.masks
        n = 0
        for s in self._slots:
            n += len(s.spec)
            for ck in s.spec:
                assert ck not in s.owned, ("predicted and held", s.worker, ck)
                assert masks.get(ck, 0) & s.bit, ("predicted without its bit", s.worker, ck)
        assert self.size == n, ("speculative entry count", self.size, n)
        records = {(w, r, ck, deadline) for deadline, _, w, r, keys in self._heap for ck in keys}
        for s in self._slots:
            for ck, d in s.spec.items():
                assert (s.worker, s.dp_rank, ck, d) in records, ("no heap record", ck, d)
