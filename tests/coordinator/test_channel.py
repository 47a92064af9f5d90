"""The fleet channel (coordinator/channel*.py) against a real coordinator on loopback sockets.

- the default client uses it when offered: concurrent selects leave as one batch, finishes are
  queued and applied (leases back to zero), answers equal the HTTP API's;
- not offered (aiohttp server, `coordinator.channel: false`): the same calls over HTTP;
- the connection dropped with finishes unacknowledged: they are re-sent, no lease is left;
- a malformed call costs its own 400, not the batch or the connection;
- past saturation: every placement is answered (a lease) or shed (`CoordinatorOverloaded`, 429 on
  the HTTP API with Retry-After), and once the answered ones are finished no lease is left.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
import pytest

from protocol import channel as cw
from coordinator.client import HttpCoordinatorClient
from protocol.coord import CoordinatorOverloaded, CoordinatorRequestError, NoServerAvailable
from router.block_keys import block_keys

from .conftest import cfg, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _leases(c) -> int:
    return sum(c.in_flight().values())


@pytest.fixture
async def served(workers, coordinator, tmp_path):
    async def make(*, http: str = "fast", **coord):
        ctx = await workers("context")
        gen = await workers("generation")
        c, s = await coordinator(cfg([ctx.url], [gen.url], **coord), uds=str(tmp_path / "c.sock"),
                                 http=http)
        await wait_for(c.is_ready)
        return c, s, ctx, gen
    return make


async def test_default_client_batches_selects_and_queues_finishes(served):
    c, s, ctx, gen = await served()
    keys = block_keys(list(range(320)), 16)
    for url in (s.uds_url, s.tcp_url):
        cl = HttpCoordinatorClient(url, timeout=5.0)
        try:
            b0 = s.channel.stats.batches
            answers = await asyncio.gather(*[
                cl.select("generation", i, {"block_keys": keys, "num_tokens": 320}) for i in range(64)])
            assert [a["req_id"] for a in answers] == list(range(64))
            assert all(a["server"] == gen.url for a in answers)
            assert cl.channel.offered is True
            # 64 concurrent selects made in one loop turn: one batch, not 64 exchanges
            assert s.channel.stats.batches - b0 == 1
            assert _leases(c) == 64
            for i in range(64):
                assert cl.finish_nowait("generation", i) is True
            await wait_for(lambda: _leases(c) == 0, what="queued finishes applied")
            assert s.channel.stats.finishes >= 64
            pair = await cl.select_pair(1000, {"block_keys": keys, "num_tokens": 320})
            assert pair["context"]["server"] == ctx.url and pair["mode"] == "disaggregated"
            assert await cl.renew("ctx", 1000) is True
            await cl.finish("context", 1000)
            await cl.finish("gen", 1000)
            assert await cl.renew("generation", 1000) is False    # finishes applied before calls
            with pytest.raises(CoordinatorRequestError) as ei:
                await cl.select("decoder", 1)
            assert ei.value.status == 400 and ei.value.field == "role"
            with pytest.raises(NoServerAvailable):
                await cl.select("generation", 2, exclude=[gen.url])
            assert _leases(c) == 0
        finally:
            await cl.close()
    async with aiohttp.ClientSession() as http, http.get(s.tcp_url + "/metrics") as r:
        m = await r.text()
    batches = [ln for ln in m.splitlines() if ln.startswith("splitserve_coordinator_channel_batches_total ")]
    assert batches and float(batches[0].split()[1]) == s.channel.stats.batches > 0


async def test_channel_answers_leave_out_server_info_the_http_api_keeps_it(served):
    """The channel's answers are the HTTP API's less each leg's `info.server_info` (the fleet has
    its own copy; an SGLang worker's is kilobytes per leg): protocol/channel.py."""
    c, s, ctx, gen = await served()
    rk = {"block_keys": block_keys(list(range(64)), 16), "num_tokens": 64}
    ch = HttpCoordinatorClient(s.uds_url, timeout=5.0)
    http = HttpCoordinatorClient(s.uds_url, timeout=5.0, channel=False)
    try:
        over_channel = await ch.select_pair(21, rk)
        assert ch.channel.offered is True
        over_http = await http.select_pair(22, rk)
        for leg in ("context", "generation"):
            a, b = over_channel[leg]["info"], over_http[leg]["info"]
            assert "server_info" not in a
            assert b["server_info"]["role"] == leg
            assert {k: v for k, v in b.items() if k != "server_info"}.keys() == a.keys()
            assert a["chosen"] == over_channel[leg]["server"] and a["lease_ttl_s"] == b["lease_ttl_s"]
        for rid in (21, 22):
            await http.finish("context", rid)
            await http.finish("generation", rid)
        assert _leases(c) == 0
    finally:
        await ch.close()
        await http.close()


