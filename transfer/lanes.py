"""Control lanes: one plain TCP connection from a generation rank to each context rank it posts
receives to, beside the ZeroMQ control plane, for the messages on the critical path.

Why: a ZeroMQ message crosses two more threads than the data needs (the sender's ZeroMQ I/O
thread, then the receiver's), and a Python thread must first hand it to the loop that owns the
socket. Each of those is a wake-up; on the GPU host one costs 50-150 µs (measured there
2026-12-07: a ZeroMQ hop ≈ 300 µs, a thread hand-off ≈ 150 µs). On a lane, the thread that has
the message writes it to the socket itself (under the lane's lock), and the kernel wakes the one
thread that reads it: the peer's listener, which polls the lane's socket with its ZeroMQ sockets.

Rules (transfer/messenger.py keeps them):
- the context rank listens (a TCP socket on the control plane's host) and says where in its
  `Registered` answer; the generation rank connects before it posts any receive to that rank,
  and its first frame names it (`Hello`): the context side then answers it on the lane;
- once a lane is up, every message between the two goes on it (receives, cancels, results), so
  a cancel never overtakes the receive it cancels; what went before went on ZeroMQ, and none of
  it is ordered against a receive (a claim; the cancel of a receive never posted);
- a lane that closes or fails a write means the peer is gone: the generation side reports the
  context rank lost (as a ZeroMQ disconnect does) and a later receive registers again and opens
  a fresh lane. Heartbeats stay on the ZeroMQ connection, which stays open.

Frames are a 4-byte big-endian length and the message's msgpack bytes (no pickle).

A context rank also listens on a Unix socket in the abstract namespace (`listen_local`, Linux)
and names it in `Registered` too; a generation rank connects there first and over TCP only where
that fails (another host, another network namespace). The same frames: a Unix stream socket's
write and wake-up cost less than TCP's loopback path (one-way hop between two processes on the
2-core box, 2026-12-07: 13.3/12.2 µs hot and 33.2/28.2 µs after a 2 ms idle, against 16.1/15.7
and 39.6/38.1 over TCP).

Abstract socket names are visible to every process of the host (/proc/net/unix) and carry no
file permissions, so both ends check who is at the other end (SO_PEERCRED, `check_local_peer`):
the listener closes a connection from a process of another user before reading its hello (which
could name a real peer and replace its lane), and a connecting rank takes the TCP lane instead
when the listener under the name runs as another user. Same effective uid only, root included:
ranks of one deployment run as one user, and a rank that runs as another (root or not) still
reaches its peers over TCP. Where SO_PEERCRED does not exist there is no Unix lane (TCP only)
rather than one without the check.
"""
from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import sys
import threading
import time

AF_UNIX = getattr(socket, "AF_UNIX", None)
SO_PEERCRED = getattr(socket, "SO_PEERCRED", None)   # Linux: no Unix lane without it
PEERCRED = struct.Struct("3i")                       # struct ucred: pid, uid, gid
FRAME = struct.Struct("!I")
MAX_FRAME = 256 << 20


class LaneClosed(Exception):
    pass


