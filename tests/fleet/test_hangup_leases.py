"""No lease outlives its request when the client hangs up at any await point (issue 15, item 1).

The topology `splitserve local` runs: two fleet processes on one SO_REUSEPORT port and the implicit
coordinator in its own process (port - 1), with sim workers. The coordinator creates a lease while
answering `/select_pair`; a client that hangs up while that answer is on its way used to cancel the
fleet handler before it recorded the placement, so no `/finish` was ever sent and the lease stayed
counted until `leases.ttl_s`. Here hundreds of clients hang up 0-10 ms after sending (placement,
context leg, transfer, generation leg, relay), and targeted delays put hang-ups inside each leg;
afterwards every server's lease load in the coordinator's `/cluster_info` must be back to zero within
seconds — the lease TTL is 300 s, so expiry cannot be what cleans up.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid

import pytest

from .conftest import NO_SHEDDING, free_port_pair, group, healthy, http, wait_for

TTL_S = 300.0
SETTLE_S = 5.0


@pytest.fixture(scope="module")
def workers(module_cluster):
    (_, ctx), (_, gen) = module_cluster.workers(
        ("context", {"name": "hl-ctx", "extra": ("--sim-prefill-us-per-token", 200)}),
        ("generation", {"name": "hl-gen", "extra": ("--sim-decode-us-per-step", 2000)}))
    return ctx, gen


# (fleet processes, context policy, generation policy): both delegated → one /select_pair; a local
# context policy → one /select for the generation leg; one process → the coordinator in-process.
# generation_first: the generation leg is sent (and may be retried) while the context leg runs.
# channel: the fleet's calls go over the coordinator's pipelined channel, or (False) plain HTTP
# requests — the transport an external coordinator without the channel gets.
# No context policy: no context servers, an aggregated deployment (one /select, one leg).
TOPOLOGIES = [(2, "kv_cache_aware", "kv_cache_aware", "context_first", True),
              (2, None, "kv_cache_aware", "context_first", True),
              (2, "kv_cache_aware", "kv_cache_aware", "context_first", False),
              (2, "round_robin", "kv_cache_aware", "context_first", False),
              (2, "kv_cache_aware", "kv_cache_aware", "generation_first", True),
              (1, "kv_cache_aware", "kv_cache_aware", "context_first", True)]


@pytest.fixture(params=TOPOLOGIES, ids=lambda t: f"{t[0]}proc-{t[1] or 'aggregated'}-{t[2]}-{t[3]}" + ("" if t[4] else "-http"))
def local(request, module_cluster, workers):
    n, pc, pg, style, channel = request.param
    ctx, gen = workers
    c = module_cluster
    port = free_port_pair()
    name = f"hl-fleet-{n}-{pc}-{style}-{channel}"
    cfg = c.config(f"{name}.yaml", port=port, num_workers=n, leases={"ttl_s": TTL_S}, schedule_style=style,
                   coordinator={**NO_SHEDDING, "channel": channel},
                   **({"context_servers": group([ctx], pc)} if pc else {}),
                   generation_servers=group([gen], pg))
    f = c.fleet(cfg, name=name)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "the fleet", f)
    # two processes: the implicit coordinator's own API; one: the fleet's /cluster_info embeds it
    yield {"url": url, "port": port, "coord": f"http://127.0.0.1:{port - 1}" if n > 1 else url}
    f.stop()


def leases(coord: str) -> dict:
    st, _, raw = http("GET", coord + "/cluster_info", headers={"Connection": "close"})
    assert st == 200, raw
    ci = json.loads(raw)
    per_server = {s["url"]: (s["load"]["requests"], s["load"]["tokens"])
                  for role in ci["servers"].values() for s in role}
    return {"in_flight": ci["leases"]["in_flight"], "servers": per_server,
            "expired": sum(ci["leases"]["expired_total"].values())}


def idle(coord: str) -> bool:
    ls = leases(coord)
    return not any(ls["in_flight"].values()) and all(r == 0 and t == 0 for r, t in ls["servers"].values())


def hang_up(port: int, body: bytes, path: str, delay_s: float) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % (path.encode(), len(body)) + body)
        time.sleep(delay_s)
        # RST instead of FIN: the fleet notices at once, like a client process that was killed.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    finally:
        s.close()


def storm(port: int, n: int, max_delay_s: float, threads: int = 16, stream: bool = False) -> None:
    rng = random.Random(n)
    jobs = []
    for i in range(n):
        chat = i % 3 == 0
        body = {"model": "tiny", "max_tokens": rng.randint(1, 40), "stream": stream or i % 2 == 0}
        if chat:
            body["messages"] = [{"role": "user", "content": f"{uuid.uuid4().hex} hang up {i}"}]
        else:
            body["prompt"] = f"{uuid.uuid4().hex} " * rng.randint(1, 8)
        jobs.append((json.dumps(body).encode(), "/v1/chat/completions" if chat else "/v1/completions",
                     rng.uniform(0.0, max_delay_s)))
    lock = threading.Lock()

    def run():
        while True:
            with lock:
                if not jobs:
                    return
                job = jobs.pop()
            hang_up(port, *job)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)


def assert_no_leases(local, what: str) -> None:
    t0 = time.monotonic()
    try:
        wait_for(lambda: idle(local["coord"]), SETTLE_S, f"every lease released after {what}")
    except AssertionError:
        raise AssertionError(f"leases still held {SETTLE_S}s after {what}: {leases(local['coord'])}") from None
    assert leases(local["coord"])["expired"] == 0, "a lease was released by expiry, not by /finish"
    assert time.monotonic() - t0 < SETTLE_S


def test_early_hangups_leave_no_lease(local):
    assert idle(local["coord"])
    # 0-10 ms: most hang-ups land while placement (the /select_pair round trip) is in flight.
    storm(local["port"], 400, 0.010)
    assert_no_leases(local, "400 clients hung up 0-10 ms after sending")
    # 0-60 ms: hang-ups inside the context leg (~200 µs/token), the transfer and the decode steps.
    storm(local["port"], 200, 0.060)
    assert_no_leases(local, "200 clients hung up 0-60 ms after sending")
    # the fleet still serves, and the requests it served were released too
    st, _, raw = http("POST", local["url"] + "/v1/completions", {"model": "tiny", "prompt": "still there?",
                                                                  "max_tokens": 3})
    assert st == 200, raw
    assert_no_leases(local, "a normal request")
