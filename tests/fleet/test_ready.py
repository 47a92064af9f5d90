"""Readiness agrees with the context fallback (issue 39, item 5).

With no context worker and `no_context_fallback: aggregate`, requests are served in
`aggregate_fallback`; the fleet's `/ready` (the Helm chart's readiness probe) must then say ready,
while `/health` stays cluster readiness (503, the coordinator's rule). Under `reject` nothing is
served and `/ready` fails too. Real sim workers and fleet processes on loopback.
"""
from __future__ import annotations

import json

from .conftest import free_port, group, http, wait_for

FAST = {"health_check_interval_s": 0.3, "health_failure_threshold": 1}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _fleet(cluster, name, ctx, gen, **doc):
    port = free_port()
    cfg = cluster.config(f"{name}.yaml", port=port, context_servers=group([ctx]),
                         generation_servers=group([gen]), coordinator=FAST, **doc)
    f = cluster.fleet(cfg, name=name)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http("GET", url + "/health", timeout=2)[0] == 200, 60, name, f)
    return url


def _get(url, path):
    st, _, raw = http("GET", url + path, timeout=5)
    return st, json.loads(raw)


def test_ready_follows_the_fallback_and_health_stays_cluster_readiness(cluster):
    (ctx_proc, ctx), (_, gen) = cluster.workers("context", "generation")
    agg = _fleet(cluster, "aggregate", ctx, gen)
    rej = _fleet(cluster, "reject", ctx, gen, no_context_fallback="reject")
    for url in (agg, rej):
        st, body = _get(url, "/ready")
        assert st == 200 and body["status"] == "ready" and body["mode"] == "disaggregated", body
        st, body = _get(url, "/health")
        assert st == 200 and body["status"] == "ready", body   # the coordinator's wording

    ctx_proc.stop()
    wait_for(lambda: _get(agg, "/health")[0] == 503 and _get(rej, "/health")[0] == 503, 30,
             "both fleets to see the context worker gone")
    st, body = _get(agg, "/health")
    assert body["status"] == "not_ready" and "context" in body["error"], body
    # served aggregated, and ready says so
    st, h, raw = http("POST", agg + "/v1/chat/completions", BODY)
    assert st == 200 and json.loads(h["x-splitserve-route"])["mode"] == "aggregate_fallback", raw
    st, body = _get(agg, "/ready")
    assert st == 200 and body["mode"] == "aggregate_fallback" and body["context_servers"] == 0, body
    # reject: nothing is served, so not ready
    st, _, _ = http("POST", rej + "/v1/chat/completions", BODY)
    assert st == 503
    st, body = _get(rej, "/ready")
    assert st == 503 and body["status"] == "not_ready" and "reject" in body["error"], body

    ctx_proc.start()
    wait_for(lambda: _get(rej, "/ready")[0] == 200 and _get(agg, "/ready")[1].get("mode") == "disaggregated",
             60, "the context worker back")


def test_fleet_version(cluster):
    _, gen = cluster.worker("generation")
    port = free_port()
    cfg = cluster.config("v.yaml", port=port, generation_servers=group([gen]))
    f = cluster.fleet(cfg, name="v")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http("GET", url + "/version", timeout=2)[0] == 200, 60, "fleet", f)
    from protocol.version import VERSION
    st, body = _get(url, "/version")
    assert body["version"] == VERSION and body["process_index"] == 0
