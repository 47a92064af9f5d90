"""Control plane: one ZMQ ROUTER (bound) plus DEALERs to peers, all owned by one listener thread.

Messages are msgpack maps with a type field `t`. The listener thread decodes each message and calls
`on_message(source, msg)`; handlers only change state and enqueue work — they never block on a
transfer (a slow handler would stall every peer's control traffic). Any thread may `send`/`reply`:
the calls go through a queue and a wake-up pipe to the listener thread, which owns every socket.

`source` is `("router", identity)` for messages that arrived on the ROUTER (reply with
`reply(identity, msg)`) and `("dealer", endpoint)` for replies to our own requests.

Peer loss: a DEALER whose established connection drops (peer process died — the kernel closes its
sockets — or heartbeats time out) or that cannot connect within `connect_timeout_s` while messages
wait, is closed and reported once through `on_peer_lost(endpoint, reason)`; a later `send` to the
same endpoint opens a fresh connection (a restarted peer is a new incarnation to the layers above).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable

import msgpack
import zmq

from .zmq_io import (Wake, bind_router, close_dealer, monitor_events, open_dealer,
                     pending_commands)

log = logging.getLogger("splitserve.transfer.messenger")

MAX_CONTROL_MSG = 256 << 20


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict:
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("control message must be a map with a string 't'")
    return msg


class Messenger:
    def __init__(self, identity: str, on_message: Callable[[tuple, dict], None],
                 on_peer_lost: Callable[[str, str], None], *, host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None, connect_timeout_s: float = 5.0,
                 heartbeat_ivl_s: float = 1.0, heartbeat_timeout_s: float = 5.0):
        self.identity = identity.encode()
        self._on_message = on_message
        self._on_peer_lost = on_peer_lost
        self._connect_timeout_s = connect_timeout_s
        self._hb = (max(1, int(heartbeat_ivl_s * 1000)), max(1, int(heartbeat_timeout_s * 1000)))
        self._ctx = zmq.Context(io_threads=1)
        self._router, self.endpoint = bind_router(self._ctx, host, port, advertise_host,
                                                  heartbeat_ms=self._hb,
                                                  max_msg_bytes=MAX_CONTROL_MSG)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = Wake()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="transfer-messenger", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def send(self, endpoint: str, msg: dict) -> None:
        self._put(("send", endpoint, pack(msg)))

    def reply(self, identity: bytes, msg: dict) -> None:
        self._put(("reply", identity, pack(msg)))

    def forget(self, endpoint: str) -> None:
        """Close the connection to `endpoint` (dropping queued messages) without a loss report."""
        self._put(("forget", endpoint))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the listener thread (serialises it with message handlers)."""
        self._put(("call", fn))

    def _put(self, cmd) -> None:
        if self._closed:
            return
        self._cmds.put(cmd)
        self._wake.wake()

    def close(self) -> None:
        if self._closed:
            return
        self._cmds.put(("stop",))
        self._wake.wake()
        self._closed = True
        self._thread.join(timeout=5)
        self._ctx.term()
        self._wake.close()

    # ------------------------------------------------------------------ listener thread
    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake.r, zmq.POLLIN)
        dealers: dict[str, zmq.Socket] = {}
        mons: dict[zmq.Socket, str] = {}
        connected: dict[str, bool] = {}
        outq: dict[str, collections.deque] = {}
        waiting_since: dict[str, float] = {}

        def drop_dealer(ep: str) -> None:
            s = dealers.pop(ep, None)
            if s is None:
                return
            close_dealer(poller, s, mons, ep)
            connected.pop(ep, None)
            outq.pop(ep, None)
            waiting_since.pop(ep, None)

        def lost(ep: str, reason: str) -> None:
            drop_dealer(ep)
            log.info("control connection to %s lost: %s", ep, reason)
            self._safe(self._on_peer_lost, ep, reason)

        running = True
        while running:
            timeout = 5 if any(outq.values()) else 200
            try:
                events = dict(poller.poll(timeout))
            except zmq.ZMQError:
                break
            if self._wake.r in events:
                self._wake.drain()
            for cmd in pending_commands(self._cmds):
                op = cmd[0]
                if op == "stop":
                    running = False
                elif op == "send":
                    ep, data = cmd[1], cmd[2]
                    if ep not in dealers:
                        s, mon = open_dealer(self._ctx, ep, self.identity, heartbeat_ms=self._hb,
                                             options={zmq.MAXMSGSIZE: MAX_CONTROL_MSG})
                        dealers[ep] = s
                        mons[mon] = ep
                        connected[ep] = False
                        outq[ep] = collections.deque()
                        poller.register(s, zmq.POLLIN)
                        poller.register(mon, zmq.POLLIN)
                    outq[ep].append(data)
                elif op == "reply":
                    try:
                        self._router.send_multipart([cmd[1], cmd[2]], flags=zmq.NOBLOCK)
                    except zmq.ZMQError as e:
                        log.info("control reply to %r dropped: %s", cmd[1], e)
                elif op == "forget":
                    drop_dealer(cmd[1])
                elif op == "call":
                    self._safe(cmd[1])
            if self._router in events:
                for _ in range(1024):
                    try:
                        ident, data = self._router.recv_multipart(zmq.NOBLOCK)[:2]
                    except zmq.Again:
                        break
                    except ValueError:
                        continue
                    self._dispatch(("router", ident), data)
            for ep, s in list(dealers.items()):
                if s in events:
                    for _ in range(1024):
                        try:
                            frames = s.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(("dealer", ep), frames[0])
            for mon, ep in list(mons.items()):
                if mon in events:
                    for ev in monitor_events(mon):
                        if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            connected[ep] = True
                            waiting_since.pop(ep, None)
                        elif ev == zmq.EVENT_DISCONNECTED and connected.get(ep):
                            lost(ep, "peer closed the connection or stopped answering heartbeats")
                            break  # lost() closed `mon`
            now = time.monotonic()
            for ep in list(outq):
                q = outq.get(ep)
                while q:
                    try:
                        dealers[ep].send(q[0], flags=zmq.NOBLOCK)
                        q.popleft()
                        waiting_since.pop(ep, None)
                    except zmq.Again:
                        start = waiting_since.setdefault(ep, now)
                        if now - start > self._connect_timeout_s:
                            lost(ep, f"no connection within {self._connect_timeout_s:.1f}s")
                        break
        for ep in list(dealers):
            drop_dealer(ep)
        self._router.close(0)

    def _dispatch(self, source: tuple, data: bytes) -> None:
        try:
            msg = unpack(data)
        except Exception as e:
            log.warning("dropping malformed control message from %r: %s", source[1], e)
            return
        self._safe(self._on_message, source, msg)

    @staticmethod
    def _safe(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # a handler bug must not kill the control plane
            log.exception("control handler failed")
