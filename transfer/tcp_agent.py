"""`TcpAgent`: the fallback between hosts — bytes travel over a ZeroMQ TCP connection.

WRITE: the initiator reads its source regions (zero-copy for host memory; device memory is staged
through the host) and sends them as messages of at most `MSG_BYTES` payload, each with a header
listing its destination descriptors. The target's I/O thread checks every descriptor against its
own registrations (a peer can only ever write into registered memory), copies the bytes in, and
after the last message acknowledges the transfer and queues the notification — so the target sees
the notification only after every byte landed, and the initiator sees DONE only then too.
READ: the initiator sends the remote descriptors; the target replies with the bytes; the initiator
scatters them into its local descriptors.

Not one-sided (the target's I/O thread copies), which is the price of working anywhere: any two
hosts, any memory, no NIXL, no ptrace permission.
"""
from __future__ import annotations

import itertools
import logging

import msgpack
import numpy as np

from .agent import PROC, XferHandle
from .descs import Descs
from .errors import InvalidDescriptors, OutOfRange, ProtocolError
from .memory import read_region, write_region
from .py_agent import PyAgentBase, desc_bytes, desc_from_bytes

log = logging.getLogger("splitserve.transfer.tcp")

MSG_BYTES = 16 << 20
SMALL_FRAGMENT = 64 << 10  # below this average, fragments of a message are gathered into one frame


def split_pieces(local: np.ndarray, remote: np.ndarray, max_bytes: int = MSG_BYTES):
    """Yield (local_rows, remote_rows) message groups: rows split so no piece exceeds `max_bytes`
    and each group carries at most `max_bytes`."""
    pieces_l, pieces_r = [], []
    for (la, n, ld), (ra, _n, rd) in zip(local.tolist(), remote.tolist()):
        off = 0
        while off < n:
            k = min(max_bytes, n - off)
            pieces_l.append((la + off, k, ld))
            pieces_r.append((ra + off, k, rd))
            off += k
    group_l, group_r, acc = [], [], 0
    for pl, pr in zip(pieces_l, pieces_r):
        if group_l and acc + pl[1] > max_bytes:
            yield group_l, group_r
            group_l, group_r, acc = [], [], 0
        group_l.append(pl)
        group_r.append(pr)
        acc += pl[1]
    if group_l:
        yield group_l, group_r


def gather_frames(rows, mem_type: str) -> list:
    """Payload frames for `rows` of (addr, len, dev): zero-copy per region when fragments are
    large, one gathered frame when they are small (per-frame cost would dominate)."""
    bufs = [read_region(a, n, mem_type, d) for a, n, d in rows]
    total = sum(n for _a, n, _d in rows)
    if len(bufs) > 1 and total / len(bufs) < SMALL_FRAGMENT:
        return [b"".join(memoryview(b).cast("B") for b in bufs)]
    return bufs


def scatter(frames, descs: np.ndarray, mem_type: str) -> None:
    """Write the concatenation of `frames` into `descs` in order; lengths must match exactly."""
    views = [memoryview(f).cast("B") for f in frames]
    total_in = sum(v.nbytes for v in views)
    total_out = int(descs[:, 1].sum()) if len(descs) else 0
    if total_in != total_out:
        raise ProtocolError(f"payload has {total_in} bytes; descriptors need {total_out}")
    fi, fo = 0, 0
    for a, n, d in descs.tolist():
        done = 0
        while done < n:
            v = views[fi]
            k = min(n - done, v.nbytes - fo)
            write_region(a + done, mem_type, d, v[fo:fo + k])
            done += k
            fo += k
            if fo == v.nbytes:
                fi, fo = fi + 1, 0


