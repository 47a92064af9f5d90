"""Machinery shared by the pure-Python agents (`TcpAgent`, `ShmAgent`).

Each agent owns one ZeroMQ context and one I/O thread (`zmq_io.IoLoop`). The thread owns every
socket: a ROUTER bound on the agent's endpoint (incoming writes, reads and notifications) and one
DEALER per loaded remote agent (outgoing traffic and its acknowledgements). Other threads talk to it
through a queue and a wake-up pipe, so no socket is ever touched by two threads.

A remote agent is *lost* when its DEALER reports a disconnect after a connection was established, or
when no connection is established within `connect_timeout_s` while traffic waits. Transfers to a
lost agent go to ERR; new submits raise `PeerLost` until the name is invalidated and reloaded.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

from .agent import (AGENT_DESC_VERSION, DONE, ERR, PROC, RegHandle, TransferAgent, XferHandle,
                    regions_array)
from .descs import Coverage, Descs, check_pair
from .errors import (AgentMismatch, FailureCause, InvalidDescriptors, NameConflict, OutOfRange,
                     PeerLost, ProtocolError, RemoteNotLoaded, TransferError)
from .zmq_io import IoLoop, bind_router

log = logging.getLogger("splitserve.transfer.pyagent")

MAX_MSG_BYTES = 64 << 20  # refuse bigger messages on the ROUTER (garbage protection)


def process_start_time(pid: int) -> int | None:
    """Kernel start time of `pid` (clock ticks since boot), to tell a pid from its reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces/parens: split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    return int(rest[19])


@dataclass
class RemoteAgent:
    name: str
    incarnation: str
    endpoint: str
    host: str
    pid: int
    start_time: int | None
    coverage: Coverage
    regions: list = field(default_factory=list)  # raw advertised rows (kind-specific extras)
    lost: str | None = None  # reason, once lost


