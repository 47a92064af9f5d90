"""OpenAI error bodies and request-field validation: the one copy the fleet and the worker share.

Every error either side returns to a client is an `ApiError`, rendered as
`{"error": {"message", "type", "param", "code"}}` with the matching status (docs/design.md §4).
A 4xx names the offending field in `param`, and its message says what was expected and what was
found, in one wording: value types are JSON's names (`string`, `integer`, `array`, …), so the same
bad request gets byte-identical answers from the fleet and from a worker
(tests/fleet/test_openai_parity.py checks it against both, running).

The field checkers take the request body (a dict) and a field name, and return the value (or the
default when the field is absent or null); they raise `InvalidRequest` (400) otherwise. What each
side then does with a valid request (the fleet forwards it, the worker builds sampling parameters)
is its own.
"""
from __future__ import annotations

import math
from typing import Any

import orjson

__all__ = ["ApiError", "InvalidRequest", "ERROR_TYPES", "bad_request", "error_body", "tname",
           "is_int", "is_num", "int_field", "num_field", "bool_field", "str_field", "token_ids",
           "stop_field", "stream_fields", "n_field", "messages_field", "model_field",
           "TOKEN_ID_LIMIT", "MAX_STOP", "MESSAGE_ROLES", "SEED_MIN", "SEED_MAX"]

# status -> OpenAI error `type`
ERROR_TYPES = {
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
    501: "not_implemented",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}

TOKEN_ID_LIMIT = 1 << 32     # token ids are hashed as uint32 (router/block_keys.py TOKEN_ID_LIMIT)
MAX_STOP = 16
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None, request_id: str | None = None) -> bytes:
    err = {"message": message, "type": type_ or ERROR_TYPES.get(status, "api_error"), "param": param,
           "code": code}
    if request_id is not None:
        err["request_id"] = request_id   # what the answer's X-Request-Id says: quote it in a report
    return orjson.dumps({"error": err})


class ApiError(Exception):
    """An error answer of an OpenAI-compatible API. `param` names the offending body field."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after: float | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ERROR_TYPES.get(status, "api_error")
        self.retry_after = retry_after
        self.close = close      # the connection cannot be reused (e.g. part of the body is unread)
        self.request_id: str | None = None   # set by a server that names its requests

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code, self.type, self.request_id)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.request_id is not None:
            h["X-Request-Id"] = self.request_id
        if self.retry_after is not None:
            h["Retry-After"] = str(max(1, int(round(self.retry_after))))
        return h

    def response(self, extra_headers: dict | None = None):
        """The error as an aiohttp response."""
        from aiohttp import web
        headers = self.headers()
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
        return f"{type(self).__name__}({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


class InvalidRequest(ApiError, ValueError):
    """400: the request does not fit the API."""

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value"):
        super().__init__(400, message, param=param, code=code)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> InvalidRequest:
    return InvalidRequest(message, param, code)


# ------------------------------------------------------------------------------ field checkers

def tname(v: Any) -> str:
    """A value's JSON type name, for messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_field(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {tname(v)} {v!r:.40}", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"between {lo} and {hi}")
        raise bad_request(f"'{name}' must be {rng}, got {v}", name)
    return v


def num_field(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name)
    if v is None:
        return default
    if not is_num(v):
        raise bad_request(f"'{name}' must be a number, got {tname(v)} {v!r:.40}", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def bool_field(body: dict, name: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {tname(v)} {v!r:.40}", name, "invalid_type")
    return v


def str_field(body: dict, name: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {tname(v)}", name, "invalid_type")
    return v


def token_ids(v: Any, name: str, vocab_size: int | None = None) -> list[int]:
    """An array of token ids in [0, 2**32) (and below `vocab_size` when given)."""
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise bad_request(f"'{name}' must be an array of integer token ids, got {tname(v)}", name,
                          "invalid_type")
    limit = TOKEN_ID_LIMIT if vocab_size is None else min(vocab_size, TOKEN_ID_LIMIT)
    bad = [t for t in v if not 0 <= t < limit]
    if bad:
        bound = "2**32" if vocab_size is None else str(limit)
        raise bad_request(f"'{name}' must hold token ids in [0, {bound}), found {bad[:3]}", name)
    return v


def stop_field(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request(f"'stop' must be a string or an array of strings, got {tname(stop)}", "stop",
                          "invalid_type")
    if len(stop) > MAX_STOP:
        raise bad_request(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}", "stop")
    return tuple(s for s in stop if s)


def stream_fields(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage); `stream_options` is only allowed on a stream (as OpenAI's API)."""
    stream = bool_field(body, "stream", False)
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not isinstance(so, dict):
        raise bad_request(f"'stream_options' must be an object, got {tname(so)}", "stream_options",
                          "invalid_type")
    iu = so.get("include_usage")
    if iu is not None and not isinstance(iu, bool):
        raise bad_request(f"'stream_options.include_usage' must be a boolean, got {tname(iu)}",
                          "stream_options.include_usage", "invalid_type")
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, bool(iu)


def n_field(body: dict) -> None:
    n = int_field(body, "n", 1, lo=1)
    if n != 1:
        raise bad_request(f"'n' must be 1 (one choice per request), got {n}", "n", "unsupported_value")


def model_field(body: dict, required: bool) -> str | None:
    model = body.get("model")
    if model is None:
        if required:
            raise bad_request("'model' is required", "model", "missing_required_parameter")
        return None
    if not isinstance(model, str) or not model:
        raise bad_request(f"'model' must be a non-empty string, got {tname(model)}", "model", "invalid_type")
    return model


def messages_field(msgs: Any) -> list[dict]:
    """A non-empty array of message objects with a known `role` and a string, null (assistant only)
    or content-part `content`."""
    if msgs is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise bad_request(f"'messages' must be an array of message objects, got {tname(msgs)}", "messages",
                          "invalid_type")
    if not msgs:
        raise bad_request("'messages' must hold at least one message", "messages")
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{p}' must be an object, got {tname(m)}", p, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"'{p}.role' must be a string, got {tname(role)}", f"{p}.role", "invalid_type")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"'{p}.role' must be one of {sorted(MESSAGE_ROLES)}, got {role!r:.40}",
                              f"{p}.role")
        c = m.get("content")
        if c is None:
            if role != "assistant":
                raise bad_request(f"'{p}.content' is required for role {role!r}", f"{p}.content",
                                  "missing_required_parameter")
        elif isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad_request(f"'{p}.content[{j}]' must be an object with a string 'type'",
                                      f"{p}.content[{j}]", "invalid_type")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise bad_request(f"'{p}.content[{j}].text' must be a string, got "
                                      f"{tname(part.get('text'))}", f"{p}.content[{j}].text", "invalid_type")
        elif not isinstance(c, str):
            raise bad_request(f"'{p}.content' must be a string or an array of content parts, got {tname(c)}",
                              f"{p}.content", "invalid_type")
    return msgs