async def test_typed_answers_equal_the_dict_answers(served):
    """`select_answer` / `select_pair_answer` (what the fleet's placer awaits: the answer checked,
    then its kv explanation built) give what `as_answer` makes of `select` / `select_pair` (built,
    then checked), for the same coordinator reply."""
    import copy
    from unittest import mock

    import msgspec

    from protocol.coord import SelectAnswer, SelectPairAnswer, as_answer
    c, s, ctx, gen = await served()
    keys = block_keys(list(range(64)), 16)
    cl = HttpCoordinatorClient(s.uds_url, timeout=5.0)
    try:
        await cl.select("generation", 40, {"block_keys": keys, "num_tokens": 64})   # channel up
        ch = cl.channel
        rk = {"block_keys": keys, "num_tokens": 64}
        raw_pair = await ch._select_pair(41, rk, None, None)
        raw_one = await ch._select("generation", 42, rk, None)
        assert "kv" in raw_pair["generation"]["info"] and "kv" in raw_one["info"]
        cases = [("select_pair", "select_pair_answer", SelectPairAnswer, raw_pair, (41, rk)),
                 ("select", "select_answer", SelectAnswer, raw_one, ("generation", 42, rk))]
        for plain, typed, schema, raw, args in cases:
            private = "_" + plain
            with mock.patch.object(ch, private, side_effect=lambda *a, r=raw: _ready(copy.deepcopy(r))):
                want = as_answer(schema, await getattr(ch, plain)(*args), "/x")
                got = await getattr(ch, typed)(*args)
            assert type(got) is schema and got == want
            assert msgspec.json.encode(got) == msgspec.json.encode(want)     # key order too
            for leg in [got.context, got.generation] if schema is SelectPairAnswer else [got]:
                assert "kv" not in leg.info and leg.info["policy"] == "kv_cache_aware"
        for role, rid in (("generation", 40), ("context", 41), ("generation", 41), ("generation", 42)):
            ch.finish(role, rid)
        await wait_for(lambda: _leases(c) == 0, what="leases finished")
    finally:
        await cl.close()


def _ready(value):
    f = asyncio.get_running_loop().create_future()
    f.set_result(value)
    return f


async def test_finish_usage_travels_on_the_channel(served):
    c, s, ctx, gen = await served()
    cl = HttpCoordinatorClient(s.uds_url, timeout=5.0)
    try:
        await cl.select("gen", 11, {"block_keys": block_keys(list(range(64)), 16), "num_tokens": 64})
        usage = {"prompt_tokens": 64, "cached_tokens": 32, "predicted_tokens": 48}
        assert cl.finish_nowait("gen", 11, True, usage)
        await wait_for(lambda: _leases(c) == 0, what="finish with usage applied")
        p = c.diag.pred[gen.url]
        assert (p.requests, p.prompt, p.predicted, p.actual) == (1, 64, 48, 32)
        # a usage the coordinator would reject is not queued: the caller's HTTP /finish answers it
        assert cl.finish_nowait("gen", 12, True, {"prompt_tokens": -1}) is False
    finally:
        await cl.close()


