"""Typed failure causes: why a call to another process failed, as a value code can branch on.

Retry, ejection and shedding decisions read `Cause` (or the exception class), never the text of an
error message: messages are for people and change wording freely. Each transport maps its own
errors onto these once, where it raises them (the fleet's upstream client, the coordinator clients,
the KV transfer agents).

| cause             | meaning                                                   | retry elsewhere? |
|-------------------|-----------------------------------------------------------|------------------|
| `CONNECT_REFUSED` | the request never reached a live server (refused, connect timed out, closed before any byte) | yes |
| `TIMEOUT`         | it was sent but no answer came in time                     | no (work may have started) |
| `UPSTREAM_5XX`    | the server answered with a 5xx status                     | 503 only (shedding) |
| `PEER_LOST`       | an established connection broke (peer died mid-call)     | no |
| `OVERLOADED`      | the callee shed the call on purpose; `retry_after` says when | after `retry_after` |
| `BAD_ANSWER`      | the answer did not parse as the protocol says             | no |
| `FAILED`          | anything else (a backend error, a shutdown)               | no |
"""
from __future__ import annotations

from enum import StrEnum

__all__ = ["Cause", "cause_of", "Failure", "ConnectRefused", "Timeout", "Upstream5xx", "PeerLost",
           "Overloaded", "BadAnswer", "NoServerAvailable"]


class Cause(StrEnum):
    CONNECT_REFUSED = "connect_refused"
    TIMEOUT = "timeout"
    UPSTREAM_5XX = "upstream_5xx"
    PEER_LOST = "peer_lost"
    OVERLOADED = "overloaded"
    BAD_ANSWER = "bad_answer"
    FAILED = "failed"
    NOT_SERVING = "not_serving"     # a coordinator replica that defers to another (docs/failover.md)


class Failure(Exception):
    """A call failed for `cause`. `where` names the other side (a URL, an agent, an endpoint)."""

    cause: Cause
    retryable = False      # safe to send again to another server: nothing reached this one

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}" if where else detail)
        self.where = where
        self.detail = detail


class ConnectRefused(Failure):
    cause = Cause.CONNECT_REFUSED
    retryable = True


class Timeout(Failure):
    cause = Cause.TIMEOUT


class Upstream5xx(Failure):
    cause = Cause.UPSTREAM_5XX

    def __init__(self, where: str, status: int, detail: str):
        super().__init__(where, detail)
        self.status = status


class PeerLost(Failure):
    cause = Cause.PEER_LOST


class Overloaded(Failure):
    cause = Cause.OVERLOADED

    def __init__(self, where: str, detail: str, retry_after: float = 1.0):
        super().__init__(where, detail)
        self.retry_after = retry_after


class BadAnswer(Failure):
    cause = Cause.BAD_ANSWER


class NoServerAvailable(Exception):
    """No server fits a placement (the routing policies and the coordinator raise it; HTTP 503).
    `reason` says why, for the operator."""

    def __init__(self, reason: str = "no server available"):
        super().__init__(reason)
        self.reason = reason


def cause_of(exc: BaseException) -> Cause | None:
    """The typed cause carried by `exc` (a `Failure`, or any exception with a `cause` attribute
    that is a `Cause`), else None."""
    c = getattr(exc, "cause", None)
    return c if isinstance(c, Cause) else None
