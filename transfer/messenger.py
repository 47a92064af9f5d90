"""Control plane: one ZMQ ROUTER (bound) plus DEALERs to peers, all owned by one listener thread.

Messages are msgpack maps with a type field `t`. The listener thread (`zmq_io.IoLoop`, which owns
every socket) decodes each message and calls
`on_message(source, msg)`; handlers only change state and enqueue work — they never block on a
transfer (a slow handler would stall every peer's control traffic). Any thread may `send`/`reply`:
the calls go through a queue and a wake-up pipe to the listener thread, which owns every socket.

`source` is `("router", identity)` for messages that arrived on the ROUTER (reply with
`reply(identity, msg)`) and `("dealer", endpoint)` for replies to our own requests.

Peer loss: a DEALER whose established connection drops (peer process died — the kernel closes its
sockets — or heartbeats time out) or that cannot connect within `connect_timeout_s` while messages
wait, is closed and reported once through `on_peer_lost(endpoint, reason)`; a later `send` to the
same endpoint opens a fresh connection (a restarted peer is a new incarnation to the layers above).

Control lanes (transfer/lanes.py): besides its ROUTER, a messenger listens for lanes
(`lane_address` over TCP, `lane_local` a Unix socket for peers on its host);
`open_lane(endpoint, address, local)` connects one to a peer, through `local` where it can.
While a lane to a peer is up, `send` to its endpoint and `reply` to its identity write to the
lane from the calling thread, and what arrives on it is dispatched like ZeroMQ traffic
(`("dealer", endpoint)` on the side that connected, `("router", identity)` on the side that
listened). A lane that closes or fails a write reports its peer lost on the connecting side, as
a ZeroMQ disconnect does. A connection to the Unix socket from a process of another user is
closed before its hello is read (`lanes.check_local_peer`), counted in `lane_stats["refused"]`
beside connections without a valid hello (`lane_stats["bad_hello"]`).
"""
from __future__ import annotations

import logging
from typing import Callable

import msgpack
import zmq

