"""Fuzzing the fleet's public API through a real socket: whatever a client sends, never a 5xx.

Against `splitserve local`'s topology (two fleet processes, the implicit coordinator, KV-aware
routing on both roles, sim workers; API keys and the HMAC key set), hypothesis generates
- request bodies over the OpenAI schema: every known field either valid or any JSON value (huge
  and negative integers, nested arrays, nulls), plus session, API-key and HMAC headers of arbitrary
  bytes and arbitrary Content-Types;
- raw HTTP framing: valid requests cut, spliced, re-chunked, with duplicated or oversized headers and
  random bytes in the request line, headers and chunk sizes.
Every answer must be a status below 500, and every 4xx an OpenAI error body (no plain-text parser
errors). A connection closed without an answer is accepted only for framing that is incomplete by
construction (the client half-closed before the request was whole).
"""
from __future__ import annotations

import json
import os
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import NO_SHEDDING, free_port_pair, group, healthy, wait_for
from .hostile import error_of, read_answer

# SPLITSERVE_FUZZ_EXAMPLES=5000 for a long run
FUZZ = settings(max_examples=int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "150")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fleet(module_cluster):
    c = module_cluster
    (_, ctx), (_, gen) = c.workers(("context", {"name": "fz-ctx"}), ("generation", {"name": "fz-gen"}))
    port = free_port_pair()
    cfg = c.config("fuzz.yaml", port=port, num_workers=2, api_keys=["sk-fuzz"], internal_request_auth_key="k",
                   coordinator=NO_SHEDDING,
                   fleet={"header_timeout_s": 2.0, "body_timeout_s": 2.0},
                   context_servers=group([ctx], "kv_cache_aware"),
                   generation_servers=group([gen], "kv_cache_aware"))
    f = c.fleet(cfg, name="fz-fleet")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "fleet", f)
    return {"port": port, "proc": f, "worker_port": int(gen.rsplit(":", 1)[1])}


# --------------------------------------------------------------------------- OpenAI request schema

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                    st.floats(allow_nan=False), st.text(max_size=20))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
token_ids = st.lists(st.one_of(st.integers(0, 300), st.integers(-2 ** 40, 2 ** 70)), min_size=0, max_size=12)


def either(valid):
    """Mostly a valid value (so requests get past the first check), sometimes anything."""
    return st.one_of(valid, valid, anything)


part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": either(st.text(max_size=20))}),
                 st.fixed_dictionaries({"type": either(st.sampled_from(["text", "image_url"]))},
                                       optional={"text": anything, "image_url": anything}),
                 anything)
message = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["user", "system", "assistant", "tool", "developer"]))},
    optional={"content": either(st.one_of(st.text(max_size=40), st.lists(part, max_size=3))),
              "name": anything})
required = {"model": either(st.just("tiny")), "max_tokens": either(st.integers(1, 4))}
common = {
    "max_completion_tokens": either(st.one_of(st.integers(1, 4), st.integers(-5, 2 ** 40))),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({}, optional={"include_usage": either(st.booleans())})),
    "temperature": either(st.floats(0, 2)),
    "top_p": either(st.floats(0, 1)),
    "top_k": either(st.integers(-1, 50)),
    "seed": either(st.integers(-2 ** 70, 2 ** 70)),
    "stop": either(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20))),
    "n": either(st.integers(0, 3)),
    "prompt_token_ids": either(token_ids),
    "disaggregated_params": either(st.fixed_dictionaries(
        {}, optional={"disagg_request_id": either(st.integers(-2 ** 70, 2 ** 70)),
                      "request_type": either(st.sampled_from(["context_only", "generation_only"])),
                      "ctx_request_id": anything, "encoded_opaque_state": anything})),
    "conversation_params": either(st.fixed_dictionaries({}, optional={"conversation_id": anything})),
    "logit_bias": anything,
    "user": either(st.text(max_size=8)),
}
completion_body = st.fixed_dictionaries(
    required,
    optional={**common, "prompt": either(st.one_of(st.text(max_size=60), token_ids, st.lists(token_ids, max_size=3),
                                                   st.lists(st.text(max_size=10), max_size=3))),
              "echo": either(st.booleans()), "logprobs": either(st.integers(0, 21)),
              "best_of": either(st.integers(0, 2)), "suffix": either(st.text(max_size=5))})
chat_body = st.fixed_dictionaries(
    required,
    optional={**common, "messages": either(st.lists(message, max_size=3)),
              "logprobs": either(st.booleans()), "top_logprobs": either(st.integers(0, 21)),
              "add_generation_prompt": anything})
# mostly printable-or-high bytes (what gets past the HTTP parser into the routes), sometimes any byte
header_value = st.one_of(
    st.lists(st.integers(0x21, 0xff), min_size=1, max_size=12).map(bytes),
    st.binary(min_size=1, max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b
                                              and b.strip() == b and b[:1] not in b" \t"))
content_types = st.sampled_from([b"application/json", b"application/json; charset=utf-8", b"text/plain",
                                 b"application/x-www-form-urlencoded", b"application/msgpack", None])


