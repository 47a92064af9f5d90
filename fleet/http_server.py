"""The fleet's public HTTP/1.1 server: httptools (llhttp) parsing on asyncio protocols.

Why not aiohttp's server: on this project's 2-core box a route that reads a small JSON body and
answers a fixed one costs ~48 µs of CPU per request through aiohttp (request/response objects,
stream reader, URL parsing, writer) and ~13 µs through a bare httptools protocol — a fifth of the
whole round-robin proxy path (bench/results/history/fleet.md, "fleet CPU per request · lean HTTP server").
coordinator/http.py made the same move for the coordinator's API; this server also runs async
handlers (one task per request), streams answers, and keeps the fleet's error contract.

Semantics (invariants):
- keep-alive and pipelining: requests on a connection are served one at a time, in order (the next
  one's task starts when the previous answer is written); `Connection: close`, HTTP/1.0 without
  keep-alive, a response marked `force_close()`, or a body left unread close after the answer.
- The handler runs once the head is complete; the body arrives meanwhile (`FleetRequest.read`), so a
  route can answer 413/415 without reading it and bound the wait (`fleet.body_timeout_s`).
- Every error is an OpenAI error body (docs/design.md §4): 414 for a URL over `MAX_URL_BYTES`, 431
  for a header line over `MAX_FIELD_BYTES`, 400 for more than `MAX_HEADERS` headers or anything the
  parser rejects (a bad chunk after the head fails the route's body read instead: also 400), 408
  when a started head is not complete within `header_timeout_s`; each closes the connection.
- A client that hangs up cancels its request's task (at whatever await point it is), as aiohttp's
  `handler_cancellation` did: the flow's scopes end leases and legs on that cancellation.
- `Expect: 100-continue` gets its interim answer; an upgrade request is served as plain HTTP and
  the connection closed. Back-pressure: a full write buffer pauses reading and `FleetStream.write`.
- Idle keep-alive connections close after `keepalive_s`. `close()` stops accepting, closes idle
  connections, waits for the requests in flight (bounded), then cancels the rest.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from http1.conn import Connection, Server
from http1.wire import CONTINUE
from protocol.openai import ApiError

from .http_messages import BadBody, FleetRequest, Reply, reply_bytes

log = logging.getLogger("splitserve.fleet.http")

# The request line and one header line have separate limits so each failure names its own status.
MAX_URL_BYTES = 8192
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128
_MAX_QUEUED = 16          # pipelined requests parsed ahead of the one being served: reading pauses

class _Limit(Exception):
    def __init__(self, err: ApiError):
        super().__init__(err.message)
        self.err = err


class _Conn(Connection):
    """One client connection: parse, queue, serve one request at a time, write answers."""

    __slots__ = ("_url", "_hdrs", "_nhdr", "cur", "queue", "task", "serving", "_hdr_timer", "_paused_r",
                 "_upgrade", "_pending_error", "_in_head")

    def __init__(self, srv: "FleetHttpServer"):
        super().__init__(srv)
        self._url = b""
        self._hdrs: list = []
        self._nhdr = 0
        self.cur: FleetRequest | None = None     # the request being parsed (head done, body coming)
        self.queue: collections.deque[FleetRequest] = collections.deque()
        self.task: asyncio.Task | None = None
        self.serving: FleetRequest | None = None
        self._hdr_timer: asyncio.TimerHandle | None = None
        self._paused_r = False
        self._upgrade = False
        self._pending_error: ApiError | None = None
        self._in_head = False      # bytes of a request head arrived, the head is not complete

    def idle(self) -> bool:
        return self.task is None and self.cur is None

    def in_flight(self) -> bool:
        return self.task is not None

    def may_read(self) -> bool:
        return not self._paused_r

    # ---- asyncio.Protocol ------------------------------------------------------------------------
    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if self._hdr_timer is not None:
            self._hdr_timer.cancel()
            self._hdr_timer = None
        if self.cur is not None:
            self.cur._fail(ConnectionResetError("the client closed the connection"))
        self.queue.clear()
        if self.task is not None:
            self.task.cancel()       # the client hung up: its request ends here (scopes clean up)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.last = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade = True       # served as plain HTTP; nothing after it is read
            if self.transport is not None:
                self.transport.pause_reading()
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
            return
        if self.srv.header_timeout is not None and not self.closing:
            if self._in_head:
                if self._hdr_timer is None:
                    self._hdr_timer = self.loop.call_later(self.srv.header_timeout, self._header_timed_out)
            elif self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None

    # ---- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._hdrs = []
        self._nhdr = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            raise _Limit(ApiError(414, f"request line (method and URL) longer than {MAX_URL_BYTES} bytes",
                                  code="uri_too_long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._nhdr += 1
        if len(name) + len(value) + 2 > MAX_FIELD_BYTES:
            raise _Limit(ApiError(431, f"a request header line is longer than {MAX_FIELD_BYTES} bytes",
                                  code="request_header_fields_too_large"))
        if self._nhdr > MAX_HEADERS:
            raise _Limit(ApiError(400, f"malformed HTTP request: more than {MAX_HEADERS} headers",
                                  code="bad_http_request"))
        self._hdrs.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        p = self.parser
        self._in_head = False
        if self._hdr_timer is not None:
            self._hdr_timer.cancel()
            self._hdr_timer = None
        req = FleetRequest(self, p.get_method().decode("ascii", "replace"), self._url, p.get_http_version(),
                           CIMultiDictProxy(CIMultiDict(self._hdrs)), p.should_keep_alive(), p.should_upgrade())
        self._hdrs = []
        self._url = b""
        self.cur = req
        self._enqueue(req)

    def on_body(self, chunk: bytes) -> None:
        cur = self.cur
        if cur is not None:
            cur._feed(chunk, self.srv.max_body)

    def on_message_complete(self) -> None:
        cur = self.cur
        self.cur = None
        if cur is not None:
            cur._eof()

    # ---- requests ------------------------------------------------------------------------------
    def _enqueue(self, req: FleetRequest) -> None:
        if self.task is None:
            self._start(req)
            return
        self.queue.append(req)
        if len(self.queue) >= _MAX_QUEUED and not self._paused_r and self.transport is not None:
            self._paused_r = True
            self.transport.pause_reading()

    def _start(self, req: FleetRequest) -> None:
        if not req._done and req.version == "1.1" and self.transport is not None \
                and req.headers.get("Expect", "").lower() == "100-continue":
            # its turn has come and its body is still to be sent: ask for it
            self.transport.write(CONTINUE)
        self.serving = req
        self.task = self.loop.create_task(self._serve(req))

    async def _serve(self, req: FleetRequest) -> None:
        srv = self.srv
        try:
            try:
                resp = await srv.dispatch(req)
            except asyncio.CancelledError:
                raise
            except Exception:   # a bug costs one request, not the connection
                log.exception("internal error on %s %s", req.method, req.path)
                resp = ApiError(500, "internal error while handling the request", code="internal_error").response()
            keep = self._answer(req, resp)
        except asyncio.CancelledError:
            self.task = None
            return
        self.task = None
        self.serving = None
        self.last = time.monotonic()
        if not keep:
            self.close()
            return
        if self._pending_error is not None:
            self._send_error(self._pending_error)
            return
        if self._in_head and self._hdr_timer is None and srv.header_timeout is not None:
            self._hdr_timer = self.loop.call_later(srv.header_timeout, self._header_timed_out)
        if self.queue:
            nxt = self.queue.popleft()
            if self._paused_r and len(self.queue) < _MAX_QUEUED // 2 and self.transport is not None:
                self._paused_r = False
                if not self._paused_w:
                    self.transport.resume_reading()
            self._start(nxt)

    def _answer(self, req: FleetRequest, resp) -> bool:
        """Write `resp` unless it was streamed; whether the connection may stay open."""
        ok = (req.keep_alive and req.body_complete and not req.upgrade and not self._upgrade
              and not self.srv.stopping)
        if req.stream is not None:
            s = req.stream
            return ok and s.eof and s.keep_alive
        if self.transport is None:
            return False
        keep = ok and resp.keep_alive is not False
        if not keep:
            self.closing = True     # nothing more is read from this connection
        self.transport.write(reply_bytes(resp, keep, req.method == "HEAD"))
        return keep

    # ---- errors ----------------------------------------------------------------------------------
    def _parse_failed(self, exc: BaseException) -> None:
        cause = exc.__context__
        if isinstance(cause, _Limit):
            err = cause.err
        else:
            detail = " ".join(str(exc).split())[:200] or "malformed request"
            err = ApiError(400, f"malformed HTTP request: {detail}", code="bad_http_request")
        cur = self.cur
        self.cur = None
        if cur is not None and self.serving is cur and not cur._done:
            # the route is reading this body: its read fails, the route answers 400 and closes
            cur._fail(BadBody(err.message))
            self.closing = True
            return
        if self.task is not None:
            self._pending_error = err    # answered after the request being served
            self.closing = True
            if self.transport is not None:
                self.transport.pause_reading()
            return
        log.debug("rejected a malformed request: %s", err.message)
        self._send_error(err)

    def _send_error(self, err: ApiError) -> None:
        t = self.transport
        self.closing = True
        if t is None:
            return
        t.write(reply_bytes(Reply(err.status, err.body(), err.headers()), False))
        t.close()

    def _header_timed_out(self) -> None:
        self._hdr_timer = None
        if self.transport is None or not self._in_head or self.task is not None or self.closing:
            return
        self._send_error(ApiError(408, f"the request head (request line and headers) was not received "
                                       f"within {self.srv.header_timeout:g}s (fleet.header_timeout_s)",
                                  code="request_timeout"))


class FleetHttpServer(Server):
    """Serves `dispatch(request) -> response` on a listening socket with `_Conn` protocols."""

    def __init__(self, dispatch, *, max_body: int, keepalive_s: float, header_timeout_s: float | None):
        super().__init__(keepalive_s=keepalive_s)
        self.dispatch = dispatch
        self.max_body = max_body
        self.header_timeout = header_timeout_s

    def protocol(self) -> _Conn:
        return _Conn(self)

    def inflight(self) -> int:
        return sum(1 for c in self.conns if c.task is not None)

    async def _abandon(self) -> None:
        # the requests still running past the shutdown's bound are cancelled (their scopes clean up)
        tasks = [c.task for c in self.conns if c.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
