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

A key is **evicted in the model** once its stamp is ``cap`` or more below the clock (LRU: a key
used at clock t is gone after ``cap`` new keys; sooner when older keys are used again meanwhile,
so the model errs toward keeping). A walk's match on a slot is cut where its keys' stamps fall to
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
``clock - low >= cap``, so some stamp may be dead), ``log(depth / STRIDE)`` more where the match
is cut.

Invariants (`CapacityBound.check_invariants`):
- ``low <= base <= clock``; ``low <= stamp <= clock`` for every stamp of a slot; ``cap >= 0``;
- a slot's bit is in ``SlotTable.pressed`` iff ``cap`` and ``clock - low >= cap``;
- ``cut`` never returns more than the walk's depth (tests/router/test_kv_capacity.py), and the
  index cuts only pressed slots' matches.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from .kv_slots import Slot, SlotTable

__all__ = ["STRIDE", "YOUNG", "FLOOR", "CapacityBound"]

STRIDE = 4          # chain positions stamped: every 4th (64 tokens at 16-token blocks) and the last
# A routed prompt whose matched prefix was stamped less than cap / YOUNG keys ago is not
# re-stamped there (only its tail is): a hot prefix costs one stamp pass per cap / 8 keys brought
# in, and the model's age for it is at most 1/8 of the capacity too old.
YOUNG = 8
# Stamps of keys the slot neither holds nor predicts are garbage; they are swept when the stamps
# outnumber the slot's keys / STRIDE by this many.
_SWEEP_SLACK = 4096
# The effective capacity (the blocks not pinned by running requests) is never taken below
# cap / FLOOR: a pinned estimate that overshoots would otherwise call every cached block evicted.
FLOOR = 8
# A walk's deepest key without a stamp takes the age of the deepest stamped stride key at most
# this many stride positions before it; past that its age is unknown (counted alive).
_SCAN = 16


def _u64_list(keys) -> list:
    if isinstance(keys, np.ndarray):
        return keys.tolist()
    if type(keys) is bytes:
        return np.frombuffer(keys, np.uint64).tolist()
    return keys if type(keys) is list else list(keys)


