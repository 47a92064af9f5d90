"""The KV index's ledger: which canonical keys each slot holds, under which engine hashes.

Per slot (router/kv_slots.py ``Slot``), ``owned: dict[key, refcount]`` says how many engine
entries hold the key (the same tokens can be resident under several engine hashes or tiers), and
``emaps[(tier, group)]`` maps each engine hash to what it stands for: the canonical keys it
completed, plus the chain state (last full key, pending tokens, namespace seed) a child event
resumes from. `BlockLedger` applies canonical events to them and keeps the slot's bit in the
owner masks (router/kv_owners.py) in step: set when the slot's first reference to a key comes
(confirming a speculative entry of the slot, router/kv_speculation.py), cleared with the last.

Engine block size ``E`` vs canonical ``B``: the event's tokens are chained at ``B`` from the
parent's state. An engine block owns every canonical block that *ends* inside it; tokens after
the last canonical boundary stay pending in its chain state (SGLang partial pages, ``E < B``).
With ``E < B`` the engine block completing a canonical block owns it: engines evict leaves first,
so removing that block (the leaf) removes the canonical key.

Our own workers publish ``engine hash == canonical key``; such entries (GPU tier, group 0, the
index's namespace) are stored as a flag on the refcount instead of an emap entry, halving memory.
A bare int entry (or identity entry) stands for one key in the index's namespace.

Invariants (`BlockLedger.check_invariants`):
- refcounts are positive; a key is in ``s.owned`` iff some entry of ``s`` (an emap entry or the
  identity flag) stands for it;
- ``n_keys`` counts the keys some slot holds (speculation excluded);
- storing an engine hash that is already present changes nothing (idempotent stores); removing
  what a store added restores the ledger exactly; ``AllCleared`` empties the slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .block_keys import block_keys_list, salt_seed
from .events import BlocksMoved, BlocksRemoved, BlocksStored, Tier
from .kv_capacity import CapacityBound
from .kv_owners import OwnerTable
from .kv_slots import Slot, SlotTable
from .kv_speculation import SpeculativeEntries

__all__ = ["BlockLedger", "Entry", "IndexStats"]

_GPU = Tier.GPU
# A refcount is the number of references in its low 32 bits, plus this flag when one of them is
# an identity entry (engine hash == key) in (GPU, group 0).
_IDENT = 1 << 32
_COUNT = _IDENT - 1


@dataclass
class IndexStats:
    stored_blocks: int = 0          # engine blocks added
    duplicate_stores: int = 0       # engine blocks re-stored (ignored)
    removed_blocks: int = 0         # engine blocks removed
    unknown_removals: int = 0       # removals of hashes never stored (or already gone)
    dangling_parents: int = 0       # stores skipped: parent hash unknown
    tier_only_updates: int = 0      # stores without tokens (tier copies of known blocks)
    moved_blocks: int = 0
    clears: int = 0                 # AllCleared events and clear_worker calls
    snapshots: int = 0
    speculative_added: int = 0
    speculative_confirmed: int = 0
    speculative_expired: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Entry:
    """What one engine hash stands for, when it is more than one canonical key."""

    __slots__ = ("keys", "last", "pending", "ns")

    def __init__(self, keys: tuple, last: int | None, pending: tuple, ns: int):
        self.keys = keys        # canonical keys this engine block completed (owned)
        self.last = last        # last full canonical key of the chain up to this block
        self.pending = pending  # tokens after ``last`` not yet forming a full canonical block
        self.ns = ns            # namespace seed the chain was computed with


def _entry_keys(e) -> tuple:
    return (e,) if type(e) is int else e.keys


class BlockLedger:
    """Every slot's engine entries and refcounts, and the confirmed-key count. Single writer."""

    def __init__(self, block_size: int, namespace: str | None, owners: OwnerTable,
                 slots: SlotTable, spec: SpeculativeEntries, stats: IndexStats,
                 capacity: CapacityBound | None = None) -> None:
        """``capacity``: the cache-age model told of the keys each store brings to a slot (keys it
        neither held nor predicted; router/kv_capacity.py), and of cleared slots."""
        self.block_size = block_size
        self.namespace = namespace
        # the namespace seed that bare int entries (and identity entries) stand for
        self._ns = salt_seed(namespace, None)
        self._owners = owners
        self._slots = slots
        self._spec = spec
        self._stats = stats
        self._cap = capacity if capacity is not None else CapacityBound(slots)
        self._brought = 0               # keys new to the slot in the store being applied
        self.n_keys = 0                 # keys with a confirmed owner

    # -- ownership primitives --------------------------------------------------------------------

    def _confirmed_in(self, mask: int, ck: int) -> bool:
        """Whether a slot of ``mask`` holds ``ck`` confirmed (not only speculatively). Without
        speculative entries every bit is a confirmed one; else the slots are asked in bit order,
        and the first usually answers."""
        if not mask:
            return False
        if not self._spec.size:
            return True
        by_bit = self._slots.by_bit
        while mask:
            low = mask & -mask
            if ck in by_bit[low.bit_length() - 1].owned:
                return True
            mask ^= low
        return False

    def _incref(self, s: Slot, ck: int, ident: bool = False) -> None:
        owned = s.owned
        c = owned.get(ck, 0)
        owned[ck] = c + (_IDENT + 1 if ident else 1)
        if not c:
            self._own(s, ck)

    def _own(self, s: Slot, ck: int) -> None:
        """Slot ``s`` now holds ``ck`` (it held no reference before): set its bit, confirming a
        speculative entry of the slot, and count the key if it had no confirmed owner."""
        masks = self._owners.masks
        o = masks.get(ck, 0)
        if not o:
            masks[ck] = s.bit
            self.n_keys += 1
            self._owners.log.append(ck)
            return
        others = o & ~s.bit
        if o & s.bit and ck in s.spec:
            self._spec.confirm(s, ck)       # the speculative bit becomes a confirmed one
        else:
            masks[ck] = o | s.bit
            self._owners.log.append(ck)
            self._brought += 1
        if not self._confirmed_in(others, ck):
            self.n_keys += 1

    def _disown(self, s: Slot, ck: int) -> None:
        """Slot ``s`` no longer holds ``ck`` (its last reference went): clear its bit, and stop
        counting the key if no confirmed owner is left."""
        self._slots.losses[s.idx] += 1
        m = self._owners.clear_bit(ck, s.bit)
        if not m or not self._confirmed_in(m, ck):
            self.n_keys -= 1

    def _decref(self, s: Slot, ck: int, ident: bool = False) -> None:
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

    def _lookup(self, s: Slot, tier: Tier, group: int, h) -> object | None:
        """The entry (int key or Entry) behind engine hash ``h``, preferring (tier, group)."""
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

    def store(self, s: Slot, ev: BlocksStored) -> None:
        self._brought = 0
        self._store(s, ev)
        if self._brought:
            self._cap.brought(s, self._brought)

    def _store(self, s: Slot, ev: BlocksStored) -> None:
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
                self._stats.dangling_parents += 1
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
        stats = self._stats
        if not pending and E == B and len(tokens) == n * B:
            keys = block_keys_list(tokens, B, ns, last)
            dflt = ns == self._ns
            ident_ok = tier is _GPU and group == 0 and dflt
            owned, masks, bit = s.owned, self._owners.masks, s.bit
            log = self._owners.log.append
            added = new = 0
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
                    emap[h] = ck if dflt else Entry((ck,), ck, (), ns)
                    owned[ck] = c + 1
                if not c:
                    o = masks.get(ck, 0)
                    if not o:
                        masks[ck] = bit
                        self.n_keys += 1
                        log(ck)
                        new += 1
                    else:
                        self._own(s, ck)
                added += 1
            stats.stored_blocks += added
            self._brought += new
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
                emap[h] = Entry(own, e_last, e_pending, ns)
            for ck in own:
                self._incref(s, ck)
            stats.stored_blocks += 1
            prev_full = full

    def _tier_update(self, s: Slot, tier: Tier, group: int, hashes: list) -> None:
        """A store without tokens: the blocks are known under another tier; copy them."""
        emap = s.emaps.setdefault((tier, group), {})
        ident_tier = tier is _GPU and group == 0
        for h in hashes:
            if h in emap or (ident_tier and type(h) is int and s.owned.get(h, 0) & _IDENT):
                self._stats.duplicate_stores += 1
                continue
            e = self._lookup(s, tier, group, h)
            if e is None:
                self._stats.dangling_parents += 1
                continue
            emap[h] = e
            for ck in _entry_keys(e):
                self._incref(s, ck)
            self._stats.tier_only_updates += 1

    def remove(self, s: Slot, ev: BlocksRemoved) -> None:
        tier, group = ev.tier, ev.group or 0
        emap = s.emaps.get((tier, group))
        ident_ok = tier is _GPU and group == 0
        owned = s.owned
        stats = self._stats
        masks, nbit, confirmed_in = self._owners.masks, ~s.bit, self._confirmed_in
        log = self._owners.log.append
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
                    m = masks[e] & nbit
                    if not m:
                        del masks[e]
                        self.n_keys -= 1
                    else:
                        masks[e] = m
                        if not confirmed_in(m, e):
                            self.n_keys -= 1
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
            self._slots.losses[s.idx] += 1
        stats.removed_blocks += removed

    def move(self, s: Slot, ev: BlocksMoved) -> None:
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
                self._stats.unknown_removals += 1
                continue
            dst = s.emaps.setdefault((ev.to_tier, group), {})
            if h in dst:
                for ck in _entry_keys(e):
                    self._decref(s, ck)
            else:
                dst[h] = e
            self._stats.moved_blocks += 1

    def clear(self, s: Slot, tier: Tier | None) -> None:
        """Drop what slot ``s`` holds in ``tier`` (``None``: everything, speculation too)."""
        self._owners.bump_epoch()
        if tier is None or tier is _GPU:
            self._cap.reset(s)      # its keys' ages went with them
        if tier is None:
            disown = self._disown
            for ck in s.owned:
                disown(s, ck)
            s.owned.clear()
            s.emaps.clear()
            self._spec.drop_slot(s)
            return
        for (t, g) in [k for k in s.emaps if k[0] is tier]:
            for e in s.emaps.pop((t, g)).values():
                for ck in _entry_keys(e):
                    self._decref(s, ck)
        if tier is _GPU:
            for ck in [k for k, c in s.owned.items() if c & _IDENT]:
                self._decref(s, ck, ident=True)

    def load_snapshot(self, s: Slot, block_keys: Iterable[int]) -> None:
        """Add a snapshot of *our* worker (engine hash == key) to what slot ``s`` holds."""
        self._owners.bump_epoch()   # its keys are not logged one by one
        if isinstance(block_keys, np.ndarray):
            if block_keys.dtype != np.uint64:
                block_keys = block_keys.astype(np.uint64)
            keys = block_keys.tolist()
        else:
            keys = [int(ck) & 0xFFFFFFFFFFFFFFFF for ck in block_keys]
        owned = s.owned
        masks = self._owners.masks
        bit = s.bit
        flag = _IDENT + 1
        new = 0
        for ck in keys:
            if ck in owned:
                continue
            owned[ck] = flag
            o = masks.get(ck, 0)
            if not o:
                masks[ck] = bit
                new += 1
            else:
                self._own(s, ck)
        self.n_keys += new

    def check_invariants(self) -> None:
        seen: set[int] = set()
        for s in self._slots:
            refs: dict[int, int] = {}
            for emap in s.emaps.values():
                for e in emap.values():
                    for ck in _entry_keys(e):
                        refs[ck] = refs.get(ck, 0) + 1
            for ck, c in s.owned.items():
                assert c & _COUNT > 0, (s.worker, ck, c)
                want = refs.get(ck, 0) + (1 if c & _IDENT else 0)
                assert c & _COUNT == want, ("refcount", s.worker, ck, c & _COUNT, want)
            assert set(refs) <= set(s.owned), ("entries without a refcount", s.worker)
            seen.update(s.owned)
        assert self.n_keys == len(seen), ("confirmed key count", self.n_keys, len(seen))
