"""The messages of the fleet's HTTP server (fleet/http_server.py): a parsed request with its body as
it arrives, a streamed answer, a complete answer and its bytes.

`FleetRequest` and `FleetStream` carry the names the routes used on aiohttp's request and
`StreamResponse` (`headers`, `content_type`, `read()`, `prepare`, `write`, `write_eof`); `Reply` is
the cheap complete answer of the hot routes, and `reply_bytes` also renders the aiohttp
`web.Response`s the other routes and `ApiError.response()` build.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from urllib.parse import unquote

from http1.wire import CLOCK, LAST_CHUNK, answer_bytes, status_line
from http1.wire import chunk as chunk_frame

if TYPE_CHECKING:
    from .http_server import _Conn


class BodyTooLarge(Exception):
    """The request body passed the server's `max_body`."""


class BadBody(Exception):
    """The request body's framing is broken (e.g. a bad chunk size after the head)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _mimetype(ctype: str) -> str:
    return ctype.partition(";")[0].strip().lower()


class FleetRequest:
    """One request: the parsed head, and its body as it arrives."""

    __slots__ = ("method", "path", "raw_path", "version", "headers", "keep_alive", "conn", "_body",
                 "_size", "_done", "_error", "_waiter", "stream", "upgrade")

    def __init__(self, conn: "_Conn", method: str, raw_path: bytes, version: str, headers, keep_alive: bool,
                 upgrade: bool):
        self.conn = conn
        self.method = method
        self.raw_path = raw_path
        target = raw_path
        if target[:1] != b"/" and (target.startswith(b"http://") or target.startswith(b"https://")):
            # absolute form (RFC 9112 §3.2.2): the path starts after the authority
            slash = target.find(b"/", target.find(b"//") + 2)
            target = target[slash:] if slash >= 0 else b"/"
        q = target.find(b"?")
        # not UTF-8: no route matches it anyway, and the 404 naming it must stay valid JSON
        p = (target if q < 0 else target[:q]).decode("utf-8", "replace")
        self.path = unquote(p, errors="replace") if "%" in p else p
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive
        self.upgrade = upgrade
        self._body: list[bytes] = []
        self._size = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self.stream: "FleetStream | None" = None     # the streamed answer, once prepared

    # ---- what the routes read (the names aiohttp's request had)
    @property
    def transport(self):
        return self.conn.transport

    @property
    def remote(self) -> str | None:
        t = self.conn.transport
        peer = t.get_extra_info("peername") if t is not None else None
        return peer[0] if isinstance(peer, tuple) else None

    @property
    def content_type(self) -> str:
        ct = self.headers.get("Content-Type")
        return "application/octet-stream" if ct is None else _mimetype(ct)

    @property
    def content_length(self) -> int | None:
        v = self.headers.get("Content-Length")
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    @property
    def body_complete(self) -> bool:
        return self._done and self._error is None

    def body_now(self) -> bytes:
        """The whole body when it has arrived already (`body_complete`)."""
        b = self._body
        return b[0] if len(b) == 1 else b"".join(b)

    async def read(self) -> bytes:
        """The whole body; BodyTooLarge / BadBody for what the client got wrong."""
        while not self._done:
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        return self.body_now()

    # ---- fed by the connection
    def _feed(self, chunk: bytes, limit: int) -> None:
        if self._done:
            return
        self._size += len(chunk)
        if self._size > limit:
            self._fail(BodyTooLarge())
            return
        self._body.append(chunk)

    def _eof(self) -> None:
        if not self._done:
            self._done = True
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._done:
            self._done = True
            self._error = exc
            self._body.clear()
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class FleetStream:
    """A streamed answer (SSE): head with chunked framing, then `write`s, then `write_eof` — the
    calls aiohttp's `StreamResponse` had. A write to a connection that is gone raises
    ConnectionResetError."""

    __slots__ = ("status", "headers", "prepared", "eof", "_conn", "_chunked", "_keep")

    def __init__(self, status: int = 200, headers: dict | None = None):
        self.status = status
        self.headers = dict(headers or {})
        self.prepared = False
        self.eof = False
        self._conn: _Conn | None = None
        self._chunked = True
        self._keep = True

    def force_close(self) -> None:
        self._keep = False

    @property
    def keep_alive(self) -> bool:
        return self._keep

    async def prepare(self, request: FleetRequest) -> "FleetStream":
        if self.prepared:
            return self
        conn = request.conn
        self._conn = conn
        request.stream = self
        self._chunked = request.version == "1.1"
        if not self._chunked:
            self._keep = False       # HTTP/1.0: the body ends when the connection closes
        head = [status_line(self.status), CLOCK.get()]
        for k, v in self.headers.items():
            head.append(b"%s: %s\r\n" % (k.encode("latin-1"), str(v).encode("latin-1")))
        head.append(b"Transfer-Encoding: chunked\r\n" if self._chunked else b"Connection: close\r\n")
        head.append(b"\r\n")
        self.prepared = True
        conn.write(b"".join(head))
        await conn.drain()
        return self

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        if conn is None:
            raise RuntimeError("write before prepare")
        conn.write(chunk_frame(data) if self._chunked else data)
        await conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.eof:
            return
        if data:
            await self.write(data)
        self.eof = True
        if self._chunked:
            self._conn.write(LAST_CHUNK)
            await self._conn.drain()


class Reply:
    """A complete answer: status, headers, body (the hot routes' cheaper stand-in for aiohttp's
    `web.Response`, which the other routes and `ApiError.response()` still build)."""

    __slots__ = ("status", "body", "headers", "keep_alive")
    prepared = False

    def __init__(self, status: int, body: bytes, headers: dict[str, str]):
        self.status = status
        self.body = body
        self.headers = headers
        self.keep_alive: bool | None = None

    def force_close(self) -> None:
        self.keep_alive = False


def reply_bytes(resp, keep: bool, head_only: bool = False) -> bytes:
    """The bytes of a complete answer: a `Reply` or an aiohttp `web.Response` as the routes build
    it (status, headers, bytes body); `Connection: close` unless `keep`."""
    body = resp.body
    return answer_bytes(resp.status, resp.headers.items(), b"" if body is None else body, keep, head_only,
                        getattr(resp, "reason", None))