async def test_first_token_reports_end_the_prefill_phase_once(served):
    """A leg's first-token report (batched like finishes on the channel, or POST /first_token)
    moves its lease's tokens from queued prefill to decoding, once; a repeat, or a report for a
    lease already ended, changes nothing; a bad role is the HTTP API's 400 naming the field."""
    c, s, ctx, gen = await served()
    cl = HttpCoordinatorClient(s.uds_url, timeout=5.0)
    try:
        key = {"block_keys": block_keys(list(range(64)), 16), "num_tokens": 64}
        await cl.select("gen", 21, key)
        await cl.select("gen", 22, {"block_keys": block_keys(list(range(64, 128)), 16),
                                    "num_tokens": 64})
        assert c.leases.phase(gen.url) == (128, 2, 128)
        assert cl.first_token_nowait("gen", 21) and cl.first_token_nowait("gen", 21)
        await wait_for(lambda: c.leases.phase(gen.url) == (64, 1, 64), what="report applied")
        assert c.leases.load(gen.url) == (2, 128)           # still in flight: decoding
        assert s.channel.stats.batches and cl.channel.stats["first_tokens"] == 2
        assert await cl.first_token("gen", 22) is True       # over HTTP
        assert await cl.first_token("gen", 22) is False      # idempotent
        assert c.leases.phase(gen.url) == (0, 0, 0) and c.leases.first_tokens == 2
        await cl.finish("gen", 21)
        await cl.finish("gen", 22)
        assert await cl.first_token("gen", 21) is False and _leases(c) == 0
        with pytest.raises(CoordinatorRequestError) as ei:
            await cl.first_token("decoder", 1)
        assert ei.value.status == 400 and ei.value.field == "role"
        # a disaggregated pair: the context leg queues the prefill, the generation leg none
        pair = await cl.select_pair(24, {"block_keys": block_keys(list(range(200, 264)), 16),
                                         "num_tokens": 64})
        assert pair["mode"] == "disaggregated"
        assert c.leases.get("generation", 24).prefill == 0 and c.leases.get("context", 24).prefill == 64
        await cl.finish("context", 24)
        await cl.finish("generation", 24)
        # a short answer's report and finish share a batch: the report is applied first
        await cl.select("gen", 23, key)
        assert cl.first_token_nowait("gen", 23) and cl.finish_nowait("gen", 23)
        await wait_for(lambda: _leases(c) == 0, what="report and finish applied")
        assert c.leases.first_tokens == 3
    finally:
        await cl.close()


@pytest.mark.parametrize("how", ["aiohttp", "disabled"])
async def test_not_offered_falls_back_to_http(served, how):
    if how == "aiohttp":
        c, s, ctx, gen = await served(http="aiohttp")
    else:
        c, s, ctx, gen = await served(channel=False)
    assert s.channel is None
    cl = HttpCoordinatorClient(s.tcp_url, timeout=5.0)
    try:
        a = await cl.select("gen", 7)
        assert a["server"] == gen.url and cl.channel.offered is False
        assert cl.finish_nowait("gen", 7) is False       # not queued: sent by HTTP instead
        await cl.finish("gen", 7)
        assert _leases(c) == 0
    finally:
        await cl.close()


async def test_lost_connection_resends_unacknowledged_finishes(served):
    c, s, ctx, gen = await served()
    cl = HttpCoordinatorClient(s.uds_url, timeout=5.0)
    try:
        for i in range(20):
            await cl.select("ctx", i)
        assert _leases(c) == 20
        # The coordinator drops the connection under the client's feet: the finishes written on
        # it were never read, so they stay unacknowledged and go out again on a new connection.
        for conn in list(s.channel.conns):
            conn.transport.pause_reading()
        for i in range(20):
            assert cl.finish_nowait("ctx", i)
        await asyncio.sleep(0.05)
        assert _leases(c) == 20
        s.channel.close()
        await wait_for(lambda: _leases(c) == 0, what="re-sent finishes applied")
        assert cl.channel.stats["resent_finishes"] == 20
        a = await cl.select("ctx", 99)          # and the channel is back for the next call
        assert a["server"] == ctx.url and s.channel.stats.opened == 2
        await cl.finish("ctx", 99)
        await wait_for(lambda: _leases(c) == 0, what="finish on the new connection")
    finally:
        await cl.close()


