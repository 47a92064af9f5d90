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
"""
from __future__ import annotations

import logging
from typing import Callable

import msgpack
import zmq

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
                 heartbeat_ivl_s: float = 1.0, heartbeat_timeout_s: float = 5.0):
        self.identity = identity.encode()
        self._on_message = on_message
        self._on_peer_lost = on_peer_lost
        hb = (max(1, int(heartbeat_ivl_s * 1000)), max(1, int(heartbeat_timeout_s * 1000)))
        self._ctx = zmq.Context(io_threads=1)
        router, self.endpoint = bind_router(self._ctx, host, port, advertise_host,
                                            heartbeat_ms=hb, max_msg_bytes=MAX_CONTROL_MSG)
        self.io = IoLoop(self._ctx, router, self.identity, name="transfer-messenger",
                         on_router=self._from_router, on_dealer=self._from_dealer,
                         on_lost=self._lost, heartbeat_ms=hb, connect_timeout_s=connect_timeout_s,
                         dealer_options={zmq.MAXMSGSIZE: MAX_CONTROL_MSG})
        self._closed = False

    # ------------------------------------------------------------------ API (any thread)
    def send(self, endpoint: str, msg: dict) -> None:
        self.io.send(endpoint, [pack(msg)], endpoint=endpoint)

    def reply(self, identity: bytes, msg: dict) -> None:
        self.io.reply(identity, [pack(msg)])

    def forget(self, endpoint: str) -> None:
        """Close the connection to `endpoint` (dropping queued messages) without a loss report."""
        self.io.forget(endpoint)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the listener thread (serialises it with message handlers)."""
        self.io.call_soon(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.io.close()
        self._ctx.term()

    # ------------------------------------------------------------------ listener thread
    def _from_router(self, frames: list) -> None:
        if len(frames) < 2:
            return
        self._dispatch(("router", frames[0].bytes), frames[1].bytes)

    def _from_dealer(self, endpoint: str, frames: list) -> None:
        self._dispatch(("dealer", endpoint), frames[0].bytes)

    def _lost(self, endpoint: str, reason: str, _unsent: list) -> None:
        log.info("control connection to %s lost: %s", endpoint, reason)
        self._on_peer_lost(endpoint, reason)

    def _dispatch(self, source: tuple, data: bytes) -> None:
        try:
            msg = unpack(data)
        except Exception as e:
            log.warning("dropping malformed control message from %r: %s", source[1], e)
            return
        self._on_message(source, msg)