class Lane:
    """One connected stream socket. Any thread may `send`; only the loop thread `read`s.

    The socket is non-blocking, so a read or a write is one system call: a socket with a Python
    timeout polls before every call. Reads land in one buffer kept for the lane's life: a fresh
    `recv(1 MiB)` per message maps and unmaps a megabyte, which cost ~30 µs warm and ~60 µs
    right after an idle wait on the 2-core box (2026-12-07), twice per round trip."""

    READ_BYTES = 64 << 10   # the buffer's size; a longer frame grows it while it is read

    def __init__(self, sock: socket.socket, key=None, send_timeout_s: float = 5.0) -> None:
        if sock.family != AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.key = key          # the peer: its endpoint (generation side) or identity (context)
        # Writes block at most this long (a peer that stopped reading): then the lane is closed.
        self._send_timeout_s = send_timeout_s
        self._lock = threading.Lock()
        self._buf = bytearray(self.READ_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0         # [start, end) of the buffer: bytes read, not yet a whole frame
        self._end = 0
        self.closed = False

    def send(self, data: bytes) -> bool:
        """Write one frame; False when the lane is (now) closed: the peer is gone."""
        frame = FRAME.pack(len(data)) + data
        with self._lock:
            if self.closed:
                return False
            try:
                try:
                    sent = self.sock.send(frame)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if sent < len(frame):
                    self._send_rest_locked(memoryview(frame)[sent:])
                return True
            except OSError:   # reset, broken pipe, or a peer that stopped reading
                self._close_locked()
                return False

    def _send_rest_locked(self, rest: memoryview) -> None:
        """The socket's buffer is full: wait for room, `send_timeout_s` at most in all."""
        deadline = time.monotonic() + self._send_timeout_s
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        while rest:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError(f"the peer read nothing for {self._send_timeout_s:.1f}s")
            try:
                rest = rest[self.sock.send(rest):]
            except (BlockingIOError, InterruptedError):
                pass

    def read(self) -> list[bytes]:
        """(loop thread, socket readable) The frames complete so far; raises `LaneClosed` at the
        end of the stream, on an error, or on a frame over `MAX_FRAME`."""
        try:
            n = self.sock.recv_into(self._view[self._end:])
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as e:
            raise LaneClosed(str(e)) from None
        if not n:
            raise LaneClosed("the peer closed the lane")
        buf, view = self._buf, self._view
        end = self._end + n
        pos = self._start
        out = []
        need = 0
        while end - pos >= FRAME.size:
            (size,) = FRAME.unpack_from(buf, pos)
            if size > MAX_FRAME:
                raise LaneClosed(f"a frame of {size} bytes; at most {MAX_FRAME}")
            if end - pos - FRAME.size < size:
                need = FRAME.size + size
                break
            out.append(bytes(view[pos + FRAME.size:pos + FRAME.size + size]))
            pos += FRAME.size + size
        if pos == end:
            pos = end = 0
            if len(buf) > self.READ_BYTES:   # a long frame is read: back to the usual size
                self._resize(self.READ_BYTES, 0, 0)
        elif len(buf) - pos < max(need, FRAME.size + 1):
            # The frame begun at `pos` does not fit behind it: move it to the front (and grow
            # the buffer when the frame is longer than the buffer).
            self._resize(max(len(buf), need), pos, end)
            pos, end = 0, end - pos
        self._start, self._end = pos, end
        return out

    def _resize(self, size: int, pos: int, end: int) -> None:
        """A buffer of `size` bytes starting with the old one's [pos, end)."""
        if size == len(self._buf):
            self._buf[:end - pos] = self._buf[pos:end]
            return
        buf = bytearray(size)
        buf[:end - pos] = self._buf[pos:end]
        self._view.release()
        self._buf, self._view = buf, memoryview(buf)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def listen(host: str) -> socket.socket:
    """A TCP listener on `host` (an OS-chosen port), as every listener binds the configured host."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(128)
    s.setblocking(False)
    return s


def listen_local() -> tuple[socket.socket | None, str]:
    """A lane listener for peers on this host: a Unix stream socket in the abstract namespace
    (Linux; no file, gone with the process), and the name peers connect to ("" and None where
    there is none). A name no other process has (random): a peer on another host, or in another
    network namespace, finds nothing under it and connects over TCP instead."""
    if AF_UNIX is None or SO_PEERCRED is None or not sys.platform.startswith("linux"):
        return None, ""   # no peer check possible: TCP lanes only
    name = f"splitserve-lane-{secrets.token_hex(12)}"
    s = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind("\0" + name)
        s.listen(128)
    except OSError:
        s.close()
        return None, ""
    s.setblocking(False)
    return s, name


def connect_local(name: str, timeout_s: float) -> socket.socket:
    """Connect to a lane listener of this host (`listen_local`'s name); OSError where no
    process here listens under that name, and PermissionError (an OSError) where the one that
    does runs as another user (`check_local_peer`)."""
    if AF_UNIX is None or SO_PEERCRED is None:
        raise OSError("no Unix sockets with peer credentials here")
    s = socket.socket(AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect("\0" + name)
        check_local_peer(s)
    except OSError:
        s.close()
        raise
    return s


def check_local_peer(sock: socket.socket) -> None:
    """The process at the other end of a Unix socket (as the kernel recorded it when that end
    connected or listened) runs as this process's effective uid; PermissionError saying whom
    it found otherwise. Same uid only, root included (module docstring)."""
    pid, uid, _gid = PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, SO_PEERCRED, PEERCRED.size))
    if uid != os.geteuid():
        raise PermissionError(f"expected a process of uid {os.geteuid()} (this process's), "
                              f"found uid {uid} (pid {pid})")


def connect(address: str, timeout_s: float) -> socket.socket:
    """Connect to a lane listener at `host:port` (`[v6]:port` for IPv6)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def address(sock: socket.socket, advertise_host: str) -> str:
    port = sock.getsockname()[1]
    return f"[{advertise_host}]:{port}" if ":" in advertise_host else f"{advertise_host}:{port}"
