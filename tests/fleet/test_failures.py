"""Failure semantics with real processes (reference §7.6: upstream retries the same server, re-mints
ids, retries 4xx/5xx, and has no local fallback):

- a connect-level failure is retried on a *different* server, the id kept, the attempt counted;
- a context worker killed mid-request: that client gets a clean 502, the server is ejected, later
  requests succeed;
- the coordinator killed under load: no request fails (local placement from the last-known list),
  and delegated placement resumes when it is back.
"""
from __future__ import annotations

import json
import signal
import threading
import time
import uuid

from .conftest import free_port, group, healthy, http, metric, wait_for
from .test_topologies import Load


def route(h) -> dict:
    return json.loads(h["x-splitserve-route"])


def test_retry_lands_on_another_server(cluster):
    (_, ctx), (doomed, dead), (_, gen) = cluster.workers(
        ("context", {"name": "live-ctx"}), ("context", {"name": "dead-ctx"}), ("generation", {"name": "live-gen"}))
    port = free_port()
    cfg = cluster.config(port=port, context_servers=group([dead, ctx]), generation_servers=group([gen]),
                         fleet={"retry_backoff_s": 0.01})
    f = cluster.fleet(cfg)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url) and json.loads(http("GET", url + "/health")[2])["context_servers"] == 2, 60,
             "fleet with both context servers healthy", f)
    # The server dies; until the coordinator's probes notice, it is still listed healthy, so the
    # fleet's round robin will pick it and must retry elsewhere.
    doomed.kill(signal.SIGKILL)
    doomed.p.wait(10)
    retried = []
    for _ in range(6):
        st, h, raw = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "retry me", "max_tokens": 2})
        assert st == 200, raw
        r = route(h)
        assert r["context"]["server"] == ctx
        if r.get("retries", {}).get("context"):
            retried.append(r)
    assert retried, "round robin must have tried the dead server once"
    assert retried[0]["retries"]["context"] == 1
    st, _, m = http("GET", url + "/metrics")
    text = m.decode()
    assert metric(text, "splitserve_fleet_leg_retries_total", role="context") >= 1
    assert metric(text, "splitserve_fleet_server_ejections_total", server=dead) >= 1
    # ejected: later requests do not try it again
    st, _, raw = http("GET", url + "/cluster_info")
    assert dead in json.loads(raw)["fleet"]["ejected_servers"]


def test_context_worker_killed_mid_request(cluster):
    (slow, slow_url), (_, fast_url), (_, gen) = cluster.workers(
        ("context", {"name": "doomed-ctx", "extra": ("--sim-prefill-us-per-token", 30000)}),
        ("context", {"name": "spare-ctx"}), ("generation", {"name": "gen"}))
    port = free_port()
    cfg = cluster.config(port=port, context_servers=group([slow_url, fast_url]), generation_servers=group([gen]))
    f = cluster.fleet(cfg)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)

    result = {}

    def call():
        result["r"] = http("POST", url + "/v1/completions",
                           {"model": "tiny", "prompt": uuid.uuid4().hex * 3, "max_tokens": 2}, timeout=30)

    def slow_running():
        st, _, raw = http("GET", slow_url + "/metrics", timeout=2)
        return metric(raw.decode(), "splitserve_worker_num_requests_running") >= 1

    # round robin: one of two consecutive requests lands on the slow worker
    for _ in range(4):
        t = threading.Thread(target=call)
        t.start()
        try:
            wait_for(slow_running, 1.5, "a request on the slow context worker")
            break
        except AssertionError:
            t.join(30)
    else:
        raise AssertionError("no request reached the slow context worker")
    slow.kill(signal.SIGKILL)
    t.join(30)
    st, _, raw = result["r"]
    assert st == 502, raw
    err = json.loads(raw)["error"]
    assert err["code"] == "upstream_error" and slow_url in err["message"]
    for _ in range(6):
        st, h, raw = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "after", "max_tokens": 2})
        assert st == 200, raw
        assert route(h)["context"]["server"] == fast_url
    st, _, raw = http("GET", url + "/cluster_info")
    assert slow_url in json.loads(raw)["fleet"]["ejected_servers"]


def test_coordinator_killed_under_load_and_restarted(cluster):
    (_, ctx), (_, gen) = cluster.workers(("context", {"name": "c-ctx"}), ("generation", {"name": "c-gen"}))
    cport = free_port()
    ccfg = cluster.config("coord.yaml", port=cport + 1, context_servers=group([ctx], "kv_cache_aware"),
                          generation_servers=group([gen], "kv_cache_aware"))
    coord = cluster.coordinator(ccfg, cport)
    curl = f"http://127.0.0.1:{cport}"
    wait_for(lambda: http("GET", curl + "/health")[0] == 200, 60, "coordinator", coord)
    port = free_port()
    fcfg = cluster.config("fleet.yaml", port=port, context_servers=group([ctx], "kv_cache_aware"),
                          generation_servers=group([gen], "kv_cache_aware"), fleet={"coordinator_timeout_s": 1})
    f = cluster.fleet(fcfg, "--coordinator-url", curl)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)

    def fleet_view():
        return json.loads(http("GET", url + "/cluster_info")[2])["fleet"]

    body = {"model": "tiny", "prompt": "keep serving through the outage", "max_tokens": 2}
    with Load(url, body) as load:
        time.sleep(0.5)
        coord.kill(signal.SIGKILL)
        coord.p.wait(10)
        wait_for(lambda: not fleet_view()["coordinator_reachable"], 10, "the fleet to notice the outage")
        served_during = load.ok
        time.sleep(1.5)
        assert load.ok > served_during, "requests must keep flowing while the coordinator is down"
        st, h, _ = http("POST", url + "/v1/completions", body)
        assert st == 200 and route(h)["context"]["policy"] == "local_fallback"
        coord2 = cluster.coordinator(ccfg, cport, name="coordinator-2")
        wait_for(lambda: fleet_view()["coordinator_reachable"], 60, "the fleet to reach the new coordinator", coord2)
        time.sleep(0.5)
    assert load.failed == [], load.failed[:5]
    st, h, _ = http("POST", url + "/v1/completions", body)
    assert st == 200 and route(h)["context"]["policy"] == "kv_cache_aware"   # delegated placement again
    st, _, m = http("GET", url + "/metrics")
    text = m.decode()
    assert metric(text, "splitserve_fleet_coordinator_fallback_total", role="context") >= 1
    assert metric(text, "splitserve_fleet_coordinator_reachable") == 1
    assert "coordinator unreachable" in f.log() and "back to delegated placement" in f.log()
