"""splitserve's legs carry the same protocol fields as the peers' own routers, for the same client
requests (tests/fleet/peers/capture.py): vllm-router 0.1.17 (`--vllm-pd-disaggregation`) and
sglang-router 0.3.2 (`--pd-disaggregation`), each run as a real process in front of recording mock
engines (tests/fleet/peers/recorder.py). The fixtures in tests/fleet/peers/fixtures/ are those
captures; `test_fixture_is_what_the_router_sends` re-captures from the router binary when it is
installed (`make peers-venv`) and checks the fixture still says the same, so a fixture can never be
hand-written wishful thinking.

Compared is the protocol view of each capture (`view`): ids (request ids, rooms, engine ids) only for
their shape and for being the same on both legs; every field the client sent, as each leg carries it;
the leg fields; and the timing (sequential for vLLM, both legs at once for SGLang). Left out, on
purpose: the engine defaults the Rust routers re-serialise into every body (`no_stop_trim`,
`skip_special_tokens`, ...), sglang-router's rename of a chat `max_tokens` to `max_completion_tokens`
(normalised back), and `min_tokens` on the vLLM prefill leg, which vllm-router sets to 1 and vLLM's
toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) removes — splitserve removes
it, like the toy proxy; with `max_tokens: 1` both mean the same.
"""
from __future__ import annotations

import json

import pytest

from .peers.capture import ABORT_PATHS, CASES, PREFILL_DELAY_S, capture, fixture_path, router_bin

ROUTERS = {"vllm": "vllm-router", "sglang": "sglang-router"}
CHANGED_ON_VLLM_PREFILL = {"stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens",
                           "min_completion_tokens"}


def _client_fields(case: str, body: dict, skip=()) -> dict:
    client = CASES[case][1]
    out = {}
    for k in client:
        if k in skip:
            continue
        v = body.get(k, "<absent>")
        if k == "max_tokens" and v == "<absent>" and "max_completion_tokens" in body:
            v = body["max_completion_tokens"]     # sglang-router's rename for chat
        out[k] = v
    return out


GEN_PATHS = ("/v1/completions", "/v1/chat/completions")


def _gen_legs(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("event") is None and r["path"] in GEN_PATHS]


def aborts(cap: dict) -> dict:
    """{role: [(path, body)]} of the abort calls each engine received."""
    return {role: [(r["path"], r["body"]) for r in cap[role] if r["path"] in ABORT_PATHS]
            for role in ("prefill", "decode") if any(r["path"] in ABORT_PATHS for r in cap[role])}


def view(engine: str, case: str, cap: dict) -> dict:
    pre, dec = _gen_legs(cap["prefill"]), _gen_legs(cap["decode"])
    v = {"answer_status": cap["answer_status"], "legs": (len(pre), len(dec))}
    if case == "hangup":
        # How the client's hang-up reached the engines (the abort calls are compared separately).
        v["decode_connection_closed"] = any(r.get("event") == "connection_closed" for r in cap["decode"])
        v["decode_stream_ran_to_completion"] = any(r.get("event") == "stream_completed" for r in cap["decode"])
        return v
    v["abort_calls"] = aborts(cap)
    if len(pre) != 1 or len(dec) != 1:
        return v
    p, d = pre[0], dec[0]
    pb, db = p["body"], d["body"]
    gap = d["t"] - p["t"]
    if engine == "vllm":
        kv = dict(db.get("kv_transfer_params") or {})
        rid = p["headers"].get("x-request-id")
        v.update({
            "same_request_id_on_both_legs": bool(rid) and rid == d["headers"].get("x-request-id"),
            "prefill.kv_transfer_params": pb.get("kv_transfer_params"),
            "prefill.stream": pb.get("stream"), "prefill.max_tokens": pb.get("max_tokens"),
            "prefill.stream_options": pb.get("stream_options", "<absent>"),
            "prefill.client_fields": _client_fields(case, pb, CHANGED_ON_VLLM_PREFILL),
            # the decode carries the prefill answer's params verbatim (the mock names the request in them)
            "decode.kv_transfer_params.remote_request_id_is_the_prefills":
                kv.pop("remote_request_id", "").startswith(("cmpl-" + (rid or "?"), "chatcmpl-" + (rid or "?"))),
            "decode.kv_transfer_params.remote_engine_id_is_the_prefills":
                kv.pop("remote_engine_id", None) == f"engine-{_port_of(p)}",
            "decode.kv_transfer_params": kv,
            "decode.client_fields": _client_fields(case, db),
            "sequential": gap >= PREFILL_DELAY_S * 0.9,
        })
    else:
        room = pb.get("bootstrap_room")
        v.update({
            "bootstrap_host": (pb.get("bootstrap_host"), db.get("bootstrap_host")),
            "bootstrap_port_is_the_prefills": pb.get("bootstrap_port") == db.get("bootstrap_port")
                                              == cap["bootstrap_port"],
            "room_shared_and_63_bit": room == db.get("bootstrap_room") and type(room) is int
                                      and 0 <= room < 1 << 63,
            "prefill.client_fields": _client_fields(case, pb),
            "decode.client_fields": _client_fields(case, db),
            "concurrent": abs(gap) < PREFILL_DELAY_S / 2,
        })
    return v


