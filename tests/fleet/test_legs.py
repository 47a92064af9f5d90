"""The leg adapters' pure functions (fleet/legs/) and the worker's reading of those legs
(worker/engine_protocols.py). Field sets come from the engines' source, cited in the modules; the
end-to-end behaviour is in test_engine_protocols.py, the routers' own requests in test_peer_parity.py."""
from __future__ import annotations

import pytest

from fleet import legs
from fleet.legs import sglang, trtllm, vllm
from worker import engine_protocols
from protocol.disagg import OpaqueState, decode_opaque_state
from worker.requests import CONTEXT_ONLY, GENERATION_ONLY, InvalidRequest

CLIENT = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
          "min_tokens": 2, "temperature": 0}

# What NIXL's scheduler returns from a finished prefill (vllm 0.33.0, nixl/pull_scheduler.py).
NIXL_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
               "remote_engine_id": "e", "remote_request_id": "cmpl-1-0", "remote_host": "10.0.0.1",
               "remote_port": 5600, "tp_size": 1}


def test_vllm_prefill_body_is_the_toy_proxys():
    b = vllm.prefill_body(CLIENT)
    assert b["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}
    assert b["stream"] is False and b["max_tokens"] == 1
    assert "stream_options" not in b and "min_tokens" not in b and "max_completion_tokens" not in b
    assert b["prompt"] == "hi" and b["temperature"] == 0
    assert CLIENT["max_tokens"] == 9 and "kv_transfer_params" not in CLIENT   # the client's body is not touched
    assert vllm.prefill_body({**CLIENT, "max_completion_tokens": 7})["max_completion_tokens"] == 1


def test_vllm_decode_carries_the_prefill_answers_params_verbatim():
    kv = vllm.decode_params({"choices": [], "kv_transfer_params": NIXL_ANSWER})
    assert kv == NIXL_ANSWER
    b = vllm.decode_body(CLIENT, kv)
    assert b["kv_transfer_params"] is kv and b["max_tokens"] == 9 and b["stream"] is True
    # No connector on the prefill: the decode server runs the request itself (as vLLM's proxy does).
    assert vllm.decode_params({"choices": []}) is None
    assert "kv_transfer_params" not in vllm.decode_body(CLIENT, None)


@pytest.mark.parametrize("answer, says", [
    ([], "JSON object"),
    ({"kv_transfer_params": "x"}, "kv_transfer_params to be an object"),
    ({"kv_transfer_params": {**NIXL_ANSWER, "remote_host": None}}, "remote_host"),
    ({"kv_transfer_params": {k: v for k, v in NIXL_ANSWER.items() if k != "remote_block_ids"}}, "remote_block_ids"),
])
def test_vllm_bad_prefill_answers_are_named(answer, says):
    with pytest.raises(vllm.BadPrefillAnswer, match=says):
        vllm.decode_params(answer)


def test_sglang_leg_body_and_bootstrap():
    b = sglang.leg_body(CLIENT, "10.0.0.5", 8998, 1 << 62, 1 << 62)
    assert (b["bootstrap_host"], b["bootstrap_port"], b["bootstrap_room"], b["rid"]) == \
        ("10.0.0.5", 8998, 1 << 62, str(1 << 62))
    assert {k: v for k, v in b.items() if not k.startswith("bootstrap_") and k != "rid"} == CLIENT
    assert sglang.bootstrap_host("http://10.0.0.5:30000") == "10.0.0.5"
    assert sglang.bootstrap_host("http://[::1]:30000") == "::1"
    with pytest.raises(ValueError, match="host:port"):
        sglang.bootstrap_host("10.0.0.5")
    assert sglang.bootstrap_port(9000, {"disaggregation_bootstrap_port": 9100}) == 9000
    assert sglang.bootstrap_port(None, {"disaggregation_bootstrap_port": 9100}) == 9100
    assert sglang.bootstrap_port(None, {}) == sglang.DEFAULT_BOOTSTRAP_PORT == 8998
    assert sglang.bootstrap_port(None, {"disaggregation_bootstrap_port": "9100"}) == 8998
    with pytest.raises(ValueError, match="2\\*\\*63"):
        sglang.room_of(1 << 63)


def test_aborts_per_protocol():
    assert (trtllm.ABORT_PATH, trtllm.abort_body(5)) == ("/v1/abort", {"request_id": 5})
    assert (sglang.ABORT_PATH, sglang.abort_body(5)) == ("/abort_request", {"rid": "5"})
    assert (vllm.ABORT_PATH, vllm.abort_body(5)) == (None, None)
    assert [legs.module(p).SEQUENTIAL for p in legs.ENGINE_PROTOCOLS] == [True, True, False]
    assert [legs.module(p).ALLOWS_LOCAL_PREFILL for p in legs.ENGINE_PROTOCOLS] == [True, True, False]
    with pytest.raises(ValueError, match="protocol must be one of"):
        legs.module("tgi")


def test_protocol_inference_from_server_info():
    # SGLang's /server_info is its resolved server args (sglang 0.5.23 build_server_info).
    assert legs.infer({"model_path": "m", "disaggregation_mode": "prefill",
                       "disaggregation_bootstrap_port": 8998, "page_size": 16}) == "sglang"
    assert legs.infer({"vllm_config": "..."}) == "vllm"               # vLLM dev-mode /server_info
    assert legs.infer({"engine": "sim", "disagg_protocol": "vllm"}) == "vllm"
    assert legs.infer({"engine": "sim"}) is None and legs.infer({}) is None and legs.infer(None) is None
    assert legs.engine_protocol_of(None, {}) == "trtllm"
    assert legs.engine_protocol_of(None, {"disaggregation_mode": "decode"}) == "sglang"
    assert legs.engine_protocol_of("vllm", {"disaggregation_mode": "decode"}) == "vllm"   # configured wins


# ------------------------------------------------------------------ worker side

def test_worker_reads_vllm_legs():
    body, st = engine_protocols.incoming("vllm", "context", vllm.prefill_body(CLIENT), 77)
    assert st == {"kind": "vllm_prefill"} and "kv_transfer_params" not in body
    assert body["disaggregated_params"] == {"request_type": CONTEXT_ONLY, "disagg_request_id": 77}
    kv = {**NIXL_ANSWER, "remote_request_id": "77", "remote_host": "127.0.0.1", "remote_port": 8100}
    body, st = engine_protocols.incoming("vllm", "generation", vllm.decode_body(CLIENT, kv), 1)
    dp = body["disaggregated_params"]
    assert st == {"kind": "vllm_decode"} and dp["request_type"] == GENERATION_ONLY and dp["ctx_request_id"] == 77
    assert decode_opaque_state(dp["encoded_opaque_state"]) == OpaqueState(worker_url="http://127.0.0.1:8100")
    assert engine_protocols.incoming("vllm", "both", dict(CLIENT), 1) == (CLIENT, None)


def test_worker_reads_sglang_legs():
    leg = sglang.leg_body(CLIENT, "127.0.0.1", 8998, 12345, 12345)
    body, st = engine_protocols.incoming("sglang", "context", leg, 1)
    assert body["disaggregated_params"] == {"request_type": CONTEXT_ONLY, "disagg_request_id": 12345}
    assert st == {"kind": "sglang_prefill", "rid": "12345", "room": 12345}
    assert not any(k.startswith("bootstrap_") or k == "rid" for k in body)
    body, st = engine_protocols.incoming("sglang", "generation", leg, 1)
    dp = body["disaggregated_params"]
    assert dp["request_type"] == GENERATION_ONLY and dp["ctx_request_id"] == 12345
    assert decode_opaque_state(dp["encoded_opaque_state"]) == OpaqueState(worker_url="http://127.0.0.1:8998",
                                                                          wait=True)


SIM_KV = {**NIXL_ANSWER, "remote_request_id": "77"}


@pytest.mark.parametrize("proto, role, body, param", [
    ("vllm", "context", {"kv_transfer_params": []}, "kv_transfer_params"),
    ("vllm", "generation", {"kv_transfer_params": {**SIM_KV, "remote_port": None}}, "kv_transfer_params.remote_port"),
    ("vllm", "generation", {"kv_transfer_params": {**SIM_KV, "remote_port": 0}}, "kv_transfer_params.remote_port"),
    ("vllm", "generation", {"kv_transfer_params": {**SIM_KV, "remote_host": "a/b"}}, "kv_transfer_params.remote_host"),
    ("vllm", "generation", {"kv_transfer_params": NIXL_ANSWER}, "kv_transfer_params.remote_request_id"),
    ("sglang", "generation", {"bootstrap_room": -1}, "bootstrap_room"),
    ("sglang", "generation", {"bootstrap_room": 1, "bootstrap_host": "h"}, "bootstrap_port"),
    ("sglang", "generation", {"bootstrap_room": 1, "bootstrap_port": 1}, "bootstrap_host"),
    ("sglang", "generation", {"bootstrap_room": 1, "bootstrap_port": 1, "bootstrap_host": "h@x"}, "bootstrap_host"),
    ("sglang", "context", {"rid": 5}, "rid"),
])
def test_worker_rejects_bad_leg_fields_naming_them(proto, role, body, param):
    with pytest.raises(InvalidRequest) as e:
        engine_protocols.incoming(proto, role, {"model": "m", "prompt": "x", **body}, 1)
    assert e.value.param == param


def test_stream_kv_handle_is_stripped():
    from fleet.relay import strip_stream_kv
    ev = (b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
          b'data: {"id":"a","choices":[],"kv_transfer_params":{"remote_block_ids":[[1]]}}\n\n'
          b"data: [DONE]\n\n")
    out = strip_stream_kv(ev)
    assert b"kv_transfer_params" not in out and out.count(b"\n\n") == 3
    assert out.startswith(b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
    assert out.endswith(b'data: {"id":"a","choices":[]}\n\ndata: [DONE]\n\n')
