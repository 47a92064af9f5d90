"""HTTP/1.1 client from the fleet to the workers: keep-alive pools on asyncio protocols + httptools.

Why not aiohttp's ClientSession: it costs several hundred µs of CPU per request on these
machines, more than the whole routing budget of the fleet (see bench/RESULTS.md, "fleet"). This
client does only what the fleet needs — POST a JSON body, read a JSON answer or relay a stream of
body chunks as they arrive — and it tells the caller precisely *how* a request failed, which the
retry rules of the flow depend on:

- `UpstreamConnectError`: the request never reached a live server (connect refused / timed out, or a
  fresh connection closed before a single response byte). Safe to retry on another server.
- `UpstreamDisconnected`: the connection broke after the request was sent (the server may have
  started work) — not retried by the flow.
- `UpstreamTimeout`, `UpstreamProtocolError`.

Nothing is resent transparently once written (a POST may have started work): the keep-alive race of a
pooled connection closed by the server while idle is kept out of reach by `idle_timeout`, which stays
below the workers' keep-alive, and by dropping connections the server closed while they sat idle.

Invariants: a connection is in the idle pool only when no response is in flight on it and its last
message completed with keep-alive; `Response.release()` / `.abort()` is idempotent and every
`Response` ends in exactly one of them (the flow's `finally` blocks guarantee it).
"""
from __future__ import annotations

import asyncio
import collections
import ssl as _ssl
import time
from urllib.parse import urlsplit

import httptools

from protocol.failures import BadAnswer, ConnectRefused, Failure, PeerLost, Timeout

_HIGH_WATER = 1 << 20   # pause reading the upstream socket when this much body is buffered
_LOW_WATER = 1 << 18


class UpstreamError(Failure):
    """Base of upstream failures. `server` is the origin (`http://host:port`); `cause` the typed
    cause (`protocol.failures`, from the subclass), which the flow's retry rules read."""

    def __init__(self, server: str, message: str):
        super().__init__(server, message)
        self.server = server


class UpstreamConnectError(UpstreamError, ConnectRefused):
    """Never reached a live server: safe to retry elsewhere."""


class UpstreamDisconnected(UpstreamError, PeerLost):
    """The connection broke after the request was sent."""


class UpstreamTimeout(UpstreamError, Timeout):
    pass


class UpstreamProtocolError(UpstreamError, BadAnswer):
    pass


class _Origin:
    __slots__ = ("url", "host", "port", "ssl", "host_header", "idle", "uds")

    def __init__(self, url: str):
        self.url = url
        self.idle: collections.deque[_Conn] = collections.deque()
        if url.startswith("unix:"):
            # unix:///path/to.sock (or unix:/path): HTTP over a Unix socket.
            self.uds = "/" + url[len("unix:"):].lstrip("/")
            self.host, self.port, self.ssl = "localhost", 0, False
            self.host_header = b"localhost"
            return
        self.uds = None
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"upstream URL must be http(s)://host[:port] or unix:///path, got {url!r}")
        self.host = u.hostname
        self.ssl = u.scheme == "https"
        self.port = u.port or (443 if self.ssl else 80)
        self.host_header = f"{u.hostname}:{self.port}".encode()


class Response:
    """One upstream response. Body bytes arrive through `read()` or `iter_chunks()`."""

    __slots__ = ("_conn", "status", "_raw_headers", "_headers", "_chunks", "_buffered", "_done", "_error",
                 "_waiter", "_finished", "_paused", "got_bytes")

    def __init__(self, conn: "_Conn"):
        self._conn = conn
        self.status = 0
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: dict[str, str] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._finished = False
        self._paused = False
        self.got_bytes = False

    # -- called by the protocol
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _eof(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._done:
            self._error = exc
            self._done = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- consumer side
    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names to values (the last of repeated ones), decoded on first use: a JSON
        leg's are never read (~1.5 µs of decoding per leg saved)."""
        h = self._headers
        if h is None:
            h = self._headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._raw_headers}
        return h

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def iter_chunks(self):
        """Yield body chunks as they arrive; raises UpstreamError if the connection breaks mid-body."""
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._paused and self._buffered < _LOW_WATER and self._conn.transport is not None:
                    self._paused = False
                    self._conn.transport.resume_reading()
                yield data
                continue
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    async def read(self) -> bytes:
        while not self._done:
            await self._wait()
        if self._error is not None:
            raise self._error
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    def release(self) -> None:
        """Give the connection back to the pool if the whole message was read, else close it."""
        if self._finished:
            return
        self._finished = True
        self._conn._response_done(self, reusable=self._done and self._error is None and not self._chunks)

    def abort(self) -> None:
        """Close the upstream connection now: the worker sees the disconnect and stops the request."""
        if self._finished:
            return
        self._finished = True
        self._conn._response_done(self, reusable=False)


