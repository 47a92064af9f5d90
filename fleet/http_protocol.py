"""The fleet's HTTP connection handling below the routes: parse errors and header read timeouts.

aiohttp answers requests its parser rejects (bad chunked encoding, duplicate Content-Length, an
oversized URL or header) itself, with a plain-text 400, before any route runs. The public API
answers every error with an OpenAI error body (docs/design.md §4), so `FleetRunner` serves connections
with `FleetRequestHandler`, whose `handle_error` renders `ApiError`s: 414 for a request line over
`MAX_URL_BYTES`, 431 for a header line over `MAX_FIELD_BYTES`, 400 for the rest.

Header read timeout: a connection whose next request's head has started but is not complete within
`header_timeout_s` gets a 408 (OpenAI body) and is closed. (aiohttp's own keep-alive timer only
closes idle connections, silently, and only at `server_keep_alive_timeout`.) The body read timeout
is the route's (`fleet/server.py`): the request head is parsed by then.
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from protocol.openai import ApiError

log = logging.getLogger("splitserve.fleet.http")

# The two limits differ so that a `LineTooLong` says which one was hit (its `args[1]`): the request
# line (→ 414) or one header line (→ 431).
MAX_URL_BYTES = 8192
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128


def parse_error(exc: BaseException | None, status: int, message: str | None) -> ApiError:
    """The OpenAI error for a request aiohttp could not parse (or failed on outside a route)."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == MAX_URL_BYTES:
            return ApiError(414, f"request line (method and URL) longer than {MAX_URL_BYTES} bytes",
                            code="uri_too_long")
        return ApiError(431, f"a request header line is longer than {MAX_FIELD_BYTES} bytes",
                        code="request_header_fields_too_large")
    if isinstance(exc, (BadHttpMessage, HttpProcessingError)) or 400 <= status < 500:
        detail = getattr(exc, "message", None) or message or "malformed request"
        detail = " ".join(str(detail).split())[:200]
        return ApiError(400, f"malformed HTTP request: {detail}", code="bad_http_request")
    return ApiError(500, "internal error while handling the request", code="internal_error")


class FleetRequestHandler(RequestHandler):
    """aiohttp's connection handler, with OpenAI error bodies and a header read timeout."""

    __slots__ = ("_hdr_timeout", "_hdr_timer")

    def __init__(self, manager, *, header_timeout_s: float | None = None, **kwargs):
        super().__init__(manager, **kwargs)
        self._hdr_timeout = header_timeout_s
        self._hdr_timer: asyncio.TimerHandle | None = None

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started, cannot send the error")
        err = parse_error(exc, status, message)
        if err.status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            log.debug("rejected a malformed request from %s: %s", request.remote, err.message)
        resp = err.response()
        resp.force_close()
        return resp

    async def finish_response(self, request, resp, start_time):
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # raised by aiohttp itself (e.g. its router for a request no route can take): plain text
            err = ApiError(resp.status, f"{resp.reason}: {request.method} {request.path[:200]}",
                           code="http_" + str(resp.status))
            resp = err.response()
        return await super().finish_response(request, resp, start_time)

    # ---- header read timeout
    def data_received(self, data: bytes) -> None:
        n = len(self._messages)
        super().data_received(data)
        cur = self._current_request
        if cur is not None and len(self._messages) > n:
            # A parse error in the body of the request being served (e.g. bad chunked encoding after
            # the head) is queued as the next "message" while the route still waits for the body;
            # hand it to the body reader instead, which answers 400.
            err = getattr(self._messages[-1][0], "exc", None)
            if isinstance(err, HttpProcessingError) and not cur.content.is_eof():
                cur.content.set_exception(err)
        if self._hdr_timeout is None:
            return
        if self._head_pending():
            if self._hdr_timer is None:
                self._hdr_timer = self._loop.call_later(self._hdr_timeout, self._header_timed_out)
        elif self._hdr_timer is not None:
            self._hdr_timer.cancel()
            self._hdr_timer = None

    def _head_pending(self) -> bool:
        """Bytes of a request head arrived and the head is not complete: no request is being served
        or queued, and the connection waits for its next (or, before its first, any) message."""
        if self._messages or self._current_request is not None:
            return False
        return (self._waiter is not None and not self._waiter.done()) or self._request_count == 0

    def _process_keepalive(self) -> None:
        if self._hdr_timer is not None:
            # A head is on its way: the header timeout answers it with a 408 instead of a silent close.
            self._keepalive_handle = None
            return
        super()._process_keepalive()

    def _header_timed_out(self) -> None:
        self._hdr_timer = None
        tr = self.transport
        if tr is None or not self._head_pending():
            return
        err = ApiError(408, f"the request head (request line and headers) was not received within "
                            f"{self._hdr_timeout:g}s (fleet.header_timeout_s)", code="request_timeout")
        body = err.body()
        tr.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (len(body), body))
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._hdr_timer is not None:
            self._hdr_timer.cancel()
            self._hdr_timer = None
        super().connection_lost(exc)


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return FleetRequestHandler(self, loop=self._loop, **self._kwargs)


class FleetRunner(web.AppRunner):
    """An `AppRunner` whose connections are served by `FleetRequestHandler`."""

    def __init__(self, app: web.Application, *, header_timeout_s: float | None, **kwargs):
        kwargs.setdefault("max_line_size", MAX_URL_BYTES)
        kwargs.setdefault("max_field_size", MAX_FIELD_BYTES)
        kwargs.setdefault("max_headers", MAX_HEADERS)
        super().__init__(app, header_timeout_s=header_timeout_s, **kwargs)

    async def _make_server(self) -> Server:
        srv = await super()._make_server()
        return _Server(srv.request_handler, request_factory=srv.request_factory,
                       handler_cancellation=srv.handler_cancellation, loop=srv._loop, **srv._kwargs)
