"""Raw-socket HTTP helpers for the hostile-client tests: send exact bytes, read one answer."""
from __future__ import annotations

import json
import socket
import time


def read_answer(s: socket.socket, timeout: float) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 answer from `s` → (status, lower-cased headers, body). Status 0: closed, no answer."""
    s.settimeout(timeout)
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\r\n\r\n" not in buf:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer head within {timeout}s (got {buf[:200]!r})")
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            if not buf:
                return 0, {}, b""
            break
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    n = headers.get("content-length")
    if n is not None:
        while len(body) < int(n):
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        body = body[:int(n)]
    else:   # chunked or until close
        while not (headers.get("transfer-encoding") == "chunked" and body.endswith(b"0\r\n\r\n")):
            try:
                chunk = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            body += chunk
        if headers.get("transfer-encoding") == "chunked":
            body = dechunk(body)
    return status, headers, body


def dechunk(data: bytes) -> bytes:
    out, i = b"", 0
    while True:
        j = data.index(b"\r\n", i)
        n = int(data[i:j].split(b";")[0], 16)
        if n == 0:
            return out
        out += data[j + 2:j + 2 + n]
        i = j + 2 + n + 2


def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_answer(s, timeout)


def post(path: str, body: bytes, *, ctype: bytes = b"application/json", extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), ctype, len(body), extra)) + body


def error_of(status: int, body: bytes) -> dict:
    """The OpenAI error object of an error answer (fails the test if the body is not one)."""
    try:
        obj = json.loads(body)
    except ValueError:
        raise AssertionError(f"{status} answer is not JSON: {body[:300]!r}") from None
    assert isinstance(obj, dict) and isinstance(obj.get("error"), dict), obj
    e = obj["error"]
    assert set(e) >= {"message", "type", "param", "code"} and e["message"], e
    return e