def _port_of(rec: dict) -> int | None:
    return rec.get("port")


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def engine(request):
    return request.param


def _fixture(engine: str) -> dict:
    return json.loads(fixture_path(ROUTERS[engine]).read_text())


@pytest.fixture(scope="module")
def ours(engine, tmp_path_factory):
    return capture("splitserve", tmp_path_factory.mktemp(f"parity-{engine}"), engine=engine)


@pytest.mark.parametrize("case", [c for c in CASES if c != "hangup"])
def test_splitserve_legs_match_the_peer_router(engine, ours, case):
    ref = view(engine, case, _fixture(engine)["cases"][case])
    got = view(engine, case, ours[case])
    assert got == ref
    if engine == "sglang" and case != "hangup":
        # Beyond the router: both legs carry one `rid`, what /abort_request names on hang-up.
        p, d = ours[case]["prefill"][0]["body"], ours[case]["decode"][0]["body"]
        assert p["rid"] == d["rid"] == str(p["bootstrap_room"])


def test_hang_up_reaches_both_engines(engine, ours):
    """A client hangs up after the first streamed event. vllm-router closes the decode leg's
    connection; sglang-router 0.3.2 does not — its decode stream runs to the end — and neither sends
    an abort call (the fixtures). splitserve closes the decode connection for both protocols (vLLM
    has no abort endpoint) and, for SGLang, also sends `/abort_request` with the legs' `rid` to both
    engines, so a prefill or a decode still waiting at the bootstrap server is dropped by the engine."""
    fx = view(engine, "hangup", _fixture(engine)["cases"]["hangup"])
    assert aborts(_fixture(engine)["cases"]["hangup"]) == {}
    assert fx["decode_connection_closed"] == (engine == "vllm")
    assert fx["decode_stream_ran_to_completion"] == (engine == "sglang")
    got = ours["hangup"]
    v = view(engine, "hangup", got)
    assert v["decode_connection_closed"] and not v["decode_stream_ran_to_completion"], v
    if engine == "vllm":
        assert aborts(got) == {}
        return
    rid = _gen_legs(got["decode"])[0]["body"]["rid"]
    assert aborts(got) == {"prefill": [("/abort_request", {"rid": rid})],
                           "decode": [("/abort_request", {"rid": rid})]}


def test_fixture_is_what_the_router_sends(engine, tmp_path):
    router = ROUTERS[engine]
    if router_bin(router) is None:
        pytest.skip(f"{router} is not installed (make peers-venv); comparing against the recorded fixture only")
    live = capture(router, tmp_path)
    fx = _fixture(engine)["cases"]
    for case in CASES:
        assert view(engine, case, live[case]) == view(engine, case, fx[case]), case


def test_decode_kv_handle_stays_internal(engine, ours):
    """A vLLM decode answers with its own `kv_transfer_params` (the final chunk, or the top level):
    vllm-router hands it to the client (the fixture); splitserve drops it, like `disaggregated_params`."""
    if engine != "vllm":
        pytest.skip("applies to vLLM only: an SGLang decode answers with no kv_transfer_params to hide")
    fx = _fixture("vllm")["cases"]
    for case in ("chat_stream", "completion"):
        assert '"kv_transfer_params"' in fx[case]["answer"], case
        assert "kv_transfer_params" not in ours[case]["answer"], case