class CapacityBound:
    """Every slot's cache-age model. Single writer, no I/O; writes only the slots' ``cap``,
    ``clock``, ``base``, ``low`` and ``stamps`` and the table's ``pressed`` mask."""

    def __init__(self, slots: SlotTable) -> None:
        self._slots = slots
        # worker -> blocks its running requests pin (router/kv_index.py `KvIndex.pinned`)
        self.pinned = None

    # -- state changes ---------------------------------------------------------------------------

    def _press(self, s: Slot) -> None:
        """Set the slot's ``pressed`` bit when one of its stamps may be evicted: its lowest
        stamp is the smallest effective capacity (``cap // FLOOR``) or more below the clock."""
        if s.cap and s.clock - s.low >= s.cap // FLOOR:
            self._slots.pressed |= s.bit

    def set_capacity(self, s: Slot, blocks: int) -> None:
        """``blocks`` the slot's cache holds (0: unknown: no bound)."""
        s.cap = blocks
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
        """A prompt (its ``keys``, the chain from its root: a uint64 array or a list) was placed
        on ``s``, which matched its first ``have``; ``brought`` of the rest are new to the slot.
        Its keys are used (the prefix) or brought in (the tail) by that request: stamp them."""
        s.clock += brought
        if s.cap and len(keys):
            self.stamp(s, keys, s.clock, have)

    def stamp(self, s: Slot, keys, clock: int, have: int = 0, raise_only: bool = False) -> None:
        """Stamp a prompt's ``keys`` (its chain from the root) as used at ``clock`` (at most the
        slot's): routed (`routed`), or freed by its finished request (`KvIndex.finished`: the
        clock then, less the prefill still queued there). ``have``: its leading keys stamped
        when routed, skipped if that was less than ``cap / YOUNG`` keys ago. ``raise_only``: a
        clock below the slot's may be below a key's stamp (a later prompt used it): keep the
        higher one."""
        n = len(keys)
        if not n:
            return
        stamps = s.stamps
        arr = keys if isinstance(keys, np.ndarray) else np.asarray(keys, dtype=np.uint64)
        # the prefix: skipped when its deepest stride key was used recently (its ancestors'
        # stamps are no older)
        start = STRIDE - 1
        if have > STRIDE:
            p = (have // STRIDE) * STRIDE - 1
            st = stamps.get(int(arr[p]))
            if st is not None and clock - (st + p) < s.cap // YOUNG:
                start = p + STRIDE
        last = int(arr[n - 1])
        if raise_only:
            get = stamps.get
            if get(last, s.low - 1) >= clock - n + 1:
                return      # its deepest key was used since, so were the others (see `cut`)
            if start < n:
                stamps.update({k: v for k, v in zip(arr[start::STRIDE].tolist(),
                                                    range(clock - start, clock - n, -STRIDE))
                               if get(k, s.low - 1) < v})
        elif start < n:
            stamps.update(zip(arr[start::STRIDE].tolist(), range(clock - start, clock - n, -STRIDE)))
        stamps[last] = clock - n + 1
        if clock - n + 1 < s.low:
            s.low = clock - n + 1
        self._press(s)
        if len(stamps) > (len(s.owned) + len(s.spec)) // STRIDE * 2 + _SWEEP_SLACK:
            owned, spec = s.owned, s.spec
            s.stamps = {k: v for k, v in stamps.items() if k in owned or k in spec}

    # -- queries ---------------------------------------------------------------------------------

    def cut(self, s: Slot, keys, depth: int) -> int:
        """The part of a walk's ``depth``-key match on slot ``s`` (pressed; ``keys`` a uint64
        array or a list) that the model still holds: ``depth``, or fewer keys.

        A stamp is ``t - p`` for a key at chain position ``p`` used at clock ``t``: a prompt's
        blocks are freed tail first, so its deeper keys are the older ones, one clock tick per
        position, and a key is alive while its stamp is above ``clock - cap``. Between two
        stride positions the count is read off the dead one's stamp (its ancestors are at least
        that young)."""
        cap = s.cap
        if self.pinned is not None:     # running requests' blocks are not the LRU's to keep
            cap = max(cap // FLOOR, cap - self.pinned(s.worker))
        limit = s.clock - cap            # a stamp at or below this is evicted
        get = s.stamps.get
        q = depth - 1
        sq = get(int(keys[q]))
        if sq is None:
            # the deepest stamped stride position decides: keys past it are as old as their
            # distance (a prompt's decode blocks are freed before its prompt's)
            j = depth // STRIDE - 1
            stop = max(-1, j - _SCAN)
            while j > stop:
                sq = get(int(keys[j * STRIDE + STRIDE - 1]))
                if sq is not None:
                    break
                j -= 1
            if sq is None:
                return depth            # never stamped (nearby): no age known
            q = j * STRIDE + STRIDE - 1
            if sq > limit:
                return min(depth, q + sq - limit)
            hi = j
        elif sq > limit:
            return depth
        else:
            hi = depth // STRIDE        # past the stride indices in the match
        # key `q` is dead: find the deepest alive stride index below `hi` (stamps only grow
        # toward the root; an unstamped one counts as alive) and the dead one after it
        lo = -1
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            st = get(int(keys[mid * STRIDE + STRIDE - 1]))
            if st is None or st > limit:
                lo = mid
            else:
                hi = mid
                q, sq = mid * STRIDE + STRIDE - 1, st
        # the keys before `q` younger than the limit, counting from q's stamp, and at least
        # through the alive stride key
        return max(lo * STRIDE + STRIDE if lo >= 0 else 0, q + sq - limit)

    def check_invariants(self) -> None:
        pressed = 0
        for s in self._slots:
            assert s.cap >= 0 and s.low <= s.base <= s.clock, \
                ("clock", s.worker, s.cap, s.low, s.base, s.clock)
            for k, v in s.stamps.items():
                assert s.low <= v <= s.clock, ("stamp", s.worker, k, v, s.low, s.clock)
            if s.cap and s.clock - s.low >= s.cap // FLOOR:
                pressed |= s.bit
        assert pressed == self._slots.pressed, ("pressed", pressed, self._slots.pressed)
