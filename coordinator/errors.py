"""Typed errors of the coordinator API, shared by the service and both clients.

`NoServerAvailable` is the router's own class (the policies raise it), re-exported so callers of the
coordinator never need to import `router` to catch it. HTTP mapping: `BadRequest` → 400,
`UnsupportedMediaType` → 415, `NoServerAvailable` → 503, `NotReady` → 503, `CoordinatorOverloaded`
→ 429 (a placement shed by a saturated coordinator, or by a fleet process whose calls to it are
already at their bound; a subclass of `NoServerAvailable`, so every caller that answers "no server"
with 503 + Retry-After sheds it the same way, and none falls back to local placement).
"""
from __future__ import annotations

from router.policies import NoServerAvailable

__all__ = [
    "BadRequest",
    "CoordinatorError",
    "CoordinatorOverloaded",
    "CoordinatorRequestError",
    "CoordinatorUnavailable",
    "NoServerAvailable",
    "UnsupportedMediaType",
]


class CoordinatorError(Exception):
    """Base of the errors raised by the coordinator's Python API and clients."""


class BadRequest(CoordinatorError, ValueError):
    """A request body that does not fit the API; `field` names the offending key path (or None)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def to_body(self) -> dict:
        return {"error": self.message, "field": self.field}


class UnsupportedMediaType(BadRequest):
    """A body whose Content-Type is neither msgpack nor JSON."""


class CoordinatorRequestError(CoordinatorError, ValueError):
    """Client side: the coordinator rejected the call (4xx other than 503); carries status and field."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(f"coordinator rejected the request ({status}): {message}"
                         + (f" [field {field}]" if field else ""))
        self.status = status
        self.message = message
        self.field = field


class CoordinatorUnavailable(CoordinatorError, ConnectionError):
    """Client side: the coordinator could not be reached (connect failure, reset, timeout, 5xx)."""


class CoordinatorOverloaded(NoServerAvailable):
    """A placement shed because the coordinator (or the path to it) is saturated; no lease was
    taken. `retry_after` is the seconds the caller should wait (the `Retry-After` it passes on)."""

    def __init__(self, reason: str, retry_after: float = 1.0):
        super().__init__(reason)
        self.retry_after = retry_after
