"""Hostile or unlucky clients against real fleet processes and sim workers (issue 15, items 3-5).

- client-chosen `disagg_request_id`: never the id a worker, lease or transfer sees; a duplicate in
  flight is a 409; a client reusing another's id and hanging up cannot abort that other stream; a
  client retrying with its own id after completion is served;
- stalled request heads and bodies: answered 408 (OpenAI body) after the configured timeouts, and
  they never take an in-flight slot (no 429 for others);
- bad input at the HTTP level (framing, sizes, content type) and in the body: 4xx with an OpenAI
  error body naming the field, never a 5xx.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from .conftest import NO_SHEDDING, free_port, free_port_pair, group, healthy, http, metric, wait_for
from .hostile import error_of, exchange, post, read_answer

TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def workers(module_cluster):
    (_, ctx), (_, gen) = module_cluster.workers(
        ("context", {"name": "hc-ctx"}),
        ("generation", {"name": "hc-gen", "extra": ("--sim-decode-us-per-step", 20000)}))
    return ctx, gen


@pytest.fixture(scope="module")
def one(module_cluster, workers):
    """One fleet process (in-process coordinator), KV-aware, 2 requests in flight at most."""
    ctx, gen = workers
    port = free_port()
    cfg = module_cluster.config("hc-one.yaml", port=port,
                                fleet={"max_inflight_requests": 2, "body_timeout_s": TIMEOUT_S,
                                       "header_timeout_s": TIMEOUT_S},
                                context_servers=group([ctx], "kv_cache_aware"),
                                generation_servers=group([gen], "kv_cache_aware"))
    f = module_cluster.fleet(cfg, name="hc-one")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)
    return {"url": url, "port": port, "ctx": ctx, "gen": gen, "proc": f}


@pytest.fixture(scope="module")
def keyed(module_cluster, workers):
    """One fleet process with API keys and an HMAC key for client disaggregated_params."""
    ctx, gen = workers
    port = free_port()
    cfg = module_cluster.config("hc-keyed.yaml", port=port, api_keys=["sk-test"], internal_request_auth_key="k",
                                context_servers=group([ctx]), generation_servers=group([gen]))
    f = module_cluster.fleet(cfg, name="hc-keyed")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)
    return {"url": url, "port": port}


@pytest.fixture(scope="module")
def two(module_cluster, workers):
    """`splitserve local`'s topology: two fleet processes and the implicit coordinator."""
    ctx, gen = workers
    port = free_port_pair()
    cfg = module_cluster.config("hc-two.yaml", port=port, num_workers=2, coordinator=NO_SHEDDING,
                                context_servers=group([ctx], "kv_cache_aware"),
                                generation_servers=group([gen], "kv_cache_aware"))
    f = module_cluster.fleet(cfg, name="hc-two")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "fleet", f)
    return {"url": url, "port": port}


def completion(rid=None, max_tokens=30, stream=True, prompt="a long story about ids"):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if rid is not None:
        body["disaggregated_params"] = {"disagg_request_id": rid}
    return json.dumps(body).encode()


def sse_tokens(raw: bytes) -> tuple[int, str | None, bool]:
    """(text chunks, last finish_reason, saw an error event) of an SSE completion stream."""
    n, fin, err = 0, None, False
    for ev in raw.split(b"\n\n"):
        if not ev.startswith(b"data: {"):
            continue
        obj = json.loads(ev[6:])
        if "error" in obj:
            err = True
            continue
        for c in obj.get("choices") or ():
            if c.get("text"):
                n += 1
            if c.get("finish_reason"):
                fin = c["finish_reason"]
    return n, fin, err


# --------------------------------------------------------------------------- item 4: request ids

