"""Every transport speaks the same API with the same answers and typed errors: one codec
(coordinator/client_codec.py) over the in-process transport, aiohttp over a Unix socket, the
persistent channel, and the fleet's pooled HTTP (fleet/coord_client.py)."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from coordinator.client import HttpCoordinatorClient, InProcessCoordinatorClient, make_client
from protocol.coord import (CoordinatorOverloaded, CoordinatorRequestError, CoordinatorUnavailable,
                            NoServerAvailable)
from router.block_keys import block_keys
from router.policies import RoutingKey

from .conftest import cfg, wait_for


@pytest.fixture
async def both_clients(workers, coordinator, tmp_path):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url]), uds=str(tmp_path / "c.sock"))
    await wait_for(c.is_ready)
    from fleet.coord_client import FleetCoordinatorClient
    clients = {"http": HttpCoordinatorClient(s.uds_url, timeout=2.0),
               "http-plain": HttpCoordinatorClient(s.uds_url, timeout=2.0, channel=False),
               "fleet-pool": FleetCoordinatorClient(s.tcp_url, timeout=2.0, channel=False),
               "inproc": InProcessCoordinatorClient(c)}
    yield c, s, ctx, gen, clients
    for cl in clients.values():
        await cl.close()


@pytest.mark.parametrize("which", ["http", "http-plain", "fleet-pool", "inproc"])
async def test_same_answers_and_errors(both_clients, which):
    c, s, ctx, gen, clients = both_clients
    cl = clients[which]
    tokens = list(range(300))
    keys = block_keys(tokens, 16)
    for rid, rk in enumerate([{"block_keys": keys, "num_tokens": 300},            # ndarray
                              {"block_keys": keys.tolist(), "num_tokens": 300},   # list
                              {"block_keys": keys.astype("<u8").tobytes()},       # bytes
                              RoutingKey(block_keys=keys, num_tokens=300),
                              "conversation-7", None]):
        ans = await cl.select("ctx", rid, rk)
        assert ans["server"] == ctx.url and ans["req_id"] == rid
        assert ans["info"]["chosen"] == ctx.url
        await cl.finish("ctx", rid)
    pair = await cl.select_pair(50, {"block_keys": keys, "num_tokens": 300})
    assert pair["context"]["server"] == ctx.url and pair["generation"]["server"] == gen.url
    assert pair["mode"] == "disaggregated"
    assert await cl.renew("generation", 50) is True
    await cl.finish("context", 50)
    await cl.finish("gen", 50)
    assert await cl.renew("generation", 50) is False
    with pytest.raises(NoServerAvailable) as ei:
        await cl.select("gen", 1, exclude={gen.url})
    assert "no healthy generation server left" in ei.value.reason
    with pytest.raises(CoordinatorRequestError) as ei:
        await cl.select("boss", 1)
    assert ei.value.field == "role" and ei.value.status == 400
    with pytest.raises(CoordinatorRequestError) as ei:
        await cl.select("ctx", 1, {"block_keys": keys, "num_tokens": 20})
    assert ei.value.field == "routing_key.block_keys"
    with pytest.raises(CoordinatorRequestError):
        await cl.finish("ctx", -5)
    node, proc = await cl.lease_identity(f"holder-{which}")
    assert 0 <= node < 256 and 0 <= proc < 64
    assert await cl.lease_identity(f"holder-{which}") == (node, proc)
    assert await cl.release_identity(f"holder-{which}") is True
    ci = await cl.cluster_info()
    assert ci["is_ready"] is True and ci["routing"]["block_size"] == 16
    assert await cl.health() is True
    assert c.in_flight() == {"context": 0, "generation": 0}
    # the channel carried the per-request calls where there is one, the transport everywhere else
    assert (cl.channel is not None and cl.channel.stats["calls"] > 0) is (which == "http")
    assert cl.inline is (which == "inproc")


async def test_url_forms(both_clients):
    c, s, *_ = both_clients
    path = s.uds_path
    for url in (f"unix://{path}", f"unix:{path}", s.tcp_url, s.tcp_url + "/"):
        cl = make_client(url, timeout_s=2.0)
        try:
            assert (await cl.cluster_info())["is_ready"] is True
        finally:
            await cl.close()
    assert isinstance(make_client(c), InProcessCoordinatorClient)
    with pytest.raises(ValueError, match="http"):
        HttpCoordinatorClient("tcp://h:1")


async def test_unreachable_coordinator_is_typed():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cl = HttpCoordinatorClient(f"http://127.0.0.1:{port}", timeout_s=1.0)
    with pytest.raises(CoordinatorUnavailable, match="unreachable"):
        await cl.select("ctx", 1)
    assert await cl.health() is False
    await cl.close()
    cl = HttpCoordinatorClient("unix:///nonexistent/dir/c.sock", timeout_s=1.0)
    with pytest.raises(CoordinatorUnavailable):
        await cl.finish("ctx", 1)
    await cl.close()


async def test_timeout_is_typed():
    # a listener that accepts and never answers
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    cl = HttpCoordinatorClient(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=0.3)
    try:
        with pytest.raises(CoordinatorUnavailable, match="did not answer"):
            await cl.select("ctx", 1, {"block_keys": np.zeros(2, dtype=np.uint64)})
    finally:
        await cl.close()
        srv.close()


@pytest.mark.parametrize("path, status, body, err", [
    ("/select", 503, {"error": "no healthy context server"}, NoServerAvailable),
    ("/select_pair", 503, {"error": "none"}, NoServerAvailable),
    ("/renew", 503, {"error": "not ready"}, CoordinatorUnavailable),       # 503 is "no server fits" only for placements
    ("/select", 429, {"error": "shed", "retry_after": 2.5}, CoordinatorOverloaded),
    ("/finish", 400, {"error": "bad role", "field": "role"}, CoordinatorRequestError),
    ("/select", 502, None, CoordinatorUnavailable),                        # a proxy's error page
])
def test_one_status_mapping_for_http_and_channel(path, status, body, err):
    """The codec's mapping, which HTTP answers and channel replies (coordinator/channel_client.py) share."""
    from coordinator import client_codec as codec
    raw = b"<html>bad gateway</html>" if body is None else b"{}"
    e = codec.error_of("http://c:1", path, status, body, raw)
    assert type(e) is err
    if err is CoordinatorOverloaded:
        assert e.retry_after == 2.5
    if err is CoordinatorRequestError:
        assert (e.status, e.field) == (400, "role")
    if body is None:
        assert "bad gateway" in str(e)
    with pytest.raises(err):
        codec.answer_or_raise("http://c:1", path, status, body, raw)
    assert codec.answer_or_raise("http://c:1", path, 200, {"ok": 1}, b"") == {"ok": 1}
