"""ZeroMQ plumbing shared by the transfer I/O threads (`PyAgentBase`, `Messenger`).

Both own one ROUTER bound on their endpoint and one monitored DEALER per peer, and every socket is
touched by that one thread only; other threads reach it through a command queue and a `Wake` pipe.
What the two do with a message, a lost peer or a stalled queue differs and stays with them — this
module holds only the socket set-up, tear-down and draining they do the same way.
"""
from __future__ import annotations

import os
import queue
import socket
from typing import Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

# A DEALER's monitor reports these two; "connected" is a finished handshake, not a TCP connect, so
# a peer that accepts TCP but never speaks ZMTP still counts as not connected.
MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Wake:
    """A pipe the I/O thread polls; any thread may write one byte to wake it."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def wake(self):
        try:
            os.write(self.w, b"x")
        except BlockingIOError:
            pass  # pipe full: the thread is awake anyway

    def drain(self):
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self):
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass


def bind_router(ctx: zmq.Context, host: str, port: int, advertise_host: str | None, *,
                heartbeat_ms: tuple[int, int], max_msg_bytes: int,
                options: dict[int, int] | None = None) -> tuple[zmq.Socket, str]:
    """A ROUTER bound on `host:port` (port 0 = OS-chosen) and the endpoint peers should dial.

    Unroutable replies raise (ROUTER_MANDATORY) instead of vanishing, and a peer reconnecting with
    the same identity takes over its old pipe (ROUTER_HANDOVER). A wildcard bind advertises the
    host name unless `advertise_host` says otherwise.
    """
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    router.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
    router.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
    for opt, value in (options or {}).items():
        router.setsockopt(opt, value)
    if port:
        router.bind(f"tcp://{host}:{port}")
    else:
        port = router.bind_to_random_port(f"tcp://{host}")
    adv = advertise_host or (host if host not in ("0.0.0.0", "::", "*") else socket.gethostname())
    return router, f"tcp://{adv}:{port}"


def open_dealer(ctx: zmq.Context, endpoint: str, identity: bytes, *, heartbeat_ms: tuple[int, int],
                options: dict[int, int] | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connecting to `endpoint` and its monitor socket (`MONITOR_EVENTS`).

    IMMEDIATE keeps sends queued in the caller (send raises `zmq.Again`) until the connection is
    up, which is what lets the callers time a connection attempt out.
    """
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IMMEDIATE, 1)
    s.setsockopt(zmq.ROUTING_ID, identity)
    s.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
    for opt, value in (options or {}).items():
        s.setsockopt(opt, value)
    mon = s.get_monitor_socket(MONITOR_EVENTS)
    s.connect(endpoint)
    return s, mon


def close_dealer(poller: zmq.Poller, s: zmq.Socket, monitors: dict, key) -> None:
    """Unregister and close DEALER `s` and every monitor in `monitors` mapped to `key`."""
    s.disable_monitor()
    for m, k in list(monitors.items()):
        if k == key:
            poller.unregister(m)
            del monitors[m]
            m.close(0)
    poller.unregister(s)
    s.close(0)


def pending_commands(cmds: queue.SimpleQueue) -> Iterator:
    """Every command queued so far, without blocking."""
    while True:
        try:
            yield cmds.get_nowait()
        except queue.Empty:
            return


def monitor_events(mon: zmq.Socket) -> Iterator[int]:
    """The event codes waiting on monitor socket `mon`, without blocking.

    Stop iterating before closing `mon` (the next read would hit a closed socket).
    """
    while True:
        try:
            ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        yield ev["event"]
