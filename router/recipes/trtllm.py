"""TensorRT-LLM block keys (``tensorrt_llm/runtime/kv_cache_hash.py``, ``blockKey.cpp``; what
routing does with engine recipes: docs/routing.md "Block keys"; vectors: tests/router/test_recipes.py).

- ``v1_block_key``: the V1 KV-cache manager's 64-bit boost-style mix, chained (parent 0 = root).
- ``v2_sha256``: the V2 radix key, a SHA-256 chain over u32le tokens from ``sha256(scope)``;
  ``v2_sha256_64`` is its first 8 bytes big-endian unsigned; the streaming ZMQ publisher sends the
  same 8 bytes as a *signed* int64.
- The router hashes ``tokens[:-1]`` (the KV-cache manager never keys the last prompt token),
  including the trailing partial block (:func:`router_block_hashes`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

M64 = (1 << 64) - 1
ALGOS = ("v1_block_key", "v2_sha256", "v2_sha256_64")
DEFAULT_TOKENS_PER_BLOCK = 32


def mix32(v: int, seed: int) -> int:
    v &= 0xFFFFFFFF
    v = (((v >> 16) ^ v) * 0x45D9F3B) & 0xFFFFFFFF
    v = (((v >> 16) ^ v) * 0x45D9F3B) & 0xFFFFFFFF
    v = ((v >> 16) ^ v) & 0xFFFFFFFF
    v = (v + 0x9E3779B9) & 0xFFFFFFFF  # C++ uint32 wrap before widening
    return seed ^ ((v + (seed << 6) + (seed >> 2)) & M64)


def mix64(v: int, seed: int) -> int:
    v &= M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & M64
    v ^= v >> 31
    return seed ^ ((v + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & M64)


def cache_salt_id(salt: str) -> int:
    """Salt id as the router and the V2 manager derive it (little-endian first 8 bytes)."""
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little")


def v1_block_key(tokens: Sequence[int], parent: int = 0, cache_salt_id: int | None = None,
                 lora_task_id: int | None = None,
                 token_extra_ids: Sequence[int] | None = None) -> int:
    s = (len(tokens) ^ ((parent * 0xBF58476D1CE4E5B9) & M64)) & M64
    if parent == 0 and cache_salt_id is not None:
        s = mix64(cache_salt_id, s)
    if token_extra_ids is None:
        for t in tokens:
            s = mix32(int(t), s)
    else:
        for t, x in zip(tokens, token_extra_ids, strict=True):
            s = mix32(int(t), s)
            s = mix64(int(x), s)
    if lora_task_id is not None:
        s = mix64(lora_task_id, s)
    return s


def v2_root(lora_id: int | None = None, salt_id: int | None = None) -> bytes:
    mask = (1 if lora_id is not None else 0) | (2 if salt_id is not None else 0)
    scope = bytes([mask]) + b"".join(struct.pack("<Q", x & M64)
                                     for x in (lora_id, salt_id) if x is not None)
    return hashlib.sha256(scope).digest()


def v2_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *[int(t) for t in tokens])).digest()


def v2_sha256_64(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")


def v2_stream_int(key: bytes) -> int:
    """The hash the V2 streaming ZMQ publisher puts on the wire (signed int64)."""
    return int.from_bytes(key[:8], "big", signed=True)


def router_block_hashes(tokens: Sequence[int], tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK,
                        algo: str = "v1_block_key", *, cache_salt: str | None = None,
                        lora_id: int | None = None) -> list:
    """What ``BlockHashMixin`` computes for a prompt: ``tokens[:-1]`` in ``tokens_per_block``
    chunks, trailing partial chunk included. v1 → ints, v2_sha256 → hex strings,
    v2_sha256_64 → unsigned ints."""
    if algo not in ALGOS:
        raise ValueError(f"unknown TensorRT-LLM hash algorithm {algo!r}; expected one of {ALGOS}")
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, found {tokens_per_block}")
    toks = [int(t) for t in tokens][:-1]
    salt_id = cache_salt_id(cache_salt) if cache_salt is not None else None
    out: list = []
    if algo == "v1_block_key":
        parent = 0
        for i in range(0, len(toks), tokens_per_block):
            parent = v1_block_key(toks[i:i + tokens_per_block], parent, salt_id, lora_id)
            out.append(parent)
        return out
    key = v2_root(lora_id, salt_id)
    for i in range(0, len(toks), tokens_per_block):
        key = v2_key(key, toks[i:i + tokens_per_block])
        out.append(key.hex() if algo == "v2_sha256" else v2_sha256_64(key))
    return out
