"""Fleet identities: unique `(node_id, process_id)` pairs leased to fleet processes (docs/design.md §3).

A snowflake id is unique only if no two live processes share a pair, so pairs are leased rather
than derived from a MAC address. Invariants:
- At any time each pair is held by at most one holder, and each holder holds at most one pair.
- Leasing again with the same holder renews and returns the same pair.
- A holder's pair is chosen deterministically from its name (a hash, then the next free pair), so
  after a coordinator restart a fleet process that renews gets the pair it already uses instead
  of a new one (the coordinator keeps no state on disk). An explicit preferred pair wins when free.
- A pair whose lease *expired* (its holder may still be running, just unable to renew) is not given
  to a different holder for one TTL; a released pair is free at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import xxhash

NODE_IDS = 256      # 8 bits in the snowflake layout
PROCESS_IDS = 64    # 6 bits
SLOTS = NODE_IDS * PROCESS_IDS


class IdentityExhausted(RuntimeError):
    """All 16,384 pairs are held (or quarantined)."""


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


def home_slot(holder: str) -> int:
    return xxhash.xxh64_intdigest(holder.encode("utf-8")) % SLOTS


class IdentityTable:
    def __init__(self, ttl_s: float):
        if ttl_s <= 0:
            raise ValueError(f"identity ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._by_holder: dict[str, IdentityLease] = {}
        self._by_slot: dict[int, IdentityLease] = {}
        self._quarantine: dict[int, tuple[str, float]] = {}   # slot -> (expired holder, until)
        self.expired_total = 0
        self.granted_total = 0

    def __len__(self) -> int:
        return len(self._by_holder)

    def _free(self, slot: int, holder: str, now: float) -> bool:
        if slot in self._by_slot:
            return False
        q = self._quarantine.get(slot)
        if q is None:
            return True
        if q[0] == holder or q[1] <= now:
            del self._quarantine[slot]
            return True
        return False

    def lease(self, holder: str, now: float, node_id: int | None = None,
              process_id: int | None = None) -> IdentityLease:
        # Expiry is swept by the owner (`expire`), not here: a late renewal before the sweep
        # simply keeps the pair, which is what the holder is still using.
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
            if self._free(want, holder, now):
                slot = want
        if slot is None:
            start = home_slot(holder)
            for i in range(SLOTS):
                s = (start + i) % SLOTS
                if self._free(s, holder, now):
                    slot = s
                    break
            else:
                raise IdentityExhausted(f"all {SLOTS} (node_id, process_id) pairs are leased or "
                                        "held back after an expiry")
        lease = IdentityLease(holder, slot, now + self.ttl_s)
        self._by_holder[holder] = lease
        self._by_slot[slot] = lease
        self.granted_total += 1
        return lease

    def get(self, holder: str) -> IdentityLease | None:
        return self._by_holder.get(holder)

    def release(self, holder: str) -> bool:
        lease = self._by_holder.pop(holder, None)
        if lease is None:
            return False
        del self._by_slot[lease.slot]
        return True

    def expire(self, now: float) -> list[IdentityLease]:
        gone = [l for l in self._by_holder.values() if l.expires_at <= now]
        for lease in gone:
            self.release(lease.holder)
            self._quarantine[lease.slot] = (lease.holder, now + self.ttl_s)
            self.expired_total += 1
        if self._quarantine and len(self._quarantine) > 1024:
            self._quarantine = {s: q for s, q in self._quarantine.items() if q[1] > now}
        return gone

    def holders(self) -> list[dict]:
        return [{"holder": l.holder, "node_id": l.node_id, "process_id": l.process_id}
                for l in self._by_holder.values()]
