"""The vLLM and SGLang engine protocols end to end: a fleet in front of sim workers started with
`--disagg-protocol vllm|sglang` (worker/engine_protocols.py), kv-aware placement on both roles. The
vLLM sims answer no /server_info, like a stock vLLM: their groups name the protocol and the KV-event
publishers (static `kv_events`); the SGLang sims are recognised from their /server_info (SGLang's
`disaggregation_*` keys and its `kv_events` descriptor).

For each protocol: a two-leg request returns exactly the tokens the decode server computes alone
(the sim's tokens are a function of the prompt), the route receipt names both servers and the
protocol, the coordinator's leases all come back (/finish once each), and the prefill worker's KV
pins are released by the decode side's transfer; a client that hangs up during the prefill leg or
during the decode stream has both legs dropped (vLLM: closed connection; SGLang: /abort_request on
both engines) with no request, lease or KV block left behind.
"""
from __future__ import annotations

import json
import signal
import time
import uuid

import pytest

from .conftest import free_port, group, healthy, http, metric, recv_until, wait_for
from .test_disconnect import ABORT_BUDGET_S, blocks, hang_up_and_time, in_flight, running, send, wm


def pd_worker(c, role: str, proto: str, name: str, extra=()):
    """(proc, url, kv_events entry) of a sim worker speaking `proto`. A vLLM one answers no
    /server_info, like a stock vLLM: its group names the protocol and its KV-event publisher (the
    static `kv_events` entry); an SGLang one is recognised from its /server_info."""
    if proto != "vllm":
        p, url = c.worker(role, name=name, extra=("--disagg-protocol", proto, *extra))
        return p, url, None
    pub, rep = free_port(), free_port()
    p, url = c.worker(role, name=name, extra=("--disagg-protocol", proto, "--kv-events-port", pub,
                                              "--kv-replay-port", rep, *extra))
    return p, url, {"server": url.replace("http://", ""), "endpoint": f"tcp://127.0.0.1:{pub}",
                    "replay_endpoint": f"tcp://127.0.0.1:{rep}", "engine": "vllm"}


def pd_group(workers, policy: str, proto: str) -> dict:
    g = group([w[1] for w in workers], policy)
    if proto == "vllm":
        g["protocol"] = "vllm"
        g["kv_events"] = [w[2] for w in workers]
    return g


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def pd(request, module_cluster):
    proto = request.param
    c = module_cluster
    cw = pd_worker(c, "context", proto, f"{proto}-ctx", ("--sim-prefill-us-per-token", 8000, "--pin-timeout", 30))
    gw = pd_worker(c, "generation", proto, f"{proto}-gen", ("--sim-decode-us-per-step", 60000))
    ctx, gen = cw[1], gw[1]
    port = free_port()
    cfg = c.config(f"{proto}.yaml", port=port, context_servers=pd_group([cw], "kv_cache_aware", proto),
                   generation_servers=pd_group([gw], "kv_cache_aware", proto),
                   conditional_disagg_config={"max_local_prefill_length": 32})
    f = c.fleet(cfg, name=f"fleet-{proto}")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)
    return {"proto": proto, "url": url, "port": port, "ctx": ctx, "gen": gen}


def settle(pd):
    wait_for(lambda: in_flight(pd["url"]) == 0, 5, "coordinator in-flight back to 0")
    for w in (pd["ctx"], pd["gen"]):
        wait_for(lambda w=w: running(w) == 0 and blocks(w, "used") == 0 and blocks(w, "pinned") == 0, 5,
                 f"worker {w} idle with its KV blocks back to baseline")
        wait_for(lambda w=w: metric(wm(w), "splitserve_worker_num_pinned_transfers") == 0, 5,
                 f"worker {w} has no pinned transfer")


def text_of(obj: dict) -> str:
    c = obj["choices"][0]
    return c.get("text") if "text" in c else c["message"]["content"]


