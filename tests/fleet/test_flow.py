"""Flow options through real processes: generation_first, request_timeout → 504, the per-connection
request cap, conversation routing by session header, and no_context_fallback."""
from __future__ import annotations

import http.client
import json

import openai
import pytest

from .conftest import free_port, group, http as call, metric, wait_for


@pytest.fixture(scope="module")
def pair(module_cluster):
    (_, ctx), (_, gen) = module_cluster.workers(
        ("context", {"name": "flow-ctx"}),
        ("generation", {"name": "flow-gen", "extra": ("--sim-decode-us-per-step", 20000)}))
    return ctx, gen


def start(c, name, **doc):
    port = free_port()
    cfg = c.config(f"{name}.yaml", port=port, **doc)
    f = c.fleet(cfg, name=name)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: call("GET", url + "/cluster_info")[0] == 200, 60, name, f)
    return url, port


def test_generation_first(module_cluster, pair):
    ctx, gen = pair
    url, _ = start(module_cluster, "genfirst", schedule_style="generation_first",
                   context_servers=group([ctx], "kv_cache_aware"), generation_servers=group([gen], "kv_cache_aware"))
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    r = c.completions.create(model="tiny", prompt="generation first, please", max_tokens=4)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream it"}], max_tokens=4, stream=True) if ch.choices)
    assert text
    st, h, _ = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "route?", "max_tokens": 2})
    assert st == 200 and json.loads(h["x-splitserve-route"])["mode"] == "disaggregated"
    # every context leg's pinned KV is released once its generation leg is done (no pin-timeout wait)
    wait_for(lambda: metric(call("GET", ctx + "/metrics")[2].decode(), "splitserve_worker_num_pinned_transfers") == 0,
             5, "the context worker's pins to be released")


def test_request_timeout_is_504_and_aborts(module_cluster, pair):
    ctx, gen = pair
    url, _ = start(module_cluster, "timeout", request_timeout=0.5, context_servers=group([ctx]),
                   generation_servers=group([gen]))
    # 100 decode steps of 20 ms each cannot finish in 0.5 s
    st, _, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "slow", "max_tokens": 100})
    assert st == 504, raw
    assert json.loads(raw)["error"]["code"] == "upstream_timeout"
    wait_for(lambda: metric(call("GET", gen + "/metrics")[2].decode(), "splitserve_worker_num_requests_running") == 0,
             5, "the timed-out request to be aborted on the worker")
    # streaming: the stream ends with an error event instead of hanging
    st, _, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "slow", "max_tokens": 100,
                                                       "stream": True})
    assert st == 200 and b"upstream_timeout" in raw and raw.rstrip().endswith(b"data: [DONE]")


def test_keepalive_request_cap(module_cluster, pair):
    ctx, gen = pair
    url, port = start(module_cluster, "kacap", fleet={"keepalive_requests": 2}, context_servers=group([ctx]),
                      generation_servers=group([gen]))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"model": "tiny", "prompt": "k", "max_tokens": 1})
    headers = []
    for _ in range(2):
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        headers.append(r.getheader("Connection"))
    conn.close()
    assert headers[0] != "close" and headers[1] == "close"


def test_conversation_routing_by_session_header(module_cluster, pair):
    ctx, gen = pair
    url, _ = start(module_cluster, "conv", context_servers=group([ctx], "conversation"),
                   generation_servers=group([gen], "conversation"))
    st, h, raw = call("POST", url + "/v1/chat/completions",
                      {"model": "tiny", "messages": [{"role": "user", "content": "turn one"}], "max_tokens": 2},
                      {"X-Session-ID": "conv-8f21"})
    assert st == 200, raw
    assert json.loads(h["x-splitserve-route"])["context"]["policy"] == "conversation"


