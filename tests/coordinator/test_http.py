"""The lean HTTP/1.1 server (`coordinator.http`) on raw sockets: pipelining, chunked bodies,
100-continue, limits, malformed input, connection semantics, idle timeout, graceful close."""
from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest

from coordinator.api import Api
from coordinator.http import HttpServer
from coordinator.service import Coordinator

from .conftest import cfg, wait_for


def _req(method: str, path: str, body: bytes = b"", headers: dict | None = None, version="1.1") -> bytes:
    h = {"Host": "c", **(headers or {})}
    if body and "Transfer-Encoding" not in h:
        h["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/{version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in lines[1:] if ln)}
    n = int(headers.get("content-length", 0))
    body = await reader.readexactly(n) if n else b""
    return status, headers, body


@pytest.fixture
async def served(workers):
    w = await workers("both")
    c = Coordinator(cfg([w.url], [w.url], ttl=30))
    await c.start()
    await wait_for(c.is_ready)
    srv = HttpServer(Api(c), max_body=4096, keepalive_s=0.3)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    await srv.serve(sock)
    port = sock.getsockname()[1]

    async def connect():
        return await asyncio.open_connection("127.0.0.1", port)
    yield c, srv, connect, w
    await srv.close(1.0)
    await c.stop()


MP = {"Content-Type": "application/msgpack"}


async def test_pipelined_requests_answer_in_order(served):
    c, srv, connect, w = served
    r, wr = await connect()
    sel = msgpack.packb({"role": "ctx", "req_id": 1})
    fin = msgpack.packb({"role": "ctx", "req_id": 1})
    wr.write(_req("POST", "/select", sel, MP) + _req("GET", "/health") +
             _req("POST", "/finish", fin, MP) + _req("GET", "/version?x=1"))
    st1, h1, b1 = await _read_response(r)
    st2, _, b2 = await _read_response(r)
    st3, _, b3 = await _read_response(r)
    st4, _, b4 = await _read_response(r)
    assert (st1, st2, st3, st4) == (200, 200, 200, 200)
    assert msgpack.unpackb(b1)["server"] == w.url and h1["content-type"] == "application/msgpack"
    assert b2 == b'{"status":"ready"}' and msgpack.unpackb(b3) == {} and b'"version"' in b4
    assert "date" in h1
    assert c.in_flight() == {"context": 0, "generation": 0}
    wr.close()


async def test_chunked_body_and_expect_continue(served):
    c, srv, connect, w = served
    r, wr = await connect()
    body = msgpack.packb({"role": "gen", "req_id": 5})
    chunks = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:3], body[3:])) + b"0\r\n\r\n"
    wr.write(_req("POST", "/select", chunks, {**MP, "Transfer-Encoding": "chunked"}))
    st, _, b = await _read_response(r)
    assert st == 200 and msgpack.unpackb(b)["req_id"] == 5
    fin = msgpack.packb({"role": "gen", "req_id": 5})
    wr.write(_req("POST", "/finish", b"", {**MP, "Content-Length": str(len(fin)), "Expect": "100-continue"}))
    interim = await r.readuntil(b"\r\n\r\n")
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    wr.write(fin)
    st, _, b = await _read_response(r)
    assert st == 200 and c.in_flight()["generation"] == 0
    wr.close()


async def test_limits_and_malformed_input_close_the_connection(served):
    c, srv, connect, w = served
    r, wr = await connect()
    wr.write(_req("POST", "/select", b"x" * 5000, MP))
    st, h, b = await _read_response(r)
    assert st == 413 and b"request body over 4096 bytes" in b and h["connection"] == "close"
    assert await r.read() == b""
    r, wr = await connect()
    wr.write(b"GARBAGE\r\n\r\n")
    st, h, b = await _read_response(r)
    assert st == 400 and b"malformed HTTP request" in b
    assert await r.read() == b""
    r, wr = await connect()
    wr.write(_req("GET", "/health", headers={"Connection": "Upgrade", "Upgrade": "websocket"}))
    st, h, b = await _read_response(r)
    assert st == 200 and h["connection"] == "close" and await r.read() == b""   # upgrade ignored


async def test_connection_semantics_and_head(served):
    c, srv, connect, w = served
    r, wr = await connect()
    wr.write(_req("GET", "/health", version="1.0"))
    st, h, b = await _read_response(r)
    assert st == 200 and h["connection"] == "close" and await r.read() == b""
    r, wr = await connect()
    wr.write(_req("GET", "/cluster_info", headers={"Connection": "close"}))
    st, h, b = await _read_response(r)
    assert st == 200 and b'"is_ready":true' in b and await r.read() == b""
    r, wr = await connect()
    wr.write(_req("HEAD", "/cluster_info"))
    head = await r.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: " in head
    wr.write(_req("DELETE", "/select"))
    st, h, b = await _read_response(r)    # nothing was sent after the HEAD headers
    assert st == 405 and h["allow"] == "POST"
    wr.close()


async def test_idle_keepalive_connections_are_closed(served):
    c, srv, connect, w = served
    r, wr = await connect()
    wr.write(_req("GET", "/version"))
    await _read_response(r)
    assert await asyncio.wait_for(r.read(), 3) == b""     # closed by the server after ~0.3 s idle
    await wait_for(lambda: not srv.conns, what="connection forgotten")


async def test_close_answers_a_request_in_progress(served):
    c, srv, connect, w = served
    r, wr = await connect()
    body = msgpack.packb({"role": "ctx", "req_id": 9})
    raw = _req("POST", "/select", body, MP)
    wr.write(raw[:-3])                          # headers and part of the body
    await wait_for(lambda: any(x.busy for x in srv.conns), what="request in progress")
    idle_r, idle_w = await connect()
    closing = asyncio.create_task(srv.close(timeout=3.0))
    await asyncio.sleep(0.1)
    assert await asyncio.wait_for(idle_r.read(), 2) == b""   # the idle connection went at once
    wr.write(raw[-3:])
    st, h, b = await _read_response(r)
    assert st == 200 and h["connection"] == "close"
    await asyncio.wait_for(closing, 5)
    with pytest.raises(OSError):
        await connect()
    c.finish("ctx", 9)
