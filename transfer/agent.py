"""The transfer-agent interface: everything a one-sided writer needs, and nothing more.

The nine operations of a transfer agent (docs/kv-transfer.md "Agents", docs/design.md §9):

| operation                  | here                                                        |
|----------------------------|-------------------------------------------------------------|
| register_memory(descs)     | `register_memory(regions, mem_type) -> RegHandle`           |
| deregister_memory(descs)   | `deregister_memory(handle)`                                 |
| load_remote_agent(desc)    | `load_remote_agent(desc) -> name`                           |
| get_local_agent_desc()     | `get_local_agent_desc() -> bytes`                           |
| invalidate_remote_agent()  | `invalidate_remote_agent(name)`                             |
| submit_transfer_requests() | `submit_transfer(...)` / `submit_prepped(...)` -> handle;   |
|                            | `poll(handle) -> "PROC" | "DONE" | "ERR"`, `release(handle)` |
| notify_sync_message()      | `notify(name, msg)`; the target reads `get_notifications()` |
| check_remote_descs()       | `check_remote_descs(name, descs) -> bool`                   |
| shutdown()                 | `shutdown()`                                                |

Semantics every implementation keeps (the contract tests in tests/transfer run against each):

- Descriptors are our `Descs` (Nx3 uint64 + mem type); nothing backend-specific crosses the API.
- `get_local_agent_desc()` is opaque bytes (msgpack envelope, never pickle) carrying the agent kind;
  `load_remote_agent` refuses another kind (`AgentMismatch`), is idempotent for the same incarnation,
  accepts updated metadata (new registrations), and refuses a *different* incarnation under a known
  name until `invalidate_remote_agent` (`NameConflict`).
- `submit_*` validates before any byte moves: unknown peer → `RemoteNotLoaded`; a local descriptor
  outside local registrations or a remote one outside the peer's → `OutOfRange`; unequal lengths →
  `InvalidDescriptors`. It returns at once; `poll` goes PROC → DONE or ERR (`error(handle)` says why).
  DONE means every byte is in the target's memory.
- A notification attached to a transfer is delivered to the target only after all its bytes landed,
  keyed by the initiator's name (str); `get_notifications()` consumes, or — agents with a thread of
  their own (tcp, shm) — `deliver_notifications(sink)` pushes each one as it arrives.
- A dead peer surfaces as ERR with `cause` `FailureCause.PEER_LOST` (or `PeerLost` at submit),
  never as a hang.
- `progress()` must be called regularly by whoever waits (the target too, even when idle: NIXL with
  its progress thread off completes connection wire-up only while both sides progress).
"""
from __future__ import annotations

import abc
import itertools
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .descs import Descs, as_desc_array
from .errors import FailureCause, InvalidDescriptors

PROC, DONE, ERR = "PROC", "DONE", "ERR"
# Version of our own agent-descriptor envelope (not of any backend's metadata).
AGENT_DESC_VERSION = 1

_handle_ids = itertools.count(1)


@dataclass(eq=False)
class RegHandle:
    """A registration: the regions as registered, and the backend's own handle."""

    regions: np.ndarray  # Nx3 uint64
    mem_type: str
    backend: Any = None
    id: int = field(default_factory=lambda: next(_handle_ids))


@dataclass(eq=False)
class PrepHandle:
    """A prepared descriptor list (one side of `submit_prepped`): rows addressed by index."""

    descs: Descs
    remote: str | None
    backend: Any = None
    id: int = field(default_factory=lambda: next(_handle_ids))
    direct: Any = None   # the agent's own plan for writes from/to it, computed once at prep


@dataclass(eq=False)
class XferHandle:
    """One submitted transfer. `state` is PROC, DONE or ERR; `error` explains ERR, `cause` types it."""

    remote: str
    op: str
    nbytes: int
    ndescs: int
    state: str = PROC
    error: str | None = None
    cause: FailureCause | None = None   # set with ERR: what callers decide on (never `error`)
    backend: Any = None
    # Set when the receiving process can itself tell that the write landed (a direct GPU write:
    # the CUDA IPC handle of the event recorded after its kernel), so the result may be sent
    # when the write is posted rather than when it finishes (`TransferAgent.ready_waiter`).
    ready: bytes | None = None
    id: int = field(default_factory=lambda: next(_handle_ids))


