"""The KV index: which worker (and data-parallel rank) holds which canonical block key.

Layout (docs/kv-events.md "How the coordinator applies them"; built for one-walk prefix matching):

- ``_owners`` maps a canonical key to a bitmask of *slots* (a `router/_owner_map.c` table of
  u64 key and mask where it built, else a dict); a slot is one
  ``(worker, dp_rank)`` pair and owns one bit. A slot's bit is set when it holds the key or
  holds it speculatively (the slot's own ``spec`` map says which), so
  ``longest_prefix`` does one lookup per key: it walks the request's keys once and narrows
  the active bitmask, so its cost is O(matched depth), independent of the number of workers
  (TensorRT-LLM's router scans one ``set`` per server instead: O(workers x depth)).
- per slot, ``owned: dict[key, refcount]`` says how many engine entries hold the key (the same
  tokens can be resident under several engine hashes or tiers), and ``emaps[(tier, group)]``
  maps each engine hash to what it stands for: the canonical keys it completed, plus the chain
  state (last full key, pending tokens, namespace seed) a child event resumes from.

Invariants (checked by the property tests):
- the bit of slot s is set in ``_owners[key]`` iff ``key in s.owned or key in s.spec`` (never
  both); no mask is stored as 0; ``size`` counts the keys some slot holds confirmed (``key in
  s.owned``); ``_n_spec`` is the number of speculative entries over all slots; refcounts are
  positive. Speculative bits have no map of their own: a key lives in two maps (``_owners`` and
  the slot's ``owned`` or ``spec``), so a routed prompt's insert and expiry touch two large maps
  per key instead of three (each a cache miss at ~0.3 µs: bench/results/history/coordinator.md, "coordinator ·
  hot-path pass");
- storing an engine hash that is already present changes nothing (idempotent stores);
- removing what a store added restores the index exactly; ``AllCleared`` empties the slot;
- speculative entries (per slot ``spec``: key -> deadline) are never counted in sizes, and are
  dropped when confirmed by a store, when they expire, or when their slot is cleared.

Engine block size ``E`` vs canonical ``B``: the event's tokens are chained at ``B`` from the
parent's state. An engine block owns every canonical block that *ends* inside it; tokens after
the last canonical boundary stay pending in its chain state (SGLang partial pages, ``E < B``).
With ``E < B`` the engine block completing a canonical block owns it: engines evict leaves first,
so removing that block (the leaf) removes the canonical key.

Our own workers publish ``engine hash == canonical key``; such entries (GPU tier, group 0, the
index's namespace) are stored as a flag on the refcount instead of an emap entry, halving memory.
A bare int entry (or identity entry) stands for one key in the index's namespace.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

import numpy as np

from .block_keys import block_keys_list, salt_seed
from .events import AllCleared, BlocksMoved, BlocksRemoved, BlocksStored, EventBatch, Tier
from .kv_query import MEMO_CAP, MEMO_STRIDE, QueryMixin
from .kv_speculation import SpeculationMixin
from .kv_types import _COUNT, _GPU, _IDENT, IndexStats, StreamVerdict, _Entry, _Slot, new_owner_map

__all__ = ["KvIndex", "IndexStats", "StreamVerdict"]


class KvIndex(SpeculationMixin, QueryMixin):
    """Per-worker, per-dp-rank ownership of canonical block keys. Single writer, no I/O."""

    def __init__(self, block_size: int = 16, namespace: str | None = None, *,
                 memo_stride: int = MEMO_STRIDE, memo_cap: int = MEMO_CAP):
        """``namespace`` is the cluster's cache namespace (``routing.namespace``): chains that
        start at the root without their own cache salt are keyed in it, as the fleet keys
        prompts, so ``ns = salt_seed(event.cache_salt or namespace, event.lora_name)``.
        ``memo_stride`` and ``memo_cap`` size the walk memo (router/kv_query.py; tests shrink
        them to reach its edges)."""
        for name, v in (("memo_stride", memo_stride), ("memo_cap", memo_cap)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive int, found {v!r}")
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, found {block_size!r}")
        self.block_size = block_size
        self.namespace = namespace or None
        # the namespace seed that bare int entries (and identity entries) stand for
        self._ns = salt_seed(self.namespace, None)
        self.stats = IndexStats()
        self._owners = new_owner_map()          # key -> confirmed | speculative bits
        self._n_spec = 0                        # speculative entries, all slots
        self._n_keys = 0                        # keys with a confirmed owner
        self._spec_heap: list = []
        self._spec_seq = itertools.count()
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._by_bit: list[_Slot | None] = []
        self._free_bits: list[int] = []
        self._worker_slots: dict[str, list[_Slot]] = {}
        self._all_bits = 0
        self._streams: dict[tuple[str, int], int] = {}
        self._mask_cache: dict[int, tuple[str, ...]] = {}
        # the walk memo's validation (router/kv_query.py): keys whose owner mask changed (log
        # position ``_log_base + i`` for ``_log[i]``: trimming drops the list, not the count), and
        # an epoch for changes not logged key by key
        self._log: list[int] = []
        self._log_base = 0
        self._epoch = 0
        self._memo = None                       # the latest walk
        self._pmemo: dict[int, object] = {}     # registered key -> memo
        self._memo_order: dict = {}             # memos, least recently used first
        self._memo_pos: dict[int, tuple] = {}   # prompt length -> registration positions
        # per slot bit: bumped whenever the slot may have stopped holding a key (its bit cleared
        # somewhere); a walk memo stays exact for a slot while its count has not moved
        self._losses: list[int] = []
        self._loss_getters: dict[int, object] = {}
        self._memo_tick = 0                     # placements walked (kv_query's cost control)
        self._memo_score = 1.0                  # decayed share of lookups that found a memo
        self._memo_stride = memo_stride
        self._memo_cap = memo_cap

    # -- slots ---------------------------------------------------------------------------------

    def _slot(self, worker: str, dp_rank: int) -> _Slot:
        s = self._slots.get((worker, dp_rank))
        if s is None:
            if not isinstance(worker, str) or not worker:
                raise ValueError(f"worker must be a non-empty string, found {worker!r}")
            if self._free_bits:
                bit_idx = heapq.heappop(self._free_bits)
            else:
                bit_idx = len(self._by_bit)
                self._by_bit.append(None)
                self._losses.append(0)
            s = _Slot(worker, dp_rank, 1 << bit_idx)
            self._by_bit[bit_idx] = s
            self._slots[(worker, dp_rank)] = s
            self._worker_slots.setdefault(worker, []).append(s)
            self._all_bits |= s.bit
            self._mask_cache.clear()
            self._epoch += 1
        return s

    def workers(self) -> list[str]:
        return list(self._worker_slots)

    def worker_size(self, worker: str) -> int:
        """Canonical keys the worker holds (summed over its dp ranks; speculation excluded)."""
        return sum(len(s.owned) for s in self._worker_slots.get(worker, ()))

    @property
    def size(self) -> int:
        """Distinct canonical keys held by any worker (speculation excluded)."""
        return self._n_keys

    def speculative_size(self) -> int:
        return self._n_spec

    def _confirmed_in(self, mask: int, ck: int) -> bool:
        """Whether a slot of ``mask`` holds ``ck`` confirmed (not only speculatively). Without
        speculative entries every bit is a confirmed one; else the slots are asked in bit order,
        and the first usually answers."""
        if not mask:
            return False
        if not self._n_spec:
            return True
        by_bit = self._by_bit
        while mask:
            low = mask & -mask
            if ck in by_bit[low.bit_length() - 1].owned:
                return True
            mask ^= low
        return False

    # -- ownership primitives --------------------------------------------------------------------

    def _incref(self, s: _Slot, ck: int, ident: bool = False) -> None:
        owned = s.owned
        c = owned.get(ck, 0)
        owned[ck] = c + (_IDENT + 1 if ident else 1)
        if not c:
            self._own(s, ck)

    def _own(self, s: _Slot, ck: int) -> None:
        """Slot ``s`` now holds ``ck`` (it held no reference before): set its bit, confirming a
        speculative entry of the slot, and count the key if it had no confirmed owner."""
        owners = self._owners
        o = owners.get(ck, 0)
        if not o:
            owners[ck] = s.bit
            self._n_keys += 1
            self._log.append(ck)
            return
        others = o & ~s.bit
        if o & s.bit and ck in s.spec:
            # the speculative bit becomes a confirmed one: ``_owners[ck]`` keeps it
            del s.spec[ck]
            self._n_spec -= 1
            self.stats.speculative_confirmed += 1
        else:
            owners[ck] = o | s.bit
            self._log.append(ck)
        if not self._confirmed_in(others, ck):
            self._n_keys += 1

    def _disown(self, s: _Slot, ck: int) -> None:
        """Slot ``s`` no longer holds ``ck`` (its last reference went): clear its bit, and stop
        counting the key if no confirmed owner is left."""
        owners = self._owners
        self._log.append(ck)
        self._losses[s.idx] += 1
        m = owners[ck] & ~s.bit
        if m:
            owners[ck] = m
            if not self._confirmed_in(m, ck):
                self._n_keys -= 1
        else:
            del owners[ck]
            self._n_keys -= 1

    def _decref(self, s: _Slot, ck: int, ident: bool = False) -> None:
        owned = s.owned
        c = owned.get(ck)
        if c is None:
            return
        c -= (_IDENT + 1) if ident else 1
        if c & _COUNT:
            owned[ck] = c
            return
        del owned[ck]
        self._disown(s, ck)

    @staticmethod
    def _entry_keys(e) -> tuple:
        return (e,) if type(e) is int else e.keys

    def _lookup(self, s: _Slot, tier: Tier, group: int, h) -> object | None:
        """The entry (int key or _Entry) behind engine hash ``h``, preferring (tier, group)."""
        emap = s.emaps.get((tier, group))
        if emap is not None:
            e = emap.get(h)
            if e is not None:
                return e
        if tier is _GPU and group == 0 and type(h) is int and s.owned.get(h, 0) & _IDENT:
            return h
        # a parent can live in another tier (offloaded) than the child being stored
        for (t, g), other in s.emaps.items():
            if g == group and t is not tier:
                e = other.get(h)
                if e is not None:
                    return e
        if (tier is not _GPU or group != 0) and type(h) is int and s.owned.get(h, 0) & _IDENT:
            return h
        return None

    # -- events ----------------------------------------------------------------------------------

    def apply(self, worker: str, event, dp_rank: int = 0) -> None:
        """Apply one canonical event for ``worker``/``dp_rank`` (in stream order)."""
        s = self._slot(worker, dp_rank or 0)
        self._trim_log()
        t = type(event)
        if t is BlocksStored:
            self._store(s, event)
        elif t is BlocksRemoved:
            self._remove(s, event)
        elif t is AllCleared:
            self._clear_slot(s, event.tier)
            self.stats.clears += 1
        elif t is BlocksMoved:
            self._move(s, event)
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
        key = (worker, rank)
        expected = self._streams.get(key)
        verdict = StreamVerdict.APPLIED
        if expected is not None and batch.seq != expected:
            if batch.seq == 0 and expected > 1 and restart_at_zero:
                verdict = StreamVerdict.RESTART
                self._clear_slot(self._slot(worker, rank), None)
                self.stats.clears += 1
            elif batch.seq < expected:
                return StreamVerdict.DUPLICATE
            else:
                return StreamVerdict.GAP
        for ev in batch.events:
            self.apply(worker, ev, rank)
        self._streams[key] = batch.seq + 1
        return verdict

    def expected_seq(self, worker: str, dp_rank: int = 0) -> int | None:
        return self._streams.get((worker, dp_rank))

    def reset_stream(self, worker: str, dp_rank: int = 0, next_seq: int | None = None) -> None:
        """Forget (or set) the next expected seq, e.g. after a snapshot taken at ``seq``."""
        if next_seq is None:
            self._streams.pop((worker, dp_rank), None)
        else:
            self._streams[(worker, dp_rank)] = next_seq

    def _store(self, s: _Slot, ev: BlocksStored) -> None:
        tier, group = ev.tier, ev.group or 0
        hashes = ev.engine_hashes
        if ev.token_ids is None:
            self._tier_update(s, tier, group, hashes)
            return
        if ev.parent_engine_hash is None:
            last, pending = None, ()
            ns = salt_seed(ev.cache_salt or self.namespace, ev.lora_name) \
                if (ev.cache_salt or ev.lora_name) else self._ns
        else:
            p = self._lookup(s, tier, group, ev.parent_engine_hash)
            if p is None:
                self.stats.dangling_parents += 1
                return
            if type(p) is int:
                last, pending, ns = p, (), self._ns
            else:
                last, pending, ns = p.last, p.pending, p.ns
        emap = s.emaps.get((tier, group))
        if emap is None:
            emap = s.emaps[(tier, group)] = {}
        B = self.block_size
        E = ev.engine_block_size
        tokens = ev.token_ids
        n = len(hashes)
        stats = self.stats
        if not pending and E == B and len(tokens) == n * B:
            keys = block_keys_list(tokens, B, ns, last)
            dflt = ns == self._ns
            ident_ok = tier is _GPU and group == 0 and dflt
            owned, owners, bit = s.owned, self._owners, s.bit
            log = self._log.append
            added = 0
            # the hot path of every store: _incref inlined
            for h, ck in zip(hashes, keys):
                if h in emap:
                    stats.duplicate_stores += 1
                    continue
                c = owned.get(ck, 0)
                if ident_ok and h == ck:
                    if c & _IDENT:
                        stats.duplicate_stores += 1
                        continue
                    owned[ck] = c + _IDENT + 1
                else:
                    emap[h] = ck if dflt else _Entry((ck,), ck, (), ns)
                    owned[ck] = c + 1
                if not c:
                    o = owners.get(ck, 0)
                    if not o:
                        owners[ck] = bit
                        self._n_keys += 1
                        log(ck)
                    else:
                        self._own(s, ck)
                added += 1
            stats.stored_blocks += added
            return
        stream = list(pending) + list(tokens)
        keys = block_keys_list(stream, B, ns, last)
        off = len(pending)
        prev_full = 0
        for j, h in enumerate(hashes):
            end = off + min((j + 1) * E, len(tokens))
            full = end // B
            if h in emap:
                stats.duplicate_stores += 1
                prev_full = full
                continue
            own = tuple(keys[prev_full:full])
            e_last = keys[full - 1] if full else last
            e_pending = tuple(stream[full * B:end])
            if not e_pending and ns == self._ns and len(own) == 1:
                emap[h] = own[0]
            else:
                emap[h] = _Entry(own, e_last, e_pending, ns)
            for ck in own:
                self._incref(s, ck)
            stats.stored_blocks += 1
            prev_full = full

    def _tier_update(self, s: _Slot, tier: Tier, group: int, hashes: list) -> None:
        """A store without tokens: the blocks are known under another tier; copy them."""
        emap = s.emaps.setdefault((tier, group), {})
        ident_tier = tier is _GPU and group == 0
        for h in hashes:
            if h in emap or (ident_tier and type(h) is int and s.owned.get(h, 0) & _IDENT):
                self.stats.duplicate_stores += 1
                continue
            e = self._lookup(s, tier, group, h)
            if e is None:
                self.stats.dangling_parents += 1
                continue
            emap[h] = e
            for ck in self._entry_keys(e):
                self._incref(s, ck)
            self.stats.tier_only_updates += 1

    def _remove(self, s: _Slot, ev: BlocksRemoved) -> None:
        tier, group = ev.tier, ev.group or 0
        emap = s.emaps.get((tier, group))
        ident_ok = tier is _GPU and group == 0
        owned = s.owned
        stats = self.stats
        owners, nbit, confirmed_in = self._owners, ~s.bit, self._confirmed_in
        log = self._log.append
        removed = 0
        for h in ev.engine_hashes:
            e = emap.pop(h, None) if emap else None
            if type(e) is int:
                # the hot path of every removal: _decref inlined
                c = owned[e] - 1
                if c & _COUNT:
                    owned[e] = c
                else:
                    del owned[e]
                    log(e)
                    m = owners[e] & nbit
                    if not m:
                        del owners[e]
                        self._n_keys -= 1
                    else:
                        owners[e] = m
                        if not confirmed_in(m, e):
                            self._n_keys -= 1
                removed += 1
            elif e is not None:
                for ck in e.keys:
                    self._decref(s, ck)
                removed += 1
            elif ident_ok and type(h) is int and owned.get(h, 0) & _IDENT:
                self._decref(s, h, ident=True)
                removed += 1
            else:
                stats.unknown_removals += 1
        if removed:
            self._losses[s.idx] += 1
        stats.removed_blocks += removed

    def _move(self, s: _Slot, ev: BlocksMoved) -> None:
        group = ev.group or 0
        for h in ev.engine_hashes:
            src = s.emaps.get((ev.from_tier, group))
            e = src.pop(h, None) if src else None
            if e is None and ev.from_tier is _GPU and group == 0 and type(h) is int \
                    and s.owned.get(h, 0) & _IDENT:
                # materialise the identity entry: same refcount, now an explicit entry
                s.owned[h] -= _IDENT
                e = h
            if e is None:
                self.stats.unknown_removals += 1
                continue
            dst = s.emaps.setdefault((ev.to_tier, group), {})
            if h in dst:
                for ck in self._entry_keys(e):
                    self._decref(s, ck)
            else:
                dst[h] = e
            self.stats.moved_blocks += 1

    def _clear_slot(self, s: _Slot, tier: Tier | None) -> None:
        self._epoch += 1
        if tier is None:
            disown = self._disown
            for ck in s.owned:
                disown(s, ck)
            s.owned.clear()
            s.emaps.clear()
            for ck in list(s.spec):
                self._drop_spec(s, ck)
            return
        for (t, g) in [k for k in s.emaps if k[0] is tier]:
            for e in s.emaps.pop((t, g)).values():
                for ck in self._entry_keys(e):
                    self._decref(s, ck)
        if tier is _GPU:
            for ck in [k for k, c in s.owned.items() if c & _IDENT]:
                self._decref(s, ck, ident=True)

    # -- worker lifecycle --------------------------------------------------------------------------

    def clear_worker(self, worker: str) -> None:
        """Drop everything the worker holds (all dp ranks, all tiers, speculation too)."""
        for s in self._worker_slots.get(worker, ()):
            self._clear_slot(s, None)
        self.stats.clears += 1

    def remove_worker(self, worker: str) -> None:
        """Forget the worker entirely and free its slots' bits."""
        for s in self._worker_slots.pop(worker, ()):
            self._clear_slot(s, None)
            del self._slots[(s.worker, s.dp_rank)]
            idx = s.bit.bit_length() - 1
            self._by_bit[idx] = None
            heapq.heappush(self._free_bits, idx)
            self._all_bits &= ~s.bit
            self._streams.pop((s.worker, s.dp_rank), None)
        self._mask_cache.clear()
        self._epoch += 1

    def load_snapshot(self, worker: str, block_keys: Iterable[int], dp_rank: int = 0, *,
                      append: bool = False) -> None:
        """Replace the slot's content with a snapshot of *our* worker (engine hash == key).

        ``append=True`` adds the keys to what the slot holds instead, so a large snapshot can be
        loaded in slices (the first one without ``append``) with the event loop served between
        them; the stats count one snapshot per non-append call.
        """
        s = self._slot(worker, dp_rank)
        self._epoch += 1    # its keys are not logged one by one
        if not append:
            self._clear_slot(s, None)
            self.stats.snapshots += 1
        if isinstance(block_keys, np.ndarray):
            if block_keys.dtype != np.uint64:
                block_keys = block_keys.astype(np.uint64)
            keys = block_keys.tolist()
        else:
            keys = [int(ck) & 0xFFFFFFFFFFFFFFFF for ck in block_keys]
        owned = s.owned
        owners = self._owners
        bit = s.bit
        flag = _IDENT + 1
        new = 0
        for ck in keys:
            if ck in owned:
                continue
            owned[ck] = flag
            o = owners.get(ck, 0)
            if not o:
                owners[ck] = bit
                new += 1
            else:
                self._own(s, ck)
        self._n_keys += new

    def keys_of(self, worker: str, dp_rank: int = 0) -> set[int]:
        s = self._slots.get((worker, dp_rank))
        return set(s.owned) if s else set()