async def _raw_channel(path: str):
    r, w = await asyncio.open_unix_connection(path)
    w.write(cw.upgrade_request())
    head = await r.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ")
    return r, w


async def _read_replies(r) -> cw.Replies:
    (n,) = cw.HEADER.unpack(await r.readexactly(4))
    return cw.decode_replies(await r.readexactly(n))


async def test_malformed_call_is_contained(served, tmp_path):
    c, s, ctx, gen = await served()
    r, w = await _raw_channel(str(tmp_path / "c.sock"))
    good = cw.Select(1, "generation", 5)
    payload = msgpack.packb(["b", 1, None, [[0, 2, "decoder", 6], msgspec_raw(good)], []])
    w.write(cw.HEADER.pack(len(payload)) + payload)
    rep = await _read_replies(r)
    by_id = {x.id: x for x in rep.results}
    assert by_id[2].status == 400 and "decoder" in by_id[2].body["error"]
    assert by_id[1].status == 200 and by_id[1].body["server"] == gen.url
    # the connection still works, and a malformed finish next to a good one costs only itself
    # (the frame's items decode in one pass until one does not fit: protocol/channel.py decode_frame)
    payload = msgpack.packb(["b", 2, None, [], [["generation"], msgspec_raw(cw.Finish("generation", 5))]])
    w.write(cw.HEADER.pack(len(payload)) + payload)
    rep = await _read_replies(r)
    assert rep.seq == 2 and _leases(c) == 0
    assert s.channel.stats.bad_calls == 2 and s.channel.stats.finishes == 2
    # a frame larger than the bound closes the connection (nothing to answer call by call)
    w.write(cw.HEADER.pack(cw.MAX_FRAME + 1))
    assert await r.read() == b""
    w.close()


def msgspec_raw(obj) -> list:
    return msgpack.unpackb(cw._enc.encode(obj))