from . import lanes
from .zmq_io import IoLoop, bind_router

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
                 heartbeat_ivl_s: float = 1.0, heartbeat_timeout_s: float = 5.0,
                 decode: Callable[[bytes], object] | None = None,
                 on_decoded: Callable[[tuple, object], None] | None = None):
        self.identity = identity.encode()
        self._on_message = on_message
        # Fast path: `decode(bytes)` straight to a typed message for `on_decoded`; whatever it
        # refuses goes the dict way (`on_message`), which reports it.
        self._decode, self._on_decoded = decode, on_decoded
        self._on_peer_lost = on_peer_lost
        hb = (max(1, int(heartbeat_ivl_s * 1000)), max(1, int(heartbeat_timeout_s * 1000)))
        self._ctx = zmq.Context(io_threads=1)
        router, self.endpoint = bind_router(self._ctx, host, port, advertise_host,
                                            heartbeat_ms=hb, max_msg_bytes=MAX_CONTROL_MSG)
        self._connect_timeout_s = connect_timeout_s
        self._lane_server = lanes.listen(host)
        adv = self.endpoint.rpartition(":")[0].removeprefix("tcp://").strip("[]")
        self.lane_address = lanes.address(self._lane_server, adv)
        # peers on this host connect here instead ("" where there is none)
        self._local_server, self.lane_local = lanes.listen_local()
        self._lanes_out: dict[str, lanes.Lane] = {}     # endpoint -> lane we connected
        self._lanes_in: dict[bytes, lanes.Lane] = {}    # identity -> lane a peer connected
        self._accepted: set[lanes.Lane] = set()         # connected to us, not yet named
        # refused: Unix-socket connections from another user; bad_hello: lanes closed because
        # their first frame was no valid hello
        self.lane_stats = {"sent": 0, "received": 0, "refused": 0, "bad_hello": 0}
        self.io = IoLoop(self._ctx, router, self.identity, name="transfer-messenger",
                         on_router=self._from_router, on_dealer=self._from_dealer,
                         on_lost=self._lost, heartbeat_ms=hb, connect_timeout_s=connect_timeout_s,
                         dealer_options={zmq.MAXMSGSIZE: MAX_CONTROL_MSG})
        for server in (self._lane_server, self._local_server):
            if server is not None:
                self.io.call_soon(lambda server=server: self.io.watch_fd(
                    server.fileno(), lambda: self._accept(server)))
        self._closed = False

    # ------------------------------------------------------------------ API (any thread)
    def send(self, endpoint: str, msg: dict) -> None:
        self.send_encoded(endpoint, pack(msg))

    def reply(self, identity: bytes, msg: dict) -> None:
        self.reply_encoded(identity, pack(msg))

    def send_encoded(self, endpoint: str, data: bytes) -> None:
        """`send` of a message already packed (msgpack bytes of its map)."""
        lane = self._lanes_out.get(endpoint)
        if lane is not None:
            if lane.send(data):
                self.lane_stats["sent"] += 1
            else:   # the peer is gone: report it once (the message is lost with it)
                self.io.call_soon(lambda: self._lane_lost(lane, "a write on its control lane "
                                                               "failed"))
            return
        self.io.send(endpoint, [data], endpoint=endpoint)

    def reply_encoded(self, identity: bytes, data: bytes) -> None:
        """`reply` with a message already packed."""
        lane = self._lanes_in.get(identity)
        if lane is not None:
            if lane.send(data):
                self.lane_stats["sent"] += 1
            else:
                self.io.call_soon(lambda: self._lane_lost(lane, "a write on its control lane "
                                                               "failed"))
            return
        self.io.reply(identity, [data])

    def forget(self, endpoint: str) -> None:
        """Close the connection to `endpoint` (dropping queued messages) without a loss report."""
        self.io.call_soon(lambda: self._close_lane(self._lanes_out.get(endpoint)))
        self.io.forget(endpoint)

    def open_lane(self, endpoint: str, address: str, local: str = "") -> bool:
        """(listener thread) Connect a control lane to the peer at `endpoint`, which listens at
        `address` (TCP) and, on its host, under `local` (a Unix socket: tried first, so a peer
        on this host is reached through it); from now on messages to it go there. False
        (ZeroMQ stays) when it cannot be reached within the connect timeout."""
        old = self._lanes_out.get(endpoint)
        if old is not None and not old.closed:
            return True
        timeout = min(self._connect_timeout_s, 1.0)
        sock = None
        if local:
            try:
                sock = lanes.connect_local(local, timeout)
            except PermissionError as e:   # its listener runs as another user: TCP
                log.info("control lane to %s: not through its Unix socket (%s): over TCP",
                         endpoint, e)
            except OSError:
                pass   # not on this host (or not in this network namespace): TCP
        try:
            if sock is None:
                sock = lanes.connect(address, timeout)
        except OSError as e:
            log.info("no control lane to %s at %s (%s): ZeroMQ carries its messages", endpoint,
                     address, e)
            return False
        lane = lanes.Lane(sock, key=endpoint, send_timeout_s=self._connect_timeout_s)
        if not lane.send(pack({"t": "lane", "id": self.identity})):
            return False
        self._lanes_out[endpoint] = lane
        self.io.watch_fd(lane.fd, lambda: self._read(lane))
        return True

    def expect(self, seconds: float) -> None:
        """(any thread) A message is expected within about `seconds`: the listener busy-polls
        meanwhile instead of sleeping (`IoLoop.expect`)."""
        self.io.expect(seconds)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the listener thread (serialises it with message handlers)."""
        self.io.call_soon(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.io.close()
        for lane in [*self._lanes_out.values(), *self._lanes_in.values(), *self._accepted]:
            lane.close()
        self._lane_server.close()
        if self._local_server is not None:
            self._local_server.close()
        self._ctx.term()

    # ------------------------------------------------------------------ lanes (listener thread)
    def _accept(self, server) -> None:
        while True:
            try:
                sock, _addr = server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("accepting a control lane: %s", e)
                return
            if server is self._local_server:
                try:   # before its hello, which could name a real peer and replace its lane
                    lanes.check_local_peer(sock)
                except OSError as e:
                    self._refuse(sock, e)
                    continue
            lane = lanes.Lane(sock, send_timeout_s=self._connect_timeout_s)
            self._accepted.add(lane)
            self.io.watch_fd(lane.fd, lambda lane=lane: self._read(lane))

    def _refuse(self, sock, why: Exception) -> None:
        """Close a connection to the Unix lane socket from a process of another user. Logged at
        the 1st, 2nd, 4th, 8th... refusal, so that a local user's loop of connections cannot
        flood the log; every one is counted."""
        sock.close()
        self.lane_stats["refused"] += 1
        n = self.lane_stats["refused"]
        if n & (n - 1) == 0:
            log.warning("refused a control lane on the Unix socket: %s (%d refused so far)",
                        why, n)

    def _read(self, lane: lanes.Lane) -> None:
        try:
            frames = lane.read()
        except lanes.LaneClosed as e:
            self._lane_lost(lane, str(e))
            return
        for data in frames:
            if lane.key is None:   # the first frame names the peer that connected
                try:
                    hello = unpack(data)
                    ident = bytes(hello["id"])
                    if hello["t"] != "lane":
                        raise ValueError(f"expected 'lane', found {hello['t']!r}")
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("control lane without a valid hello: %s", e)
                    self.lane_stats["bad_hello"] += 1
                    self._close_lane(lane)
                    return
                self._accepted.discard(lane)
                lane.key = ident
                self._close_lane(self._lanes_in.get(ident))   # a reconnect replaces it
                self._lanes_in[ident] = lane
                continue
            self.lane_stats["received"] += 1
            if isinstance(lane.key, bytes):
                self._dispatch(("router", lane.key), data)
            else:
                self._dispatch(("dealer", lane.key), data)
            if lane.closed:
                return

    def _close_lane(self, lane: lanes.Lane | None) -> None:
        if lane is None:
            return
        self.io.unwatch_fd(lane.fd)
        lane.close()
        self._accepted.discard(lane)
        if self._lanes_out.get(lane.key) is lane:
            del self._lanes_out[lane.key]
        if self._lanes_in.get(lane.key) is lane:
            del self._lanes_in[lane.key]

    def _lane_lost(self, lane: lanes.Lane, reason: str) -> None:
        """A lane ended: on the connecting side its peer is lost (and its ZeroMQ connection is
        closed, so a later message starts afresh); on the listening side the peer's replies go
        back to ZeroMQ (its own side reports what happened to it)."""
        if self.io.on_loop_thread is False:
            self.io.call_soon(lambda: self._lane_lost(lane, reason))
            return
        known = self._lanes_out.get(lane.key) is lane
        self._close_lane(lane)
        if known:
            self.io.forget(lane.key)
            self._lost(lane.key, f"control lane: {reason}")

    # ------------------------------------------------------------------ listener thread
    def _from_router(self, frames: list) -> None:
        if len(frames) < 2:
            return
        self._dispatch(("router", frames[0].bytes), frames[1].bytes)

    def _from_dealer(self, endpoint: str, frames: list) -> None:
        self._dispatch(("dealer", endpoint), frames[0].bytes)

    def _lost(self, endpoint: str, reason: str, _unsent: list = ()) -> None:
        log.info("control connection to %s lost: %s", endpoint, reason)
        self._close_lane(self._lanes_out.get(endpoint))
        self._on_peer_lost(endpoint, reason)

    def _dispatch(self, source: tuple, data: bytes) -> None:
        if self._decode is not None:
            try:
                typed = self._decode(data)
            except Exception:
                pass
            else:
                self._on_decoded(source, typed)
                return
        try:
            msg = unpack(data)
        except Exception as e:
            log.warning("dropping malformed control message from %r: %s", source[1], e)
            return
        self._on_message(source, msg)