class TcpAgent(PyAgentBase):
    kind = "tcp"
    mem_types = ("DRAM", "VRAM")

    def __init__(self, name: str, **kw):
        self._ids = itertools.count(1)
        self._rx: dict[tuple[bytes, int], str | None] = {}  # (initiator, xfer) -> error so far
        self._by_xid: dict[int, XferHandle] = {}
        super().__init__(name, **kw)

    # ------------------------------------------------------------------ initiator
    def submit_transfer(self, remote: str, local: Descs, remote_descs: Descs, notif: bytes = b"",
                        op: str = "WRITE") -> XferHandle:
        if op not in ("WRITE", "READ"):
            raise InvalidDescriptors(f"op must be WRITE or READ; found {op!r}")
        self._validate(remote, local, remote_descs)
        xid = next(self._ids)
        x = XferHandle(remote=remote, op=op, nbytes=local.total_bytes, ndescs=len(local))
        x.backend = {"xid": xid, "local": local, "notif": bytes(notif)}
        with self._lock:
            self._xfers[x.id] = x
            self._by_xid[xid] = x
        if op == "READ":
            hdr = {"x": xid, "d": desc_bytes(remote_descs.arr), "m": remote_descs.mem_type}
            self._send(remote, [b"R", msgpack.packb(hdr)], x)
            return x
        groups = list(split_pieces(local.arr, remote_descs.arr))
        if not groups:
            groups = [([], [])]
        for i, (gl, gr) in enumerate(groups):
            last = i == len(groups) - 1
            hdr = {"x": xid, "d": desc_bytes(np.array(gr, np.uint64).reshape(-1, 3)),
                   "m": remote_descs.mem_type, "last": last,
                   "n": bytes(notif) if last else None}
            frames = [b"W", msgpack.packb(hdr), *gather_frames(gl, local.mem_type)]
            self._send(remote, frames, x)
        return x

    def _handle_reply(self, name: str, kind: bytes, header: dict, payload: list) -> None:
        xid = int(header["x"])
        with self._lock:
            x = self._by_xid.pop(xid, None)
        if x is None or x.state != PROC:
            return
        if not header.get("ok"):
            self._finish(x, False, f"remote agent {name!r}: {header.get('err')}")
            return
        if kind == b"A":
            self._finish(x, True)
        elif kind == b"D":
            try:
                local: Descs = x.backend["local"]
                scatter([f.buffer for f in payload], local.arr, local.mem_type)
            except Exception as e:
                self._finish(x, False, f"READ from {name!r}: {e}")
                return
            if x.backend["notif"]:
                self._send(name, [b"N", msgpack.packb(
                    {"from": self.name, "n": x.backend["notif"]})])
            self._finish(x, True)
        else:
            raise ProtocolError(f"unexpected reply kind {kind!r}")

    def release(self, handle: XferHandle) -> None:
        super().release(handle)
        with self._lock:
            if handle.backend:
                self._by_xid.pop(handle.backend["xid"], None)

    # ------------------------------------------------------------------ target
    def _registered_descs(self, header: dict, access: str):
        """The descriptors (and memory type) a peer's W/R header names, all inside our registrations.

        A peer must never reach memory we did not register: the first row outside raises
        `OutOfRange`, naming the `access` ("write to" / "read of").
        """
        descs = desc_from_bytes(header["d"])
        mem = str(header["m"])
        with self._lock:
            bad = self._local.uncovered(Descs(descs, mem))
        if bad >= 0:
            a, n, dv = descs[bad].tolist()
            raise OutOfRange(f"{access} unregistered {mem} addr=0x{a:x} len={n} dev={dv}")
        return descs, mem

    def _handle_incoming(self, ident: bytes, kind: bytes, header: dict, payload: list) -> None:
        if kind == b"W":
            key = (ident, int(header["x"]))
            err = self._rx.get(key)
            if err is None:
                try:
                    descs, mem = self._registered_descs(header, "write to")
                    scatter([f.buffer for f in payload], descs, mem)
                except Exception as e:
                    err = str(e) or type(e).__name__
            if header.get("last"):
                self._rx.pop(key, None)
                if err is None and header.get("n"):
                    self._push_notif(ident.decode(errors="replace"), bytes(header["n"]))
                self._reply(ident, [b"A", msgpack.packb({"x": key[1], "ok": err is None,
                                                          "err": err})])
            else:
                self._rx[key] = err
        elif kind == b"R":
            xid = int(header["x"])
            try:
                descs, mem = self._registered_descs(header, "read of")
                frames = gather_frames(descs.tolist(), mem)
                self._reply(ident, [b"D", msgpack.packb({"x": xid, "ok": True}), *frames])
            except Exception as e:
                self._reply(ident, [b"D", msgpack.packb({"x": xid, "ok": False, "err": str(e)})])
        else:
            super()._handle_incoming(ident, kind, header, payload)
