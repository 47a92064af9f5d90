"""`ShmAgent`: the same-host fallback — the initiator copies straight into the target's pages.

The target's registered memory must live in a shared file mapping (allocate it with
`transfer.memory.alloc_shared_host`); registration finds the backing file through
/proc/self/maps and advertises `(path, file offset)` with each region. The initiator maps those
files and `memmove`s into them on a copy thread: truly one-sided (the target's CPU does nothing), no
ptrace permission needed (unlike `process_vm_writev`), host memory only.

Memory that is not in a shared mapping can still be registered — it can be the *source* of a WRITE
(or the destination of a READ) — but it is not advertised, so a peer's `check_remote_descs` reports
it uncovered and a write to it fails validation with a message naming the fix.

Completion: DONE after the last byte was copied; the notification is then sent over the agent's
ZeroMQ channel, so it reaches the target after the bytes. A target whose process died (pid gone or
reused: the kernel start time is compared) fails the transfer with ERR instead of "succeeding" into
an orphaned file.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import mmap
import os
import socket
import threading

import msgpack

from .agent import XferHandle
from .descs import Descs
from .errors import FailureCause, InvalidDescriptors, OutOfRange, PeerLost
from .memory import find_file_mapping, memmove
from .py_agent import PyAgentBase, RemoteAgent, process_start_time

log = logging.getLogger("splitserve.transfer.shm")


class _Mapping:
    """One peer file mapped into this process."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def close(self):
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process


class ShmAgent(PyAgentBase):
    kind = "shm"
    mem_types = ("DRAM",)

    def __init__(self, name: str, **kw):
        self._maps: dict[str, _Mapping] = {}
        self._map_lock = threading.Lock()
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shm-agent-copy")
        self._host = socket.gethostname()
        super().__init__(name, **kw)

    def _region_extra(self, addr, nbytes, dev, mem_type):
        m = find_file_mapping(addr, nbytes)
        if m is None:
            log.info("shm agent %s: region 0x%x+%d is not in a shared mapping; usable as a local "
                     "source only", self.name, addr, nbytes)
            return None
        return [m[0], m[1]]

    def _on_remote_loaded(self, ra: RemoteAgent) -> None:
        if ra.host and ra.host != self._host:
            log.warning("shm agent %s: remote %s runs on host %s, not %s; writes will fail",
                        self.name, ra.name, ra.host, self._host)

    def _on_remote_invalidated(self, ra: RemoteAgent) -> None:
        with self._map_lock:
            for row in ra.regions:
                m = self._maps.pop(row[4], None) if len(row) > 4 else None
                if m is not None:
                    m.close()

    def _peer_alive(self, ra: RemoteAgent) -> bool:
        if ra.host and ra.host != self._host:
            return False
        st = process_start_time(ra.pid)
        return st is not None and (ra.start_time is None or st == ra.start_time)

    def _translate(self, ra: RemoteAgent, descs: Descs):
        """Local addresses of remote descriptors (through our mappings of the peer's files)."""
        regions = sorted((int(r[0]), int(r[1]), str(r[4]), int(r[5])) for r in ra.regions)
        out = []
        for a, n, _d in descs.arr.tolist():
            for ra_addr, ra_len, path, off in regions:
                if ra_addr <= a and a + n <= ra_addr + ra_len:
                    with self._map_lock:
                        m = self._maps.get(path)
                        if m is None:
                            m = self._maps[path] = _Mapping(path)
                    foff = off + (a - ra_addr)
                    if foff + n > m.size:
                        raise OutOfRange(f"{path}: offset {foff}+{n} beyond file size {m.size}")
                    out.append(m.base + foff)
                    break
            else:
                raise OutOfRange(f"remote address 0x{a:x}+{n} is in no shared region of {ra.name!r}")
        return out

    def submit_transfer(self, remote: str, local: Descs, remote_descs: Descs, notif: bytes = b"",
                        op: str = "WRITE") -> XferHandle:
        if op not in ("WRITE", "READ"):
            raise InvalidDescriptors(f"op must be WRITE or READ; found {op!r}")
        if local.mem_type != "DRAM" or remote_descs.mem_type != "DRAM":
            raise InvalidDescriptors("ShmAgent moves host memory (DRAM) only; use nixl or tcp "
                                     "for VRAM")
        ra = self._validate(remote, local, remote_descs)
        if not self._peer_alive(ra):
            raise PeerLost(f"remote agent {remote!r} (pid {ra.pid} on {ra.host}) is not running "
                           f"on this host")
        x = XferHandle(remote=remote, op=op, nbytes=local.total_bytes, ndescs=len(local))
        with self._lock:
            self._xfers[x.id] = x
        self._copier.submit(self._copy, ra, x, local, remote_descs, bytes(notif))
        return x

    def _copy(self, ra: RemoteAgent, x: XferHandle, local: Descs, remote_descs: Descs,
              notif: bytes) -> None:
        try:
            targets = self._translate(ra, remote_descs)
            for (la, n, _d), ta in zip(local.arr.tolist(), targets):
                if x.state != "PROC":
                    return  # failed meanwhile (peer lost / invalidated)
                if x.op == "WRITE":
                    memmove(ta, la, n)
                else:
                    memmove(la, ta, n)
            if not self._peer_alive(ra):
                self._finish(x, False, f"remote agent {ra.name!r} died during the transfer",
                             FailureCause.PEER_LOST)
                return
            if notif:
                self._send(ra.name, [b"N", msgpack.packb(
                    {"from": self.name, "n": notif})])
            self._finish(x, True)
        except Exception as e:
            self._finish(x, False, f"shm copy to {ra.name!r} failed: {e}")

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)
        super().shutdown()
        with self._map_lock:
            for m in self._maps.values():
                m.close()
            self._maps.clear()