class PyAgentBase(TransferAgent):
    """Registration, metadata, validation, notifications and the I/O thread."""

    kind = "py"
    mem_types = ("DRAM", "VRAM")

    def __init__(self, name: str, *, host: str = "127.0.0.1", advertise_host: str | None = None,
                 port: int = 0, connect_timeout_s: float = 5.0, heartbeat_ivl_s: float = 1.0,
                 heartbeat_timeout_s: float = 5.0):
        self.name = name
        self.incarnation = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._regs: dict[int, RegHandle] = {}
        self._local = Coverage()
        self._remotes: dict[str, RemoteAgent] = {}
        self._xfers: dict[int, XferHandle] = {}
        self._notifs: dict[str, list[bytes]] = collections.defaultdict(list)
        self._notif_sink = None     # deliver_notifications
        self._finished_hook = None  # on_finished
        self._connect_timeout_s = connect_timeout_s
        self._hb = (int(heartbeat_ivl_s * 1000), int(heartbeat_timeout_s * 1000))
        self._ctx = zmq.Context(io_threads=1)
        self._router, self.endpoint = bind_router(self._ctx, host, port, advertise_host,
                                                  heartbeat_ms=self._hb,
                                                  max_msg_bytes=MAX_MSG_BYTES + (1 << 20),
                                                  options={zmq.RCVHWM: 0})
        self._stopped = False
        # A lost remote keeps its DEALER (ZeroMQ reconnects it): the remote stays refused
        # (`RemoteAgent.lost`) until it is invalidated, and re-loading the same incarnation
        # without an invalidation sends on the old connection again.
        self.io = IoLoop(self._ctx, self._router, self.name.encode(), name=f"{self.kind}-agent-io",
                         on_router=self._from_router, on_dealer=self._from_dealer,
                         on_lost=self._io_lost, on_refused=self._io_refused,
                         is_live=lambda x: x.state == PROC, heartbeat_ms=self._hb,
                         connect_timeout_s=connect_timeout_s, dealer_options={zmq.SNDHWM: 0},
                         close_on_lost=False)

    # ------------------------------------------------------------------ registration
    def _region_extra(self, addr: int, nbytes: int, dev: int, mem_type: str):
        """Kind-specific data advertised with a region (None = not reachable by peers)."""
        return []

    def register_memory(self, regions, mem_type: str = "DRAM") -> RegHandle:
        if mem_type not in self.mem_types:
            raise InvalidDescriptors(
                f"{type(self).__name__} registers {self.mem_types}; found {mem_type!r}")
        arr = regions_array(regions)
        h = RegHandle(regions=arr, mem_type=mem_type)
        h.backend = [self._region_extra(int(a), int(n), int(d), mem_type) for a, n, d in arr.tolist()]
        with self._lock:
            self._regs[h.id] = h
            self._local.add((a, n, d, mem_type) for a, n, d in arr.tolist())
        return h

    def deregister_memory(self, handle: RegHandle) -> None:
        with self._lock:
            if self._regs.pop(handle.id, None) is None:
                raise InvalidDescriptors("deregister_memory: handle is not registered here")
            self._local.remove([(a, n, d, handle.mem_type) for a, n, d in handle.regions.tolist()])

    # ------------------------------------------------------------------ metadata
    def get_local_agent_desc(self) -> bytes:
        with self._lock:
            rows = []
            for h in self._regs.values():
                for (a, n, d), extra in zip(h.regions.tolist(), h.backend):
                    if extra is not None:
                        rows.append([a, n, d, h.mem_type, *extra])
        return msgpack.packb({
            "v": AGENT_DESC_VERSION, "kind": self.kind, "name": self.name,
            "inc": self.incarnation, "host": socket.gethostname(), "pid": os.getpid(),
            "st": process_start_time(os.getpid()), "endpoint": self.endpoint, "regions": rows,
        })

    @staticmethod
    def decode_desc(desc: bytes) -> dict:
        try:
            md = msgpack.unpackb(desc, raw=False)
        except Exception as e:
            raise AgentMismatch(f"agent descriptor is not our msgpack envelope: {e}") from None
        if not isinstance(md, dict) or "kind" not in md:
            raise AgentMismatch("agent descriptor lacks a 'kind' field")
        return md

    def load_remote_agent(self, desc: bytes) -> str:
        md = self.decode_desc(desc)
        if md.get("kind") != self.kind:
            raise AgentMismatch(
                f"remote agent is kind {md.get('kind')!r}; this agent is {self.kind!r}")
        if md.get("v") != AGENT_DESC_VERSION:
            raise AgentMismatch(
                f"remote agent descriptor version {md.get('v')}; expected {AGENT_DESC_VERSION}")
        try:
            name, inc, endpoint = str(md["name"]), str(md["inc"]), str(md["endpoint"])
            rows = [list(r) for r in md["regions"]]
            cov = Coverage((int(r[0]), int(r[1]), int(r[2]), str(r[3])) for r in rows)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise AgentMismatch(f"malformed agent descriptor: {e!r}") from None
        with self._lock:
            cur = self._remotes.get(name)
            if cur is not None and cur.incarnation != inc:
                raise NameConflict(
                    f"agent {name!r} is loaded with incarnation {cur.incarnation[:8]}; "
                    f"found {inc[:8]} — invalidate the old one first")
            ra = RemoteAgent(name=name, incarnation=inc, endpoint=endpoint,
                             host=str(md.get("host", "")), pid=int(md.get("pid", 0)),
                             start_time=md.get("st"), coverage=cov, regions=rows)
            self._remotes[name] = ra
            fresh = cur is None
        if fresh:
            self._check_running()
            self.io.connect(name, endpoint)
        self._on_remote_loaded(ra)
        return name

    def _on_remote_loaded(self, ra: RemoteAgent) -> None:
        pass

    def invalidate_remote_agent(self, name: str) -> None:
        with self._lock:
            ra = self._remotes.pop(name, None)
        if ra is not None:
            if not self._stopped:
                self.io.forget(name, f"remote agent {name!r} was invalidated")
            self._fail_remote(name, f"remote agent {name!r} was invalidated", drop=False)
            self._on_remote_invalidated(ra)

    def _on_remote_invalidated(self, ra: RemoteAgent) -> None:
        pass

    def _remote(self, name: str) -> RemoteAgent:
        with self._lock:
            ra = self._remotes.get(name)
        if ra is None:
            raise RemoteNotLoaded(f"remote agent {name!r} is not loaded")
        if ra.lost:
            raise PeerLost(f"remote agent {name!r} is lost: {ra.lost}")
        return ra

    def check_remote_descs(self, name: str, descs: Descs) -> bool:
        with self._lock:
            ra = self._remotes.get(name)
        return ra is not None and not ra.lost and ra.coverage.covers(descs)

    def _validate(self, remote: str, local: Descs, remote_descs: Descs) -> RemoteAgent:
        check_pair(local, remote_descs)
        ra = self._remote(remote)
        with self._lock:
            bad = self._local.uncovered(local)
        if bad >= 0:
            a, n, d = local.arr[bad].tolist()
            raise OutOfRange(
                f"local descriptor {bad} ({local.mem_type} addr=0x{a:x} len={n} dev={d}) is not "
                f"inside any registered region")
        bad = ra.coverage.uncovered(remote_descs)
        if bad >= 0:
            a, n, d = remote_descs.arr[bad].tolist()
            raise OutOfRange(
                f"remote descriptor {bad} ({remote_descs.mem_type} addr=0x{a:x} len={n} dev={d}) "
                f"is not inside memory agent {remote!r} registered")
        return ra

    # ------------------------------------------------------------------ transfers
    def poll(self, handle: XferHandle) -> str:
        return handle.state

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            self._xfers.pop(handle.id, None)

    def _finish(self, xfer: XferHandle, ok: bool, err: str | None = None,
                cause: FailureCause = FailureCause.FAILED) -> None:
        if xfer.state != PROC:
            return
        xfer.error = None if ok else (err or "transfer failed")
        xfer.cause = None if ok else cause
        xfer.state = DONE if ok else ERR
        hook = self._finished_hook
        if hook is not None:
            try:
                hook()
            except Exception:  # the waiter's bug must not fail the transfer
                log.exception("agent %s: on_finished hook failed", self.name)

    def on_finished(self, fn) -> bool:
        self._finished_hook = fn
        return True

    # ------------------------------------------------------------------ notifications
    def notify(self, remote: str, msg: bytes) -> None:
        self._remote(remote)
        self._send(remote, [b"N", msgpack.packb({"from": self.name, "n": bytes(msg)})])

    def get_notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            out = {k: v for k, v in self._notifs.items() if v}
            self._notifs = collections.defaultdict(list)
        return out

    def deliver_notifications(self, sink) -> bool:
        with self._lock:
            self._notif_sink = sink
            held, self._notifs = self._notifs, collections.defaultdict(list)
        for sender, msgs in held.items():
            for m in msgs:
                self._deliver(sink, sender, m)
        return True

    def _deliver(self, sink, sender: str, msg: bytes) -> None:
        try:
            sink(sender, msg)
        except Exception:  # the receiver's bug must not kill the I/O thread
            log.exception("agent %s: notification sink failed", self.name)

    def _push_notif(self, sender: str, msg: bytes) -> None:
        with self._lock:
            sink = self._notif_sink
            if sink is None:
                self._notifs[sender].append(msg)
                return
        self._deliver(sink, sender, msg)

    # ------------------------------------------------------------------ I/O thread
    def _check_running(self) -> None:
        if self._stopped:
            raise TransferError(f"agent {self.name!r} is shut down")

    def _send(self, remote: str, frames: list, xfer: XferHandle | None = None) -> None:
        """Queue `frames` to loaded remote `remote`; `xfer` fails if they can never go."""
        self._check_running()
        self.io.send(remote, frames, xfer)

    def _fail_remote(self, name: str, reason: str, drop: bool = True) -> None:
        with self._lock:
            pending = [x for x in self._xfers.values() if x.remote == name and x.state == PROC]
            ra = self._remotes.get(name)
            if ra is not None and drop:
                ra.lost = reason
        for x in pending:
            self._finish(x, False, reason, FailureCause.PEER_LOST if drop else FailureCause.FAILED)

    def _io_lost(self, name: str, reason: str, unsent: list) -> None:
        reason = f"connection to remote agent {name!r} was lost: {reason}"
        log.warning("%s", reason)
        self._fail_remote(name, reason)
        for x in unsent:
            self._finish(x, False, reason, FailureCause.PEER_LOST)

    def _io_refused(self, name: str, unsent: list, reason: str) -> None:
        if reason == "not connected":
            reason = f"remote agent {name!r} is not connected"
        for x in unsent:
            self._finish(x, False, reason)

    def _from_router(self, frames: list) -> None:
        if len(frames) < 3:
            log.warning("dropping malformed agent message (%d frames)", len(frames))
            return
        ident = frames[0].bytes
        kind = frames[1].bytes
        try:
            header = msgpack.unpackb(frames[2].bytes, raw=False)
            if not isinstance(header, dict):
                raise ProtocolError("header is not a map")
            self._handle_incoming(ident, kind, header, frames[3:])
        except Exception as e:  # a bad peer message must never kill the I/O thread
            log.warning("agent %s: bad message %r from %r: %s", self.name, kind, ident, e)

    def _reply(self, ident: bytes, frames: list) -> None:
        try:
            self._router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # initiator gone: nothing to acknowledge to
            log.info("agent %s: cannot reply to %r: %s", self.name, ident, e)

    def _handle_incoming(self, ident: bytes, kind: bytes, header: dict, payload: list) -> None:
        if kind == b"N":
            self._push_notif(str(header["from"]), bytes(header["n"]))
        else:
            raise ProtocolError(f"unexpected message kind {kind!r}")

    def _from_dealer(self, name: str, frames: list) -> None:
        try:
            header = msgpack.unpackb(frames[1].bytes, raw=False)
            self._handle_reply(name, frames[0].bytes, header, frames[2:])
        except Exception as e:
            log.warning("agent %s: bad reply from %r: %s", self.name, name, e)

    def _handle_reply(self, name: str, kind: bytes, header: dict, payload: list) -> None:
        raise ProtocolError(f"unexpected reply kind {kind!r}")

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.io.close()
        with self._lock:
            for x in self._xfers.values():
                self._finish(x, False, "agent shut down")
            self._remotes.clear()
            self._regs.clear()
        self._ctx.term()

    def describe(self) -> dict:
        d = super().describe()
        d["endpoint"] = self.endpoint
        return d


def desc_bytes(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr, dtype=np.uint64).tobytes()


def desc_from_bytes(b: bytes) -> np.ndarray:
    if len(b) % 24:
        raise ProtocolError(f"descriptor bytes not a multiple of 24: {len(b)}")
    return np.frombuffer(b, dtype=np.uint64).reshape(-1, 3)