def exchange(port: int, data: bytes, timeout: float = 15.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_answer(s, timeout)


def check(status: int, headers: dict, body: bytes, what) -> None:
    assert 0 < status < 500, (status, body[:400], what)
    if status >= 400:
        assert headers.get("content-type", "").startswith("application/json"), (status, body[:200], what)
        error_of(status, body)


header_names = st.sampled_from([b"x-session-affinity", b"x-session-id", b"x-correlation-id",
                                b"x-multi-turn-session-id", b"x-splitserve-disagg-auth", b"Authorization"])


@FUZZ
@given(kind=st.sampled_from(["completion", "chat"]), data=st.data(), ctype=content_types,
       session=st.one_of(st.none(), st.tuples(header_names, st.one_of(
           header_value, header_value.map(lambda b: b"Bearer " + b), header_value.map(lambda b: b"sha256=" + b)))))
def test_request_schema_never_5xx(fleet, kind, data, ctype, session):
    schema_case(fleet["port"], kind, data, ctype, session)


@FUZZ
@given(kind=st.sampled_from(["completion", "chat"]), data=st.data())
def test_worker_request_schema_never_5xx(fleet, kind, data):
    """A worker's own public API (reachable directly on its port) holds to the same rule."""
    schema_case(fleet["worker_port"], kind, data, b"application/json", None)


def schema_case(port, kind, data, ctype, session):
    body = data.draw(completion_body if kind == "completion" else chat_body)
    raw = json.dumps(body).encode()
    path = b"/v1/completions" if kind == "completion" else b"/v1/chat/completions"
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: %d\r\n" % (path, len(raw))
    if session is None or session[0] != b"Authorization":
        head += b"Authorization: Bearer sk-fuzz\r\n"
    if ctype is not None:
        head += b"Content-Type: %s\r\n" % ctype
    if session is not None:
        head += session[0] + b": " + session[1] + b"\r\n"
    st_, h, out = exchange(port, head + b"\r\n" + raw)
    check(st_, h, out, (body, ctype, session))


# --------------------------------------------------------------------------- raw HTTP framing

def chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for n in sizes:
        piece = payload[i:i + n]
        if not piece:
            break
        out += b"%x\r\n%s\r\n" % (len(piece), piece)
        i += n
    if i < len(payload):
        out += b"%x\r\n%s\r\n" % (len(payload) - i, payload[i:])
    return out + b"0\r\n\r\n"


VALID = json.dumps({"model": "tiny", "prompt": "fuzz", "max_tokens": 1}).encode()


@st.composite
def framed(draw):
    method = draw(st.sampled_from([b"POST", b"GET", b"PUT", b"post", b"P\xffST", b"", b"CONNECT"]))
    path = draw(st.sampled_from([b"/v1/completions", b"/v1/chat/completions", b"/health", b"/v1/models",
                                 b"*", b"http://x/v1/completions", b"/%zz", b"/v1/completions?" + b"q" * 9000]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b""]))
    headers = [b"Host: t", b"Content-Type: application/json", b"Authorization: Bearer sk-fuzz"]
    use_chunked = draw(st.booleans())
    payload = draw(st.one_of(st.just(VALID), st.binary(max_size=64)))
    if use_chunked:
        headers.append(draw(st.sampled_from([b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked",
                                             b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
                                             b"Transfer-Encoding: chunked\r\nContent-Length: 3"])))
        body = chunked(payload, draw(st.lists(st.integers(1, 16), max_size=6)))
    else:
        n = draw(st.one_of(st.just(len(payload)), st.integers(-2, len(payload) + 2)))
        headers.append(b"Content-Length: %d" % n)
        if draw(st.booleans()):
            headers.append(b"Content-Length: %d" % draw(st.integers(0, 99)))
        body = payload
    headers += draw(st.lists(st.sampled_from([b"X-Big: " + b"a" * 9000, b"Bad Header: x", b"X-Empty:",
                                              b": novalue", b"X-Ctl: \x01\x7f", b"X-Hi: \xff\xfe",
                                              b"Expect: 100-continue", b"Connection: keep-alive",
                                              b"Content-Encoding: gzip"]), max_size=3))
    head = method + b" " + path + (b" " + version if version else b"") + b"\r\n" + b"\r\n".join(headers)
    data = head + b"\r\n\r\n" + body
    # splice random bytes somewhere (request line, a header, a chunk size, the body)
    if draw(st.booleans()):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=6)) + data[at:]
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    return data if cut is None else data[:cut], cut is not None


@FUZZ
@given(case=framed())
def test_http_framing_never_5xx(fleet, case):
    data, cut = case
    with socket.create_connection(("127.0.0.1", fleet["port"]), timeout=15) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)      # nothing more comes: an incomplete request cannot be waited for
        status, h, out = read_answer(s, 15)
    if status == 0:
        return      # closed without an answer: the request never became complete (cut or half-closed)
    check(status, h, out, data[:300])