def test_no_context_server_reject_and_aggregate(module_cluster, pair):
    _, gen = pair
    dead = f"127.0.0.1:{free_port()}"
    url, _ = start(module_cluster, "reject", no_context_fallback="reject",
                   context_servers={"urls": [dead], "router": {"type": "kv_cache_aware"}},
                   generation_servers=group([gen], "kv_cache_aware"))
    st, h, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert st == 503 and "Retry-After" in h, raw
    assert json.loads(raw)["error"]["code"] == "no_context_server"
    url2, _ = start(module_cluster, "aggregate", no_context_fallback="aggregate",
                    context_servers={"urls": [dead], "router": {"type": "kv_cache_aware"}},
                    generation_servers=group([gen], "kv_cache_aware"))
    st, h, raw = call("POST", url2 + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert st == 200, raw
    assert json.loads(h["x-splitserve-route"])["mode"] == "aggregate_fallback"
    st, _, raw = call("GET", url2 + "/health")
    assert st == 503     # below the minimum of one healthy context server, though requests are served


def test_signed_client_params_are_forwarded(module_cluster, pair):
    from fleet.auth import AUTH_HEADER, sign
    ctx, gen = pair
    key = "internal-secret"
    url, _ = start(module_cluster, "hmac", internal_request_auth_key=key, context_servers=group([ctx]),
                   generation_servers=group([gen]))
    params = {"request_type": "context_and_generation", "disagg_request_id": 4242424242}
    body = {"model": "tiny", "prompt": "signed", "max_tokens": 2, "disaggregated_params": params}
    st, h, raw = call("POST", url + "/v1/completions", body, {AUTH_HEADER: sign(key, params)})
    assert st == 200, raw
    r = json.loads(h["x-splitserve-route"])
    assert r["mode"] == "aggregated" and "context" not in r
    assert r["client_request_id"] == 4242424242 and r["id"] != 4242424242     # the fleet mints the id
    st, h, raw = call("POST", url + "/v1/completions", body, {AUTH_HEADER: sign("wrong-key", params)})
    assert st == 200, raw
    assert json.loads(h["x-splitserve-route"])["mode"] == "disaggregated"    # forged: stripped


def test_long_stream_renews_its_lease(module_cluster, pair):
    ctx, gen = pair
    url, _ = start(module_cluster, "renew", leases={"ttl_s": 1.0, "renew_interval_s": 0.3},
                   context_servers=group([ctx], "kv_cache_aware"), generation_servers=group([gen], "kv_cache_aware"))
    # 100 decode steps of 20 ms: a 2 s stream, twice the lease TTL
    st, _, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "renew me", "max_tokens": 100,
                                                       "stream": True}, timeout=30)
    assert st == 200 and raw.rstrip().endswith(b"data: [DONE]")
    leases = json.loads(call("GET", url + "/cluster_info")[2])["leases"]
    assert leases["expired_total"]["generation"] == 0, leases
    assert sum(leases["in_flight"].values()) == 0


def test_sigterm_drains_in_flight_stream(module_cluster, pair):
    import signal
    import threading
    ctx, gen = pair
    port = free_port()
    cfg = module_cluster.config("drain.yaml", port=port, context_servers=group([ctx]),
                                generation_servers=group([gen]), fleet={"drain_timeout_s": 10})
    f = module_cluster.fleet(cfg, name="drain")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: call("GET", url + "/cluster_info")[0] == 200, 60, "drain fleet", f)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=call(
        "POST", url + "/v1/completions", {"model": "tiny", "prompt": "drain", "max_tokens": 60, "stream": True},
        timeout=30)))
    t.start()
    wait_for(lambda: metric(call("GET", gen + "/metrics")[2].decode(), "splitserve_worker_num_requests_running") >= 1,
             10, "the stream to run")
    f.kill(signal.SIGTERM)
    t.join(30)
    st, _, raw = out["r"]
    assert st == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
    f.p.wait(20)
    assert f.p.returncode == 0


