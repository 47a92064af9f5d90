"""Overload, end to end with real processes (issue 13).

- A fleet on an external coordinator driven far past what its coordinator path admits (a tiny
  `fleet.coordinator_max_pending` and `coordinator.max_queue_delay_s`): every client gets 200 or
  503/429 with `Retry-After` and an OpenAI error body — no timeout, no connection error — and once
  the load is gone the coordinator holds no lease.
- The listening socket keeps its 4096 backlog (aiohttp's SockSite listened again with 128: 256
  connections opened at once overflowed the accept queue and their first requests waited ~1 s for
  TCP retransmission), and 300 connections opened at once all get their first answer promptly.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import aiohttp
import pytest

from .conftest import free_port, group, healthy, http, metric, wait_for


@pytest.fixture(scope="module")
def workers(module_cluster):
    (_, ctx), (_, gen) = module_cluster.workers(("context", {"name": "ovl-ctx"}), ("generation", {"name": "ovl-gen"}))
    return ctx, gen


def _leases(curl: str) -> int:
    st, _, raw = http("GET", curl + "/cluster_info")
    assert st == 200
    return sum(json.loads(raw)["leases"]["in_flight"].values())


async def _blast(url: str, n: int, body: dict) -> list[tuple[int, dict, bytes]]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i):
            async with s.post(url + "/v1/completions", json={**body, "prompt": f"{body['prompt']} {i}"}) as r:
                return r.status, dict(r.headers), await r.read()
        return await asyncio.gather(*[one(i) for i in range(n)])


def test_past_saturation_clients_get_200_or_shed_and_no_lease_is_left(cluster, workers):
    ctx, gen = workers
    cport = free_port()
    ccfg = cluster.config("coord.yaml", port=cport + 1, context_servers=group([ctx], "kv_cache_aware"),
                          generation_servers=group([gen], "kv_cache_aware"),
                          coordinator={"max_queue_delay_s": 0.002})
    coord = cluster.coordinator(ccfg, cport)
    curl = f"http://127.0.0.1:{cport}"
    wait_for(lambda: http("GET", curl + "/health")[0] == 200, 60, "coordinator", coord)
    port = free_port()
    fcfg = cluster.config("fleet.yaml", port=port, context_servers=group([ctx], "kv_cache_aware"),
                          generation_servers=group([gen], "kv_cache_aware"),
                          fleet={"coordinator_max_pending": 4, "coordinator_timeout_s": 30})
    f = cluster.fleet(fcfg, "--coordinator-url", curl)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "fleet on the external coordinator", f)
    body = {"model": "tiny", "prompt": "overload " * 40, "max_tokens": 1}
    st, _, raw = http("POST", url + "/v1/completions", {**body, "prompt": "warm"})
    assert st == 200, raw
    results = asyncio.run(_blast(url, 300, body))
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429, 503}, sorted(set(statuses))
    # No count of 200s inside the blast: with a 2 ms queue bound, a busy 2-core CI box may
    # legitimately shed all 300 (it did once, 2026-12-06). What must hold is that the cluster
    # serves again once the load is gone, with every lease ended.
    shed = [r for r in results if r[0] != 200]
    assert shed, "300 concurrent requests against 4 pending coordinator calls shed nothing"
    for status, headers, raw in shed:
        assert headers.get("Retry-After") == "1"
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code", "request_id"} and err["message"]
        assert err["request_id"] == {k.lower(): v for k, v in headers.items()}["x-request-id"]
        assert err["type"] in ("service_unavailable", "rate_limit_error")
    assert any("unanswered" in json.loads(r[2])["error"]["message"] for r in shed)
    # every lease that was taken was finished (exactly once: nothing left, nothing expired)
    wait_for(lambda: _leases(curl) == 0, 10, "no lease left on the coordinator")
    st, _, raw = http("POST", url + "/v1/completions", {**body, "prompt": "after the blast"})
    assert st == 200, raw
    wait_for(lambda: _leases(curl) == 0, 10, "no lease left after the request that followed")
    st, _, raw = http("GET", curl + "/cluster_info")
    assert json.loads(raw)["leases"]["expired_total"] == {"context": 0, "generation": 0}
    st, _, text = http("GET", curl + "/metrics")
    assert metric(text.decode(), "splitserve_coordinator_channel_connections") >= 1


def _backlog(port: int) -> int | None:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "LISTEN":
            return int(parts[2])      # Send-Q of a listener = its backlog
    return None


async def _first_answers(port: int, n: int) -> list[float]:
    async def one():
        t0 = time.perf_counter()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await r.readuntil(b"\r\n\r\n")
        dt = time.perf_counter() - t0
        w.close()
        return dt
    return await asyncio.gather(*[one() for _ in range(n)])


def test_one_process_fleet_keeps_its_listen_backlog(cluster, workers):
    ctx, gen = workers
    port = free_port()
    cfg = cluster.config("rr.yaml", port=port, context_servers=group([ctx]), generation_servers=group([gen]))
    f = cluster.fleet(cfg, name="fleet-backlog")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "one-process fleet", f)
    if shutil.which("ss"):
        assert _backlog(port) == 4096
    times = asyncio.run(_first_answers(port, 300))
    assert max(times) < 0.9, sorted(times)[-5:]