class _Deadlines:
    """The requests in flight with one timeout value, in deadline order (that of their start): one
    timer for all of them, at the earliest deadline, instead of a `call_later` and a `cancel` per
    request (~2.3 µs, twice per two-leg request; bench/RESULTS.md, issue 13). A request that ends
    leaves the table (a dict: O(1) wherever it is)."""

    __slots__ = ("loop", "timeout", "conns", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float):
        self.loop = loop
        self.timeout = timeout
        self.conns: dict[_Conn, float] = {}
        self.timer: asyncio.TimerHandle | None = None

    def add(self, conn: "_Conn") -> None:
        dl = self.loop.time() + self.timeout
        conns = self.conns
        conns.pop(conn, None)      # re-added: goes to the end, where its deadline belongs
        conns[conn] = dl
        conn._dl = self
        if self.timer is None:
            self.timer = self.loop.call_at(dl, self._fire)

    def _fire(self) -> None:
        self.timer = None
        conns = self.conns
        now = self.loop.time()
        while conns:
            conn = next(iter(conns))
            dl = conns[conn]
            if dl > now:
                self.timer = self.loop.call_at(dl, self._fire)
                return
            del conns[conn]
            conn._dl = None
            conn._on_timeout(self.timeout)


class _Conn(asyncio.Protocol):
    __slots__ = ("origin", "pool", "transport", "parser", "response", "_hdr_future", "_hname", "_keep_alive",
                 "last_used", "reused", "_closed", "_msg_started", "_dl")

    def __init__(self, origin: _Origin, pool: "UpstreamPool"):
        self.origin = origin
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self._hdr_future: asyncio.Future | None = None
        self._hname = b""
        self._keep_alive = True
        self.last_used = 0.0
        self.reused = False
        self._closed = False
        self._msg_started = False
        self._dl: _Deadlines | None = None       # the pool's timeout table this request is in

    # -- asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            # Bytes on an idle connection are a protocol violation; drop the connection.
            self._close()
            return
        self.response.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._error(UpstreamProtocolError(self.origin.url, "unexpected protocol upgrade"))
        except httptools.HttpParserError as e:
            self._error(UpstreamProtocolError(self.origin.url, f"malformed HTTP response: {e}"))

    def connection_lost(self, exc):
        self._closed = True
        self.transport = None
        r = self.response
        if r is not None:
            if r.status and "content-length" not in r.headers and "transfer-encoding" not in r.headers:
                r._eof()   # a close-delimited body (HTTP/1.0 style) ends at EOF
            elif not r.got_bytes:
                # The request was written: the server may have started work, so this is not retryable,
                # even on a reused connection (the idle timeout keeps the keep-alive race out of reach).
                self._error(UpstreamDisconnected(
                    self.origin.url, f"connection closed before any response byte ({exc or 'EOF'})"))
            else:
                self._error(UpstreamDisconnected(self.origin.url, f"connection lost mid-response ({exc or 'EOF'})"))
        self.pool._forget(self)

    # -- httptools callbacks
    def on_message_begin(self):
        self._msg_started = True

    def on_header(self, name: bytes, value: bytes):
        r = self.response
        if r is not None:
            r._raw_headers.append((name, value))

    def on_headers_complete(self):
        r = self.response
        if r is None:
            return
        r.status = self.parser.get_status_code()
        self._keep_alive = self.parser.should_keep_alive()
        f = self._hdr_future
        if f is not None and not f.done():
            f.set_result(None)

    def on_body(self, body: bytes):
        r = self.response
        if r is not None:
            r._feed(body)

    def on_message_complete(self):
        r = self.response
        if r is not None:
            r._eof()

    # -- internals
    def _error(self, exc: BaseException) -> None:
        f = self._hdr_future
        if f is not None and not f.done():
            f.set_exception(exc)
        if self.response is not None:
            self.response._fail(exc)
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self._closed:
            self._closed = True
            self.transport.abort()

    def _on_timeout(self, seconds: float) -> None:
        if self.response is not None:
            self._error(UpstreamTimeout(self.origin.url, f"no complete answer within {seconds:g}s"))

    def _response_done(self, r: Response, reusable: bool) -> None:
        if self.response is not r:
            return
        dl = self._dl
        if dl is not None:
            self._dl = None
            dl.conns.pop(self, None)
        self.response = None
        self._hdr_future = None
        if reusable and self._keep_alive and not self._closed and self.transport is not None \
                and not self.transport.is_closing():
            self.last_used = time.monotonic()
            self.reused = True
            self.parser = httptools.HttpResponseParser(self)
            self.pool._put_idle(self)
        else:
            self._close()