def test_reused_id_and_hangup_does_not_abort_the_other_stream(two):
    rid = 424242
    out = {}
    t = threading.Thread(target=lambda: out.update(a=exchange(two["port"], post("/v1/completions",
                                                                                  completion(rid, 40)), 30)))
    t.start()
    time.sleep(0.3)                     # A is decoding (40 steps x 20 ms)
    # B reuses A's id on fresh connections (either fleet process) and hangs up mid-request
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", two["port"]))
        s.sendall(post("/v1/completions", completion(rid, 40)))
        time.sleep(0.1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    t.join(30)
    st, _, raw = out["a"]
    assert st == 200
    n, fin, err = sse_tokens(raw)
    assert not err and fin == "length" and n >= 39, (n, fin, raw[-300:])


def test_concurrent_duplicates_across_processes_are_whole_or_409(two):
    """Four clients send one id at once to the two-process fleet: each is served in full (its own
    minted id) or refused with 409 — never a 502 or a stream cut short by another's abort."""
    outs = [None] * 4

    def one_client(i):
        outs[i] = exchange(two["port"], post("/v1/completions", completion(99, 20)), 30)

    ts = [threading.Thread(target=one_client, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    served = 0
    for st, _, raw in outs:
        if st == 409:
            assert error_of(st, raw)["code"] == "duplicate_request_id"
            continue
        assert st == 200, raw[:300]
        n, fin, err = sse_tokens(raw)
        assert not err and fin == "length" and n >= 19, raw[-300:]
        served += 1
    assert served >= 1


def test_concurrent_duplicate_id_is_409_and_retry_after_completion_succeeds(one):
    rid = 777
    out = {}
    t = threading.Thread(target=lambda: out.update(a=exchange(one["port"], post("/v1/completions",
                                                                                  completion(rid, 30)), 30)))
    t.start()
    time.sleep(0.3)
    st, _, raw = exchange(one["port"], post("/v1/completions", completion(rid, 30)))
    assert st == 409, raw
    e = error_of(st, raw)
    assert e["param"] == "disaggregated_params.disagg_request_id" and e["code"] == "duplicate_request_id"
    t.join(30)
    st, _, raw = out["a"]
    n, fin, err = sse_tokens(raw)
    assert st == 200 and not err and fin == "length" and n >= 29, raw[-300:]
    # the same client retries with its own id, again and again: served every time, in full
    for _ in range(3):
        st, h, raw = exchange(one["port"], post("/v1/completions", completion(rid, 3, stream=False)))
        assert st == 200, raw
        route = json.loads(h["x-splitserve-route"])
        assert route["client_request_id"] == rid and route["id"] != rid
        assert json.loads(raw)["usage"]["completion_tokens"] == 3


# --------------------------------------------------------------------------- item 5: stalled clients

def stall_body(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(post("/v1/completions", completion(None, 2, stream=False))[:-20])   # the last 20 bytes never come
    return s


def test_stalled_bodies_take_no_slot_and_get_408(one):
    stalled = [stall_body(one["port"]) for _ in range(2)]
    t0 = time.monotonic()
    try:
        time.sleep(0.2)
        for i in range(3):
            st, _, raw = http("POST", one["url"] + "/v1/completions",
                              {"model": "tiny", "prompt": f"not locked out {i}", "max_tokens": 2})
            assert st == 200, raw
        for s in stalled:
            st, h, raw = read_answer(s, TIMEOUT_S + 5)
            assert st == 408, raw
            e = error_of(st, raw)
            assert e["code"] == "request_timeout" and "fleet.body_timeout_s" in e["message"]
            assert h.get("connection", "").lower() == "close"
        assert TIMEOUT_S - 0.2 < time.monotonic() - t0 < TIMEOUT_S + 3
    finally:
        for s in stalled:
            s.close()
    m = http("GET", one["url"] + "/metrics")[2].decode()
    assert metric(m, "splitserve_fleet_body_timeouts_total") >= 2


def test_stalled_head_gets_408(one):
    with socket.create_connection(("127.0.0.1", one["port"])) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Le")
        st, _, raw = read_answer(s, TIMEOUT_S + 5)
        assert st == 408 and "fleet.header_timeout_s" in error_of(st, raw)["message"]
        assert time.monotonic() - t0 > TIMEOUT_S - 0.2
    # the fleet still serves
    assert http("POST", one["url"] + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})[0] == 200


# --------------------------------------------------------------------------- item 3: framing and input

FRAMING = [
    # (what, bytes, expected status)
    ("bad chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    ("duplicate Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    ("URL over 8 KiB", b"GET /v1/models?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414),
    ("header over 8 KiB", b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
    ("too many headers", b"GET /v1/models HTTP/1.1\r\nHost: t\r\n"
                         + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n", 400),
    ("CONNECT", b"CONNECT /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", 404),
    ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n", 400),
]


@pytest.mark.parametrize("what,data,status", FRAMING, ids=[f[0] for f in FRAMING])
def test_framing_errors_are_openai_errors(one, what, data, status):
    st, h, raw = exchange(one["port"], data)
    assert st == status, (what, raw[:300])
    assert h["content-type"].startswith("application/json")
    error_of(st, raw)


def test_bad_chunk_after_the_head_is_400(one):
    with socket.create_connection(("127.0.0.1", one["port"])) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n3\r\n{\"m\r\n")
        time.sleep(0.2)                 # the route is already reading the body
        s.sendall(b"QQ\r\n")
        st, _, raw = read_answer(s, 10)
        assert st == 400, raw
        assert error_of(st, raw)["code"] == "bad_http_request"


@pytest.mark.parametrize("ctype", [b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data"])
def test_non_json_content_type_is_415(one, ctype):
    st, _, raw = exchange(one["port"], post("/v1/completions", completion(None, 1, False), ctype=ctype))
    assert st == 415, raw
    assert error_of(st, raw)["code"] == "unsupported_media_type"


def test_json_content_types_are_accepted(one):
    for ctype in (b"application/json; charset=utf-8", b"application/vnd.api+json"):
        st, _, raw = exchange(one["port"], post("/v1/completions", completion(None, 1, False), ctype=ctype))
        assert st == 200, (ctype, raw)


BAD_BODIES = [
    # (path, body, param)
    ("/v1/completions", {"prompt": [1, 2, 2 ** 32]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2 ** 40]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2 ** 32]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt_token_ids": [5, 2 ** 32]}, "prompt_token_ids"),
    ("/v1/completions", {"prompt_token_ids": [5, -3]}, "prompt_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [2 ** 33]},
     "prompt_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "9"},
     "max_completion_tokens"),
    # past the worker's context (tiny: 8192 tokens): the engine's error names what the client sent
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 6},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [65] * 9000},
     "prompt_token_ids"),
    ("/v1/completions", {"prompt_token_ids": [65] * 9000}, "prompt_token_ids"),
    ("/v1/completions", {"prompt": [65] * 9000}, "prompt"),
    ("/v1/completions", {"prompt_token_ids": [65, 10 ** 6]}, "prompt_token_ids"),   # over the vocabulary
]


@pytest.mark.parametrize("path,body,param", BAD_BODIES, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_BODIES)])
def test_bad_body_is_400_naming_the_field(one, path, body, param):
    st, _, raw = http("POST", one["url"] + path, {"model": "tiny", "max_tokens": 2, **body})
    assert st == 400, raw[:300]
    assert error_of(st, raw)["param"] == param


@pytest.mark.parametrize("topology", ["one", "two"])
def test_non_utf8_session_header_is_400(request, topology):
    # two processes: the id used to break the msgpack body of the coordinator call (a 500)
    f = request.getfixturevalue(topology)
    st, _, raw = exchange(f["port"], post("/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode(),
        extra=b"x-session-affinity: \xff\xfe\r\n"))
    assert st == 400, raw
    assert error_of(st, raw)["param"] == "x-session-affinity"


def test_worker_rejects_the_same_inputs_with_4xx(workers):
    """A worker's public API (reachable directly) answers the same bad inputs with 4xx too."""
    for url in workers:
        for path, body, param in BAD_BODIES:
            st, _, raw = http("POST", url + path, {"model": "tiny", "max_tokens": 2, **body})
            assert 400 <= st < 500, (url, body, raw)
            assert error_of(st, raw)["param"] == param, (url, body, raw)


@pytest.mark.parametrize("header", [b"Authorization: Bearer \xff\xfe", b"Authorization: Bearer sk-t\xc3\xa9st",
                                    b"Authorization: Bearer sk-test\r\nx-splitserve-disagg-auth: sha256=\xff\xe9"])
def test_non_ascii_secrets_are_rejected_not_500(keyed, header):
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1,
                       "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 5}}).encode()
    st, _, raw = exchange(keyed["port"], post("/v1/completions", body, extra=header + b"\r\n"))
    if b"sk-test\r\n" in header:     # right API key, forged HMAC: served with the params stripped
        assert st == 200, raw
    else:
        assert st == 401 and error_of(st, raw)["code"] == "invalid_api_key", raw