def test_two_leg_request_matches_decode_server_alone(pd):
    settle(pd)
    prompt = f"{uuid.uuid4().hex} two legs"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    ctx_prompts = metric(wm(pd["ctx"]), "splitserve_worker_prompt_tokens_total")
    st, h, raw = http("POST", pd["url"] + "/v1/completions", body, timeout=30)
    assert st == 200, raw
    route = json.loads(h["x-splitserve-route"])
    assert route["mode"] == "disaggregated" and route["protocol"] == pd["proto"]
    assert route["context"]["server"] == pd["ctx"] and route["generation"]["server"] == pd["gen"]
    out = json.loads(raw)
    assert "kv_transfer_params" not in out or out["kv_transfer_params"] is None
    assert metric(wm(pd["ctx"]), "splitserve_worker_prompt_tokens_total") > ctx_prompts
    settle(pd)      # the decode side's transfer released the prefill's pins; every lease finished
    # The decode server alone (no leg fields: vLLM and our SGLang sim serve it locally) gives the
    # same tokens: the first token was computed once, on the decode side, from the moved prompt.
    st, _, alone = http("POST", pd["gen"] + "/v1/completions", body, timeout=30)
    assert st == 200, alone
    assert text_of(out) == text_of(json.loads(alone)) and out["usage"]["completion_tokens"] == 6


def test_streamed_chat_relays_the_decode_stream(pd):
    settle(pd)
    body = {"model": "tiny", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    st, h, raw = http("POST", pd["url"] + "/v1/chat/completions", body, timeout=30)
    assert st == 200, raw
    assert h["Content-Type"].startswith("text/event-stream")
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert "".join((c["choices"][0]["delta"].get("content") or "") for c in events if c["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 4
    settle(pd)


def test_client_cannot_send_leg_fields(pd):
    for field, v in (("kv_transfer_params", {"do_remote_prefill": True}), ("bootstrap_room", 7), ("rid", "x")):
        st, _, raw = http("POST", pd["url"] + "/v1/completions",
                          {"model": "tiny", "prompt": "x", "max_tokens": 1, field: v})
        assert st == 400, raw
        assert json.loads(raw)["error"]["param"] == field


def test_hang_up_during_prefill_drops_both_legs(pd):
    settle(pd)
    gen_prompts = metric(wm(pd["gen"]), "splitserve_worker_prompt_tokens_total")
    # ~150 byte-tokens: over a second of simulated prefill.
    s = send(pd["port"], "/v1/completions",
             {"model": "tiny", "prompt": f"{uuid.uuid4().hex} " * 4 + "x" * 20, "max_tokens": 4})
    wait_for(lambda: running(pd["ctx"]) == 1, 5, "the prefill leg to start")
    took = hang_up_and_time(s, pd["ctx"])
    assert took < ABORT_BUDGET_S, f"prefill worker still running {took:.3f}s after the hang-up"
    settle(pd)
    st, _, raw = http("GET", pd["url"] + "/metrics")
    if pd["proto"] == "vllm":
        # Sequential: no decode leg was started for a client that is gone.
        assert metric(wm(pd["gen"]), "splitserve_worker_prompt_tokens_total") == gen_prompts
    else:
        # Concurrent: the decode leg waiting at the bootstrap server was aborted too (/abort_request).
        assert metric(raw.decode(), "splitserve_fleet_upstream_aborts_total", role="generation") >= 1


def test_hang_up_during_decode_stream_drops_it(pd):
    settle(pd)
    body = {"model": "tiny", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "max_tokens": 60,
            "stream": True}
    s = send(pd["port"], "/v1/chat/completions", body)
    recv_until(s, b"data: ", 20, "stream ended early")
    wait_for(lambda: running(pd["gen"]) == 1, 10, "the decode leg to run")
    took = hang_up_and_time(s, pd["gen"])
    assert took < ABORT_BUDGET_S, f"decode worker still running {took:.3f}s after the hang-up"
    settle(pd)


def test_requests_complete_after_hang_ups(pd):
    st, _, raw = http("POST", pd["url"] + "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2},
                      timeout=30)
    assert st == 200, raw
    settle(pd)


def route_of(h) -> dict:
    return json.loads(h["x-splitserve-route"])


def test_conditional_disaggregation_where_the_protocol_allows_it(pd):
    """A prompt the decode server already holds: vLLM serves it there alone (local prefill); an SGLang
    decode server cannot serve a request without a prefill leg, so it still gets one."""
    settle(pd)
    body = {"model": "tiny", "prompt": uuid.uuid4().hex * 6, "max_tokens": 2, "temperature": 0}
    st, h, raw = http("POST", pd["url"] + "/v1/completions", body, timeout=30)
    assert st == 200 and route_of(h)["mode"] == "disaggregated", raw
    settle(pd)
    deadline = time.monotonic() + 10
    while True:     # until the decode server's KV events for the moved prompt reached the coordinator
        ctx_prompts = metric(wm(pd["ctx"]), "splitserve_worker_prompt_tokens_total")
        st, h, raw = http("POST", pd["url"] + "/v1/completions", body, timeout=30)
        assert st == 200, raw
        r = route_of(h)
        settle(pd)
        if r["generation"].get("matched_tokens", 0) >= 160 or time.monotonic() > deadline:
            break
    assert r["generation"].get("matched_tokens", 0) >= 160, r
    prefilled = metric(wm(pd["ctx"]), "splitserve_worker_prompt_tokens_total") > ctx_prompts
    if pd["proto"] == "vllm":
        assert r["mode"] == "generation_only" and "context" not in r and not prefilled, r
    else:
        assert r["mode"] == "disaggregated" and r["context"]["server"] == pd["ctx"] and prefilled, r


@pytest.mark.parametrize("proto", ["vllm", "sglang"])
def test_dead_prefill_server_is_retried_elsewhere(cluster, proto):
    live = pd_worker(cluster, "context", proto, "live-ctx")
    doomed, dead, dead_ev = pd_worker(cluster, "context", proto, "dead-ctx")
    gw = pd_worker(cluster, "generation", proto, "live-gen")
    ctx, gen = live[1], gw[1]
    port = free_port()
    cfg = cluster.config(port=port, context_servers=pd_group([(doomed, dead, dead_ev), live], "round_robin", proto),
                         generation_servers=pd_group([gw], "round_robin", proto), fleet={"retry_backoff_s": 0.01})
    f = cluster.fleet(cfg)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url) and json.loads(http("GET", url + "/health")[2])["context_servers"] == 2, 60,
             "fleet with both prefill servers healthy", f)
    doomed.kill(signal.SIGKILL)
    doomed.p.wait(10)
    retried = []
    for _ in range(6):
        st, h, raw = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "retry me", "max_tokens": 2})
        assert st == 200, raw
        r = route_of(h)
        assert r["mode"] == "disaggregated" and r["context"]["server"] == ctx, r
        if r.get("retries", {}).get("context"):
            retried.append(r)
    assert retried and retried[0]["retries"]["context"] == 1, "round robin must have tried the dead server once"
    st, _, raw = http("GET", url + "/cluster_info")
    assert sum(json.loads(raw)["leases"]["in_flight"].values()) == 0
    for w in (ctx, gen):
        wait_for(lambda w=w: running(w) == 0 and blocks(w, "used") == 0 and blocks(w, "pinned") == 0, 5,
                 f"worker {w} idle")


