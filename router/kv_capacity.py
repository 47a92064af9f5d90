"""The KV index's capacity bound: which matches a full cache has already evicted (issue 40 item 3).

A server's KV cache holds ``capacity`` blocks and evicts the least recently used ones when new
blocks come in. Its events say what it evicted, but only once it did: a prompt routed to a server
with a queue is prefilled later, and the blocks the queue's own uncached tails bring in evict
that server's oldest blocks first. Between the routing and the eviction the index would promise
them. So each slot (router/kv_slots.py) keeps a model of its cache's ages, in blocks brought in:

- ``clock``: keys the slot has been brought since it was created or cleared: a routed prompt's
  keys that it neither held nor predicted (its speculative tail, router/kv_speculation.py) at
  routing time, and a store of a key it neither held nor predicted (decode blocks, requests
  routed elsewhere) when the event comes. A store confirming a prediction brings nothing new;
- ``stamps``: key -> its age, ``t - p`` for a key at chain position ``p`` that a prompt routed to
  the slot used (its matched prefix) or brought in (its tail) at clock ``t``: a request's blocks
  are freed tail first, so its deeper keys are the older ones, one tick per position. Only every
  ``STRIDE``-th chain position (``STRIDE - 1``, ``2 * STRIDE - 1``, ...) and each routed prompt's
  last key are stamped: a chain's keys are used together with their ancestors, so a key's stamp
  is above any stamp deeper in a chain through it, and the stride positions of a walk's keys are
  enough to find where its match dies;
- ``cap``: the capacity in blocks (0: unknown, no bound); ``low``: the lowest stamp since the
  slot was cleared (its clock then, ``base``, when none is lower).

A key is **evicted in the model** once its stamp is ``room`` or more below the clock (LRU: a key
used at clock t is gone after ``room`` new keys; sooner when older keys are used again meanwhile,
so the model errs toward keeping), where ``room`` is ``cap`` less the blocks the server's running
requests brought (``pinned``, the coordinator's `RoutedPrompts`: an LRU cannot evict them), at
least ``cap / FLOOR``. A walk's match on a slot is cut where its keys' stamps fall to
that limit (`CapacityBound.cut`): evicted keys stop counting for matches, held ones included,
whatever the owner masks say. The masks and the ledger are left alone: stores and removals from
the engine's events stay the truth (a removal drops a key, a store adds one and advances the
clock), and a routed prompt that uses a key again stamps it alive again. Keys never stamped (a
snapshot's, a stream's from before the capacity was known) count as alive: the model has no age
for them. A walk's keys past its deepest stamp take that stamp's age, one tick older per
position (the decode blocks stored after the prompt was routed).

Cost: nothing for a slot without a capacity. With one, a placement stamps ``n / STRIDE`` keys of
its prompt (only its tail when its matched prefix was used less than ``cap / YOUNG`` keys ago),
and a walk looks up one or two stamps per matching slot that is *pressed* (``SlotTable.pressed``:
``clock - low >= cap / FLOOR``, so some stamp may be dead), ``log(depth / STRIDE)`` more where
the match is cut. Both loops are router/_owner_map.c's (``OwnerMap.age_stamp`` and ``age_cut``
on a table per slot) where it built, else the same recipes over a dict (``_stamp_py``,
``_cut_py``; tests/router/test_kv_capacity.py checks one against the other).

Invariants (`CapacityBound.check_invariants`):
- ``low <= base <= clock``; ``low <= stamp <= clock`` for every stamp of a slot; ``cap >= 0``;
- a slot's bit is in ``SlotTable.pressed`` iff ``cap`` and ``clock - low >= cap // FLOOR``;
- `RoutedPrompts`: a server's ``pinned`` is the sum of its running leases' blocks;
- ``cut`` never returns more than the walk's depth (tests/router/test_kv_capacity.py), and the
  index cuts only pressed slots' matches.
"""

from __future__ import annotations

import numpy as np

from . import kv_owners
from .kv_slots import Slot, SlotTable

__all__ = ["STRIDE", "YOUNG", "FLOOR", "CapacityBound", "RoutedPrompts"]

