"""Load accounting as leases: one per in-flight ``(role, req_id)``, with a deadline.

A lease counts toward its server's load from ``acquire`` until ``finish`` or expiry. Expiry is a
queue of deadlines with lazy deletion (a renew pushes a fresh entry and strands the old one), so
there is no timer or task per request: the owner calls ``expire(now)`` periodically. The
coordinator's deadlines are ``now + one ttl`` on a monotonic clock, so they arrive in order: those
go to a FIFO (an append, where a heap push cost ~1 µs of every placement at thousands of live
leases); a deadline earlier than the FIFO's last (another ttl, a clock that went back) goes to a
heap, and expiry drains both in deadline order.

Phase: a lease starts *in prefill* with its ``prefill`` tokens (the prompt tokens its server must
compute: uncached ones) queued, and leaves that phase once, at the first of ``first_token`` (the
fleet saw the leg's first token; a context leg: its answer, the KV ready), its end, or
``prefill_ttl`` after it was acquired (a lost or never-sent report: the lease then counts as
decoding, never as queued prefill forever). ``phases_for`` gives per server the queued prefill
tokens and the leases still in prefill (with their prompt tokens), so a policy can tell queued
prefill work from decoding requests and their context tokens.

Invariants:
- per-server ``requests``/``tokens`` equal the sums over live leases: never negative, and zero
  (with the server gone from ``loads()``) once every lease finished or expired; the same for
  ``phases_for``'s sums over the live leases in prefill;
- a lease leaves the prefill phase at most once (``first_token`` is idempotent);
- ``finish`` is idempotent; ``acquire`` on a live key replaces that lease (load moves with it);
- a lease is reported by ``expire`` at most once, and never after ``finish``;
- ``count(role)`` equals the number of live leases of that role.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from operator import attrgetter
from dataclasses import dataclass

try:    # router/_kv_cost.c: `_add` and `_remove` below, one native call each
    from ._kv_cost import lease_add as _native_add, lease_remove as _native_remove
except ImportError:     # no C compiler at install time
    _native_add = _native_remove = None

NATIVE = _native_add is not None

__all__ = ["Lease", "LeaseTable", "NATIVE"]

_ZERO_LOAD = (0, 0)
_ZERO_PHASE = (0, 0, 0)
_ZERO_STATE = (_ZERO_LOAD, 0, 0, 0, 0)
_IN_PREFILL = attrgetter("in_prefill")


@dataclass(slots=True)
class Lease:
    role: str
    req_id: int
    server: str
    tokens: int
    acquired_at: float
    deadline: float
    prefill: int = 0            # uncached tokens queued while in prefill
    in_prefill: bool = False
    predicted_s: float = 0.0    # the placement's estimated time to first token, where its
                                # policy learns from the report (0: none; Decision.learn_s)
    private: int = 0            # its uncached tokens at placement: the blocks it brought


def _add(states: dict, kv: dict, server: str, tokens: int, prefill: int) -> None:
    """A lease of ``tokens`` prompt tokens, ``prefill`` of them uncached (its queued prefill and
    the blocks it brings), joins ``server``'s entries in the table's maps (``LeaseTable._state``
    and ``_kv``). The recipe of router/_kv_cost.c `lease_add`, which does the same in one call
    (this in Python was ~1/3 of an acquire's bytecodes); tests/router/test_leases.py compares
    the two."""
    st = states.get(server)
    shared = tokens - prefill
    if st is None:
        kv[server] = (prefill, shared)
        states[server] = ((1, tokens), prefill, 1, tokens, tokens)
    else:
        (r, t), q, n, pt, _ = st
        priv, deep = kv[server]
        priv += prefill
        if shared > deep:
            deep = shared
        kv[server] = (priv, deep)
        states[server] = ((r + 1, t + tokens), q + prefill, n + 1, pt + tokens, priv + deep)


def _remove(states: dict, kv: dict, server: str, tokens: int, prefill: int, private: int,
            in_prefill: bool) -> None:
    """A lease (its ``tokens``, queued ``prefill`` counted while ``in_prefill``, ``private``
    tokens) leaves ``server``'s entries in the table's maps; its server's last lease takes them
    (the phase sums with it). The recipe of router/_kv_cost.c `lease_remove`."""
    (r, t), q, n, pt, _ = states[server]
    if r == 1:
        del states[server]
        del kv[server]
        return
    priv, deep = kv[server]
    priv -= private
    kv[server] = (priv, deep)
    if in_prefill:
        states[server] = ((r - 1, t - tokens), q - prefill, n - 1, pt - tokens, priv + deep)
    else:
        states[server] = ((r - 1, t - tokens), q, n, pt, priv + deep)


class LeaseTable:
    def __init__(self, prefill_ttl: float = 60.0, *, native: bool | None = None):
        """``native``: the maps' updates by router/_kv_cost.c (None: where it built; False: the
        recipes, `_add` and `_remove`)."""
        if not prefill_ttl > 0:
            raise ValueError(f"prefill_ttl must be positive seconds, found {prefill_ttl!r}")
        native = NATIVE if native is None else native and NATIVE
        self._add = _native_add if native else _add
        self._remove = _native_remove if native else _remove
        self.prefill_ttl = prefill_ttl
        # leases in acquisition order, for their prefill_ttl: a monotonic clock keeps their
        # acquired_at sorted (one out of order is only handled late: counted as queued longer);
        # one that left prefill (in_prefill False: reported, ended, replaced) is a stale entry
        self._prefill_q: deque[Lease] = deque()
        self._prefill_q_limit = 1024
        self.first_tokens = 0       # leases that left prefill by a report
        self.prefill_timeouts = 0   # ... by prefill_ttl (no report in time)
        self._leases: dict[tuple[str, int], Lease] = {}
        self._fifo: deque[tuple[float, Lease]] = deque()    # deadlines in non-decreasing order
        self._heap: list[tuple[float, int, Lease]] = []     # the ones that came out of order
        self._seq = itertools.count()
        self._queue_limit = 1024
        self.replaced = 0                                    # acquires that replaced a live lease
        # Per server with live leases: ((requests, tokens), queued prefill tokens, leases in
        # prefill, their prompt tokens, held KV tokens), replaced on change. One map, so a placement reads a
        # server's load and phase in one probe (`states`); the (requests, tokens) tuple is read
        # as is by every placement (`loads_for`, the route receipt's loads).
        self._state: dict[str, tuple[tuple[int, int], int, int, int, int]] = {}
        # Per server with live leases: (sum of their ``private`` tokens, the deepest cached
        # prefix one of them was placed on since the server last had none). Their sum is the
        # state's *held KV tokens*: the distinct prompt tokens its in-flight requests hold, a
        # shared prefix once (the KV-full rule's input, router/policy_kv.py `_time_core`).
        # Summing whole prompts counted a prefix tree's prefix once per sibling in flight, and
        # the tree's server looked full. The deepest prefix is a high-water mark (a max cannot
        # be undone in O(1) when its lease ends): it errs toward full, and resets when the
        # server's last lease ends. Leases of other trees add their tails only.
        self._kv: dict[str, tuple[int, int]] = {}
        self._per_role: dict[str, int] = {}     # live leases per role

    @staticmethod
    def _check(ttl: float, tokens: int = 0) -> None:
        if not ttl > 0:
            raise ValueError(f"lease ttl must be positive seconds, found {ttl!r}")
        if type(tokens) is not int or tokens < 0:
            raise ValueError(f"lease tokens must be a non-negative int, found {tokens!r}")

    def _push(self, lease: Lease) -> None:
        d = lease.deadline
        fifo = self._fifo
        if not fifo or fifo[-1][0] <= d:
            fifo.append((d, lease))
        else:
            heapq.heappush(self._heap, (d, next(self._seq), lease))
        # stale entries from renewals and finishes: compact before they dominate the queues
        # (the limit set at the last compaction: ~1024 pushes or more apart, amortised O(1))
        if len(fifo) + len(self._heap) > self._queue_limit:
            self._fifo = deque(sorted(((l.deadline, l) for l in self._leases.values()),
                                      key=lambda e: e[0]))
            self._heap = []
            self._queue_limit = 2 * len(self._leases) + 1024

    def _drop(self, lease: Lease) -> None:
        """A lease left the table (expired, its server dropped; `finish` has these two lines
        inline)."""
        self._per_role[lease.role] -= 1
        self._unload(lease)

    def _unload(self, lease: Lease) -> None:
        try:
            self._remove(self._state, self._kv, lease.server, lease.tokens, lease.prefill,
                         lease.private, lease.in_prefill)
        except (OverflowError, TypeError):  # numbers the native call does not take: the recipe
            _remove(self._state, self._kv, lease.server, lease.tokens, lease.prefill,
                    lease.private, lease.in_prefill)
        lease.in_prefill = False

    def _unphase(self, lease: Lease) -> None:
        lease.in_prefill = False
        server = lease.server
        ld, q, n, pt, h = self._state[server]
        self._state[server] = (ld, q - lease.prefill, n - 1, pt - lease.tokens, h)

    def acquire(self, role: str, req_id: int, server: str, now: float, ttl: float,
                tokens: int = 0, prefill: int | None = None, predicted_s: float = 0.0) -> Lease:
        """``prefill``: the uncached tokens the server must compute (None: all ``tokens``);
        ``predicted_s``: the placement's estimated time to first token, for ``first_token``'s
        caller to compare (0: none)."""
        if not ttl > 0 or type(tokens) is not int or tokens < 0:
            self._check(ttl, tokens)
        if prefill is None or prefill > tokens:
            prefill = tokens
        elif prefill < 0:
            prefill = 0
        key = (role, req_id)
        leases = self._leases
        old = leases.pop(key, None)
        if old is not None:
            self._unload(old)
            self.replaced += 1
        else:
            self._per_role[role] = self._per_role.get(role, 0) + 1
        lease = Lease(role, req_id, server, tokens, now, now + ttl, prefill, True, predicted_s,
                      prefill)
        leases[key] = lease
        try:
            self._add(self._state, self._kv, server, tokens, prefill)
        except (OverflowError, TypeError):  # numbers the native call does not take: the recipe
            _add(self._state, self._kv, server, tokens, prefill)
        pq = self._prefill_q
        pq.append(lease)
        if len(pq) > self._prefill_q_limit:     # ended or reported leases' entries: compact
            self._prefill_q = deque(filter(_IN_PREFILL, pq))
            # the next compaction ~1024 acquisitions or more later (amortised O(1) per acquire)
            self._prefill_q_limit = 2 * len(self._leases) + 1024
        # `_push`'s usual case in place (a deadline in order, no compaction due: an append), the
        # rest by it: one call fewer per placement
        fifo = self._fifo
        d = lease.deadline
        if (not fifo or fifo[-1][0] <= d) and len(fifo) + len(self._heap) < self._queue_limit:
            fifo.append((d, lease))
        else:
            self._push(lease)
        return lease

    def set_prefill(self, role: str, req_id: int, prefill: int) -> bool:
        """The live lease's queued prefill is ``prefill`` tokens from now on (a disaggregated
        pair's generation leg computes none: its KV comes from the context leg); False when it is
        not live or already past prefill."""
        lease = self._leases.get((role, req_id))
        if lease is None or not lease.in_prefill:
            return False
        if prefill < 0:
            prefill = 0
        elif prefill > lease.tokens:
            prefill = lease.tokens
        ld, q, n, pt, h = self._state[lease.server]
        self._state[lease.server] = (ld, q - lease.prefill + prefill, n, pt, h)
        lease.prefill = prefill
        return True

    def first_token(self, role: str, req_id: int) -> Lease | None:
        """The leg's first token arrived (a context leg: its answer): the lease leaves prefill.
        Returns it, or None when it is not live or already past prefill (idempotent)."""
        lease = self._leases.get((role, req_id))
        if lease is None or not lease.in_prefill:
            return None
        self._unphase(lease)
        self.first_tokens += 1
        return lease

    def first_tokens_of(self, reports) -> tuple[list[Lease], int]:
        """``first_token`` for each of ``reports`` (items with ``role`` and ``req_id``: a channel
        frame's first-token reports), in order: (the leases that left prefill, how many reports
        found no lease in prefill). One call per frame, and `_unphase`'s update in the loop (it
        ran per report, ~1/4 of a report's CPU in bench/routing/placement.py --first-tokens)."""
        leases = self._leases
        states = self._state
        out = []
        for r in reports:
            lease = leases.get((r.role, r.req_id))
            if lease is None or not lease.in_prefill:
                continue
            # _unphase, inlined
            lease.in_prefill = False
            server = lease.server
            ld, q, n, pt, h = states[server]
            states[server] = (ld, q - lease.prefill, n - 1, pt - lease.tokens, h)
            out.append(lease)
        self.first_tokens += len(out)
        return out, len(reports) - len(out)

    def finish(self, role: str, req_id: int) -> Lease | None:
        """End the lease; returns it, or None when it was already finished or expired."""
        lease = self._leases.pop((role, req_id), None)
        if lease is not None:     # `_drop`, inline: one Python call fewer per lease end
            self._per_role[lease.role] -= 1
            self._unload(lease)
        return lease

    def renew(self, role: str, req_id: int, now: float, ttl: float) -> bool:
        """Push the deadline to ``now + ttl``; False when no such live lease exists."""
        self._check(ttl)
        lease = self._leases.get((role, req_id))
        if lease is None:
            return False
        lease.deadline = now + ttl
        self._push(lease)
        return True

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every live lease whose deadline is ``<= now``; leases in prefill
        past ``prefill_ttl`` leave that phase (counted in ``prefill_timeouts``)."""
        pq = self._prefill_q
        ttl = self.prefill_ttl
        while pq and pq[0].acquired_at + ttl <= now:
            lease = pq.popleft()
            if lease.in_prefill:
                self._unphase(lease)
                self.prefill_timeouts += 1
        out = []
        heap, fifo = self._heap, self._fifo
        leases = self._leases
        while True:
            if fifo and fifo[0][0] <= now and not (heap and heap[0][0] < fifo[0][0]):
                deadline, lease = fifo.popleft()
            elif heap and heap[0][0] <= now:
                deadline, _, lease = heapq.heappop(heap)
            else:
                return out
            key = (lease.role, lease.req_id)
            if leases.get(key) is lease and lease.deadline == deadline:
                del leases[key]
                self._drop(lease)
                out.append(lease)

    def next_deadline(self) -> float | None:
        """Earliest deadline that may expire something (stale entries may make it early)."""
        fifo, heap = self._fifo, self._heap
        if fifo and heap:
            return min(fifo[0][0], heap[0][0])
        return fifo[0][0] if fifo else heap[0][0] if heap else None

    def get(self, role: str, req_id: int) -> Lease | None:
        return self._leases.get((role, req_id))

    def load(self, server: str) -> tuple[int, int]:
        """(in-flight requests, in-flight tokens) on ``server``."""
        st = self._state.get(server)
        return st[0] if st else _ZERO_LOAD

    def requests(self, server: str) -> int:
        st = self._state.get(server)
        return st[0][0] if st else 0

    def tokens(self, server: str) -> int:
        st = self._state.get(server)
        return st[0][1] if st else 0

    def loads_for(self, servers) -> list[tuple[int, int]]:
        """(requests, tokens) for each of ``servers``, in order (one call per routing decision)."""
        get = self._state.get
        zero = _ZERO_STATE
        return [get(s, zero)[0] for s in servers]

    def phases_for(self, servers) -> list[tuple[int, int, int, int]]:
        """(queued prefill tokens, leases in prefill, their prompt tokens, held KV tokens) for
        each of ``servers``, in order: the rest of ``loads_for``'s requests and tokens are
        decoding; the held tokens count a prefix shared between leases once (``_kv``)."""
        get = self._state.get
        zero = _ZERO_STATE
        return [get(s, zero)[1:] for s in servers]

    def states(self) -> dict[str, tuple[tuple[int, int], int, int, int, int]]:
        """The map behind ``loads_for`` and ``phases_for``: server -> ((requests, tokens), queued
        prefill tokens, leases in prefill, their prompt tokens, held KV tokens), a server absent
        when it has no live lease. Read-only for callers, and the same dict for the table's life, so a policy
        may keep it: the native placement core reads it in its one pass over the candidates
        (router/_kv_cost.c ``time_core_table``) instead of lists built per placement."""
        return self._state

    def phase(self, server: str) -> tuple[int, int, int]:
        st = self._state.get(server)
        return st[1:4] if st else _ZERO_PHASE

    def loads(self) -> dict[str, tuple[int, int]]:
        return {s: st[0] for s, st in self._state.items()}

    def total(self) -> int:
        return len(self._leases)

    def count(self, role: str) -> int:
        """Live leases of ``role``."""
        return self._per_role.get(role, 0)

    def __len__(self) -> int:
        return len(self._leases)

    def drop_server(self, server: str) -> list[Lease]:
        """Remove every lease on ``server`` (it left the cluster, or restarted: its requests died
        with it); returns them."""
        return self.drop_if(lambda l: l.server == server)

    def drop_if(self, pred) -> list[Lease]:
        """Remove every live lease for which ``pred(lease)`` is true (a scan: for rare events
        such as a fleet process's death); returns them."""
        gone = [l for l in self._leases.values() if pred(l)]
        for lease in gone:
            del self._leases[(lease.role, lease.req_id)]
            self._drop(lease)
        return gone
