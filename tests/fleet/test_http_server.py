"""fleet/http_server.py on real loopback sockets: connection semantics the fleet's routes rely on.

The fleet's own behaviour through this server (OpenAI errors, timeouts, hang-ups releasing leases)
is tested end to end in test_hostile_clients.py, test_fuzz_api.py, test_disconnect.py and
test_hangup_leases.py; here a small dispatch exercises what those do not reach.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from fleet.http_messages import FleetStream, Reply
from fleet.http_server import FleetHttpServer
from protocol.openai import ApiError

from .hostile import dechunk, read_answer


class _Harness:
    """A FleetHttpServer on its own loop thread, with a dispatch that records what it saw."""

    def __init__(self, keepalive_s: float = 30.0, header_timeout_s: float | None = 5.0, loop: str = "asyncio"):
        if loop == "uvloop":
            import uvloop
            self.loop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.seen: list[str] = []
        self.cancelled: list[str] = []
        self.gate = asyncio.Event()
        self.srv = FleetHttpServer(self.dispatch, max_body=1024, keepalive_s=keepalive_s,
                                   header_timeout_s=header_timeout_s)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.srv.serve(sock, 128))

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def dispatch(self, req):
        self.seen.append(f"{req.method} {req.path}")
        try:
            if req.path == "/echo":
                body = await req.read()
                return Reply(200, body, {"Content-Type": "application/json"})
            if req.path == "/early":
                return ApiError(401, "no key", code="invalid_api_key").response()
            if req.path == "/wait":
                await self.gate.wait()
                return Reply(200, b'{"waited":true}', {"Content-Type": "application/json"})
            if req.path == "/stream":
                out = FleetStream(200, {"Content-Type": "text/event-stream"})
                await out.prepare(req)
                for i in range(3):
                    await out.write(b"data: %d\n\n" % i)
                await out.write_eof()
                return out
            return Reply(200, b'{"path":%s}' % json.dumps(req.path).encode(), {"Content-Type": "application/json"})
        except asyncio.CancelledError:
            self.cancelled.append(req.path)
            raise

    def stop(self):
        self.call(self.srv.close(2.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(params=["asyncio", "uvloop"])
def h(request):
    """The server on either event loop `fleet.event_loop` offers."""
    x = _Harness(loop=request.param)
    yield x
    x.stop()


def _conn(h) -> socket.socket:
    return socket.create_connection(("127.0.0.1", h.port), timeout=10)


def _req(method: str, path: str, body: bytes = b"", extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return (b"%s %s %s\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (method.encode(), path.encode(), version, len(body), extra)) + body


def _answers(s: socket.socket, n: int) -> list[tuple[int, dict, bytes]]:
    """`n` Content-Length answers read off one connection (hostile.read_answer reads one and may
    swallow the next)."""
    s.settimeout(5)
    buf, out = b"", []
    while len(out) < n:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            hd = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            size = int(hd["content-length"])
            if len(rest) >= size:
                out.append((int(lines[0].split()[1]), hd, rest[:size]))
                buf = rest[size:]
                continue
        chunk = s.recv(65536)
        assert chunk, f"closed after {len(out)} answers"
        buf += chunk
    return out


def test_pipelined_requests_are_answered_in_order(h):
    with _conn(h) as s:
        s.sendall(_req("POST", "/echo", b'{"a":1}') + _req("GET", "/x") + _req("POST", "/echo", b'{"b":2}'))
        answers = _answers(s, 3)
    assert [a[0] for a in answers] == [200, 200, 200]
    assert [a[2] for a in answers] == [b'{"a":1}', b'{"path":"/x"}', b'{"b":2}']
    assert all("connection" not in a[1] for a in answers)
    assert h.seen == ["POST /echo", "GET /x", "POST /echo"]


def test_head_has_no_body_and_the_connection_stays_usable(h):
    with _conn(h) as s:
        s.sendall(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n")
        s.settimeout(5)
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        assert b"Content-Length: 13\r\n" in head       # the GET's length, no body bytes follow
        s.sendall(_req("GET", "/y"))
        assert read_answer(s, 5)[2] == b'{"path":"/y"}'


def test_expect_100_continue_gets_its_interim_answer(h):
    with _conn(h) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 7\r\n"
                  b"Expect: 100-continue\r\n\r\n")
        s.settimeout(5)
        assert s.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b'{"c":3}')
        st, _, body = read_answer(s, 5)
    assert st == 200 and body == b'{"c":3}'


def test_100_continue_behind_a_pipelined_request_comes_at_its_turn(h):
    with _conn(h) as s:
        s.sendall(_req("GET", "/wait") + b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 7\r\nExpect: 100-continue\r\n\r\n")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(64)                              # the first request is still being served
        h.loop.call_soon_threadsafe(h.gate.set)
        s.settimeout(5)
        got = b""
        while b"100 Continue" not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        # the interim answer follows the first request's answer, right when the second one's turn came
        assert got.endswith(b'{"waited":true}HTTP/1.1 100 Continue\r\n\r\n'), got
        s.sendall(b'{"d":4}')
        assert _answers(s, 1)[0][2] == b'{"d":4}'


def test_an_answer_before_the_whole_body_closes_the_connection(h):
    with _conn(h) as s:
        s.sendall(_req("POST", "/early", b"x" * 100)[:-50])     # half the body
        st, hd, raw = read_answer(s, 5)
        assert st == 401 and hd.get("connection") == "close"
        assert json.loads(raw)["error"]["code"] == "invalid_api_key"
        s.settimeout(5)
        assert s.recv(10) == b""


def test_streams_are_chunked_on_1_1_and_close_delimited_on_1_0(h):
    with _conn(h) as s:
        s.sendall(_req("GET", "/stream"))
        st, hd, body = read_answer(s, 5)
        assert st == 200 and hd["transfer-encoding"] == "chunked"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        s.sendall(_req("GET", "/x"))                  # keep-alive after a complete stream
        assert read_answer(s, 5)[0] == 200
    with _conn(h) as s:
        s.sendall(_req("GET", "/stream", version=b"HTTP/1.0"))
        st, hd, body = read_answer(s, 5)
        assert st == 200 and hd.get("connection") == "close" and "transfer-encoding" not in hd
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_a_client_that_hangs_up_cancels_its_request(h):
    s = _conn(h)
    s.sendall(_req("GET", "/wait"))
    deadline = time.monotonic() + 5
    while "GET /wait" not in h.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()
    while not h.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.cancelled == ["/wait"]
    assert h.call(_count(h.srv)) == 0


async def _count(srv) -> int:
    return srv.inflight()


def test_a_parse_error_behind_a_request_is_answered_after_it(h):
    with _conn(h) as s:
        s.sendall(_req("GET", "/x") + b"NOT HTTP AT ALL\r\n\r\n")
        first, second = _answers(s, 2)
    assert first[0] == 200 and first[2] == b'{"path":"/x"}'
    assert second[0] == 400 and json.loads(second[2])["error"]["code"] == "bad_http_request"
    assert second[1].get("connection") == "close"


def test_idle_keepalive_connections_are_closed():
    x = _Harness(keepalive_s=0.2)
    try:
        with _conn(x) as s:
            s.sendall(_req("GET", "/x"))
            assert read_answer(s, 5)[0] == 200
            s.settimeout(5)
            t0 = time.monotonic()
            assert s.recv(10) == b""                 # closed by the server, silently
            assert time.monotonic() - t0 < 2
    finally:
        x.stop()


def test_close_waits_for_the_request_in_flight_then_refuses_new_ones():
    x = _Harness()
    s = _conn(x)
    try:
        s.sendall(_req("GET", "/wait"))
        deadline = time.monotonic() + 5
        while "GET /wait" not in x.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        closing = asyncio.run_coroutine_threadsafe(x.srv.close(5.0), x.loop)
        time.sleep(0.2)
        assert not closing.done()                   # draining: the request is still served
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", x.port), timeout=2).recv(1)
        x.loop.call_soon_threadsafe(x.gate.set)
        st, hd, body = read_answer(s, 5)
        assert st == 200 and body == b'{"waited":true}' and hd.get("connection") == "close"
        closing.result(5)
    finally:
        s.close()
        x.loop.call_soon_threadsafe(x.loop.stop)
        x.thread.join(5)


def test_chunked_request_bodies_are_decoded(h):
    with _conn(h) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n")
        st, _, body = read_answer(s, 5)
    assert st == 200 and body == b'{"a":1}'
    assert dechunk(b"3\r\nabc\r\n0\r\n\r\n") == b"abc"


def test_absolute_form_and_undecodable_paths(h):
    with _conn(h) as s:
        s.sendall(_req("GET", "http://fleet.example:80/v1/x?q=1") + _req("GET", "/%ff%fe"))
        a, b = _answers(s, 2)
    assert a[2] == b'{"path":"/v1/x"}'
    assert b[0] == 200 and json.loads(b[2])["path"] == "/\ufffd\ufffd"


def test_a_client_that_does_not_read_stops_being_read():
    x = _Harness(header_timeout_s=None)
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)    # before connect: a small window
        s.connect(("127.0.0.1", x.port))
        with s:
            big = _req("GET", "/x" + "y" * 4000)              # ~4 KiB requests and answers
            sent = 0
            s.setblocking(False)
            deadline = time.monotonic() + 30
            # pipelined requests whose answers are never read: the server's writes back up, it
            # pauses reading, and this side's sends stop being accepted (no unbounded buffering)
            stuck = 0
            while time.monotonic() < deadline and stuck < 10:
                try:
                    sent += s.send(big)
                    stuck = 0
                except BlockingIOError:
                    stuck += 1
                    time.sleep(0.05)
            assert stuck == 10, "the server kept reading requests whose answers pile up"
            served = len(x.seen)
            time.sleep(0.3)
            assert len(x.seen) == served < sent // len(big)
    finally:
        x.stop()
