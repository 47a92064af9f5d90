"""Engine recipes against every vector of docs/reference/kv_events.md §10."""

from __future__ import annotations

import hashlib
import struct

import pytest

from router.recipes import _cbor, dynamo, sglang, trtllm, vllm

TOKENS = [(i * 7919 + 13) % 152064 for i in range(300)]


def test_fixture_tokens():
    assert TOKENS[:4] == [13, 7932, 15851, 23770]


@pytest.mark.parametrize("algo,seed,none_prefix,wires", [
    ("sha256", "vllm-none-hash", "066b1e8987e02713", [5141853805067238592, 14375846540789485166]),
    ("sha256", "0", "1973e23848344dc4", [14427914317333314944, 4698958320666500944]),
    ("sha256_cbor", "vllm-none-hash", "9bd96a485ad84efd",
     [13233661041218796127, 3765112554186970179]),
    ("xxhash", "0", "6fb31cc38bba6066", [6640141733816421070, 14342265590786746475]),
    ("xxhash", "vllm-none-hash", None, [2128660301170978796, 11120355112994061432]),
    ("xxhash_cbor", "vllm-none-hash", None, [16078918924449296011, 11535463211205145347]),
])
def test_vllm_vectors(algo, seed, none_prefix, wires):
    if none_prefix:
        assert vllm.none_hash(algo, seed).hex().startswith(none_prefix)
    digests = vllm.block_hashes(TOKENS, 16, algo, seed=seed)
    assert len(digests) == 300 // 16
    assert [vllm.wire(d) for d in digests[:2]] == wires
    # the per-block API chains to the same values
    d0 = vllm.hash_block_tokens(algo, None, TOKENS[:16], seed=seed)
    assert vllm.hash_block_tokens(algo, d0, TOKENS[16:32], seed=seed) == digests[1]


def test_vllm_seed_rules():
    assert vllm.seed_for("sha256") == "vllm-none-hash"
    assert vllm.seed_for("xxhash", "0") == "0"
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        vllm.seed_for("xxhash_cbor")
    with pytest.raises(ValueError, match="unknown vLLM hash algorithm"):
        vllm.hash_fn("md5")


def test_canonical_cbor_matches_cbor2():
    cbor2 = pytest.importorskip("cbor2")
    samples = [
        (b"\x01" * 32, tuple(TOKENS[:40]), None),
        (b"\x02" * 16, (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1), None),
        ("seed", (-1, -24, -25, -2**63), ("lora", "name", None, True, False, [1, (2, "x")])),
        ("é" * 30, tuple(range(300)), ("cache_salt", "s" * 300)),
    ]
    for obj in samples:
        assert _cbor.dumps(obj) == cbor2.dumps(obj, canonical=True)
    with pytest.raises(TypeError, match="unsupported type"):
        _cbor.dumps((1.5,))


def test_trtllm_v1_vector_and_drop_last_token():
    got = trtllm.router_block_hashes(TOKENS, 32, "v1_block_key")
    assert got[:9] == [2501436643085760869, 4196608833193136717, 12308700645614128222,
                       12530311152235723850, 14681475655343817427, 802268816007256168,
                       8466853920173422766, 4164358431179037388, 1014579491311248302]
    # tokens[:299] -> 9 full blocks + the partial block tokens[288:299]
    assert len(got) == 10
    assert got[9] == trtllm.v1_block_key(TOKENS[288:299], got[8])
    # a 289-token prompt hashes 288 tokens: exactly 9 blocks, no partial
    assert len(trtllm.router_block_hashes(TOKENS[:289], 32)) == 9