def test_sglang_prefill_dying_aborts_the_waiting_decode(cluster):
    """sglang #9726: a decode whose prefill failed must not wait for KV that never comes."""
    (doomed, ctx), (_, gen) = cluster.workers(
        ("context", {"name": "sg-ctx", "extra": ("--disagg-protocol", "sglang", "--sim-prefill-us-per-token", 20000)}),
        ("generation", {"name": "sg-gen", "extra": ("--disagg-protocol", "sglang")}))
    port = free_port()
    cfg = cluster.config(port=port, context_servers=group([ctx]), generation_servers=group([gen]),
                         max_retries=0)
    f = cluster.fleet(cfg)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)
    s = send(port, "/v1/completions", {"model": "tiny", "prompt": f"{uuid.uuid4().hex} " * 4, "max_tokens": 4})
    wait_for(lambda: running(ctx) == 1, 5, "the prefill leg to start")
    doomed.kill(signal.SIGKILL)
    doomed.p.wait(10)
    got = recv_until(s, b"\r\n\r\n", 10, "the fleet closed the connection without an answer")
    s.close()
    assert got.startswith(b"HTTP/1.1 502"), got[:200]
    wait_for(lambda: blocks(gen, "used") == 0 and metric(wm(gen), "splitserve_worker_num_requests_waiting") == 0,
             3, "the decode leg aborted, its blocks freed")
    wait_for(lambda: in_flight(url) == 0, 5, "every lease finished")
    st, _, raw = http("GET", url + "/metrics")
    assert metric(raw.decode(), "splitserve_fleet_upstream_aborts_total", role="generation") >= 1