STRIDE = 4          # chain positions stamped: every 4th (64 tokens at 16-token blocks) and the last
# A routed prompt whose matched prefix was stamped less than cap / YOUNG keys ago is not
# re-stamped there (only its tail is): a hot prefix costs one stamp pass per cap / 8 keys brought
# in, and the model's age for it is at most 1/8 of the capacity too old.
YOUNG = 8
# Stamps of keys the slot neither holds nor predicts are garbage; they are swept when the stamps
# outnumber half the capacity by this many.
_SWEEP_SLACK = 4096
# The effective capacity (the blocks not pinned by running requests) is never taken below
# cap / FLOOR: a pinned estimate that overshoots would otherwise call every cached block evicted.
FLOOR = 8
# a native table's stored word: AGE_OFFSET + the stamp (always positive, so never an empty entry)
AGE_OFFSET = 1 << 62
# A walk's deepest key without a stamp takes the age of the deepest stamped stride key at most
# this many stride positions before it; past that its age is unknown (counted alive).
_SCAN = 16


def _stamp_py(stamps: dict, keys: list, stride: int, clock: int, have: int, young: int):
    """`OwnerMap.age_stamp` (router/_owner_map.c) on a dict of stamps: the same recipe."""
    n = len(keys)
    if not n:
        return None
    get = stamps.get
    start = stride - 1
    if stride < have <= n:
        p = (have // stride) * stride - 1
        st = get(keys[p])
        if st is not None and clock - (st + p) < young:
            start = p + stride
    for i in range(start, n, stride):
        stamps[keys[i]] = clock - i
    stamps[keys[-1]] = clock - n + 1
    return clock - n + 1


def _cut_py(stamps: dict, keys: list, depth: int, limit: int, stride: int, scan: int) -> int:
    """`OwnerMap.age_cut` (router/_owner_map.c) on a dict of stamps: the same recipe."""
    get = stamps.get
    q = depth - 1
    sq = get(keys[q])
    if sq is None:
        j = depth // stride - 1
        stop = max(-1, j - scan)
        while j > stop:
            sq = get(keys[j * stride + stride - 1])
            if sq is not None:
                break
            j -= 1
        if sq is None:
            return depth
        q = j * stride + stride - 1
        if sq > limit:
            return min(depth, q + sq - limit)
        hi = j
    elif sq > limit:
        return depth
    else:
        hi = depth // stride
    lo = -1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        st = get(keys[mid * stride + stride - 1])
        if st is None or st > limit:
            lo = mid
        else:
            hi = mid
            q, sq = mid * stride + stride - 1, st
    return max(lo * stride + stride if lo >= 0 else 0, q + sq - limit, 0)


class CapacityBound:
    """Every slot's cache-age model. Single writer, no I/O; writes only the slots' ``cap``,
    ``clock``, ``base``, ``low`` and ``stamps`` and the table's ``pressed`` mask. A slot's stamps
    are a router/_owner_map.c table where it built (its ``age_stamp`` and ``age_cut`` loops; the
    stored word is ``AGE_OFFSET`` + the stamp), else a dict and the same Python recipes."""

    def __init__(self, slots: SlotTable) -> None:
        self._slots = slots
        # read at each construction, as router/kv_owners.py's OwnerTable does (tests run both)
        self._table = kv_owners.OwnerMap
        # worker -> blocks its running requests pin (router/kv_index.py `KvIndex.pinned`)
        self.pinned = None

    @property
    def native(self) -> bool:
        return self._table is not None

    def stamps_of(self, s: Slot) -> dict[int, int]:
        """The slot's stamps as a dict (tests, invariants)."""
        if type(s.stamps) is dict:
            return dict(s.stamps)
        return {k: v - AGE_OFFSET for k, v in s.stamps.items()}

    # -- state changes ---------------------------------------------------------------------------

    def _press(self, s: Slot) -> None:
        """Set the slot's ``pressed`` bit when one of its stamps may be evicted: its lowest
        stamp is the smallest effective capacity (``cap // FLOOR``) or more below the clock."""
        if s.cap and s.clock - s.low >= s.cap // FLOOR:
            self._slots.pressed |= s.bit

    def set_capacity(self, s: Slot, blocks: int) -> None:
        """``blocks`` the slot's cache holds (0: unknown: no bound)."""
        s.cap = blocks
        if blocks and self._table is not None and type(s.stamps) is dict:
            s.stamps = self._table()
        self._slots.pressed &= ~s.bit
        self._press(s)

    def brought(self, s: Slot, n: int) -> None:
        """``n`` keys new to the slot came in (stores of keys it neither held nor predicted)."""
        s.clock += n
        if s.cap:
            self._press(s)

    def reset(self, s: Slot) -> None:
        """The slot was cleared: no key it held has an age any more."""
        s.base = s.low = s.clock
        s.stamps.clear()
        self._slots.pressed &= ~s.bit

    def routed(self, s: Slot, keys, have: int, brought: int) -> None:
        """A prompt (its ``keys``, the chain from its root: a uint64 array) was placed on ``s``,
        which matched its first ``have``; ``brought`` of the rest are new to the slot. Its keys
        are used (the prefix) or brought in (the tail) by that request: stamp them."""
        s.clock += brought
        if s.cap:
            self._press(s)
            if len(keys):
                self.stamp(s, keys, s.clock, have)

    def stamp(self, s: Slot, keys, clock: int, have: int = 0) -> None:
        """Stamp a prompt's ``keys`` (its chain from the root, a uint64 array) as used at
        ``clock`` (the slot's, after its tail came in). ``have``: its leading keys the slot
        matched, not stamped again when that was less than ``cap / YOUNG`` keys ago."""
        stamps = s.stamps
        if type(stamps) is not dict:    # router/_owner_map.c
            low = stamps.age_stamp(keys, STRIDE, clock, have, s.cap // YOUNG)
        else:
            low = _stamp_py(stamps, keys.tolist() if isinstance(keys, np.ndarray) else keys,
                            STRIDE, clock, have, s.cap // YOUNG)
        # `_settle`'s two tests, made here so that a pass needing neither costs no call
        if low is not None and (low < s.low or len(stamps) > s.cap // 2 + _SWEEP_SLACK):
            self._settle(s, low)

    def used(self, worker: str, keys, have: int) -> None:
        """All of a prompt placed on ``worker`` (its rank-0 slot) matched there: its keys are
        used again at the slot's clock (`stamp`; ``keys`` a uint64 array, ``have`` the matched
        depth). The coordinator's call per such placement (`KvIndex.used` is this method): one
        Python call into the native loop, where `KvIndex.routed` took two (~2k of a
        placement's instructions, bench/routing/placement.py --kv-capacity)."""
        s = self._slots.rank0.get(worker)
        if s is None or not s.cap:
            return
        stamps = s.stamps
        if type(stamps) is dict:
            self.stamp(s, keys, s.clock, have)
            return
        low = stamps.age_stamp(keys, STRIDE, s.clock, have, s.cap // YOUNG)
        # `stamp`'s tests for `_settle`
        if low is not None and (low < s.low or len(stamps) > s.cap // 2 + _SWEEP_SLACK):
            self._settle(s, low)

    def _settle(self, s: Slot, low: int) -> None:
        """After a stamp pass on ``s`` whose lowest (last) stamp is ``low``: the slot's lowest
        stamp, and the sweep of stamps of keys it neither holds nor predicts once they outnumber
        what its cache can hold."""
        if low < s.low:
            s.low = low
            self._press(s)
        # live stamps are about a STRIDE-th of the keys a cache of `cap` holds, plus prompts' ends
        stamps = s.stamps
        if len(stamps) > s.cap // 2 + _SWEEP_SLACK:
            owned, spec = s.owned, s.spec
            kept = [(k, v) for k, v in stamps.items() if k in owned or k in spec]
            stamps.clear()
            for k, v in kept:
                stamps[k] = v

    # -- queries ---------------------------------------------------------------------------------

    @staticmethod
    def room(cap: int, pinned: int) -> int:
        """The blocks an LRU of ``cap`` keeps beside ``pinned`` ones (at least ``cap // FLOOR``)."""
        return max(cap // FLOOR, cap - pinned)

    def cut(self, s: Slot, keys, depth: int) -> int:
        """The part of a walk's ``depth``-key match on slot ``s`` (pressed; ``keys`` a uint64
        array) that the model still holds: ``depth``, or fewer keys (`cut_into` for one slot)."""
        res: dict = {}
        self.cut_into(keys, s.bit, depth, res)
        return res.get(s.worker, 0)

    def cut_into(self, keys, bits: int, depth: int, res: dict) -> None:
        """Put the cut depth of the ``bits`` slots' ``depth``-key match (each pressed; ``keys``
        a uint64 array) into ``res`` (worker -> best depth, raised only; a slot that keeps
        nothing is left out). One call per matching group of a walk, the slots in its loop.

        A stamp is ``t - p`` for a key at chain position ``p`` used at clock ``t``: a prompt's
        blocks are freed tail first, so its deeper keys are the older ones, one clock tick per
        position, and a key is alive while its stamp is above ``clock - cap``. Between two
        stride positions the count is read off the dead one's stamp (its ancestors are at least
        that young)."""
        by_bit = self._slots.by_bit
        pinned_of = self.pinned
        listed = None
        while bits:
            low = bits & -bits
            bits ^= low
            s = by_bit[low.bit_length() - 1]
            cap = s.cap
            if pinned_of is not None:   # running requests' blocks are not the LRU's to keep
                pinned = pinned_of(s.worker)
                if pinned:
                    cap = self.room(cap, pinned)
            stamps = s.stamps
            if type(stamps) is dict:
                if listed is None:
                    listed = keys.tolist() if isinstance(keys, np.ndarray) else keys
                d = _cut_py(stamps, listed, depth, s.clock - cap, STRIDE, _SCAN)
            else:
                d = stamps.age_cut(keys, depth, s.clock - cap, STRIDE, _SCAN)
            if d and res.get(s.worker, 0) < d:
                res[s.worker] = d

    def check_invariants(self) -> None:
        pressed = 0
        for s in self._slots:
            assert s.cap >= 0 and s.low <= s.base <= s.clock, \
                ("clock", s.worker, s.cap, s.low, s.base, s.clock)
            for k, v in self.stamps_of(s).items():
                assert s.low <= v <= s.clock, ("stamp", s.worker, k, v, s.low, s.clock)
            if s.cap and s.clock - s.low >= s.cap // FLOOR:
                pressed |= s.bit
        assert pressed == self._slots.pressed, ("pressed", pressed, self._slots.pressed)


class RoutedPrompts:
    """The coordinator's side of the model: per server with a capacity, the blocks its running
    requests brought (`pinned`: the uncached prompt blocks of each lease from its first token to
    its end), which the LRU cannot evict, so its room is the capacity less them. A request pins
    its cached prefix too, but that part is the cache's (and shared: counting whole prompts
    counted a shared prefix once per request, and cut matches the workers then reused). Nothing
    is kept per placement: a lease's first token brings its server and blocks. Single writer,
    no I/O."""

    __slots__ = ("live", "_pinned")

    def __init__(self) -> None:
        self.live: dict[tuple[str, int], tuple[str, int]] = {}     # -> (server, blocks)
        self._pinned: dict[str, int] = {}

    def started(self, role: str, req_id: int, server: str, blocks: int) -> None:
        """A lease's first token: its request runs on ``server``, pinning the ``blocks`` its
        prompt brought there (idempotent; a prompt that brought nothing pins nothing)."""
        key = (role, req_id)
        if blocks > 0 and key not in self.live:
            self.live[key] = (server, blocks)
            self._pinned[server] = self._pinned.get(server, 0) + blocks

    def ended(self, role: str, req_id: int) -> None:
        """Its lease ended (finished, expired, dropped): the LRU's again (idempotent)."""
        r = self.live.pop((role, req_id), None)
        if r is not None:
            left = self._pinned[r[0]] - r[1]
            if left:
                self._pinned[r[0]] = left
            else:
                del self._pinned[r[0]]

    def pinned(self, server: str) -> int:
        return self._pinned.get(server, 0)

    def pinned_source(self):
        """`KvIndex.set_pinned_source`'s callable: the blocks pinned on a server, None for none
        (the map's own ``get``: a C call per pressed matching slot of a walk, where `pinned` was
        a Python one)."""
        return self._pinned.get

    def check_invariants(self) -> None:
        want: dict[str, int] = {}
        for server, blocks in self.live.values():
            assert blocks > 0, ("pinned nothing", server)
            want[server] = want.get(server, 0) + blocks
        assert want == self._pinned, ("pinned", want, self._pinned)
