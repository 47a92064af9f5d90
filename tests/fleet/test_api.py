"""The public API through a real fleet: the official openai client, errors, auth, endpoints.

One module-scoped cluster: a context and a generation sim worker, a one-process fleet (coordinator
in-process, kv_cache_aware) and a second fleet with API keys on the same workers (round robin).
"""
from __future__ import annotations

import json

import openai
import pytest

from .conftest import free_port, group, healthy, http, metric, wait_for

KEY = "sk-test-fleet-key"


@pytest.fixture(scope="module")
def api(module_cluster):
    c = module_cluster
    (_, ctx), (_, gen) = c.workers(("context", {"name": "ctx"}), ("generation", {"name": "gen"}))
    port = free_port()
    cfg = c.config("open.yaml", port=port, context_servers=group([ctx], "kv_cache_aware"),
                   generation_servers=group([gen], "kv_cache_aware"),
                   fleet={"max_body_bytes": 65536})
    f = c.fleet(cfg, name="fleet-open")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "open fleet", f)
    port2 = free_port()
    cfg2 = c.config("auth.yaml", port=port2, context_servers=group([ctx]), generation_servers=group([gen]),
                    api_keys=[KEY])
    f2 = c.fleet(cfg2, name="fleet-auth")
    url2 = f"http://127.0.0.1:{port2}"
    wait_for(lambda: healthy(url2), 60, "auth fleet", f2)
    return {"url": url, "auth_url": url2, "ctx": ctx, "gen": gen}


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_chat_non_streaming(api):
    r = client(api["url"]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Name one colour."}], max_tokens=6)
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 0


def test_openai_chat_streaming_with_usage(api):
    stream = client(api["url"]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream me a few tokens."}], max_tokens=5,
        stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage
    assert finish == "length"
    assert text
    assert usage is not None and usage.completion_tokens == 5


def test_openai_stream_without_usage_gets_no_usage_chunk(api):
    stream = client(api["url"]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "no usage please"}], max_tokens=3, stream=True)
    chunks = list(stream)
    # The fleet asks the worker for usage (routing metrics) but must not hand the client a chunk
    # with empty choices it did not ask for.
    assert chunks and all(ch.choices for ch in chunks)
    assert all(ch.usage is None for ch in chunks)


def test_openai_completions_both_modes(api):
    c = client(api["url"])
    r = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    parts = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="The quick brown fox",
                                                                max_tokens=4, stream=True) if ch.choices]
    assert "".join(parts)


def test_route_header_and_cached_tokens(api):
    prompt = "A shared system prompt that is long enough to fill several KV blocks. " * 4
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    st, h, _ = http("POST", api["url"] + "/v1/completions", body)
    assert st == 200
    route = json.loads(h["x-splitserve-route"])
    assert route["mode"] == "disaggregated"
    assert route["context"]["server"] == api["ctx"] and route["generation"]["server"] == api["gen"]
    assert route["context"]["policy"] == "kv_cache_aware"

    def matched():
        st, h, _ = http("POST", api["url"] + "/v1/completions", body)
        return json.loads(h["x-splitserve-route"])["context"].get("matched_tokens", 0) > 0
    # The context worker's KV events reach the coordinator's index: placement sees the prefix.
    wait_for(matched, 10, "a predicted prefix match")
    st, _, m = http("GET", api["url"] + "/metrics")
    text = m.decode()
    assert metric(text, "splitserve_fleet_routing_predicted_cached_tokens_total", role="context") > 0
    assert metric(text, "splitserve_fleet_routing_reported_cached_tokens_total", role="context") > 0


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
      "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}, "stream_options"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": 3}, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
])
def test_chat_400_names_param(api, body, param):
    st, _, raw = http("POST", api["url"] + "/v1/chat/completions", body)
    assert st == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert err["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": {"a": 1}}, "prompt"),
    ({"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "tiny", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "echo": "no"}, "echo"),
])
def test_completions_400_names_param(api, body, param):
    st, _, raw = http("POST", api["url"] + "/v1/completions", body)
    assert st == 400, raw
    assert json.loads(raw)["error"]["param"] == param