def test_overload_sheds_with_429(module_cluster, pair):
    import threading
    ctx, gen = pair
    url, _ = start(module_cluster, "shed", fleet={"max_inflight_requests": 1}, context_servers=group([ctx]),
                   generation_servers=group([gen]))
    first = {}
    t = threading.Thread(target=lambda: first.update(r=call(
        "POST", url + "/v1/completions", {"model": "tiny", "prompt": "hold", "max_tokens": 50}, timeout=30)))
    t.start()
    wait_for(lambda: metric(call("GET", gen + "/metrics")[2].decode(), "splitserve_worker_num_requests_running") >= 1,
             10, "the first request to run")
    st, h, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "shed me", "max_tokens": 1})
    assert st == 429 and h.get("Retry-After") == "1", raw
    assert json.loads(raw)["error"]["type"] == "rate_limit_error"
    t.join(30)
    assert first["r"][0] == 200


@pytest.mark.parametrize("num_workers", [1, 2])
def test_dynamically_registered_workers(cluster, num_workers):
    from .conftest import free_port_pair
    port = free_port_pair()
    # one process: the in-process coordinator also serves its API on port - 1 for registrations
    cfg = cluster.config("dyn.yaml", port=port, num_workers=num_workers,
                         disagg_cluster={"cluster_uri": f"http://127.0.0.1:{port - 1}"},
                         context_servers={"router": {"type": "kv_cache_aware"}},
                         generation_servers={"router": {"type": "kv_cache_aware"}})
    f = cluster.fleet(cfg, name="dyn-fleet")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: call("GET", url + "/cluster_info")[0] == 200, 90, "fleet without workers", f)
    assert call("GET", url + "/health")[0] == 503            # nothing registered yet
    coord = f"http://127.0.0.1:{port - 1}"
    reg = ("--coordinator-url", coord, "--register-ttl", 5)
    cluster.workers(("context", {"name": "dyn-ctx", "extra": reg}), ("generation", {"name": "dyn-gen", "extra": reg}))
    wait_for(lambda: call("GET", url + "/health", headers={"Connection": "close"})[0] == 200, 30,
             "registered workers to reach every fleet process", f)
    st, h, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "dynamic", "max_tokens": 2})
    assert st == 200, raw
    assert json.loads(h["x-splitserve-route"])["mode"] == "disaggregated"


def test_generation_server_without_kv_transfer_is_served_aggregated(module_cluster, pair):
    from .conftest import PY, ROOT
    ctx, _ = pair
    sport = free_port()
    stub = module_cluster.spawn("no-transfer-gen", [PY, str(ROOT / "tests" / "fleet" / "no_transfer_worker.py"),
                                                   str(sport)])
    gen = f"http://127.0.0.1:{sport}"
    wait_for(lambda: call("GET", gen + "/health")[0] == 200, 30, "stub generation backend", stub)
    url, _ = start(module_cluster, "notransfer", context_servers=group([ctx]), generation_servers=group([gen]))
    wait_for(lambda: call("GET", url + "/health")[0] == 200, 30, "fleet health")
    ctx_prompts = lambda: metric(call("GET", ctx + "/metrics")[2].decode(), "splitserve_worker_prompt_tokens_total")
    st, h, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "first", "max_tokens": 1})
    assert st == 200, raw
    assert json.loads(h["x-splitserve-route"])["mode"] == "no_kv_transfer"
    # the context leg that ran before the 501 is released at once (abort), not at its pin timeout
    wait_for(lambda: metric(call("GET", ctx + "/metrics")[2].decode(), "splitserve_worker_num_pinned_transfers") == 0,
             5, "the context leg's pinned KV to be released")
    before = ctx_prompts()
    st, h, raw = call("POST", url + "/v1/completions", {"model": "tiny", "prompt": "second", "max_tokens": 1})
    assert st == 200 and json.loads(h["x-splitserve-route"])["mode"] == "no_kv_transfer"
    assert ctx_prompts() == before          # known not to receive KV: no context leg any more
    assert json.loads(call("GET", gen + "/stats")[2])["aggregated"] == 2
