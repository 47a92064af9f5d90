"""The fleet and the worker answer the same bad request with the same bytes (protocol.openai).

One sim worker and a fleet in front of it, both real processes on loopback. Each bad body is sent
to the fleet's and to the worker's endpoint; the two answers must have the same status and be
byte-identical but for the fleet's `request_id` (its API's X-Request-Id), and the 400 must name the
offending field. (Before the shared module they
differed: "got string" from the fleet, "got str" from the worker.)
"""
from __future__ import annotations

import json

import pytest

from .conftest import free_port, group, healthy, http, wait_for

CHAT_OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL_OK = {"model": "tiny", "prompt": "hi", "max_tokens": 2}

CASES = [
    ("/v1/completions", {**CMPL_OK, "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {**CMPL_OK, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**CMPL_OK, "temperature": 3}, "temperature"),
    ("/v1/completions", {**CMPL_OK, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**CMPL_OK, "top_k": -5}, "top_k"),
    ("/v1/completions", {**CMPL_OK, "seed": "x"}, "seed"),
    ("/v1/completions", {**CMPL_OK, "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {**CMPL_OK, "stream": "yes"}, "stream"),
    ("/v1/completions", {**CMPL_OK, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("/v1/completions", {**CMPL_OK, "stream_options": {}}, "stream_options"),
    ("/v1/completions", {**CMPL_OK, "stop": 3}, "stop"),
    ("/v1/completions", {**CMPL_OK, "stop": [1]}, "stop"),
    ("/v1/completions", {**CMPL_OK, "stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {**CMPL_OK, "n": 2}, "n"),
    ("/v1/completions", {**CMPL_OK, "ignore_eos": "y"}, "ignore_eos"),
    ("/v1/completions", {**CMPL_OK, "model": 3}, "model"),
    ("/v1/completions", {"model": "tiny", "prompt_token_ids": "abc"}, "prompt_token_ids"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [3]}, "messages[0]"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": 3}]},
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.fixture(scope="module")
def pair(module_cluster):
    c = module_cluster
    _, worker = c.worker("both", name="parity-worker")
    port = free_port()
    cfg = c.config("parity.yaml", port=port, context_servers=group([]),
                   generation_servers=group([worker]))
    f = c.fleet(cfg, name="parity-fleet")
    fleet = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(fleet), 60, "parity fleet", f)
    return fleet, worker


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{p.rsplit('/', 1)[1]}:{f}" for p, _, f in CASES])
def test_same_bad_request_same_answer_bytes(pair, path, body, param):
    fleet, worker = pair
    fs, _, fb = http("POST", fleet + path, body, headers={"X-Request-Id": "parity-1"})
    ws, _, wb = http("POST", worker + path, body)
    assert fs == ws == 400, (fs, fb, ws, wb)
    # the fleet's error body also carries the request's id (its API's X-Request-Id), last
    assert fb == wb[:-2] + b',"request_id":"parity-1"}}', f"\nfleet:  {fb.decode()}\nworker: {wb.decode()}"
    err = json.loads(fb)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"'{param}'")    # the message names the field too


def test_a_good_request_passes_both(pair):
    fleet, worker = pair
    for url in (fleet, worker):
        st, _, b = http("POST", url + "/v1/completions", CMPL_OK)
        assert st == 200, b
