"""Request ids and the route receipt on public answers (issue 39, item 6).

A client's `X-Request-Id` is honoured (sanitised, at most 128 characters) and echoed on every
answer of the API, errors and streams included, and error bodies name it; without one the answer
carries the fleet's own id. `x-splitserve-route` (worker URLs, loads, scores) is off by default;
`fleet.route_header: short` keeps mode, policies and predicted tokens, `full` everything. Real sim
workers and fleet processes on loopback.
"""
from __future__ import annotations

import json

import openai
import pytest
import yaml

from .conftest import PY, Cluster, free_port, group, healthy, http, wait_for


@pytest.fixture(scope="module")
def fleets(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("rid"))
    (_, ctx), (_, gen) = c.workers("context", "generation")
    urls = {}
    for detail in (None, "short", "full"):
        port = free_port()
        doc = {"hostname": "127.0.0.1", "model": "tiny", "port": port,
               "context_servers": group([ctx], "kv_cache_aware"), "generation_servers": group([gen])}
        if detail is not None:
            doc["fleet"] = {"route_header": detail}
        cfg = c.tmp / f"{detail or 'default'}.yaml"
        cfg.write_text(yaml.safe_dump(doc))     # not Cluster.config: it turns the receipt on
        f = c.spawn(f"fleet-{detail or 'default'}", [PY, "-m", "splitserve_cli", "serve", "-c", str(cfg)])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(url), 60, f"fleet {detail}", f)
        urls[detail or "default"] = url
    yield urls
    c.stop()


BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


def test_client_request_id_is_echoed_and_no_route_by_default(fleets):
    url = fleets["default"]
    st, h, _ = http("POST", url + "/v1/chat/completions", BODY, {"X-Request-Id": "req-42.a:b/c"})
    assert st == 200
    assert h["X-Request-Id"] == "req-42.a:b/c"
    assert not any(k.lower() == "x-splitserve-route" for k in h), h
    # none given: the fleet's own id (the snowflake every worker and lease sees)
    st, h, _ = http("POST", url + "/v1/chat/completions", BODY)
    assert st == 200 and h["X-Request-Id"].isdigit() and int(h["X-Request-Id"]) >= 2 ** 40


def test_client_request_id_is_sanitised_and_bounded(fleets):
    url = fleets["default"]
    st, h, _ = http("POST", url + "/v1/chat/completions", BODY,
                    {"X-Request-Id": 'a "b" <c>;d\te' + "x" * 300})
    assert st == 200
    rid = h["X-Request-Id"]
    assert rid.startswith("abcde") and len(rid) == 128 and set(rid[5:]) == {"x"}
    # nothing usable left: the fleet's own id
    st, h, _ = http("POST", url + "/v1/chat/completions", BODY, {"X-Request-Id": '"<>"'})
    assert st == 200 and h["X-Request-Id"].isdigit()


def test_errors_carry_the_request_id(fleets):
    url = fleets["default"]
    st, h, raw = http("POST", url + "/v1/chat/completions", {**BODY, "model": "nope"}, {"X-Request-Id": "e-1"})
    assert st == 404 and h["X-Request-Id"] == "e-1"
    assert json.loads(raw)["error"]["request_id"] == "e-1"
    st, h, raw = http("POST", url + "/v1/chat/completions", b"{not json")
    assert st == 400
    err = json.loads(raw)["error"]
    assert err["request_id"] == h["X-Request-Id"] and err["request_id"].isdigit()


def test_streams_carry_the_request_id(fleets):
    cli = openai.OpenAI(base_url=fleets["default"] + "/v1", api_key="x", max_retries=0)
    raw = cli.chat.completions.with_raw_response.create(**BODY, stream=True,
                                                         extra_headers={"X-Request-Id": "s-9"})
    assert raw.headers["x-request-id"] == "s-9"
    assert "x-splitserve-route" not in raw.headers
    assert list(raw.parse())


def test_short_route_names_no_server(fleets):
    st, h, _ = http("POST", fleets["short"] + "/v1/chat/completions", BODY)
    assert st == 200
    text = h["x-splitserve-route"]
    route = json.loads(text)
    assert route["mode"] == "disaggregated" and route["id"] == int(h["X-Request-Id"])
    assert route["context"]["policy"] == "kv_cache_aware" and route["generation"]["policy"] == "round_robin"
    assert "127.0.0.1" not in text and "candidates" not in text and "score" not in text \
        and "load_requests" not in text


def test_full_route_names_the_servers(fleets):
    st, h, _ = http("POST", fleets["full"] + "/v1/chat/completions", BODY)
    route = json.loads(h["x-splitserve-route"])
    assert st == 200 and route["context"]["server"].startswith("http://127.0.0.1:")
    assert route["generation"]["server"].startswith("http://127.0.0.1:")


def test_a_request_chat_template_is_refused_unless_allowed(fleets):
    """allow_request_chat_template (upstream's key, default false) is enforced, not ignored."""
    st, h, raw = http("POST", fleets["default"] + "/v1/chat/completions",
                      {**BODY, "chat_template": "{{ messages }}"}, {"X-Request-Id": "t-1"})
    err = json.loads(raw)["error"]
    assert st == 400 and err["param"] == "chat_template" and err["code"] == "chat_template_not_allowed"
    assert err["request_id"] == "t-1"