def test_malformed_json_and_non_object(api):
    for raw_body in (b"{not json", b"[1, 2]", b""):
        st, _, raw = http("POST", api["url"] + "/v1/completions", raw_body)
        assert st == 400, raw_body
        assert json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(api):
    st, _, raw = http("POST", api["url"] + "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert st == 404
    err = json.loads(raw)["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "tiny" in err["message"]


def test_oversize_body_is_413(api):
    big = {"model": "tiny", "prompt": "x" * 70000}
    st, _, raw = http("POST", api["url"] + "/v1/completions", big)
    assert st == 413
    assert "65536" in json.loads(raw)["error"]["message"]


def test_worker_4xx_is_relayed_not_retried(api):
    # Far beyond the model's context: the worker rejects it (4xx) and the fleet passes that on.
    st, _, raw = http("POST", api["url"] + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10 ** 7})
    assert 400 <= st < 500, raw
    st, _, m = http("GET", api["url"] + "/metrics")
    assert metric(m.decode(), "splitserve_fleet_leg_retries_total") == 0


def test_unknown_route_and_method(api):
    st, _, raw = http("GET", api["url"] + "/v1/nothing")
    assert st == 404 and json.loads(raw)["error"]["code"] == "not_found"
    st, h, raw = http("GET", api["url"] + "/v1/completions")
    assert st == 405 and h.get("Allow") == "POST"


def test_models_health_cluster_info_metrics(api):
    st, _, raw = http("GET", api["url"] + "/v1/models")
    assert st == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["tiny"]
    st, _, raw = http("GET", api["url"] + "/health")
    assert st == 200 and json.loads(raw)["context_servers"] == 1
    st, _, raw = http("GET", api["url"] + "/cluster_info")
    ci = json.loads(raw)
    assert st == 200
    assert ci["fleet"]["node_id"] is not None and ci["fleet"]["coordinator"] == "in-process"
    assert {s["url"] for s in ci["servers"]["context"]} == {api["ctx"]}
    assert ci["routing"]["block_size"] == 16
    st, h, raw = http("GET", api["url"] + "/metrics")
    assert st == 200 and h["Content-Type"].startswith("text/plain")
    text = raw.decode()
    assert "# HELP splitserve_fleet_time_to_first_token_seconds" in text
    assert metric(text, "splitserve_fleet_requests_total", endpoint="chat", status="200") >= 1


def test_client_disaggregated_params_are_stripped(api):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2,
            "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 1,
                                     "encoded_opaque_state": "forged", "disagg_request_id": 987654321}}
    st, h, raw = http("POST", api["url"] + "/v1/completions", body)
    assert st == 200, raw
    route = json.loads(h["x-splitserve-route"])
    assert route["mode"] == "disaggregated"          # forged params did not skip the context leg
    # the client's positive request id is kept as an alias; the id workers and leases see is minted
    assert route["client_request_id"] == 987654321 and route["id"] != 987654321
    st, _, m = http("GET", api["url"] + "/metrics")
    assert metric(m.decode(), "splitserve_fleet_stripped_disaggregated_params_total") >= 1


def test_auth_on(api):
    url = api["auth_url"]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    st, _, raw = http("POST", url + "/v1/completions", body)
    assert st == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    st, _, _ = http("POST", url + "/v1/completions", body, {"Authorization": "Bearer wrong"})
    assert st == 401
    st, _, _ = http("GET", url + "/v1/models")
    assert st == 401
    st, _, _ = http("GET", url + "/health")          # probes stay open
    assert st == 200
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    r = client(url, KEY).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_auth_off_accepts_any_or_no_key(api):
    st, _, _ = http("POST", api["url"] + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert st == 200


def test_leg_latency_runs_from_each_legs_send(api):
    """`splitserve_fleet_leg_latency_seconds` is "from sending it to its last byte" for both legs:
    the generation worker (sim engine, 5 ms per decode step) answers a non-streamed request only
    once it has decoded every token, so its leg takes at least those steps. (It was timed from the
    answer's headers on, ~10 µs: a JSON answer's whole decode went uncounted.)"""
    url = api["url"]

    def sums():
        _, _, m = http("GET", url + "/metrics")
        m = m.decode() if isinstance(m, bytes) else m
        return {role: (metric(m, "splitserve_fleet_leg_latency_seconds_sum", role=role),
                       metric(m, "splitserve_fleet_leg_latency_seconds_count", role=role))
                for role in ("context", "generation")}

    before = sums()
    n = 4
    for stream in (False, True):
        for _ in range(n // 2):
            st, _, body = http("POST", url + "/v1/completions",
                               {"model": "tiny", "prompt": "a leg timed from its send", "max_tokens": 8,
                                "ignore_eos": True, "stream": stream})
            assert st == 200, body
    after = sums()
    (g0, gn0), (g1, gn1) = before["generation"], after["generation"]
    assert gn1 - gn0 == n
    # 8 tokens: the context leg makes the first, the generation worker decodes >= 6 more steps
    assert (g1 - g0) / n >= 6 * 0.005 * 0.8, (g1 - g0) / n
    (c0, cn0), (c1, cn1) = before["context"], after["context"]
    assert cn1 - cn0 == n and (c1 - c0) > 0
