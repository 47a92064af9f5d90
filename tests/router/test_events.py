"""Event codecs on the byte-exact payloads of docs/reference/kv_events.md §2.3 and every producer variant."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events import (END_SEQ_BYTES, AllCleared, BlocksMoved, BlocksRemoved, BlocksStored,
                           EventDecodeError, Tier, decode_payload, decode_trtllm_http, decode_zmq,
                           encode_vllm_batch)
from protocol.kv_replay import request_frames as replay_request

HEX_23 = (
    "93cb3ff800000000000093de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739"
    "1cfb7a7689a1fc5ba5fb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa"
    "626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a96772"
    "6f75705f6964780083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfb7a768"
    "9a1fc5ba5fa66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400")
PAYLOAD = bytes.fromhex(HEX_23)
H = 13233661041218796127
SEQ7 = (7).to_bytes(8, "big")


def _check_23(batch):
    assert (batch.seq, batch.ts, batch.dp_rank) == (7, 1.5, 0)
    stored, removed, cleared = batch.events
    assert stored == BlocksStored([H], None, [1, 2, 3, 4], 4, Tier.GPU, group=0)
    assert removed == BlocksRemoved([H], Tier.GPU, None)
    assert cleared == AllCleared(None)
    assert not batch.skipped


@pytest.mark.parametrize("frames", [
    [b"kv@pod@m", SEQ7, PAYLOAD],      # live PUB
    [b"", b"kv", SEQ7, PAYLOAD],       # vLLM 0.33 replay reply through a DEALER
    [SEQ7, PAYLOAD],                   # old replay reply
    [b"", SEQ7, PAYLOAD],              # old replay reply through a DEALER
])
def test_decode_reference_payload_in_every_framing(frames):
    _check_23(decode_zmq(frames))


def test_encoder_is_byte_exact_vllm_033():
    batch = decode_zmq([b"", SEQ7, PAYLOAD])
    assert encode_vllm_batch(1.5, batch.events, 0) == PAYLOAD


def test_legacy_array_encoding_decodes_to_same_events():
    legacy = msgpack.packb([1.5, [
        ["BlockStored", [H], None, [1, 2, 3, 4], 4, None, "GPU", None, None, 0, None, None],
        ["BlockRemoved", [H], "GPU", None],
        ["AllBlocksCleared"],
    ], 0])
    _check_23(decode_zmq([b"", SEQ7, legacy]))
    # v0.9 producers: five stored fields and a two-element envelope
    old = msgpack.packb([2.0, [["BlockStored", [5], None, [9, 9], 2, None]]])
    b = decode_zmq([b"", SEQ7, old])
    assert b.dp_rank is None and b.events[0].token_ids == [9, 9] and b.events[0].group is None


@pytest.mark.parametrize("frames", [[b"", END_SEQ_BYTES, b""], [END_SEQ_BYTES, b""],
                                    [b"", b"", END_SEQ_BYTES, b""]])
def test_replay_end_marker(frames):
    assert decode_zmq(frames).is_replay_end


def test_replay_request_frames():
    assert replay_request(5) == [b"", (5).to_bytes(8, "big")]


def test_sglang_variants():
    payload = msgpack.packb([3.0, [
        # signed hashes, partial last page (6 tokens in 2 pages of 4), salt, host tier
        {"type": "BlockStored", "block_hashes": [-5, 7], "parent_block_hash": -9,
         "token_ids": [1, 2, 3, 4, 5, 6], "block_size": 4, "lora_id": None,
         "medium": "CPU_PINNED", "cache_salt": "tenant"},
        # EAGLE bigram pairs
        {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None,
         "token_ids": [[1, 2], [2, 3], [3, 4], [4, 5]], "block_size": 4, "lora_id": None},
        {"type": "BlockRemoved", "block_hashes": [-5], "medium": "CPU_PINNED"},
    ], None])
    b = decode_zmq([b"", SEQ7, payload], engine="sglang")
    s0, s1, r = b.events
    assert s0.engine_hashes == [2**64 - 5, 7] and s0.parent_engine_hash == 2**64 - 9
    assert s0.tier is Tier.HOST and s0.cache_salt == "tenant" and s0.engine_block_size == 4
    assert s1.token_ids == [1, 2, 3, 4]
    assert r == BlocksRemoved([2**64 - 5], Tier.HOST, None)
    assert b.dp_rank is None


def test_sglang_legacy_arrays_with_metadata_slot():
    payload = msgpack.packb([1.0, [
        ["BlockStored", [1], None, [1, 2], 2, None, "GPU", {"cache_salt": "s"}],
        ["BlockStored", [2], 1, [3, 4], 2, None, "GPU", "my-lora", None],
    ], 0])
    a, b = decode_zmq([b"", SEQ7, payload], engine="sglang").events
    assert a.cache_salt == "s" and b.lora_name == "my-lora" and b.parent_engine_hash == 1


def test_vllm_salt_recovered_from_block0_extra_keys():
    payload = msgpack.packb([1.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": None,
         "lora_name": "lora-a", "extra_keys": [["lora-a", "salty", ["mmhash", 0]], None]},
    ], 0])
    (ev,) = decode_zmq([b"", SEQ7, payload]).events
    assert ev.cache_salt == "salty" and ev.lora_name == "lora-a"


def test_bytes_and_hex_hashes_stay_opaque():
    payload = msgpack.packb([1.0, [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": "ab" * 16,
         "token_ids": [1], "block_size": 1, "lora_id": None, "medium": "GPU",
         "lora_name": None}], 0], use_bin_type=True)
    (ev,) = decode_zmq([b"", SEQ7, payload]).events
    assert ev.engine_hashes == [b"\x01" * 32] and ev.parent_engine_hash == bytes.fromhex("ab" * 16)


def test_non_attention_groups_and_unknown_types_are_not_indexed():
    payload = msgpack.packb([1.0, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [1], "block_size": 1, "lora_id": None, "medium": None, "lora_name": None,
         "group_idx": 1, "kv_cache_spec_kind": "sliding_window"},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
         "token_ids": [1], "block_size": 1, "lora_id": None, "medium": None, "lora_name": None,
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "SomethingNew", "x": 1},
    ], 0])
    b = decode_zmq([b"", SEQ7, payload], engine="trtllm")
    assert [e.engine_hashes for e in b.events] == [[2]]
    assert b.skipped == ["SomethingNew"]


def _stored(**over):
    d = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None}
    d.update(over)
    return msgpack.packb([1.0, [d], 0])


@pytest.mark.parametrize("payload,needle", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb({"ts": 1}), "expected an array"),
    (msgpack.packb([1.0]), "expected an array"),
    (msgpack.packb(["x", []]), "batch.ts"),
    (msgpack.packb([1.0, {}]), "batch.events"),
    (msgpack.packb([1.0, [], "r"]), "batch.dp_rank"),
    (msgpack.packb([1.0, [5]]), "map or a tagged array"),
    (msgpack.packb([1.0, [{"x": 1}]]), "without a \"type\""),
    (_stored(block_hashes=5), "block_hashes: expected a list"),
    (_stored(block_hashes=[1.5, 2]), "expected int, bytes or hex"),
    (_stored(block_hashes=[True, 2]), "found bool"),
    (_stored(parent_block_hash="zz"), "non-hex"),
    (_stored(token_ids=[1, 2]), "need 3..4 token ids, found 2"),
    (_stored(token_ids=[1, 2, 3, 4, 5]), "found 5"),
    (_stored(token_ids=[1, -2, 3, 4]), "token ids in [0, 2**32)"),
    (_stored(token_ids=[1, 2, 3, 2**32]), "token ids in [0, 2**32)"),
    (_stored(token_ids=[[1, 2, 3], [1, 2]]), "bigram"),
    (_stored(block_size=0), "block_size"),
    (_stored(medium=3), "medium"),
    (_stored(group_idx="a"), "group_idx"),
    (_stored(lora_name=3), "lora_name"),
])
def test_malformed_payloads_raise_typed_errors(payload, needle):
    with pytest.raises(EventDecodeError) as ei:
        decode_zmq([b"", SEQ7, payload])
    assert needle in ei.value.reason


@pytest.mark.parametrize("frames,needle", [
    ([b"x"], "frames"),
    ([b"", b"\x00" * 7, PAYLOAD], "8 bytes"),
    ([b"", END_SEQ_BYTES, PAYLOAD], "non-empty payload"),
    ([b"", SEQ7, b""], "empty payload"),
])
def test_malformed_frames(frames, needle):
    with pytest.raises(EventDecodeError, match=needle):
        decode_zmq(frames)


def test_unknown_engine_is_a_caller_error():
    with pytest.raises(ValueError, match="engine"):
        decode_payload(PAYLOAD, engine="tgi")


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type",
                       "block_hashes", "token_ids", "block_size"]),
    lambda c: st.lists(c, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "medium", "group_idx", "lora_name", "extra_keys",
                         "kv_cache_spec_kind"]), c, max_size=6),
    max_leaves=30)


@settings(max_examples=150, deadline=None)
@given(st.lists(_msgpack_values, max_size=4), st.sampled_from(["vllm", "sglang", "trtllm"]))
def test_arbitrary_msgpack_never_crashes(envelope, engine):
    payload = msgpack.packb(envelope, use_bin_type=True)
    try:
        batch = decode_zmq([b"", SEQ7, payload], engine=engine)
    except EventDecodeError as e:
        assert e.reason
        return
    for ev in batch.events:
        assert isinstance(ev, (BlocksStored, BlocksRemoved, AllCleared))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_crash(payload):
    try:
        decode_zmq([b"", SEQ7, payload])
    except EventDecodeError:
        pass


# ---- TensorRT-LLM HTTP ----------------------------------------------------------------------

def _tok(ids, extra=0):
    return [{"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in ids]


def test_trtllm_http_events():
    obj = [
        {"event_id": 17, "window_size": 4096, "attention_dp_rank": 1,
         "data": {"type": "created", "num_blocks_per_cache_level": [100, 50]}},
        {"event_id": 18, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": 987, "tokens": _tok([1, 2]), "cache_level": 0,
             "priority": 35},
            {"type": "stored_block", "block_hash": -1, "tokens": _tok([3, 4]), "cache_level": 0,
             "priority": 35}]}},
        {"event_id": 19, "data": {"type": "removed", "block_hashes": [987]}},
        {"event_id": 20, "data": {"type": "updated", "block_hash": 987,
                                  "cache_level": {"type": "event_diff", "new_value": 1,
                                                  "old_value": 0},
                                  "priority": None}},
        {"event_id": 21, "data": {"type": "updated", "block_hash": 987, "cache_level": None,
                                  "priority": {"type": "event_diff", "new_value": 1,
                                               "old_value": 50}}},
    ]
    b = decode_trtllm_http(obj)
    assert [x.seq for x in b] == [17, 18, 19, 20, 21]
    assert b[0].events == [AllCleared(None)] and b[0].dp_rank == 1
    st_ = b[1].events[0]
    assert st_.engine_hashes == [987, 2**64 - 1] and st_.token_ids == [1, 2, 3, 4]
    assert st_.engine_block_size == 2 and st_.parent_engine_hash is None
    assert b[2].events == [BlocksRemoved([987], Tier.GPU, None)]
    assert b[3].events == [BlocksMoved([987], Tier.GPU, Tier.HOST, None)]
    assert b[4].events == []  # priority-only


def test_trtllm_http_extra_token_ids_truncate_the_chain():
    obj = [{"event_id": 1, "data": {"type": "stored", "parent_hash": 5, "blocks": [
        {"block_hash": 1, "tokens": _tok([1, 2])},
        {"block_hash": 2, "tokens": _tok([3, 4], extra=9)},
        {"block_hash": 3, "tokens": _tok([5, 6])}]}}]
    (ev,) = decode_trtllm_http(obj)[0].events
    assert ev.engine_hashes == [1] and ev.token_ids == [1, 2] and ev.parent_engine_hash == 5


@pytest.mark.parametrize("obj,needle", [
    ({}, "JSON list"),
    ([{"event_id": 1}], "data"),
    ([{"event_id": "1", "data": {"type": "created"}}], "event_id"),
    ([{"event_id": 1, "data": {"type": "stored", "blocks": 3}}], "stored.blocks"),
    ([{"event_id": 1, "data": {"type": "stored", "blocks": [{"block_hash": 1}]}}], "tokens"),
    ([{"event_id": 1, "data": {"type": "stored", "blocks": [
        {"block_hash": 1, "tokens": [{"token_id": "a"}]}]}}], "token_id"),
    ([{"event_id": 1, "data": {"type": "updated", "block_hash": 1, "cache_level": 3}}],
     "event_diff"),
    ([{"event_id": 1, "data": {"type": 4}}], "data.type"),
])
def test_trtllm_http_malformed(obj, needle):
    with pytest.raises(EventDecodeError, match=needle):
        decode_trtllm_http(obj)


def test_encoder_rejects_what_vllm_cannot_carry():
    with pytest.raises(ValueError, match="without token ids"):
        encode_vllm_batch(1.0, [BlocksStored([1], None, None, 1)])
    with pytest.raises(TypeError, match="BlocksMoved"):
        encode_vllm_batch(1.0, [BlocksMoved([1], Tier.GPU, Tier.HOST)])


def test_encode_decode_round_trip_with_optional_fields():
    evs = [BlocksStored([2**64 - 1, 3], 9, list(range(8)), 4, Tier.HOST, lora_name="l",
                        group=2, group_kind="full_attention"),
           BlocksRemoved([3], Tier.DISK, 2), AllCleared()]
    b = decode_payload(encode_vllm_batch(4.25, evs, 3), seq=11)
    assert b.seq == 11 and b.ts == 4.25 and b.dp_rank == 3
    assert b.events[0] == evs[0] and b.events[1] == evs[1] and b.events[2] == AllCleared()
