"""Typed failure causes, produced by the real clients against real sockets on loopback.

Each way a call can fail is staged for real — a closed port, a server that reads the request and
never answers, one that hangs up after reading it, one that answers 500 — and the exception the
client raises must carry the matching `protocol.failures.Cause` (the retry rules read that).
"""
from __future__ import annotations

import asyncio
import socket

import pytest

from coordinator.client import HttpCoordinatorClient
from fleet.upstream import UpstreamPool
from protocol.coord import CoordinatorUnavailable
from protocol.failures import Cause, ConnectRefused, Failure, PeerLost, Timeout, cause_of


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()        # nothing listens there now: connect is refused
    return port


async def _server(behaviour: str):
    """A TCP server that reads one request head, then hangs (`silent`), closes (`hangup`) or
    answers 500 (`fail`)."""
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        if behaviour == "fail":
            body = b'{"error": "boom"}'
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        if behaviour != "hangup":
            await reader.read()      # until the client gives up and closes
        writer.close()
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


async def test_fleet_upstream_failures_carry_their_cause():
    pool = UpstreamPool(connect_timeout=2.0)
    try:
        with pytest.raises(ConnectRefused) as e:
            await pool.request(f"http://127.0.0.1:{_closed_port()}", "/v1/completions", b"{}")
        assert e.value.cause is Cause.CONNECT_REFUSED and e.value.retryable

        srv, url = await _server("silent")
        async with srv:
            with pytest.raises(Timeout) as e:
                await pool.request(url, "/v1/completions", b"{}", timeout=0.3)
            assert e.value.cause is Cause.TIMEOUT and not e.value.retryable
        srv, url = await _server("hangup")
        async with srv:
            with pytest.raises(Failure) as e:
                await pool.request(url, "/v1/completions", b"{}", timeout=5)
            # the server read the request, then hung up: it may have started work, not retryable
            assert e.value.cause is Cause.PEER_LOST and isinstance(e.value, PeerLost)
            assert not e.value.retryable
    finally:
        await pool.close()


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "http"])
async def test_coordinator_client_failures_carry_their_cause(channel):
    c = HttpCoordinatorClient(f"http://127.0.0.1:{_closed_port()}", timeout_s=2.0, channel=channel)
    try:
        with pytest.raises(CoordinatorUnavailable) as e:
            await c.cluster_info()
        assert cause_of(e.value) is Cause.CONNECT_REFUSED
    finally:
        await c.close()
    for behaviour, cause in (("silent", Cause.TIMEOUT), ("fail", Cause.UPSTREAM_5XX)):
        srv, url = await _server(behaviour)
        async with srv:
            c = HttpCoordinatorClient(url, timeout_s=0.5, channel=channel)
            try:
                with pytest.raises(CoordinatorUnavailable) as e:
                    await c.select("ctx", 1)
                assert cause_of(e.value) is cause, e.value
            finally:
                await c.close()


def test_peer_lost_is_one_class_for_every_layer():
    from fleet.upstream import UpstreamDisconnected
    from transfer.errors import FailureCause, PeerLost as TransferPeerLost
    assert issubclass(UpstreamDisconnected, PeerLost)
    assert TransferPeerLost("x").cause is Cause.PEER_LOST and FailureCause is Cause
