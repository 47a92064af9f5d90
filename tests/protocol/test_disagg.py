"""The opaque state codec: what a context worker writes is what its generation peer reads."""
from __future__ import annotations

import base64

import msgpack
import pytest

from protocol.disagg import (OPAQUE_FIELD, OpaqueState, OpaqueStateError, RequestType,
                             decode_opaque_state, encode_opaque_state)


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