def unique_agent_name(prefix: str = "agent") -> str:
    """Agent names must be unique per incarnation (a restarted peer under its old name is refused)."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def regions_array(regions) -> np.ndarray:
    """Accept Nx3 arrays, (addr, len, dev) tuples, or objects with `data_ptr()`/`nbytes`
    (torch tensors) or `ctypes.data`/`nbytes` (numpy arrays)."""
    if isinstance(regions, np.ndarray) and regions.dtype != object and regions.ndim == 2:
        return as_desc_array(regions)
    items = regions if isinstance(regions, (list, tuple)) else [regions]
    rows = []
    for r in items:
        if hasattr(r, "data_ptr") and hasattr(r, "untyped_storage"):  # torch tensor
            if not r.is_contiguous():
                raise InvalidDescriptors("register a contiguous tensor (its bytes form one region)")
            dev = r.device.index if r.device.type == "cuda" else 0
            rows.append((r.data_ptr(), r.numel() * r.element_size(), dev or 0))
        elif isinstance(r, np.ndarray):
            if not r.flags.c_contiguous:
                raise InvalidDescriptors("register a C-contiguous numpy array")
            rows.append((r.ctypes.data, r.nbytes, 0))
        else:
            try:
                a, n, d = r
            except (TypeError, ValueError):
                raise InvalidDescriptors(
                    f"a region is (addr, len, dev), a tensor or an ndarray; found {type(r).__name__}"
                ) from None
            rows.append((int(a), int(n), int(d)))
    arr = as_desc_array(rows)
    if not len(arr):
        raise InvalidDescriptors("register_memory needs at least one region")
    if (arr[:, 1] == 0).any():
        raise InvalidDescriptors("a registered region has length 0")
    return arr


class TransferAgent(abc.ABC):
    """One endpoint of one-sided transfers. See the module docstring for the contract."""

    kind: str = "abstract"
    name: str
    mem_types: tuple[str, ...] = ("DRAM",)
    #: Whether `submit_transfer` / `submit_prepped` take ``after=``: a CUDA event (recorded after
    #: the compute that writes the source blocks) that the write must not start before. Such an
    #: agent orders its own device work after it (or waits for it on the host where it cannot);
    #: an agent without it is handed a write only once the event completed (the transfer thread
    #: waits for it: transfer/pump.py).
    orders_after: bool = False
    # `submit_*` returns once the write is posted (the bytes move on a device, in the network
    # stack or on the agent's own thread), so the thread that has the work may submit it itself
    # instead of handing it to the transfer thread. False where a submit copies the payload.
    posts_async: bool = False

    # -- memory --------------------------------------------------------------------------
    @abc.abstractmethod
    def register_memory(self, regions, mem_type: str = "DRAM") -> RegHandle: ...

    @abc.abstractmethod
    def deregister_memory(self, handle: RegHandle) -> None: ...

    # -- peers ---------------------------------------------------------------------------
    @abc.abstractmethod
    def get_local_agent_desc(self) -> bytes: ...

    @abc.abstractmethod
    def load_remote_agent(self, desc: bytes) -> str: ...

    @abc.abstractmethod
    def invalidate_remote_agent(self, name: str) -> None: ...

    @abc.abstractmethod
    def check_remote_descs(self, name: str, descs: Descs) -> bool: ...

    # -- transfers -----------------------------------------------------------------------
    @abc.abstractmethod
    def submit_transfer(self, remote: str, local: Descs, remote_descs: Descs, notif: bytes = b"",
                        op: str = "WRITE") -> XferHandle: ...

    def prep_descs(self, remote: str | None, descs: Descs) -> PrepHandle:
        """Prepare one side's descriptor list once; later transfers address rows by index.
        `remote=None` prepares a local list. Default: keep the array (fallback agents)."""
        return PrepHandle(descs=descs, remote=remote)

    def submit_prepped(self, remote: str, local: PrepHandle, local_idx, remote_side: PrepHandle,
                       remote_idx, notif: bytes = b"", op: str = "WRITE") -> XferHandle:
        """Transfer rows `local_idx` of `local` to rows `remote_idx` of `remote_side`.
        Default: gather the rows and submit them as one list (runs contiguous on both sides merged)."""
        from .descs import merge_runs, build_pair  # local import keeps the ABC light

        li = np.asarray(local_idx, dtype=np.int64)
        ri = np.asarray(remote_idx, dtype=np.int64)
        if li.shape != ri.shape:
            raise InvalidDescriptors(f"index lists differ in length: {li.shape} vs {ri.shape}")
        la, ra = local.descs.arr[li], remote_side.descs.arr[ri]
        if len(la) and not np.array_equal(la[:, 1], ra[:, 1]):
            raise InvalidDescriptors("prepared rows differ in length between local and remote")
        out_l, out_r = [], []
        for ldev in np.unique(la[:, 2]) if len(la) else []:
            for rdev in np.unique(ra[la[:, 2] == ldev, 2]):
                m = (la[:, 2] == ldev) & (ra[:, 2] == rdev)
                s, d, n = merge_runs(la[m, 0], ra[m, 0], la[m, 1])
                a, b = build_pair(s, d, n, int(ldev), int(rdev), local.descs.mem_type,
                                  remote_side.descs.mem_type)
                out_l.append(a.arr)
                out_r.append(b.arr)
        larr = np.concatenate(out_l) if out_l else np.zeros((0, 3), np.uint64)
        rarr = np.concatenate(out_r) if out_r else np.zeros((0, 3), np.uint64)
        return self.submit_transfer(remote, Descs(larr, local.descs.mem_type),
                                    Descs(rarr, remote_side.descs.mem_type), notif, op)

    def release_prepped(self, prep: PrepHandle) -> None:
        prep.backend = None

    @abc.abstractmethod
    def poll(self, handle: XferHandle) -> str: ...

    def error(self, handle: XferHandle) -> str | None:
        return handle.error

    @abc.abstractmethod
    def release(self, handle: XferHandle) -> None: ...

    # -- notifications and progress ------------------------------------------------------
    @abc.abstractmethod
    def notify(self, remote: str, msg: bytes) -> None: ...

    @abc.abstractmethod
    def get_notifications(self) -> dict[str, list[bytes]]: ...

    def progress(self) -> None:
        """Drive progress without consuming notifications (they are buffered)."""

    def deliver_notifications(self, sink) -> bool:
        """From now on hand every notification to `sink(sender, msg)` as it arrives, on this
        agent's own thread (it must not block), instead of buffering it for
        `get_notifications()`; buffered ones go to it at once. False when this agent has no
        thread to deliver on (NIXL: only `get_new_notifs` polling reads them) — poll then."""
        return False

    def on_finished(self, fn) -> bool:
        """Call `fn()` (on an agent thread) whenever a submitted transfer leaves PROC, so whoever
        waits for it is woken instead of polling. False when this agent cannot (poll)."""
        return False

    def orders_on_device(self, remote: str) -> bool:
        """Whether a write to `remote` given ``after=`` waits for it on the device (no host
        wait in `submit_*`)."""
        return False

    def expect_writes_from(self, desc: bytes) -> None:
        """(receiving side) A peer whose agent descriptor is `desc` is about to write into this
        process: prepare what waiting on its writes needs (off the critical path)."""

    def ready_waiter(self):
        """(receiving side) An object whose `landed(token) -> bool` says whether the write that
        `XferHandle.ready` token stands for has landed in this process's memory (it never
        blocks), or None when this agent cannot tell, and peers must send results only once
        their writes finished."""
        return None

    def wait_any(self, handles) -> bool:
        """Block, without holding the GIL, until one of `handles` (submitted, maybe PROC) has
        made progress worth polling for; False when this agent cannot wait (poll instead)."""
        return False

    # -- lifecycle -----------------------------------------------------------------------
    @abc.abstractmethod
    def shutdown(self) -> None: ...

    selection: dict | None = None  # how transfer.agents.make_agent chose it (requested, fallback)

    def describe(self) -> dict:
        """What /server_info shows about this agent."""
        d = {"kind": self.kind, "name": self.name, "mem_types": list(self.mem_types)}
        if self.selection:
            d.update(self.selection)
        return d

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
