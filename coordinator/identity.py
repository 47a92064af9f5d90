"""Fleet identities: unique `(node_id, process_id)` pairs leased to fleet processes (DESIGN.md §3).

A snowflake id is unique only if no two live processes share a pair, so pairs are leased rather
than derived from a MAC address. Invariants:
- At any time each pair is held by at most one holder, and each holder holds at most one pair.
- Leasing again with the same holder renews and returns the same pair.
- A released or expired pair goes to the back of the free queue, so it is reused as late as
  possible (a holder that missed its renewal is unlikely to collide with a newcomer).
- A preferred pair (the one a process held before a coordinator restart) is granted if free.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

NODE_IDS = 256      # 8 bits in the snowflake layout
PROCESS_IDS = 64    # 6 bits
SLOTS = NODE_IDS * PROCESS_IDS


class IdentityExhausted(RuntimeError):
    """All 16,384 pairs are held."""


@dataclass(slots=True)
class IdentityLease:
    holder: str
    slot: int
    expires_at: float

    @property
    def node_id(self) -> int:
        return self.slot // PROCESS_IDS

    @property
    def process_id(self) -> int:
        return self.slot % PROCESS_IDS


class IdentityTable:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"identity ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._by_holder: dict[str, IdentityLease] = {}
        self._by_slot: dict[int, IdentityLease] = {}
        self._free: deque[int] = deque(range(SLOTS))
        self.expired_total = 0
        self.granted_total = 0

    def __len__(self) -> int:
        return len(self._by_holder)

    def lease(self, holder: str, now: float, node_id: int | None = None,
              process_id: int | None = None) -> IdentityLease:
        self.expire(now)
        cur = self._by_holder.get(holder)
        if cur is not None:
            cur.expires_at = now + self.ttl_s
            return cur
        slot = None
        if node_id is not None and process_id is not None:
            if not (0 <= node_id < NODE_IDS and 0 <= process_id < PROCESS_IDS):
                raise ValueError(f"preferred pair ({node_id}, {process_id}) is out of range: "
                                 f"node_id < {NODE_IDS}, process_id < {PROCESS_IDS}")
            want = node_id * PROCESS_IDS + process_id
            if want not in self._by_slot:
                slot = want  # its stale copy in the free queue is skipped when popped
        while slot is None:
            if not self._free:
                raise IdentityExhausted(f"all {SLOTS} (node_id, process_id) pairs are leased")
            s = self._free.popleft()
            if s not in self._by_slot:
                slot = s
        lease = IdentityLease(holder, slot, now + self.ttl_s)
        self._by_holder[holder] = lease
        self._by_slot[slot] = lease
        self.granted_total += 1
        return lease

    def release(self, holder: str) -> bool:
        lease = self._by_holder.pop(holder, None)
        if lease is None:
            return False
        del self._by_slot[lease.slot]
        self._free.append(lease.slot)
        return True

    def expire(self, now: float) -> list[IdentityLease]:
        gone = [l for l in self._by_holder.values() if l.expires_at <= now]
        for lease in gone:
            self.release(lease.holder)
            self.expired_total += 1
        return gone

    def holders(self) -> list[dict]:
        return [{"holder": l.holder, "node_id": l.node_id, "process_id": l.process_id}
                for l in self._by_holder.values()]