def test_trtllm_v2_vectors():
    root = trtllm.v2_root()
    assert root.hex() == "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    assert root == hashlib.sha256(b"\x00").digest()
    k0 = trtllm.v2_key(root, TOKENS[:32])
    assert k0.hex() == "69246d97958abcf0ef07771f2ff86ca6c425489694ae9f6867a85ebf4c07b3f1"
    assert trtllm.v2_sha256_64(k0) == 7576300970960403696
    assert trtllm.v2_stream_int(k0) == 7576300970960403696  # positive: same on the wire
    assert trtllm.router_block_hashes(TOKENS, 32, "v2_sha256")[0] == k0.hex()
    assert trtllm.router_block_hashes(TOKENS, 32, "v2_sha256_64")[0] == 7576300970960403696


def test_trtllm_scope_and_salt():
    salt_id = trtllm.cache_salt_id("tenant")
    assert salt_id == int.from_bytes(hashlib.sha256(b"tenant").digest()[:8], "little")
    root = trtllm.v2_root(lora_id=7, salt_id=salt_id)
    assert root == hashlib.sha256(b"\x03" + struct.pack("<QQ", 7, salt_id)).digest()
    salted = trtllm.router_block_hashes(TOKENS, 32, cache_salt="tenant")
    assert salted[0] != trtllm.router_block_hashes(TOKENS, 32)[0]
    # only the root block mixes the salt, but the chain carries it into every later block
    assert salted[1] != trtllm.router_block_hashes(TOKENS, 32)[1]
    assert salted[1] == trtllm.v1_block_key(TOKENS[32:64], salted[0])
    with pytest.raises(ValueError, match="unknown TensorRT-LLM"):
        trtllm.router_block_hashes(TOKENS, 32, "v3")


def test_trtllm_mix_functions_wrap_at_width():
    # the u32 wrap inside mix32 is what makes it match the C++ harness; a 64-bit add would not
    big = 0xFFFFFFFF
    assert trtllm.mix32(big, 0) < 2**64
    assert trtllm.mix64(2**64 - 1, 2**64 - 1) < 2**64


def test_sglang_chain_and_event_int():
    pages = sglang.page_hashes([1, 2, 3, 4, 5, 6], 4)
    assert len(pages) == 2  # trailing partial page hashed too
    assert pages[0] == hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert pages[1] == hashlib.sha256(pages[0] + struct.pack("<2I", 5, 6)).digest()
    assert sglang.event_int(pages[0]) == int.from_bytes(pages[0][:8], "big", signed=True)
    salted = sglang.page_hashes([1, 2, 3, 4], 4, cache_salt="s")
    assert salted[0] == hashlib.sha256(
        hashlib.sha256(b"sglang-cache-salt-v1\0s").digest() + struct.pack("<4I", 1, 2, 3, 4)).digest()
    bigram = sglang.page_hashes([(1, 2), (3, 4)], 2)
    assert bigram[0] == hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).digest()
    wide = sglang.page_hashes([2**33], 1)
    assert wide[0] == hashlib.sha256(b"\xff" + struct.pack("<Q", 2**33)).digest()


def test_sglang_namespace_formula():
    h = -123456789
    seed = hashlib.sha256(b"sglang-kv-event-namespace-v1" + b"\x01" + struct.pack("<Q", 4)
                          + b"lora" + b"\x00").digest()
    expect = int.from_bytes(hashlib.sha256(seed + h.to_bytes(8, "big", signed=True)).digest()[:8],
                            "big", signed=True)
    assert sglang.namespaced(h, "lora", None) == expect


def test_dynamo_local_and_sequence():
    assert dynamo.compute_block_hash_for_seq([1, 2, 3, 4] * 8, 32) == [15883719750896736839]
    assert dynamo.compute_salt_hash() == 1337
    loc = dynamo.compute_block_hash_for_seq(TOKENS, 16, lora_name="l", cache_namespace="n")
    seqs = dynamo.sequence_hashes(loc)
    assert seqs[0] == loc[0]
    import xxhash
    assert seqs[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", seqs[0], loc[1]), 1337)
    seed = dynamo.compute_salt_hash("n", "l")
    blk = struct.pack("<16I", *TOKENS[:16])
    assert loc[0] == xxhash.xxh3_64_intdigest(blk, seed)