@pytest.fixture
async def coordinator_process(workers, tmp_path):
    """A real `splitserve coordinator` process (its own event loop and core) → its URLs."""
    procs = []

    async def make(**coord):
        ctx = await workers("context")
        gen = await workers("generation")
        conf = tmp_path / "cluster.json"
        conf.write_text(json.dumps(cfg([ctx.url], [gen.url], **coord)))
        uds = str(tmp_path / "proc.sock")
        p = subprocess.Popen([sys.executable, "-m", "splitserve_cli", "coordinator", "-c", str(conf),
                              "--port", "0", "--uds", uds], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
        procs.append(p)
        line = await asyncio.get_running_loop().run_in_executor(None, p.stdout.readline)
        assert line.startswith("splitserve coordinator listening on "), line
        tcp = line.split("listening on ", 1)[1].split(" and ")[0].strip()
        return tcp, "unix://" + uds, gen
    yield make
    for p in procs:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _in_flight(cl: HttpCoordinatorClient) -> int:
    ci = await cl.cluster_info()
    return sum(ci["leases"]["in_flight"].values())


async def test_past_saturation_only_answers_or_sheds_and_no_lease_is_left(coordinator_process):
    # the stand-in workers share this busy event loop: probes must not eject them meanwhile
    # 10 ms: with 50 ms a fast moment of the CI box let the coordinator keep up with all 8,000
    # (~15 µs each over an empty index) and shed none
    tcp, uds, gen = await coordinator_process(max_queue_delay_s=0.01, threshold=10_000,
                                              server_info_timeout_s=30.0)
    # distinct prompts, so the router's memo of the last prefix walk cannot make placements free
    prompts = [block_keys(list(range(v * 7919, v * 7919 + 4096)), 16) for v in range(16)]
    clients = [HttpCoordinatorClient(uds, timeout=30.0) for _ in range(4)]
    probe = HttpCoordinatorClient(tcp, timeout=10.0, channel=False)
    try:
        async def ready():
            return (await probe.cluster_info())["is_ready"]
        for _ in range(200):
            if await ready():
                break
            await asyncio.sleep(0.05)
        await asyncio.gather(*[cl.select("gen", 10**6 + i) for i, cl in enumerate(clients)])
        for i, cl in enumerate(clients):
            await cl.finish("gen", 10**6 + i)
        outcomes = {"ok": 0, "shed": 0}
        placed: list[tuple[HttpCoordinatorClient, int]] = []

        async def one(cl, rid):
            try:
                await cl.select("generation", rid, {"block_keys": prompts[rid % 16], "num_tokens": 4096})
            except CoordinatorOverloaded as exc:
                assert exc.retry_after >= 1 and "overloaded" in str(exc)
                outcomes["shed"] += 1
            else:
                outcomes["ok"] += 1
                placed.append((cl, rid))

        # 4 clients x 2000 concurrent placements of 256 keys each, 100 per client per loop turn
        # (batches of 200 kB): many times the work the coordinator can do within 10 ms
        tasks = []
        for chunk in range(20):
            tasks += [asyncio.ensure_future(one(cl, k * 10_000 + chunk * 100 + i))
                      for k, cl in enumerate(clients) for i in range(100)]
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert outcomes["ok"] + outcomes["shed"] == 8000
        assert outcomes["ok"] > 0 and outcomes["shed"] > 0, outcomes
        async with aiohttp.ClientSession() as http:
            async with http.get(tcp + "/metrics") as r:
                text = await r.text()
        assert f'splitserve_coordinator_shed_total{{transport="channel"}} {float(outcomes["shed"])}' in text
        assert await _in_flight(probe) == outcomes["ok"]
        for cl, rid in placed:
            assert cl.finish_nowait("generation", rid)
        for _ in range(200):
            if await _in_flight(probe) == 0:
                break
            await asyncio.sleep(0.05)
        assert await _in_flight(probe) == 0
    finally:
        for cl in clients:
            await cl.close()
        await probe.close()


async def test_http_api_sheds_when_the_loop_is_late(served):
    c, s, ctx, gen = await served(max_queue_delay_s=0.01)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    host, port = s.tcp_url.rsplit("//", 1)[1].rsplit(":", 1)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    body = msgpack.packb({"role": "gen", "req_id": 3})
    req = (b"POST /select HTTP/1.1\r\nHost: c\r\nContent-Type: application/msgpack\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, b"GET /version HTTP/1.1\r\nHost: c\r\n\r\n")
    data = b""
    while b"}" not in data:                # the connection is accepted and served
        data += await loop.sock_recv(sock, 65536)
    assert data.startswith(b"HTTP/1.1 200 ")
    # One pause (the OS ran something else) sheds nothing: the next select is answered.
    time.sleep(0.05)
    await asyncio.sleep(0.001)
    await loop.sock_sendall(sock, req)
    data = b""
    while b"\r\n\r\n" not in data:
        data += await loop.sock_recv(sock, 65536)
    assert data.startswith(b"HTTP/1.1 200 "), data[:100]
    while True:           # the rest of that answer, if it came in pieces
        try:
            await asyncio.wait_for(loop.sock_recv(sock, 65536), 0.05)
        except asyncio.TimeoutError:
            break
    # A loop that stays behind (every tick late: two holds in a row) sheds.
    loop.call_soon(time.sleep, 0.05)
    await asyncio.sleep(0.006)      # the next tick runs right after the first hold, 50 ms late
    await loop.sock_sendall(sock, req.replace(msgpack.packb({"role": "gen", "req_id": 3}),
                                              msgpack.packb({"role": "gen", "req_id": 4})))
    time.sleep(0.05)       # hold the event loop again: the tick after it is late too
    data = b""
    while b"\r\n\r\n" not in data:
        data += await loop.sock_recv(sock, 65536)
    head = data.split(b"\r\n\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 429 ") and b"Retry-After: 1" in head
    assert _leases(c) == 1 and s.api.shed == 1      # req 3's lease; req 4 took none
    sock.close()
