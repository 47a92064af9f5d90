"""Property: whatever the bytes, the KV-event decoders raise only EventDecodeError.

Inputs: arbitrary msgpack values (any nesting of maps, arrays, ints of every width, floats,
strings, bytes), near-valid batches (real event maps and legacy arrays with fields replaced by
arbitrary values), raw bytes, deep nesting, and arbitrary JSON for TensorRT-LLM's
`POST /kv_cache_events` response.
"""
from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.events import (EventBatch, EventDecodeError, decode_payload, decode_trtllm_http,
                           decode_zmq)

ENGINES = ("vllm", "sglang", "trtllm")
# SPLITSERVE_FUZZ_EXAMPLES=5000 for a long run
SETTINGS = settings(max_examples=int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "100")), deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True), st.text(max_size=12), st.binary(max_size=12))
keys = st.one_of(st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids",
                                  "block_size", "medium", "lora_name", "extra_keys", "group_idx",
                                  "kv_cache_spec_kind", "cache_salt", "lora_id"]),
                 st.text(max_size=6))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(keys, inner, max_size=5)), max_leaves=30)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])


@st.composite
def near_valid_event(draw):
    tag = draw(tags)
    ev = {"type": tag, "block_hashes": [1, 2], "parent_block_hash": None,
          "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
          "lora_name": None}
    for k in draw(st.lists(keys, max_size=3)):
        ev[k] = draw(values)
    if draw(st.booleans()):
        return ev
    return [tag, *[ev.get(k) for k in ("block_hashes", "parent_block_hash", "token_ids",
                                      "block_size", "lora_id", "medium")],
            *draw(st.lists(values, max_size=3))]


@st.composite
def near_valid_batch(draw):
    evs = draw(st.lists(st.one_of(near_valid_event(), values), max_size=4))
    head = [draw(st.one_of(st.floats(), st.integers(-(2**63), 2**64 - 1), values)), evs]
    if draw(st.booleans()):
        head.append(draw(st.one_of(st.integers(min_value=-5, max_value=5), values)))
    return head


def _decode_all(payload: bytes, seq_frame: bytes = (3).to_bytes(8, "big")) -> None:
    for engine in ENGINES:
        for call in (lambda: decode_payload(payload, 0, engine),
                     lambda: decode_zmq([b"t", seq_frame, payload], engine),
                     lambda: decode_zmq([seq_frame, payload], engine)):
            try:
                out = call()
            except EventDecodeError:
                continue
            assert isinstance(out, EventBatch)


@SETTINGS
@given(values)
def test_arbitrary_msgpack_values(v):
    _decode_all(msgpack.packb(v, use_bin_type=True))


@SETTINGS
@given(near_valid_batch())
def test_near_valid_batches(b):
    _decode_all(msgpack.packb(b, use_bin_type=True))


@SETTINGS
@given(st.binary(max_size=200), st.binary(min_size=0, max_size=10))
def test_arbitrary_bytes_and_seq_frames(payload, seq):
    _decode_all(payload, seq)


@pytest.mark.parametrize("depth", [10, 900, 5_000, 200_000])
def test_deep_nesting_is_a_decode_error_not_a_crash(depth):
    deep = b"\x91" * depth + b"\xc0"
    # [1.5, [{"type": "BlockStored", "extra_keys": <deep>}], 0]
    event = b"\x82" + msgpack.packb("type") + msgpack.packb("BlockStored") \
        + msgpack.packb("extra_keys") + deep
    batch = b"\x93" + msgpack.packb(1.5) + b"\x91" + event + b"\x00"
    _decode_all(deep)
    _decode_all(batch)
    with pytest.raises(EventDecodeError):
        decode_payload(batch, 0, "vllm")


def test_a_bigram_entry_that_is_a_map_is_a_decode_error():
    # the KeyError of issue 15: token_ids as bigram "pairs" that are maps
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": [[1, 2], {"a": 1}], "block_size": 2}
    with pytest.raises(EventDecodeError, match="bigram"):
        decode_payload(msgpack.packb([1.0, [ev], 0]), 0, "sglang")


def test_oversized_payload_is_refused_before_parsing(monkeypatch):
    import router.events as events
    monkeypatch.setattr(events, "MAX_PAYLOAD_BYTES", 100)
    with pytest.raises(EventDecodeError, match="exceeds"):
        decode_payload(msgpack.packb([1.0, [[0] * 200], 0]), 0, "vllm")


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
              st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(keys, st.sampled_from(
                                ["event_id", "data", "blocks", "tokens", "token_id", "cache_level",
                                 "mm_keys", "block_hash", "parent_hash", "attention_dp_rank",
                                 "window_size", "new_value", "old_value"])), inner, max_size=5)),
    max_leaves=30)


@st.composite
def near_valid_trt(draw):
    block = {"type": "stored_block", "block_hash": draw(st.integers(-5, 5)),
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                        for t in range(4)], "cache_level": 0, "priority": 35}
    data = draw(st.sampled_from([
        {"type": "stored", "parent_hash": None, "blocks": [block, dict(block, block_hash=9)]},
        {"type": "removed", "block_hashes": [1, 2]},
        {"type": "created", "num_blocks_per_cache_level": [10, 0]},
        {"type": "updated", "block_hash": 1,
         "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1}, "priority": None}]))
    for k in draw(st.lists(st.sampled_from(["blocks", "block_hashes", "parent_hash", "cache_level",
                                            "type", "cache_salt"]), max_size=2)):
        data[k] = draw(json_values)
    ev = {"event_id": draw(st.one_of(st.integers(0, 10), json_values)), "data": data,
          "window_size": 32}
    if draw(st.booleans()):
        ev["attention_dp_rank"] = draw(st.one_of(st.integers(0, 3), json_values))
    return ev


@SETTINGS
@given(st.one_of(json_values, st.lists(st.one_of(near_valid_trt(), json_values), max_size=4)))
def test_trtllm_http_decoder_on_arbitrary_json(obj):
    try:
        out = decode_trtllm_http(obj)
    except EventDecodeError:
        return
    assert isinstance(out, list) and all(isinstance(b, EventBatch) for b in out)
