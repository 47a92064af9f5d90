"""OpenAI-shaped errors of the public API (docs/design.md §4).

Every error the fleet returns to a client is an `ApiError`, rendered as
`{"error": {"message", "type", "param", "code"}}` with the matching status. Messages say what was
expected and what was found, so a client can fix its request without reading our logs.
"""
from __future__ import annotations

import orjson
from aiohttp import web

# status -> OpenAI error `type`
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answer of the public API. `param` names the offending body field when there is one."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after: float | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "api_error")
        self.retry_after = retry_after
        self.close = close      # the connection cannot be reused (e.g. part of the body is unread)

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}})

    def response(self, extra_headers: dict | None = None) -> web.Response:
        headers = {"Content-Type": "application/json"}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(round(self.retry_after))))
        if extra_headers:
            headers.update(extra_headers)
        resp = web.Response(status=self.status, body=self.body(), headers=headers)
        if self.close:
            resp.force_close()
        return resp

    def sse_event(self) -> bytes:
        """The error as one SSE event, for failures after a stream's headers were sent."""
        return b"data: " + self.body() + b"\n\n"

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)
