"""The KV index: which worker (and data-parallel rank) holds which canonical block key.

`KvIndex` is a facade over small objects, each with its own state and invariants
(docs/kv-events.md "How the coordinator applies them"; built for one-walk prefix matching):

- `SlotTable` (router/kv_slots.py): one slot per ``(worker, dp_rank)``, each owning one bit;
- `OwnerTable` (router/kv_owners.py): canonical key -> bitmask of the slots holding or predicting
  it, with its change log and epoch. ``longest_prefix`` walks the request's keys once and narrows
  the active bitmask, so its cost is O(matched depth), independent of the number of workers
  (TensorRT-LLM's router scans one ``set`` per server instead: O(workers x depth));
- `BlockLedger` (router/kv_ledger.py): per slot, the engine entries and refcounts behind each
  key; it applies canonical events;
- `SpeculativeEntries` (router/kv_speculation.py): routing-time predictions, until a store
  confirms them, they expire, or their slot is cleared;
- `WalkMemo` (router/kv_memo.py): prefix walks kept and reused, exactly;
- `CapacityBound` (router/kv_capacity.py): per slot, a model of its cache's ages against the
  server's KV capacity (`set_capacity`): a walk's match on a slot is cut where the blocks routed
  there since have evicted it (`longest_prefix`), before the engine's removals say so;
- `StreamOrder` (router/kv_streams.py): the next expected batch seq per event stream.

Invariants across them (`check_invariants`): the bit of slot s is set in the owner mask of
``key`` iff ``key in s.owned or key in s.spec`` (never both); ``size`` counts the keys some slot
holds confirmed. A key lives in two maps (the owner table and the slot's ``owned`` or ``spec``),
so a routed prompt's insert and expiry touch two large maps per key instead of three (each a
cache miss at ~0.3 µs: bench/results/history/coordinator.md, "coordinator · hot-path pass").
The answers of `longest_prefix` are the owner-mask walk's, each slot's depth cut by
`CapacityBound.cut` (never deeper than the walk's; unchanged for a slot without a capacity or
whose cache has not filled since it was cleared).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

import numpy as np

from .events import AllCleared, BlocksMoved, BlocksRemoved, BlocksStored, EventBatch
from .kv_capacity import CapacityBound
from .kv_ledger import BlockLedger, IndexStats
from .kv_memo import MEMO_CAP, MEMO_STRIDE, WalkMemo
from .kv_owners import OwnerTable
from .kv_slots import Slot, SlotTable
from .kv_speculation import SpeculativeEntries
from .kv_streams import StreamOrder, StreamVerdict

__all__ = ["KvIndex", "IndexStats", "StreamVerdict"]


_U64 = np.dtype(np.uint64)


def _u64_array(keys) -> np.ndarray:
    """The keys as a contiguous uint64 array (the capacity model's loops read them as a buffer)."""
    if isinstance(keys, np.ndarray):
        return keys if keys.dtype == np.uint64 and keys.flags.c_contiguous \
            else np.ascontiguousarray(keys, dtype=np.uint64)
    if type(keys) is bytes:
        return np.frombuffer(keys, np.uint64)
    return np.array(keys, dtype=np.uint64)


class KvIndex:
    """Per-worker, per-dp-rank ownership of canonical block keys. Single writer, no I/O."""

    def __init__(self, block_size: int = 16, namespace: str | None = None, *,
                 memo_stride: int = MEMO_STRIDE, memo_cap: int = MEMO_CAP):
        """``namespace`` is the cluster's cache namespace (``routing.namespace``): chains that
        start at the root without their own cache salt are keyed in it, as the fleet keys
        prompts, so ``ns = salt_seed(event.cache_salt or namespace, event.lora_name)``.
        ``memo_stride`` and ``memo_cap`` size the walk memo (router/kv_memo.py; tests shrink
        them to reach its edges)."""
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, found {block_size!r}")
        self.block_size = block_size
        self.namespace = namespace or None
        self.stats = IndexStats()
        self.slots = SlotTable()
        self.owners = OwnerTable()
        self.memo = WalkMemo(self.owners, self.slots, stride=memo_stride, cap=memo_cap)
        self.spec = SpeculativeEntries(self.owners, self.slots, self.stats)
        self.capacity = CapacityBound(self.slots)
        # ``used(worker, keys, have)``: all of a prompt placed on the worker matched there (its
        # rank-0 slot; ``keys`` a uint64 array): its keys are stamped as used again for the
        # capacity model, as `routed` does for such a prompt. The model's own method, bound
        # here: the coordinator's one call per fully cached placement.
        self.used = self.capacity.used
        self.ledger = BlockLedger(block_size, self.namespace, self.owners, self.slots, self.spec,
                                  self.stats, self.capacity)
        self.streams = StreamOrder()
        # worker -> KV capacity in blocks (each dp rank's); read-only outside `set_capacity`
        self.capacities: dict[str, int] = {}

    def _slot(self, worker: str, dp_rank: int) -> Slot:
        s = self.slots.get(worker, dp_rank)
        if s is None:
            s = self.slots.add(worker, dp_rank)
            self.owners.bump_epoch()        # a new bit: walks over every slot change
            cap = self.capacities.get(worker)
            if cap:
                self.capacity.set_capacity(s, cap)
        return s

    # -- capacity --------------------------------------------------------------------------------

    def set_capacity(self, worker: str, blocks: int | None) -> None:
        """The worker's KV cache holds ``blocks`` blocks of ``block_size`` tokens (each dp rank's;
        ``None`` or 0: unknown, no bound). Its matches are cut where the blocks routed to it
        since have evicted them (router/kv_capacity.py)."""
        if blocks is None:
            blocks = 0
        if type(blocks) is not int or blocks < 0:
            raise ValueError(f"KV capacity must be a block count >= 0 (or None), found {blocks!r}")
        if blocks:
            self.capacities[worker] = blocks
        else:
            self.capacities.pop(worker, None)
        for s in self.slots.of_worker(worker):
            self.capacity.set_capacity(s, blocks)

    def set_pinned_source(self, pinned) -> None:
        """``pinned(worker) -> blocks`` its running requests hold (0 or None: none; the source
        None: none known): those are not the LRU's, so a worker's effective capacity is its
        capacity less them (the coordinator answers from its lease table: the prompts of leases
        past their first token)."""
        self.capacity.pinned = pinned

    def capacity_state(self, worker: str) -> dict | None:
        """The capacity model of the worker's rank-0 slot, for `/cluster_info` and metrics:
        ``{capacity_blocks, room_blocks, pinned_blocks, clock, pressed}`` (None: no capacity)."""
        cap = self.capacities.get(worker)
        if not cap:
            return None
        s = self.slots.get(worker, 0)
        pinned = (self.capacity.pinned(worker) or 0) if self.capacity.pinned is not None else 0
        return {"capacity_blocks": cap, "pinned_blocks": pinned,
                "room_blocks": self.capacity.room(cap, pinned),
                "clock": s.clock - s.base if s is not None else 0,
                "pressed": bool(s is not None and self.slots.pressed & s.bit)}

    def capacity_of(self, worker: str) -> int | None:
        """The KV capacity in blocks given by `set_capacity` (None: unknown)."""
        return self.capacities.get(worker)

    # -- sizes -----------------------------------------------------------------------------------

    def workers(self) -> list[str]:
        return self.slots.workers()

    def worker_size(self, worker: str) -> int:
        """Canonical keys the worker holds (summed over its dp ranks; speculation excluded)."""
        return sum(len(s.owned) for s in self.slots.of_worker(worker))

    @property
    def size(self) -> int:
        """Distinct canonical keys held by any worker (speculation excluded)."""
        return self.ledger.n_keys

    def speculative_size(self) -> int:
        return self.spec.size

    def keys_of(self, worker: str, dp_rank: int = 0) -> set[int]:
        s = self.slots.get(worker, dp_rank)
        return set(s.owned) if s else set()

    # -- events ----------------------------------------------------------------------------------

    def apply(self, worker: str, event, dp_rank: int = 0) -> None:
        """Apply one canonical event for ``worker``/``dp_rank`` (in stream order)."""
        s = self._slot(worker, dp_rank or 0)
        self.owners.trim_log()
        t = type(event)
        if t is BlocksStored:
            self.ledger.store(s, event)
        elif t is BlocksRemoved:
            self.ledger.remove(s, event)
        elif t is AllCleared:
            self.ledger.clear(s, event.tier)
            self.stats.clears += 1
        elif t is BlocksMoved:
            self.ledger.move(s, event)
        else:
            raise TypeError(f"KvIndex.apply: expected a canonical event, found {t.__name__}")

    def apply_batch(self, worker: str, batch: EventBatch, dp_rank: int = 0, *,
                    restart_at_zero: bool = True) -> str:
        """Apply a batch if it is the next one of its ``(worker, dp_rank)`` stream.

        Returns a :class:`StreamVerdict`. On ``GAP`` nothing is applied: replay from
        ``expected_seq`` (and feed the replayed batches here), or ``clear_worker`` and
        ``reset_stream`` when the replay cannot cover the gap. ``dp_rank`` is the stream's rank
        when the batch names none (a per-rank publisher that leaves it out). With
        ``restart_at_zero=False`` a seq-0 batch behind the expected seq is a ``DUPLICATE``, not a
        ``RESTART``: for batches that may predate a resync (buffered while a snapshot loaded).
        """
        if batch.is_replay_end:
            raise ValueError("the replay end marker is not a batch: stop reading replies there")
        rank = batch.dp_rank if batch.dp_rank is not None else dp_rank
        verdict = self.streams.verdict(worker, rank, batch.seq, restart_at_zero)
        if verdict is StreamVerdict.DUPLICATE or verdict is StreamVerdict.GAP:
            return verdict
        if verdict is StreamVerdict.RESTART:
            self.ledger.clear(self._slot(worker, rank), None)
            self.stats.clears += 1
        for ev in batch.events:
            self.apply(worker, ev, rank)
        self.streams.applied(worker, rank, batch.seq)
        return verdict

    def expected_seq(self, worker: str, dp_rank: int = 0) -> int | None:
        return self.streams.expected(worker, dp_rank)

    def reset_stream(self, worker: str, dp_rank: int = 0, next_seq: int | None = None) -> None:
        """Forget (or set) the next expected seq, e.g. after a snapshot taken at ``seq``."""
        self.streams.reset(worker, dp_rank, next_seq)

    # -- worker lifecycle ------------------------------------------------------------------------

    def clear_worker(self, worker: str) -> None:
        """Drop everything the worker holds (all dp ranks, all tiers, speculation too)."""
        for s in self.slots.of_worker(worker):
            self.ledger.clear(s, None)
        self.stats.clears += 1

    def remove_worker(self, worker: str) -> None:
        """Forget the worker entirely and free its slots' bits (its capacity, given by
        `set_capacity`, stays until set again: it is the server's, not its slots')."""
        for s in self.slots.of_worker(worker):
            self.ledger.clear(s, None)
        for s in self.slots.remove_worker(worker):
            self.streams.reset(s.worker, s.dp_rank)
        self.owners.bump_epoch()

    def load_snapshot(self, worker: str, block_keys: Iterable[int], dp_rank: int = 0, *,
                      append: bool = False) -> None:
        """Replace the slot's content with a snapshot of *our* worker (engine hash == key).

        ``append=True`` adds the keys to what the slot holds instead, so a large snapshot can be
        loaded in slices (the first one without ``append``) with the event loop served between
        them; the stats count one snapshot per non-append call.
        """
        s = self._slot(worker, dp_rank)
        if not append:
            self.ledger.clear(s, None)
            self.stats.snapshots += 1
        self.ledger.load_snapshot(s, block_keys)

    # -- speculation -----------------------------------------------------------------------------

    def add_speculative(self, worker: str, keys, now: float, ttl: float,
                        dp_rank: int = 0) -> int:
        """Predict that ``worker`` will hold ``keys`` until ``now + ttl`` (routing-time insert).

        Keys it already holds are skipped; re-adding refreshes the deadline. Returns how many
        keys are speculative for the slot after the call among ``keys``.
        """
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, found {ttl}")
        s = self._slot(worker, dp_rank)
        n, brought = self._predict(s, keys, now + ttl)
        self.capacity.routed(s, (), 0, brought)
        return n

    def routed(self, worker: str, keys, have: int, now: float, ttl: float,
               dp_rank: int = 0) -> int:
        """A prompt (``keys``: its whole chain of block keys) placed on ``worker``, whose index
        matched its first ``have``: predict the rest there until ``now + ttl`` (as
        `add_speculative`), and stamp its keys for the capacity model (used again or brought
        in by that request). Returns how many keys are speculative after the call."""
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, found {ttl}")
        s = (self.slots.rank0.get(worker) if dp_rank == 0 else None) or self._slot(worker, dp_rank)
        if type(keys) is not np.ndarray or keys.dtype is not _U64:
            keys = _u64_array(keys)
        if have < len(keys):
            n, brought = self._predict(s, keys[have:], now + ttl)
            self.capacity.routed(s, keys, have, brought)
            return n
        if s.cap:       # all of it matched: only used again (CapacityBound.routed, inlined)
            self.capacity.stamp(s, keys, s.clock, have)
        return 0

    def _predict(self, s: Slot, keys, deadline: float) -> tuple[int, int]:
        """(keys predicted after the call, keys new to the slot) of a speculative insert."""
        spec = self.spec
        size = spec.size
        # the latest walk takes this insert in when it is that walk's unmatched tail
        self.memo.before_tail_insert(keys, s.bit)
        n = spec.add(s, keys, deadline)
        self.memo.after_tail_insert()
        # only the newly predicted keys: one predicted again (deadline moved) is not new, and a
        # held key past the match (evicted in the model) is counted by the store that brings it
        # back if the engine did evict it (counted here too, it was counted twice)
        return n, spec.size - size

    def expire_speculative(self, now: float, max_entries: int | None = None,
                           max_keys: int | None = None) -> int:
        """Drop speculative entries whose deadline is ``<= now``; returns how many keys expired
        (bounds: `SpeculativeEntries.expire`)."""
        self.owners.trim_log()
        return self.spec.expire(now, max_entries, max_keys)

    def speculative_due(self, now: float) -> bool:
        """Whether a speculative entry's deadline has passed (a backlog for the next slice)."""
        return self.spec.due(now)

    # -- queries ---------------------------------------------------------------------------------

    def walk_version(self) -> tuple[int, int]:
        """Changes whenever the answer of a walk may (router/kv_owners.py `version`)."""
        return self.owners.version()

    def drop_walk_memo(self) -> None:
        """Make the next query walk (benchmarks measuring the walk itself)."""
        self.memo.drop()

    def longest_prefix(self, keys, workers: Iterable[str] | None = None) -> dict[str, int]:
        """Matched leading blocks per worker (best dp rank), in one walk over ``keys``.

        With ``workers`` given, every named worker is in the answer (0 when nothing matched);
        otherwise only workers that matched at least one block are.
        """
        slots = self.slots
        if workers is None:
            res: dict[str, int] = {}
            active = slots.all_bits
        else:
            workers = list(workers)
            res = dict.fromkeys(workers, 0)
            active = slots.mask(workers)
        if not active:
            return res
        # groups come in increasing depth, so a later update is a deeper match (best dp rank)
        full = active == slots.all_bits
        names = slots.names
        pressed = slots.pressed & active
        for bits, depth in self.memo.groups(keys):
            if depth:
                if not full:
                    bits &= active
                    if not bits:
                        continue
                if bits & pressed:
                    # slots whose cache may have evicted part of the match: each its own depth
                    bits = self._cut(keys, bits & pressed, depth, res) | (bits & ~pressed)
                    if not bits:
                        continue
                res.update(zip(names(bits), repeat(depth)))
        return res

    def _cut(self, keys, bits: int, depth: int, res: dict) -> int:
        """Put the capacity-cut depths of the ``bits`` slots' ``depth``-key match into ``res``
        (worker -> best depth); returns 0 (every slot of ``bits`` answered)."""
        if type(keys) is not np.ndarray or keys.dtype is not _U64:
            keys = _u64_array(keys)
        self.capacity.cut_into(keys, bits, depth, res)
        return 0

    def longest_prefix_ranks(self, keys, workers: Iterable[str] | None = None
                             ) -> dict[tuple[str, int], int]:
        """Like :meth:`longest_prefix` but per ``(worker, dp_rank)``, nonzero matches only."""
        active = self.slots.mask(workers)
        res: dict[tuple[str, int], int] = {}
        by_bit = self.slots.by_bit
        pressed = self.slots.pressed
        cut = self.capacity.cut
        if pressed:
            keys = _u64_array(keys)
        for bits, depth in self.memo.groups(keys) if active else ():
            bits &= active
            while depth and bits:
                low = bits & -bits
                s = by_bit[low.bit_length() - 1]
                d = cut(s, keys, depth) if low & pressed else depth
                if d:
                    res[(s.worker, s.dp_rank)] = d
                bits ^= low
        return res

    def check_invariants(self) -> None:
        """Assert every part's invariants and those across them (tests; O(index size))."""
        self.slots.check_invariants()
        self.owners.check_invariants()
        self.ledger.check_invariants()
        self.spec.check_invariants()
        self.capacity.check_invariants()
        for s in self.slots:
            assert s.cap == self.capacities.get(s.worker, 0), ("capacity", s.worker, s.cap)
        combined: dict[int, int] = {}
        for s in self.slots:
            for ck in s.owned:
                combined[ck] = combined.get(ck, 0) | s.bit
            for ck in s.spec:
                combined[ck] = combined.get(ck, 0) | s.bit
        assert combined == dict(self.owners.masks.items()), \
            "owner masks disagree with slot ownership"
