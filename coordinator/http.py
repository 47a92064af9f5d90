"""A lean HTTP/1.1 server for the coordinator API on the shared core of http1/ (httptools parsing).

Why not aiohttp here: every endpoint is a synchronous state operation (`coordinator.api.Api`),
so a request needs no task, no stream reader and no response object — only parse, call, write.
Measured on this project's 2-core box, a `/finish` costs ~50 µs of coordinator CPU through
aiohttp's low-level server and ~11-17 µs through this protocol (bench/coordinator/coordinator.py, "HTTP floor").
aiohttp remains available (`CoordinatorServer(http="aiohttp")`, `api.make_app`).

Semantics (invariants):
- HTTP/1.1 keep-alive and pipelining: answers are written in request order, since each is
  computed synchronously when its request completes; `Connection: close` and HTTP/1.0 without
  keep-alive close after the answer. Chunked request bodies are decoded by the parser.
- A body over `max_body` is answered 413 and the connection closed; a malformed request 400 and
  closed; `Expect: 100-continue` gets its interim answer; an `Upgrade` request is answered as
  plain HTTP and the connection closed — except `GET /channel` with the fleet channel's token
  (`protocol.channel`), which gets `101` and continues as that channel's protocol.
- Back-pressure: when the transport's write buffer is full, reading pauses until it drains.
- Idle keep-alive connections are closed after `keepalive_s`; `close()` stops accepting, closes
  idle connections at once and the rest when their current request is answered (bounded).
"""
from __future__ import annotations

import logging
import time

import httptools
import orjson

from coordinator.api import Api, Reply
from http1.conn import Connection, Server
from http1.wire import CLOCK, CONTINUE, status_line
from protocol.channel import PATH as CHANNEL_PATH
from protocol.channel import PROTOCOL, UPGRADE_ANSWER

CHANNEL_TOKEN = PROTOCOL.encode()

log = logging.getLogger("splitserve.coordinator.http")


class _Conn(Connection):
    """One connection: each request is answered synchronously when its body is complete, so
    pipelined answers are written in request order without a task."""

    __slots__ = ("api", "url", "ctype", "accept", "expect", "body", "size", "busy", "upgrade", "handoff")

    def __init__(self, srv: "HttpServer"):
        super().__init__(srv)
        self.api = srv.api
        self.url = b""
        self.ctype = None
        self.accept = None
        self.expect = False
        self.body: list[bytes] = []
        self.size = 0
        self.busy = False        # a request is partially received
        self.upgrade = None
        self.handoff = None      # the channel protocol this connection was upgraded to

    def idle(self) -> bool:
        return not self.busy

    def in_flight(self) -> bool:
        return self.busy

    # ---- asyncio.Protocol ---------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # Either answered with the upgrade ignored (and closed), or switched to the channel:
            # the bytes after the upgrade request are already the channel's.
            h = self.handoff
            if h is not None:
                rest = data[exc.args[0]:] if exc.args and isinstance(exc.args[0], int) else b""
                if rest:
                    h.data_received(rest)
        except httptools.HttpParserError as exc:
            # a callback's exception arrives wrapped, with the original as its context
            if isinstance(exc.__context__, _TooLarge):
                self._fail(413, f"request body over {self.srv.max_body} bytes")
            else:
                self._fail(400, f"malformed HTTP request: {exc}")

    # ---- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.busy = True
        self.url = b""
        self.ctype = None
        self.accept = None
        self.expect = False
        self.body = []
        self.size = 0
        self.upgrade = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-type":
            self.ctype = value.decode("latin-1")
        elif n == b"accept":
            self.accept = value.decode("latin-1")
        elif n == b"upgrade":
            self.upgrade = value
        elif n == b"expect" and value.lower() == b"100-continue":
            self.expect = True
        elif n == b"content-length":
            try:
                if int(value) > self.srv.max_body:
                    raise _TooLarge
            except ValueError:
                pass  # the parser rejects a malformed length itself

    def on_headers_complete(self) -> None:
        if self.expect and self.transport is not None:
            self.transport.write(CONTINUE)

    def on_body(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.srv.max_body:
            raise _TooLarge
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        self.busy = False
        t = self.transport
        if t is None:
            return
        method = self.parser.get_method().decode("ascii", "replace")
        raw = self.url
        q = raw.find(b"?")
        path = (raw if q < 0 else raw[:q]).decode("latin-1")
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        if self.upgrade is not None and path == CHANNEL_PATH and self.srv.channel is not None \
                and method == "GET" and self.upgrade.strip().lower() == CHANNEL_TOKEN \
                and not self.srv.stopping:
            self._switch(t)
            return
        try:
            reply = self.api.handle(method, path, self.ctype, self.accept, body)
        except Exception:  # a bug must cost one request, not the connection or the loop
            log.exception("coordinator API failed on %s %s", method, path)
            reply = Reply(500, "application/json", b'{"error":"internal error in the coordinator"}')
        # An Upgrade request is answered as plain HTTP (the header ignored, as RFC 9110 allows);
        # the parser stops after it, so the connection closes.
        keep = (self.parser.should_keep_alive() and not self.srv.stopping
                and not self.parser.should_upgrade())
        self._write(reply, keep, head=method == "HEAD")
        if not keep:
            self.closing = True
            t.close()

    def _switch(self, t) -> None:
        """Answer 101 and hand the transport to a channel protocol (coordinator.channel)."""
        t.write(UPGRADE_ANSWER)
        proto = self.srv.channel.protocol()
        self.handoff = proto
        self.srv.conns.discard(self)
        t.set_protocol(proto)
        proto.connection_made(t)
        self.transport = None

    # ---- answers --------------------------------------------------------------------------------
    def _write(self, r: Reply, keep: bool, head: bool = False) -> None:
        srv = self.srv
        key = (r.status, r.content_type)
        prefix = srv.prefixes.get(key)
        if prefix is None:
            prefix = srv.prefixes[key] = (status_line(r.status) + b"Content-Type: " +
                                          r.content_type.encode("latin-1") + b"\r\nContent-Length: ")
        head_ = prefix + str(len(r.body)).encode() + b"\r\n" + CLOCK.get()
        for k, v in r.headers:
            head_ += k.encode("latin-1") + b": " + v.encode("latin-1") + b"\r\n"
        if not keep:
            head_ += b"Connection: close\r\n"
        self.transport.write(head_ + b"\r\n" if head else head_ + b"\r\n" + r.body)

    def _fail(self, status: int, message: str) -> None:
        if self.transport is None or self.closing:
            return
        self._write(Reply(status, "application/json", orjson.dumps({"error": message})), keep=False)
        self.closing = True
        self.transport.close()


class _TooLarge(Exception):
    pass


class HttpServer(Server):
    """Serves an `Api` on listening sockets (TCP and/or Unix) with `_Conn` protocols."""

    def __init__(self, api: Api, *, max_body: int = 32 * 1024 * 1024, keepalive_s: float = 75.0,
                 channel=None):
        super().__init__(keepalive_s=keepalive_s)
        self.api = api
        self.channel = channel      # a coordinator.channel.ChannelServer, or None (not offered)
        self.max_body = max_body
        self.prefixes: dict[tuple[int, str], bytes] = {}   # status line + content type, rendered once

    def protocol(self) -> _Conn:
        return _Conn(self)

    async def _stopping(self) -> None:
        if self.channel is not None:
            # Every channel batch is answered within the data_received that read it, so nothing is
            # half-done: the fleet fails its pending calls over and re-sends unacknowledged finishes.
            self.channel.close()
