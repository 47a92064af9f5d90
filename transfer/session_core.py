"""What the sender, the receiver and the transfer pump of one rank share: configuration, the agent,
the control-plane messenger, this rank's RankInfo, and the one lock every session table is under.
"""
from __future__ import annotations

import collections
import struct
import threading
import time

import numpy as np

from .control import ControlMessage, Result, ResultStatus, encode
from .errors import ProtocolError, SessionError
from .page_table import PageTable
from .states import RankTopology, TransferConfig

RETIRED_MAX = 65536
PY_MAX_IDS = 64       # block-id lists up to this long take their largest id in Python (group_ids)


def _int64_list(ids) -> np.ndarray | None:
    """A list of Python ints as a (writable) int64 array, or None when one is not an int64
    (np.asarray then converts, or says why not)."""
    buf = bytearray(8 * len(ids))
    try:
        struct.pack_into(f"{len(ids)}q", buf, 0, *ids)
    except (struct.error, TypeError):
        return None
    return np.frombuffer(buf, np.int64)


class RankCore:
    def __init__(self, cfg: TransferConfig, topology: RankTopology, page_table: PageTable,
                 agent) -> None:
        self.cfg = cfg
        self.spin_s = cfg.spin_window_s   # how long a listener spins for an expected message
        self.topology = topology
        self.page_table = page_table
        self.agent = agent
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)   # wakes the pump
        self.stats: collections.Counter = collections.Counter()
        self.messenger = None   # set by the facade once it is bound (it defines our endpoint)
        self.info = None        # this rank's RankInfo, likewise
        # Our agent pushes notifications as they arrive: receives ask for `ok` results that way
        # (control.Recv.notif), so completion needs no control message and no thread hand-off.
        self.results_by_notif = False
        # Our agent can tell when a peer's direct write landed (`TransferAgent.ready_waiter`):
        # receives ask for results as soon as the write is posted (control.Recv.ready).
        self.ready_waiter = None
        self.pump = None        # the transfer thread (set by the facade)
        self._group_slots: list[int] | None = None   # group_ids: the pool size of each group

    @property
    def tokens_per_block(self) -> int:
        return self.page_table.tokens_per_block

    # ------------------------------------------------------------------ control plane
    def send(self, endpoint: str, msg: ControlMessage) -> None:
        self.messenger.send_encoded(endpoint, encode(msg))

    def reply(self, identity: bytes, msg: ControlMessage) -> None:
        self.messenger.reply_encoded(identity, encode(msg))

    def reply_result(self, key: str, req: int, status: ResultStatus, *,
                     ident: bytes | None = None, error: str | None = None, slices=(0, 0),
                     span=(0, 0), last: bool = True, meta: dict | None = None,
                     ready: bytes | None = None) -> None:
        self.reply(ident or key.encode(), Result(
            req=req, sender=self.info.key, status=status, error=error, slices=tuple(slices),
            span=tuple(span), last=last, meta=meta, ready=ready))

    # ------------------------------------------------------------------ helpers
    def group_ids(self, block_ids) -> list[np.ndarray]:
        """Block ids per layer group (1-D int64 arrays); a flat list is accepted for a
        single-group table."""
        groups = self.page_table.groups
        if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1:
            block_ids = [block_ids]
        elif len(groups) == 1 and (len(block_ids) == 0 or isinstance(block_ids[0], int)
                                   or np.isscalar(block_ids[0])):
            block_ids = [block_ids]
        if len(block_ids) != len(groups):
            raise SessionError(f"block ids for {len(block_ids)} groups; the page table has "
                               f"{len(groups)}")
        lims = self._group_slots
        if lims is None:   # the pools never change: their sizes per group, once
            lims = self._group_slots = [min(self.page_table.pools[v.pool].num_slots
                                            for v in grp.views) for grp in groups]
        out = []
        for g, ids in enumerate(block_ids):
            # A short list's largest id in Python: a numpy reduction on a few ids costs ~25 µs
            # on a cold path (the receive's post). A long one's in numpy: Python's max over
            # 4,096 ids took 134 µs against 3 µs (2-core box, warm). A list of ints is packed
            # by struct: 0.4-0.8x np.asarray's time (2-core box, load ~10, median of 7: 2.8
            # against 3.7 µs at 65 ids, 19 against 48 at 1,024, 204 against 495 at 4,096).
            pylist = isinstance(ids, (list, tuple)) and ids and type(ids[0]) is int
            top = max(ids) if pylist and len(ids) <= PY_MAX_IDS else None
            a = _int64_list(ids) if pylist else None
            if a is None:
                a = np.asarray(ids, dtype=np.int64)
            if a.ndim != 1:
                a = a.reshape(-1)
            if top is None:
                top = a.max() if a.size else -1
            if top >= lims[g]:
                raise SessionError(f"group {g}: block id {int(a.max())} ≥ pool size {lims[g]}")
            out.append(a)
        return out

    @staticmethod
    def retire(table: collections.OrderedDict, request_id: int) -> None:
        table[request_id] = time.monotonic()
        while len(table) > RETIRED_MAX:
            table.popitem(last=False)


def ids_from(b) -> np.ndarray:
    if not isinstance(b, (bytes, bytearray)) or len(b) % 8:
        raise ProtocolError("block ids must be int64 bytes")
    return np.frombuffer(b, dtype=np.int64).copy()