class UpstreamPool:
    """Keep-alive connection pools per upstream origin (no global cap: the clients bound concurrency).

    `idle_timeout` stays below the workers' keep-alive so a pooled connection is dropped by us before
    the server closes it.
    """

    def __init__(self, connect_timeout: float = 3.0, idle_timeout: float = 15.0, max_idle_per_origin: int = 256):
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle_per_origin
        self._origins: dict[str, _Origin] = {}
        self._all: set[_Conn] = set()
        self._ssl_ctx: _ssl.SSLContext | None = None
        self._deadlines: dict[float, _Deadlines] = {}

    def _origin(self, url: str) -> _Origin:
        o = self._origins.get(url)
        if o is None:
            o = _Origin(url)
            self._origins[url] = o
        return o

    def _put_idle(self, c: _Conn) -> None:
        idle = c.origin.idle
        if len(idle) >= self.max_idle:
            c._close()
            return
        idle.append(c)

    def _forget(self, c: _Conn) -> None:
        self._all.discard(c)
        try:
            c.origin.idle.remove(c)
        except ValueError:
            pass

    async def _connect(self, o: _Origin) -> _Conn:
        loop = asyncio.get_running_loop()
        ssl_ctx = None
        if o.ssl:
            if self._ssl_ctx is None:
                self._ssl_ctx = _ssl.create_default_context()
            ssl_ctx = self._ssl_ctx
        try:
            async with asyncio.timeout(self.connect_timeout):
                if o.uds is not None:
                    _, conn = await loop.create_unix_connection(lambda: _Conn(o, self), o.uds)
                else:
                    _, conn = await loop.create_connection(lambda: _Conn(o, self), o.host, o.port, ssl=ssl_ctx)
        except TimeoutError:
            raise UpstreamConnectError(o.url, f"connect timed out after {self.connect_timeout}s") from None
        except OSError as e:
            raise UpstreamConnectError(o.url, f"connect failed: {e.strerror or e}") from None
        self._all.add(conn)
        return conn

    def _checkout(self, o: _Origin) -> _Conn | None:
        idle = o.idle
        now = time.monotonic()
        while idle:
            c = idle.pop()   # LIFO: the warmest connection, the cold tail ages out
            if c._closed or c.transport is None or c.transport.is_closing():
                continue
            if now - c.last_used > self.idle_timeout:
                c._close()
                continue
            return c
        return None

    async def request(self, url: str, path: str, body: bytes, headers: bytes = b"",
                      method: bytes = b"POST", timeout: float | None = None,
                      content_type: bytes = b"application/json") -> Response:
        """Send one request; return once the response *headers* arrived.

        `headers` are extra pre-encoded header lines, each ending in CRLF. `timeout` bounds the whole
        exchange (headers and body, or the whole stream): past it the connection is closed and the
        pending read raises `UpstreamTimeout` (`_Deadlines`: one timer per timeout value, not per
        request).
        """
        o = self._origin(url)
        conn = self._checkout(o)
        if conn is None:
            conn = await self._connect(o)
        r = Response(conn)
        conn.response = r
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        conn._hdr_future = fut
        if timeout is not None:
            dls = self._deadlines.get(timeout)
            if dls is None or dls.loop is not loop:
                dls = self._deadlines[timeout] = _Deadlines(loop, timeout)
            dls.add(conn)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            method, path.encode(), o.host_header, content_type, len(body), headers)
        if len(body) < 65536:
            conn.transport.write(head + body)
        else:
            conn.transport.writelines((head, body))
        try:
            await fut
        except BaseException:
            r.abort()
            raise
        return r

    async def close(self) -> None:
        for c in list(self._all):
            c._close()
        self._all.clear()
        for o in self._origins.values():
            o.idle.clear()

    def num_connections(self) -> int:
        return len(self._all)
