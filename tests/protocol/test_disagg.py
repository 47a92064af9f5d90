"""The opaque state codec: what a context worker writes is what its generation peer reads."""
from __future__ import annotations

import base64

import msgpack
import pytest

from protocol.disagg import (OPAQUE_FIELD, DisaggParamsError, OpaqueState, OpaqueStateError, RequestType,
                             decode_opaque_state, encode_opaque_state, parse_disagg_params)


def test_roundtrip_and_wire_form():
    st = OpaqueState(worker_id="w1", worker_url="http://127.0.0.1:9", ctx_request_id=7, num_tokens=40,
                     block_size=16, key_scheme="xxh3_chain_v1", block_ids=[3, 4, 5],
                     tx_ep="tcp://127.0.0.1:5", tx_req=7)
    blob = encode_opaque_state(st)
    assert decode_opaque_state(blob) == st
    # the wire form is plain base64 msgpack of a map (readable by any msgpack reader, no pickle)
    raw = msgpack.unpackb(base64.b64decode(blob))
    assert raw["v"] == 1 and raw["ctx_request_id"] == 7 and raw["block_ids"] == [3, 4, 5]
    # a map of the fields encodes the same
    assert decode_opaque_state(encode_opaque_state({"worker_url": "http://x", "wait": True})) == \
        OpaqueState(worker_url="http://x", wait=True)


@pytest.mark.parametrize("blob,why", [
    (3, "must be a string, got int"),
    ("not base64!", "not base64 msgpack"),
    (base64.b64encode(b"\xc1").decode(), "not base64 msgpack"),
    (base64.b64encode(msgpack.packb([1, 2])).decode(), "does not fit"),
    (base64.b64encode(msgpack.packb({"ctx_request_id": "7"})).decode(), "$.ctx_request_id"),
])
def test_bad_blobs_say_what_was_found(blob, why):
    with pytest.raises(OpaqueStateError) as e:
        decode_opaque_state(blob)
    assert why in str(e.value) and e.value.field == OPAQUE_FIELD


def test_a_field_one_side_does_not_know_is_refused_not_dropped():
    with pytest.raises(ValueError, match="tx_unknown"):
        encode_opaque_state({"worker_url": "http://x", "tx_unknown": 1})


def test_request_types_are_the_trtllm_spelling():
    assert [t.value for t in RequestType] == ["context_only", "generation_only", "context_and_generation"]


@pytest.mark.parametrize("dp,field", [
    ({"request_type": "both"}, "disaggregated_params.request_type"),
    ({"request_type": "generation_only", "first_gen_tokens": [1, "x"]},
     "disaggregated_params.first_gen_tokens"),
    ({"disagg_request_id": -1}, "disaggregated_params.disagg_request_id"),
    ({"ctx_request_id": "7"}, "disaggregated_params.ctx_request_id"),
    (3, "disaggregated_params"),
])
def test_disagg_params_errors_name_the_field(dp, field):
    with pytest.raises(DisaggParamsError) as e:
        parse_disagg_params(dp)
    assert e.value.field == field and str(e.value).startswith(f"'{field}'")


def test_disagg_params_fields_we_do_not_name_pass_and_types_are_typed():
    p = parse_disagg_params({"request_type": "generation_only", "ctx_request_id": 7,
                             "first_gen_tokens": [5], "route_hint": {"dp_rank": 0}})
    assert p.request_type is RequestType.GENERATION_ONLY and p.ctx_request_id == 7
