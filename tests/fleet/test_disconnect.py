"""Client disconnects reach both legs at once (reference §7.7: upstream has no disconnect watcher).

Sim workers with a slow prefill (context) and a slow decode (generation) keep each leg busy long
enough to hang up in the middle of it. After the client closes its socket: the worker running the
leg drops the request within 200 ms, no further leg is started, the coordinator's in-flight count
returns to zero and the KV blocks of both workers return to their baseline (nothing stays pinned).
"""
from __future__ import annotations

import json
import socket
import time
import uuid

import pytest

from .conftest import free_port, group, healthy, http, metric, recv_until, wait_for

ABORT_BUDGET_S = 0.2


@pytest.fixture(scope="module")
def slow(module_cluster):
    c = module_cluster
    (_, ctx), (_, gen) = c.workers(
        ("context", {"name": "slow-ctx", "extra": ("--sim-prefill-us-per-token", 20000)}),
        ("generation", {"name": "slow-gen", "extra": ("--sim-decode-us-per-step", 100000)}))
    port = free_port()
    cfg = c.config("slow.yaml", port=port, context_servers=group([ctx], "kv_cache_aware"),
                   generation_servers=group([gen], "kv_cache_aware"))
    f = c.fleet(cfg, name="fleet-slow")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)
    return {"url": url, "port": port, "ctx": ctx, "gen": gen}


def wm(url: str) -> str:
    st, _, raw = http("GET", url + "/metrics", timeout=5)
    assert st == 200
    return raw.decode()


def running(url: str) -> float:
    return metric(wm(url), "splitserve_worker_num_requests_running")


def blocks(url: str, state: str) -> float:
    return metric(wm(url), "splitserve_worker_kv_blocks", state=state)


def in_flight(fleet_url: str) -> int:
    st, _, raw = http("GET", fleet_url + "/cluster_info")
    return sum(json.loads(raw)["leases"]["in_flight"].values())


def send(port: int, path: str, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), len(data)) + data)
    return s


def hang_up_and_time(s: socket.socket, worker: str) -> float:
    t0 = time.monotonic()
    s.close()
    while time.monotonic() - t0 < 3:
        if running(worker) == 0:
            return time.monotonic() - t0
        time.sleep(0.01)
    return float("inf")


def prompt() -> str:
    # ~150 byte-tokens of unique text: 3 s of simulated prefill, never a prefix-cache hit.
    return f"{uuid.uuid4().hex} " * 4 + "x" * 20


def settle(slow):
    wait_for(lambda: in_flight(slow["url"]) == 0, 5, "coordinator in-flight back to 0")
    wait_for(lambda: blocks(slow["ctx"], "used") == 0 and blocks(slow["ctx"], "pinned") == 0, 5,
             "context worker blocks back to baseline")
    wait_for(lambda: blocks(slow["gen"], "used") == 0, 5, "generation worker blocks back to baseline")


def test_disconnect_during_context_leg(slow):
    settle(slow)
    gen_prompts = metric(wm(slow["gen"]), "splitserve_worker_prompt_tokens_total")
    s = send(slow["port"], "/v1/completions", {"model": "tiny", "prompt": prompt(), "max_tokens": 4})
    wait_for(lambda: running(slow["ctx"]) == 1, 5, "the context leg to start")
    assert in_flight(slow["url"]) >= 1
    took = hang_up_and_time(s, slow["ctx"])
    assert took < ABORT_BUDGET_S, f"context worker still running the request {took:.3f}s after the hang-up"
    settle(slow)
    time.sleep(0.3)
    # No generation leg was started for a client that is gone.
    assert metric(wm(slow["gen"]), "splitserve_worker_prompt_tokens_total") == gen_prompts
    st, _, raw = http("GET", slow["url"] + "/metrics")
    assert metric(raw.decode(), "splitserve_fleet_client_disconnects_total", phase="context") >= 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_generation(slow, stream):
    settle(slow)
    body = {"model": "tiny", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "max_tokens": 60,
            "stream": stream}
    s = send(slow["port"], "/v1/chat/completions", body)
    if stream:     # until the first streamed event reached the client
        recv_until(s, b"data: ", 10, "stream ended early")
    wait_for(lambda: running(slow["gen"]) == 1, 10, "the generation leg to run")
    took = hang_up_and_time(s, slow["gen"])
    assert took < ABORT_BUDGET_S, f"generation worker still running {took:.3f}s after the hang-up"
    # The finished context leg's pinned KV is released by the abort, not by the 60 s pin timeout.
    settle(slow)
    assert metric(wm(slow["ctx"]), "splitserve_worker_num_pinned_transfers") == 0


def test_requests_still_complete_after_disconnects(slow):
    st, _, raw = http("POST", slow["url"] + "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2},
                      timeout=30)
    assert st == 200, raw
    settle(slow)
