"""The KV index's records: slots (one per worker and dp rank), engine-hash entries, counters.

Shared by `router/kv_index.py` (events), `router/kv_speculation.py` and `router/kv_query.py`;
the layout they implement is described in `router/kv_index.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .events import Tier

try:    # router/_owner_map.c, built by setup.py: the owner masks as a native table
    from ._owner_map import OwnerMap
except ImportError:     # no C compiler at install time: a dict, and the Python loops over it
    OwnerMap = None

# Whether it loaded: its `walk`, `spec_add` and `spec_expire` are the index's per-key loops
# (router/kv_query.py and router/kv_speculation.py re-export this as their NATIVE).
NATIVE = OwnerMap is not None

__all__ = ["IndexStats", "StreamVerdict"]


def new_owner_map():
    """The index's owner masks: a `router._owner_map.OwnerMap` where it built, else a dict (read
    here at each call, so a test can build an index on the Python recipes by patching
    ``OwnerMap``). The index's per-key loops dispatch on which one they hold."""
    return OwnerMap() if OwnerMap is not None else {}


_GPU = Tier.GPU
_IDENT = 1 << 32  # refcount flag: an identity entry (engine hash == key) in (GPU, group 0)
_COUNT = _IDENT - 1


class _Entry:
    """What one engine hash stands for, when it is more than one canonical key."""

    __slots__ = ("keys", "last", "pending", "ns")

    def __init__(self, keys: tuple, last: int | None, pending: tuple, ns: int):
        self.keys = keys        # canonical keys this engine block completed (owned)
        self.last = last        # last full canonical key of the chain up to this block
        self.pending = pending  # tokens after ``last`` not yet forming a full canonical block
        self.ns = ns            # namespace seed the chain was computed with


class _Slot:
    __slots__ = ("worker", "dp_rank", "bit", "idx", "owned", "emaps", "spec")

    def __init__(self, worker: str, dp_rank: int, bit: int):
        self.worker = worker
        self.dp_rank = dp_rank
        self.bit = bit
        self.idx = bit.bit_length() - 1     # its position in the index's per-bit lists
        self.owned: dict[int, int] = {}
        self.emaps: dict[tuple, dict] = {}
        self.spec: dict[int, float] = {}


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


class StreamVerdict:
    """What ``KvIndex.apply_batch`` did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq already applied: ignored
    GAP = "gap"              # seq ahead of the next expected one: NOT applied; replay or resync
    RESTART = "restart"      # seq went back to 0: the engine restarted; slot cleared, then applied
