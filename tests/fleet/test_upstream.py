"""fleet.upstream.UpstreamPool against a real aiohttp server on loopback (and a raw TCP one for the
misbehaving cases): keep-alive reuse, incremental streaming, failure classification, timeouts, UDS."""
from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from fleet.upstream import (UpstreamConnectError, UpstreamDisconnected, UpstreamPool, UpstreamProtocolError,
                            UpstreamTimeout)


@pytest.fixture
async def server():
    gate = asyncio.Event()

    async def echo(request):
        body = await request.read()
        return web.Response(body=b"echo:" + body, headers={"X-Req": request.headers.get("X-Request-Id", "")})

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await gate.wait()
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    async def slow(request):
        await asyncio.sleep(1)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", stream)
    app.router.add_post("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", gate
    await runner.cleanup()


async def test_keep_alive_reuse_and_headers(server):
    url, _ = server
    pool = UpstreamPool()
    for i in range(5):
        r = await pool.request(url, "/echo", b"x%d" % i, b"X-Request-Id: %d\r\n" % i)
        assert r.status == 200 and r.headers["x-req"] == str(i)
        assert await r.read() == b"echo:x%d" % i
        r.release()
    assert pool.num_connections() == 1          # one keep-alive connection served all five
    await pool.close()


async def test_stream_chunks_arrive_before_the_end(server):
    url, gate = server
    pool = UpstreamPool()
    r = await pool.request(url, "/stream", b"")
    it = r.iter_chunks()
    first = await asyncio.wait_for(it.__anext__(), 2)
    assert b"data: 1" in first                   # relayed while the server still holds the rest
    gate.set()
    rest = b"".join([c async for c in it])
    assert b"data: 2" in rest
    r.release()
    await pool.close()


async def test_connect_refused_is_retryable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = UpstreamPool(connect_timeout=1)
    with pytest.raises(UpstreamConnectError) as ei:
        await pool.request(f"http://127.0.0.1:{port}", "/x", b"")
    assert ei.value.retryable and "connect failed" in str(ei.value)


async def test_timeout_closes_the_connection(server):
    url, _ = server
    pool = UpstreamPool()
    with pytest.raises(UpstreamTimeout):
        await pool.request(url, "/slow", b"", timeout=0.2)
    await asyncio.sleep(0.05)                    # connection_lost runs on the next loop turn
    assert pool.num_connections() == 0
    await pool.close()


async def test_timeouts_share_one_table_in_deadline_order(server):
    """Requests with one timeout value share one timer (fleet/upstream.py `_Deadlines`): each still
    times out at its own deadline, a completed one (or a reused connection's earlier request) never
    does, and the table is empty once nothing is in flight."""
    url, _ = server
    pool = UpstreamPool()
    loop = asyncio.get_running_loop()
    # a completed request on a connection that is then reused: its deadline must not fire later
    r = await pool.request(url, "/echo", b"a", timeout=0.3)
    assert await r.read() == b"echo:a"
    r.release()
    await asyncio.sleep(0.2)                     # "a"'s deadline is 0.1 s ahead: it must not hit `first`
    t0 = loop.time()
    first = asyncio.ensure_future(pool.request(url, "/slow", b"", timeout=0.3))
    await asyncio.sleep(0.15)
    second = asyncio.ensure_future(pool.request(url, "/slow", b"", timeout=0.3))
    ok = await pool.request(url, "/echo", b"b", timeout=0.3)      # answered long before its deadline
    assert await ok.read() == b"echo:b"
    ok.release()
    with pytest.raises(UpstreamTimeout):
        await first
    t_first = loop.time() - t0
    assert not second.done()                     # its own deadline is 0.15 s later
    with pytest.raises(UpstreamTimeout):
        await second
    t_second = loop.time() - t0
    assert 0.28 <= t_first < 0.42 and 0.43 <= t_second < 0.6, (t_first, t_second)
    assert all(not d.conns for d in pool._deadlines.values())
    await pool.close()


async def _raw_server(reply: bytes):
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


async def test_disconnect_mid_body_and_before_answer_are_not_retryable():
    srv, url = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
    pool = UpstreamPool()
    r = await pool.request(url, "/x", b"{}")
    with pytest.raises(UpstreamDisconnected):
        await r.read()
    srv.close()
    srv2, url2 = await _raw_server(b"")
    with pytest.raises(UpstreamDisconnected) as ei:
        await pool.request(url2, "/x", b"{}")
    assert not ei.value.retryable               # the request was sent: the server may have started work
    srv2.close()
    await pool.close()


async def test_malformed_response_and_close_delimited_body():
    srv, url = await _raw_server(b"NOT HTTP AT ALL\r\n\r\n")
    pool = UpstreamPool()
    with pytest.raises(UpstreamProtocolError):
        await pool.request(url, "/x", b"")
    srv.close()
    srv2, url2 = await _raw_server(b"HTTP/1.0 200 OK\r\n\r\nbody until EOF")
    r = await pool.request(url2, "/x", b"")
    assert await r.read() == b"body until EOF"
    r.release()
    srv2.close()
    await pool.close()


async def test_unix_socket(tmp_path):
    path = str(tmp_path / "s.sock")

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
    srv = await asyncio.start_unix_server(handle, path)
    pool = UpstreamPool()
    r = await pool.request(f"unix://{path}", "/x", b"", content_type=b"application/msgpack")
    assert await r.read() == b"ok"
    r.release()
    srv.close()
    await pool.close()
