"""SGLang 0.5.23 page hashes (``srt/mem_cache/cpp_utils/hash_binding.cpp``; what routing does with engine
recipes: docs/routing.md "Block keys"; vectors: tests/router/test_recipes.py).

A SHA-256 chain over little-endian u32 tokens per page, the first page unseeded (or seeded by
the cache salt); the trailing partial page is hashed too. Events carry the first 8 bytes of each
digest as a *signed* big-endian int64.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_SALT_PREFIX = b"sglang-cache-salt-v1\0"
_NS_PREFIX = b"sglang-kv-event-namespace-v1"


def _page_bytes(page: Sequence) -> bytes:
    if page and isinstance(page[0], (tuple, list)):
        # EAGLE bigram keys: two u32 per position
        return b"".join(struct.pack("<II", int(a), int(b)) for a, b in page)
    vals = [int(t) for t in page]
    if any(v < 0 for v in vals):
        raise ValueError("SGLang token ids must be non-negative")
    if any(v > 0xFFFFFFFF for v in vals):
        # wide ids: a 0xff tag then 8-byte words
        return b"\xff" + b"".join(struct.pack("<Q", v) for v in vals)
    return struct.pack(f"<{len(vals)}I", *vals)


def salt_prior(cache_salt: str) -> bytes:
    """The chain seed of a salted request (default event format)."""
    return hashlib.sha256(_SALT_PREFIX + cache_salt.encode()).digest()


def page_hashes(tokens: Sequence, page_size: int, prior: bytes | None = None, *,
                cache_salt: str | None = None) -> list[bytes]:
    """32-byte digests per page, trailing partial page included."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, found {page_size}")
    if prior is None and cache_salt is not None:
        prior = salt_prior(cache_salt)
    out = []
    for i in range(0, len(tokens), page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(_page_bytes(tokens[i:i + page_size]))
        prior = h.digest()
        out.append(prior)
    return out


def event_int(digest: bytes) -> int:
    """``hash_str_to_int64``: the first 8 bytes as a signed big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def _enc(s: str | None) -> bytes:
    if s is None:
        return b"\x00"
    b = s.encode()
    return b"\x01" + struct.pack("<Q", len(b)) + b


def namespaced(h: int, extra_key: str | None = None, cache_salt: str | None = None) -> int:
    """A published hash namespaced by LoRA ``extra_key`` and ``cache_salt`` (dynamo format)."""
    seed = hashlib.sha256(_NS_PREFIX + _enc(extra_key) + _enc(cache_salt)).digest()
    return event_int(hashlib.sha256(seed + h.to_bytes(8, "big", signed=True)).digest())
