"""`DirectCopies`: one-sided writes into a peer's GPU memory on the same host, by one kernel.

The NIXL agent hands its VRAM writes here when the peer is on this host and exported its
allocations (CUDA IPC handles in its agent descriptor). The peer's allocations are mapped into this
process once, when its descriptor is loaded; a transfer then translates the remote addresses
(`mapped base + offset`, vectorised) and queues one batched-copy kernel (transfer/copy_kernels.py)
on this agent's transfer stream, followed by an event. `poll` queries the event: DONE means the
kernel finished, so every byte is in the peer's memory, and only then is the transfer's
notification sent (through NIXL, as for any other write).

Everything else (another host, DRAM, memory that did not export, READs) stays on NIXL, so the
contract of `TransferAgent` is unchanged; `describe()` says whether peers are reached directly.
"""
from __future__ import annotations

import logging
import os
import threading

import numpy as np

from . import cuda_ipc
from .descs import Coverage, Descs, Strided
from .errors import OutOfRange

log = logging.getLogger("splitserve.transfer.direct")

EVENT_RING = 16      # interprocess events per device, reused round-robin
OPENED_MAX = 4096    # peers' event handles kept open on the receiving side


class _PeerMap:
    """A peer's exported allocations, mapped here: remote base → local address."""

    def __init__(self) -> None:
        self.base = np.zeros(0, np.uint64)
        self.size = np.zeros(0, np.uint64)
        self.mapped = np.zeros(0, np.uint64)
        self.dev: list[int] = []
        self.owned: list[bool] = []    # mapped by cuIpcOpenMemHandle (closed at the end)
        self.regions = Coverage()      # the peer's registered regions: what may be written

    def translate(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
        """Local addresses for remote `addrs`, or None when a row is in no mapped allocation."""
        if not self.base.size:
            return None
        i = np.searchsorted(self.base, addrs, side="right").astype(np.int64) - 1
        if (i < 0).any():
            return None
        off = addrs - self.base[i]
        if (off + lens > self.size[i]).any():
            return None
        return self.mapped[i] + off


class DirectCopies:
    """IPC exports of this agent's VRAM, maps of peers' VRAM, and the kernel writes between them."""

    def __init__(self) -> None:
        self.host = cuda_ipc.host_identity()
        self.pid = os.getpid()
        self.exports: dict[int, tuple[bytes, int, int, int]] = {}   # base -> (handle, base, size, dev)
        self.regions: list[tuple[int, int, int]] = []               # registered VRAM (addr, len, dev)
        self.peers: dict[str, _PeerMap] = {}
        self.refused: dict[str, str] = {}                           # peer -> why not direct
        self._copiers: dict[int, object] = {}
        self._streams: dict[int, object] = {}
        self._events: dict[int, list] = {}      # device -> ring of (interprocess event, IPC handle)
        self._next_event: dict[int, int] = {}
        self._ipc_events = True                 # False once creating one failed: plain events
        self._opened: dict[bytes, object] = {}  # peers' event handles opened here (receiving side)
        self._open_lock = threading.Lock()

    # ------------------------------------------------------------------ local side
    def register(self, regions: np.ndarray) -> None:
        """Export the allocations under newly registered VRAM regions (best effort)."""
        for a, n, d in regions.tolist():
            self.regions.append((a, n, d))
            try:
                handle, base, size = cuda_ipc.export(a, d)
            except cuda_ipc.IpcUnavailable as e:
                log.info("VRAM at 0x%x is not exported for direct writes: %s", a, e)
                continue
            self.exports[base] = (handle, base, size, d)
            self._ring(d)   # now, so the events' handles go into the agent descriptor

    def deregister(self, regions: np.ndarray) -> None:
        for r in regions.tolist():
            if tuple(r) in self.regions:
                self.regions.remove(tuple(r))

    def describe(self) -> dict | None:
        """What goes into the agent descriptor (msgpack-able), or None when nothing exported."""
        if not self.exports:
            return None
        return {"host": self.host, "pid": self.pid,
                "allocs": [[b, s, d, h] for h, b, s, d in self.exports.values()],
                "regions": [list(r) for r in self.regions],
                # the end events of our writes: a peer opens them when it loads us, not when
                # the first result naming one arrives (an open costs far more than a query)
                "events": [tok for ring in self._events.values() for _ev, tok in ring
                           if tok is not None]}

    # ------------------------------------------------------------------ peers
    def load(self, name: str, desc: dict | None) -> None:
        """Map a peer's newly exported allocations; a peer elsewhere, or one whose memory does not
        map, stays on NIXL (`refused` says why)."""
        if not desc:
            self.refused.setdefault(name, "peer exported no GPU memory")
            return
        if desc.get("host") != self.host:
            self.refused[name] = "peer is on another host"
            return
        pm = self.peers.get(name) or _PeerMap()
        same = desc.get("pid") == self.pid
        known = set(pm.base.tolist())
        base, size, mapped = list(pm.base.tolist()), list(pm.size.tolist()), list(pm.mapped.tolist())
        # copies: a failed load leaves the map as it was (its lists stay aligned with its arrays)
        devs, owned = list(pm.dev), list(pm.owned)
        try:
            for b, s, d, h in desc.get("allocs", []):
                if b in known:
                    continue
                local = self.regions[0][2] if self.regions else self._local_device()
                m = b if same else cuda_ipc.open_handle(bytes(h), local)
                base.append(b), size.append(s), mapped.append(m)
                devs.append(local)
                owned.append(not same)
        except cuda_ipc.IpcUnavailable as e:
            # what this load opened before the failure is closed again (nothing refers to it)
            for m, d, o in zip(mapped[len(pm.mapped):], devs[len(pm.dev):], owned[len(pm.owned):]):
                if o:
                    try:
                        cuda_ipc.close(m, d)
                    except cuda_ipc.IpcUnavailable as e2:
                        log.warning("closing a mapping of %s: %s", name, e2)
            self.refused[name] = str(e)
            log.info("peer %s is written through NIXL: %s", name, e)
            return
        order = np.argsort(np.array(base, np.uint64), kind="stable")
        pm.base = np.array(base, np.uint64)[order]
        pm.size = np.array(size, np.uint64)[order]
        pm.mapped = np.array(mapped, np.uint64)[order]
        pm.dev = [devs[i] for i in order.tolist()]
        pm.owned = [owned[i] for i in order.tolist()]
        pm.regions = Coverage((a, n, d, "VRAM") for a, n, d in desc.get("regions", []))
        self.peers[name] = pm
        self.refused.pop(name, None)

    def drop(self, name: str) -> None:
        pm = self.peers.pop(name, None)
        self.refused.pop(name, None)
        if pm is None:
            return
        for s in self._streams.values():   # no kernel may still write through the mapping
            s.synchronize()
        for m, d, owned in zip(pm.mapped.tolist(), pm.dev, pm.owned):
            if owned:
                try:
                    cuda_ipc.close(m, d)
                except cuda_ipc.IpcUnavailable as e:
                    log.warning("closing a mapping of %s: %s", name, e)

    def close(self) -> None:
        for name in list(self.peers):
            self.drop(name)

    # ------------------------------------------------------------------ writes
    def route(self, remote: str, local: Descs, remote_descs: Descs) -> np.ndarray | None:
        """Mapped destination addresses when this write can go direct, else None. Raises
        `OutOfRange` for a destination outside the peer's registrations (as NIXL would)."""
        pm = self.peers.get(remote)
        if pm is None or local.mem_type != "VRAM" or remote_descs.mem_type != "VRAM":
            return None
        if not len(local) or len(np.unique(local.arr[:, 2])) != 1:
            return None
        bad = pm.regions.uncovered(remote_descs)
        if bad >= 0:
            a, n, d = remote_descs.arr[bad].tolist()
            raise OutOfRange(f"remote descriptor {bad} (VRAM addr=0x{a:x} len={n} dev={d}) is not "
                             f"inside any region {remote} registered")
        return pm.translate(remote_descs.arr[:, 0], remote_descs.arr[:, 1])

    def map_strided(self, remote: str, dst: Strided | None, descs: Descs) -> Strided | None:
        """The peer's strided list `dst` (its prepared `descs`) with this process's mapped base,
        when every row may be written directly: all inside the peer's registrations and in one
        mapped allocation. Computed once per prepared list; None sends its writes the general
        way (`route`, which also raises `OutOfRange` for a row outside the registrations)."""
        pm = self.peers.get(remote)
        if dst is None or pm is None or descs.mem_type != "VRAM" or pm.regions.uncovered(descs) >= 0:
            return None
        first, last = dst.base, dst.base + (dst.rows - 1) * dst.stride
        ends = np.array([first, last], np.uint64)
        mapped = pm.translate(ends, np.array([dst.length, dst.length], np.uint64))
        if mapped is None or int(mapped[1]) - int(mapped[0]) != last - first:
            return None   # not one allocation: the rows between may map anywhere
        i = np.searchsorted(pm.base, ends, side="right") - 1
        if i[0] != i[1]:
            return None
        return Strided(base=int(mapped[0]), stride=dst.stride, length=dst.length, dev=dst.dev,
                       rows=dst.rows)

    def write_strided(self, src: Strided, si: np.ndarray, dst: Strided, di: np.ndarray,
                      after=None):
        """`write` for rows `si` of the local strided list `src` to rows `di` of `dst` (from
        `map_strided`); indices checked by the caller. Returns (end event, its IPC handle)."""
        copier, stream = self._copier(src.dev)
        copier.copy_strided(src.base, src.stride, si, dst.base, dst.stride, di, src.length,
                            stream, after)   # waits for `after` after uploading the indices
        ev, token = self._event(src.dev)
        ev.record(stream)
        return ev, token

    def _copier(self, dev: int):
        """(DeviceCopier, transfer stream) of local device `dev`, made on first use."""
        c = self._copiers.get(dev)
        if c is None:
            import torch

            from .copy_kernels import DeviceCopier

            c = self._copiers[dev] = DeviceCopier(dev)
            self._streams[dev] = torch.cuda.Stream(device=dev)
        return c, self._streams[dev]

    def write(self, local: Descs, mapped_dst: np.ndarray, after=None):
        """Queue the kernel; returns (the event that marks its end, the event's CUDA IPC handle
        or None). The handle lets the receiving process see the end itself (`landed`).
        ``after`` (a CUDA event): the kernel waits for it on the device (pipelined prefill: the
        chunk that writes the source blocks may still be computing; no host wait)."""
        dev = int(local.arr[0, 2])
        copier, stream = self._copier(dev)
        copier.copy(local.arr[:, 0], mapped_dst, local.arr[:, 1], stream, after)
        ev, token = self._event(dev)
        ev.record(stream)
        return ev, token

    def _event(self, dev: int):
        """The next event of this device's ring, with its IPC handle. Reusing an event whose last
        record a receiver has not seen yet is safe: the receiver then waits for the later write,
        which this one stream orders after the earlier one."""
        import torch

        ring = self._ring(dev)
        if not ring:
            return torch.cuda.Event(), None
        i = self._next_event.get(dev, 0)
        self._next_event[dev] = (i + 1) % len(ring)
        return ring[i]

    def _ring(self, dev: int) -> list:
        """This device's ring of (interprocess event, IPC handle), created once; empty where
        CUDA IPC events do not work (results then wait for each write to finish)."""
        ring = self._events.get(dev)
        if ring is not None:
            return ring
        import torch

        ring = self._events[dev] = []
        if self._ipc_events:
            try:
                with torch.cuda.device(dev):
                    for _ in range(EVENT_RING):
                        ev = torch.cuda.Event(interprocess=True)
                        ring.append((ev, bytes(ev.ipc_handle())))
            except Exception as e:
                log.info("CUDA IPC events unavailable (%s: %s); results are sent once each "
                         "write finished", type(e).__name__, e)
                self._ipc_events = False
                ring.clear()
        return ring

    # ------------------------------------------------------------------ receiving side
    def expect(self, desc: dict | None) -> None:
        """Open the end events of a peer that will write here (its `describe()`), ahead of its
        first result: an open costs far more than a query. Best effort: `landed` opens what is
        missing."""
        if not desc or desc.get("host") != self.host or desc.get("pid") == self.pid:
            return
        for tok in desc.get("events", []):
            try:
                self._open_event(bytes(tok))
            except cuda_ipc.IpcUnavailable as e:
                log.info("a peer's write events do not open here (%s)", e)
                return

    def landed(self, token: bytes) -> bool:
        """Whether the write whose end event has IPC handle `token` (a peer's `write`) finished:
        every byte of it is in this process's memory. Raises `IpcUnavailable` when the handle
        does not open."""
        ev = self._opened.get(token)
        if ev is None:
            ev = self._open_event(token)
        return bool(ev.query())

    def _open_event(self, token: bytes):
        import torch

        with self._open_lock:
            ev = self._opened.get(token)
            if ev is not None:
                return ev
            dev = self.regions[0][2] if self.regions else self._local_device()
            try:
                ev = torch.cuda.Event.from_ipc_handle(dev, token)
            except Exception as e:
                raise cuda_ipc.IpcUnavailable(f"opening a peer's CUDA IPC event: "
                                              f"{type(e).__name__}: {e}") from None
            while len(self._opened) >= OPENED_MAX:   # peers come and go; their handles too
                self._opened.pop(next(iter(self._opened)))
            self._opened[token] = ev
            return ev

    @staticmethod
    def _local_device() -> int:
        import torch

        return torch.cuda.current_device()
