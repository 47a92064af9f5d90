"""vLLM 0.33 prefix-cache block hashes (``vllm/v1/core/kv_cache_utils.py``; what routing does with engine
recipes: docs/routing.md "Block keys"; vectors: tests/router/test_recipes.py).

``H((parent_digest or NONE_HASH, tuple(tokens), extra_keys))`` per full block, with H one of
sha256 / sha256_cbor / xxhash / xxhash_cbor, and ``NONE_HASH = H(seed)``. The event wire value is
``int.from_bytes(digest, "big") & (2**64 - 1)``.

pickle appears here only because vLLM's default hash is sha256 *over pickle*; nothing is ever
unpickled and no pickle crosses a wire.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence

import xxhash

from . import _cbor

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"  # since vLLM PR #51875, for the sha256 algorithms only
_M64 = (1 << 64) - 1


def hash_fn(algo: str) -> Callable[[object], bytes]:
    if algo == "sha256":
        return lambda x: hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        return lambda x: hashlib.sha256(_cbor.dumps(x)).digest()
    if algo == "xxhash":
        return lambda x: xxhash.xxh3_128_digest(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
    if algo == "xxhash_cbor":
        return lambda x: xxhash.xxh3_128_digest(_cbor.dumps(x))
    raise ValueError(f"unknown vLLM hash algorithm {algo!r}; expected one of {ALGOS}")


def seed_for(algo: str, pythonhashseed: str | None = None) -> str:
    """The seed string vLLM 0.33 uses: PYTHONHASHSEED if set, else the fixed sha256 seed.

    xxhash without PYTHONHASHSEED seeds from os.urandom in every vLLM version, so it cannot be
    reproduced: that raises ValueError instead of returning a seed that silently never matches.
    """
    if pythonhashseed is not None:
        return pythonhashseed
    if algo in ("sha256", "sha256_cbor"):
        return DEFAULT_SEED
    hash_fn(algo)
    raise ValueError(f"vLLM {algo!r} without PYTHONHASHSEED uses a random per-process seed; "
                     "set PYTHONHASHSEED on the workers and pass it here")


def none_hash(algo: str, seed: str = DEFAULT_SEED) -> bytes:
    return hash_fn(algo)(seed)


def hash_block_tokens(algo: str, parent: bytes | None, tokens: Sequence[int],
                      extra_keys: tuple | None = None, *, seed: str = DEFAULT_SEED) -> bytes:
    h = hash_fn(algo)
    return h((parent if parent is not None else h(seed),
              tuple(int(t) for t in tokens), extra_keys))


def block_hashes(tokens: Sequence[int], block_size: int, algo: str = "sha256", *,
                 seed: str = DEFAULT_SEED,
                 extra_keys: Sequence[tuple | None] | None = None) -> list[bytes]:
    """Digests of the full blocks of ``tokens`` (a trailing partial block gets none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, found {block_size}")
    h = hash_fn(algo)
    parent = h(seed)
    toks = [int(t) for t in tokens]
    out = []
    for i in range(len(toks) // block_size):
        ek = extra_keys[i] if extra_keys is not None else None
        parent = h((parent, tuple(toks[i * block_size:(i + 1) * block_size]), ek))
        out.append(parent)
    return out


def wire(digest: bytes) -> int:
    """The int a vLLM event carries for a digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(digest, "big") & _M64
