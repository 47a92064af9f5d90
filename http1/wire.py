"""An HTTP/1.1 answer's bytes: status lines, the `Date` header, a complete answer's head and body.

Rendered by hand (no response objects) because the fleet's and the coordinator's hot routes answer
tens of thousands of requests a second per process; the status line of each status and the `Date`
line of each second are rendered once.
"""
from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

REASONS = {s.value: s.phrase for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}

# Framing headers are the server's to write: a route's own copy would contradict the real framing.
FRAMING = frozenset(("content-length", "transfer-encoding", "connection"))

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def status_line(status: int, reason: str | None = None) -> bytes:
    """`HTTP/1.1 <status> <reason>\\r\\n`; the standard reason unless another is given."""
    if reason is None or reason == REASONS.get(status):
        line = _STATUS_LINES.get(status)
        if line is None:
            line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n".encode()
        return line
    return f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1", "replace")


class Clock:
    """The `Date` header line, rendered once per second (RFC 9110 §6.6.1 asks for one per answer)."""

    __slots__ = ("_sec", "line")

    def __init__(self):
        self._sec = -1
        self.line = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._sec:
            self._sec = now
            self.line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.line


CLOCK = Clock()


def answer_bytes(status: int, headers, body: bytes, keep: bool, head_only: bool = False,
                 reason: str | None = None) -> bytes:
    """A complete answer: status line, `Date`, the route's headers (`(name, value)` pairs, framing
    headers dropped), `Content-Length`, `Connection: close` unless `keep`, then the body (not for
    HEAD)."""
    parts = [status_line(status, reason), CLOCK.get()]
    for k, v in headers:
        if k.lower() in FRAMING:
            continue
        parts.append(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")))
    parts.append(b"Content-Length: %d\r\n" % len(body))
    if not keep:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    if not head_only:
        parts.append(body)
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    """One chunk of a `Transfer-Encoding: chunked` body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