def test_vllm_prefill_pins_end_at_the_lease_when_no_decode_comes(cluster):
    """vLLM has no abort for a finished prefill: its blocks wait for the decode's read and are freed
    at the lease (`kv_lease_duration`; the sim's --pin-timeout) when the decode never comes."""
    cw = pd_worker(cluster, "context", "vllm", "vl-ctx", ("--pin-timeout", 1))
    doomed, gen, gen_ev = pd_worker(cluster, "generation", "vllm", "vl-gen")
    ctx = cw[1]
    port = free_port()
    cfg = cluster.config(port=port, context_servers=pd_group([cw], "round_robin", "vllm"),
                         generation_servers=pd_group([(doomed, gen, gen_ev)], "round_robin", "vllm"),
                         max_retries=0)
    f = cluster.fleet(cfg)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)
    doomed.kill(signal.SIGKILL)
    doomed.p.wait(10)
    st, _, raw = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "orphan", "max_tokens": 2},
                      timeout=30)
    assert st in (502, 503), raw
    assert metric(wm(ctx), "splitserve_worker_num_pinned_transfers") == 1
    t0 = time.monotonic()
    wait_for(lambda: metric(wm(ctx), "splitserve_worker_num_pinned_transfers") == 0
             and blocks(ctx, "pinned") == 0, 5, "the prefill's pins freed at the lease")
    assert time.monotonic() - t0 < 3
    wait_for(lambda: in_flight(url) == 0, 5, "every lease finished")


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def pd2(request, module_cluster):
    """Two prefill and two decode servers per protocol, kv-aware placement on both roles."""
    proto = request.param
    c = module_cluster
    cws = [pd_worker(c, "context", proto, f"{proto}-kv-ctx{i}") for i in range(2)]
    gws = [pd_worker(c, "generation", proto, f"{proto}-kv-gen{i}") for i in range(2)]
    ctxs, gens = [w[1] for w in cws], [w[1] for w in gws]
    port = free_port()
    cfg = c.config(f"{proto}-kv.yaml", port=port, context_servers=pd_group(cws, "kv_cache_aware", proto),
                   generation_servers=pd_group(gws, "kv_cache_aware", proto))
    f = c.fleet(cfg, name=f"fleet-{proto}-kv")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url) and json.loads(http("GET", url + "/health")[2])["context_servers"] == 2
             and json.loads(http("GET", url + "/health")[2])["generation_servers"] == 2, 60, "fleet", f)
    return {"proto": proto, "url": url, "ctxs": ctxs, "gens": gens}


def test_kv_aware_placement_on_both_roles(pd2):
    url = pd2["url"]
    prompts = [uuid.uuid4().hex * 6 for _ in range(3)]
    first = {}
    for p in prompts:
        st, h, raw = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 2}, timeout=30)
        assert st == 200, raw
        r = route_of(h)
        assert r["mode"] == "disaggregated" and r["protocol"] == pd2["proto"], r
        first[p] = (r["context"]["server"], r["generation"]["server"])
    # The index is fed by each engine's KV events (SGLang: found through the kv_events descriptor
    # in its /server_info), not only by the coordinator's own routed-block predictions: wait until
    # every server that took a leg has had blocks stored through its feed.
    used = {s for s in first.values() for s in s}

    def fed_by_events():
        st, _, raw = http("GET", url + "/cluster_info")
        ss = {d["url"]: d for role in ("context", "generation") for d in json.loads(raw)["servers"][role]}
        return ss if all((ss[u]["kv_events"] or {}).get("blocks_stored", 0) > 0 for u in used) else None
    servers = wait_for(fed_by_events, 10, "the workers' KV events to reach the coordinator's index")
    for u in pd2["ctxs"] + pd2["gens"]:
        d = servers[u]
        assert d["kv_ready"] and d["kv_events"]["format"] == pd2["proto"], d["kv_events"]
        if u in used:
            assert d["kv_index_blocks"] > 0, d
    for p in prompts:
        ctx, gen = first[p]
        hits = metric(wm(ctx), "splitserve_worker_prefix_cache_hit_tokens_total")
        st, h, raw = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 2}, timeout=30)
        assert st == 200, raw
        r = route_of(h)
        # Each leg went where the prompt's KV is, and the coordinator said why.
        assert (r["context"]["server"], r["generation"]["server"]) == (ctx, gen), r
        assert r["context"]["matched_tokens"] >= 160 and r["generation"]["matched_tokens"] >= 160, r
        # ...and the prefill server really had it cached.
        assert metric(wm(ctx), "splitserve_worker_prefix_cache_hit_tokens_total") - hits >= 160
    wait_for(lambda: in_flight(url) == 0, 5, "every lease finished")
