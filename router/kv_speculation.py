"""Speculative (routing-time) entries of the KV index: predicted, unconfirmed ownership.

A mixin of `router.kv_index.KvIndex` (same single-writer state): a routed prompt's keys count
for the chosen slot until a store confirms them, they expire, or the slot is cleared. Expiry is a
heap of one entry per routed prompt, drained in bounded slices (issue 13).
"""

from __future__ import annotations

import heapq

import numpy as np

from .kv_types import NATIVE, _Slot  # noqa: F401  (NATIVE: router/_owner_map.c's loops run)


class SpeculationMixin:
    """`KvIndex` methods for speculative entries (see `router/kv_index.py` for the layout)."""

    __slots__ = ()

    def _drop_spec(self, s: _Slot, ck: int) -> None:
        """Forget the slot's speculative entry for ``ck`` (the key keeps its confirmed owners)."""
        del s.spec[ck]
        self._n_spec -= 1
        self._log.append(ck)
        self._losses[s.idx] += 1
        nb = ~s.bit
        m = self._owners[ck] & nb
        if m:
            self._owners[ck] = m
        else:
            del self._owners[ck]

    def add_speculative(self, worker: str, keys, now: float, ttl: float,
                        dp_rank: int = 0) -> int:
        """Predict that ``worker`` will hold ``keys`` until ``now + ttl`` (routing-time insert).

        Keys it already holds are skipped; re-adding refreshes the deadline. Returns how many
        keys are speculative for the slot after the call among ``keys``.
        """
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, found {ttl}")
        s = self._slot(worker, dp_rank)
        given = keys
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        deadline = now + ttl
        spec, owned, owners, bit, log = s.spec, s.owned, self._owners, s.bit, self._log
        n_before = len(spec)
        # The latest walk takes this insert in when it is the walk's unmatched tail with nothing
        # logged since (router/kv_query.py `_memo_tail`); after the call the slot holds or
        # predicts every key given, which is what the memo is told.
        memo = self._memo
        track = memo is not None and memo.pos == self._log_end()
        if track:
            self._memo_tail(given, bit)
        if type(owners) is not dict and type(keys) is list:
            added = owners.spec_add(keys, owned, spec, bit, deadline, log)
        else:
            oget = owners.get
            logged = log.append
            added = []
            # One probe of the owner map decides most keys: the slot's bit is set iff it holds
            # the key or already predicts it (the invariants). A key it predicts already only
            # gets the new deadline: its owner mask does not change, so it is not logged (the
            # log holds owner-mask changes, and every entry in it costs the latest memo).
            # router/_owner_map.c `spec_add` is this loop.
            for ck in keys:
                o = oget(ck, 0)
                if o & bit:
                    if ck in owned:
                        continue
                else:
                    owners[ck] = o | bit
                    logged(ck)
                spec[ck] = deadline
                added.append(ck)
        if track:
            self._memo_logged()
        self._n_spec += len(spec) - n_before
        if added:
            # Only atomic values in the entry (no slot object): the collector untracks such tuples,
            # so a heap of 30 s of routed prompts adds nothing to its full scans (issue 13).
            heapq.heappush(self._spec_heap, (deadline, next(self._spec_seq), s.worker, s.dp_rank,
                                             tuple(added)))
            self.stats.speculative_added += len(added)
        return len(added)

    def expire_speculative(self, now: float, max_entries: int | None = None,
                           max_keys: int | None = None) -> int:
        """Drop speculative entries whose deadline is ``<= now``; returns how many keys expired.

        ``max_entries`` (heap entries, one per routed prompt) and ``max_keys`` (keys looked at,
        counted per whole entry: an entry is never left half expired) bound the work of one call.
        A second's worth of routed prompts expiring at once cost tens of ms: 256 entries of a
        4k-token prompt are ~65,000 keys, a 15-40 ms stall of every select behind the maintenance
        tick (bench/results/history/coordinator.md, "coordinator · open-loop stall"); so the coordinator expires a
        few entries per placement and the tick works through a backlog in key-bounded slices."""
        self._trim_log()
        heap = self._spec_heap
        n = 0
        budget = -1 if max_entries is None else max_entries
        keys_left = -1 if max_keys is None else max_keys
        while heap and heap[0][0] <= now and budget and keys_left:
            budget -= 1
            _, _, worker, rank, keys = heapq.heappop(heap)
            if keys_left > 0:
                keys_left = max(0, keys_left - len(keys))
            s = self._slots.get((worker, rank))
            if s is None:
                continue  # slot removed since (a new slot's entries carry their own deadlines)
            # _drop_spec inlined: this loop runs for every key of every routed prompt
            # (router/_owner_map.c `spec_expire` is the same loop)
            spec, owners, log = s.spec, self._owners, self._log
            n0 = n
            if type(owners) is not dict and type(keys) is tuple:
                n += owners.spec_expire(keys, spec, log, s.bit, now)
            else:
                nb = ~s.bit
                for ck in keys:
                    d = spec.get(ck)
                    if d is not None and d <= now:
                        del spec[ck]
                        log.append(ck)
                        m = owners[ck] & nb
                        if m:
                            owners[ck] = m
                        else:
                            del owners[ck]
                        n += 1
            # An entry whose keys were all confirmed, re-predicted later or already gone took
            # nothing from the slot: its memos stay exact (router/kv_query.py, `_losses`).
            if n != n0:
                self._losses[s.idx] += 1
        self.stats.speculative_expired += n
        self._n_spec -= n
        return n

    def speculative_due(self, now: float) -> bool:
        """Whether a speculative entry's deadline has passed (a backlog for the next slice)."""
        heap = self._spec_heap
        return bool(heap) and heap[0][0] <= now
