"""Canonical block keys: the one key scheme the fleet, the coordinator and our workers share.

Scheme ``xxh3_chain_v1`` (docs/routing.md "Block keys", docs/design.md §7; identical to NVIDIA
Dynamo's local hash plus its sequence hash, so Dynamo publishers are wire-compatible):

    local_i = xxh3_64(u32le(tokens[i*B:(i+1)*B]), seed=(1337 + ns_seed) mod 2**64)
    key_0   = local_0                                             (chain starts at the root)
    key_i   = xxh3_64(u64le(key_{i-1}) || u64le(local_i), seed=1337)

``ns_seed`` is the namespace salt *added to* Dynamo's base seed, so the default namespace is
``ns_seed == 0`` and ``salt_seed(ns, lora)`` reproduces Dynamo's ``compute_salt_hash`` exactly.

Invariants:
- only *full* blocks get keys; a trailing partial block is ignored;
- a key identifies its whole prefix (it is chained), so "key k is cached on worker w" implies every
  earlier key of the same prompt is too, and prefix matching is a plain walk;
- ``block_keys(t[:n*B]) == block_keys(t)[:n]`` and
  ``block_keys(t[m*B:], parent=block_keys(t)[m-1]) == block_keys(t)[m:]`` (resumable chains).

Speed: for block sizes of 1..60 tokens the whole recipe runs in one call of the native module
router/_chain.c (built by ``pip install``; ``NATIVE`` says whether it loaded), 14-24x the
Python path's tokens per second (bench/RESULTS.md, "router core"). Without it, and for larger blocks, the per-block local
hashes are computed for all blocks at once with a numpy re-implementation of XXH3's 17..240-byte
paths (block sizes 5..60 tokens) or one library call per block, and the chain, which is
inherently sequential, runs one C ``xxh3_64`` call per block. Every path is checked bit for bit
against the xxhash library in the tests.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from functools import lru_cache
from itertools import repeat
from operator import itemgetter

import numpy as np
import xxhash

try:
    from . import _chain as _native
except ImportError:     # no C compiler at install time: the pure-Python recipe below
    _native = None

__all__ = [
    "KEY_SCHEME",
    "NATIVE",
    "block_keys_bytes",
    "CHAIN_SEED",
    "block_keys",
    "local_hashes",
    "chain_keys",
    "salt_seed",
    "tokens_to_u32",
]

KEY_SCHEME = "xxh3_chain_v1"
TOKEN_ID_LIMIT = 1 << 32     # token ids are hashed as uint32: every id must be in [0, TOKEN_ID_LIMIT)
CHAIN_SEED = 1337
_M64 = (1 << 64) - 1

NATIVE = _native is not None
_NATIVE_MAX = _native.MAX_BLOCK_SIZE if _native is not None else 0

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_BIG_ENDIAN = sys.byteorder == "big"

if array.array("I").itemsize != 4:  # pragma: no cover - every CPython platform we run on
    raise ImportError("router.block_keys needs a 4-byte array typecode 'I'")


def salt_seed(namespace: str | None = None, lora_name: str | None = None) -> int:
    """Namespace salt for ``ns_seed``: 0 for the default namespace (no LoRA, no cache salt).

    Matches Dynamo's ``compute_salt_hash`` minus its base seed 1337 (empty strings count as
    absent), so ``(1337 + salt_seed(ns, lora)) % 2**64`` is Dynamo's local-hash seed.
    """
    s = 0
    if lora_name:
        s = (s + _xxh3(lora_name.encode(), 0)) & _M64
    if namespace:
        s = (s + _xxh3(namespace.encode(), 1)) & _M64
    return s


def tokens_to_u32(token_ids) -> np.ndarray:
    """Token ids as a little-endian uint32 array; raises ValueError for ids outside [0, 2**32).

    Lists go through ``array.array('I')`` (3x faster than ``np.array`` and range-checked by
    CPython); integer ndarrays are range-checked explicitly because ``astype`` would wrap.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token ids must be one-dimensional, found shape {token_ids.shape}")
        if token_ids.size == 0:
            return np.zeros(0, dtype="<u4")
        if token_ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, found dtype {token_ids.dtype}")
        if token_ids.dtype != np.dtype("<u4"):
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi > 0xFFFFFFFF:
                raise ValueError(
                    f"token ids must be in [0, 2**32), found min {lo} max {hi}")
            token_ids = token_ids.astype("<u4")
        return np.ascontiguousarray(token_ids)
    try:
        arr = array.array("I", token_ids)
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    except TypeError as e:
        raise ValueError(f"token ids must be a sequence of ints: {e}") from None
    out = np.frombuffer(arr, dtype=np.uint32)
    if out.dtype.byteorder == ">":  # pragma: no cover - big-endian hosts
        out = out.astype("<u4")
    return out


# ---------------------------------------------------------------------------------------------
# numpy XXH3-64 for inputs of 17..240 bytes (constants and structure from xxhash.h, v0.8)

_K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_PRIME64_1 = 0x9E3779B185EBCA87
_PRIME_MX1 = 0x165667919E3779F9
_U32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def _secret64(off: int) -> int:
    return int.from_bytes(_K_SECRET[off:off + 8], "little")


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """lo64(a*b) ^ hi64(a*b) elementwise, with the 128-bit product built from 32-bit limbs."""
    a0 = a & _U32
    a1 = a >> _S32
    b0 = b & _U32
    b1 = b >> _S32
    p01 = a0 * b1
    p10 = a1 * b0
    mid = ((a0 * b0) >> _S32) + (p01 & _U32) + (p10 & _U32)
    hi = a1 * b1 + (p01 >> _S32) + (p10 >> _S32) + (mid >> _S32)
    return (a * b) ^ hi


def _avalanche(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(37))
    h = h * np.uint64(_PRIME_MX1)
    return h ^ (h >> _S32)


@lru_cache(maxsize=64)
def _plan(nbytes: int):
    """Which 16-byte input windows feed XXH3 for this length, and with which secret offsets.

    Returns (phase_a, phase_b): lists of (input_offset, secret_offset). Phase b is empty for
    17..128 bytes; for 129..240 bytes phase a is avalanched before phase b is added.
    """
    if 17 <= nbytes <= 128:
        a = []
        if nbytes > 32:
            if nbytes > 64:
                if nbytes > 96:
                    a += [(48, 96), (nbytes - 64, 112)]
                a += [(32, 64), (nbytes - 48, 80)]
            a += [(16, 32), (nbytes - 32, 48)]
        a += [(0, 0), (nbytes - 16, 16)]
        return a, []
    if 129 <= nbytes <= 240:
        a = [(16 * i, 16 * i) for i in range(8)]
        b = [(nbytes - 16, 136 - 17)]
        b += [(16 * i, 16 * (i - 8) + 3) for i in range(8, nbytes // 16)]
        return a, b
    raise ValueError(f"no vectorised XXH3 path for {nbytes} bytes")


@lru_cache(maxsize=256)
def _windows(block_size: int, part: int, seed: int):
    """u32 column of each 16-byte window's first word, and the seeded secret words (m, 1)."""
    plan = _plan(block_size * 4)[part]
    if not plan:
        return None
    cols = np.array([o // 4 for o, _ in plan], dtype=np.intp)
    sec_lo = np.array([[(_secret64(s) + seed) & _M64] for _, s in plan], dtype=np.uint64)
    sec_hi = np.array([[(_secret64(s + 8) - seed) & _M64] for _, s in plan], dtype=np.uint64)
    return cols, sec_lo, sec_hi


def _read64(blocks: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Little-endian u64 reads at u32 columns ``cols`` of every row, shaped (len(cols), n)."""
    if blocks.shape[1] % 2 == 0 and not (cols % 2).any():
        # every window is 8-byte aligned: read the words directly
        return blocks.view("<u8").T[cols // 2]
    t = blocks.T
    return t[cols].astype(np.uint64) | (t[cols + 1].astype(np.uint64) << _S32)


def _mix_sum(blocks: np.ndarray, win) -> np.ndarray:
    cols, sec_lo, sec_hi = win
    folded = _mul128_fold64(_read64(blocks, cols) ^ sec_lo, _read64(blocks, cols + 2) ^ sec_hi)
    return np.add.reduce(folded, axis=0, dtype=np.uint64)


# Temporaries above ~32 KiB make glibc hand pages back and fault them in again on every numpy
# call (measured: 6x slower per element at 64 KiB), so large inputs are hashed in row chunks.
_CHUNK_ELEMS = 4096


def _xxh3_rows(blocks: np.ndarray, seed: int) -> np.ndarray:
    block_size = blocks.shape[1]
    acc = np.uint64((block_size * 4 * _PRIME64_1) & _M64) + _mix_sum(
        blocks, _windows(block_size, 0, seed))
    win_b = _windows(block_size, 1, seed)
    if win_b is None:
        return _avalanche(acc)
    return _avalanche(_avalanche(acc) + _mix_sum(blocks, win_b))


def _xxh3_blocks_np(blocks: np.ndarray, seed: int) -> np.ndarray:
    """xxh3_64 of each row's u32le bytes, for rows of 5..60 tokens (17..240 bytes)."""
    n, block_size = blocks.shape
    windows = len(_plan(block_size * 4)[0]) + len(_plan(block_size * 4)[1])
    rows = max(1, _CHUNK_ELEMS // windows)
    if n <= rows:
        return _xxh3_rows(blocks, seed)
    out = np.empty(n, dtype=np.uint64)
    for start in range(0, n, rows):
        out[start:start + rows] = _xxh3_rows(blocks[start:start + rows], seed)
    return out


# Below this many blocks the fixed cost of ~40 numpy calls (~40 us) exceeds one C call per
# block (~0.25 us each); measured crossover on the 2-core box is ~150 blocks.
_NUMPY_MIN_BLOCKS = 160


def local_hashes(token_ids, block_size: int = 16, ns_seed: int = 0) -> np.ndarray:
    """Dynamo local (unchained) hashes of the full blocks of ``token_ids``, as uint64."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, found {block_size}")
    toks = tokens_to_u32(token_ids)
    n = len(toks) // block_size
    seed = (CHAIN_SEED + ns_seed) & _M64
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    if n >= _NUMPY_MIN_BLOCKS and 5 <= block_size <= 60:
        return _xxh3_blocks_np(toks[: n * block_size].reshape(n, block_size), seed)
    mv = memoryview(toks[: n * block_size]).cast("B")
    step = block_size * 4
    return np.fromiter((_xxh3(mv[o:o + step], seed) for o in range(0, n * step, step)),
                       dtype=np.uint64, count=n)


def chain_keys(locals_: Sequence[int] | np.ndarray, parent: int | None = None) -> list[int]:
    """Chain local hashes into canonical keys (Dynamo sequence hashes), as Python ints."""
    loc = locals_.tolist() if isinstance(locals_, np.ndarray) else list(locals_)
    if not loc:
        return []
    h, pack = _xxh3, _pack_pair
    if parent is None:
        prev = loc[0]
        out = [prev]
        rest = loc[1:]
    else:
        prev = parent & _M64
        out = []
        rest = loc
    append = out.append
    for x in rest:
        prev = h(pack(prev, x), CHAIN_SEED)
        append(prev)
    return out


def block_keys(token_ids, block_size: int = 16, ns_seed: int = 0,
               parent: int | None = None) -> np.ndarray:
    """Canonical keys of the full blocks of ``token_ids``, chained from ``parent`` (None = root).

    Accepts a list of ints or an integer ndarray; raises ValueError for ids outside [0, 2**32)
    and for a non-positive block size. Returns ``np.ndarray[uint64]`` of ``len // block_size``.
    """
    got = _native_keys(token_ids, block_size, ns_seed, parent, False)
    if got is not None:
        return np.frombuffer(got, dtype="<u8").astype(np.uint64)
    loc = local_hashes(token_ids, block_size, ns_seed)
    return np.array(chain_keys(loc, parent), dtype=np.uint64)


def _native_keys(token_ids, block_size: int, ns_seed: int, parent: int | None, as_list: bool):
    """The keys from router/_chain.c (u64le bytes, or a list), or None where it does not apply
    (not built, or blocks over its 60 tokens). Lists and tuples go in as they are, arrays as
    checked u32 (`tokens_to_u32`), anything else as a list."""
    if _native is None or not 0 < block_size <= _NATIVE_MAX:
        return None
    if isinstance(token_ids, np.ndarray):
        token_ids = tokens_to_u32(token_ids)
    elif type(token_ids) is not list and type(token_ids) is not tuple:
        token_ids = list(token_ids)
    return _native.chain(token_ids, block_size, (CHAIN_SEED + ns_seed) & _M64, parent, as_list)


def block_keys_bytes(token_ids, block_size: int = 16, ns_seed: int = 0,
                     parent: int | None = None) -> bytes:
    """Same keys as :func:`block_keys`, as little-endian u64 bytes (the routing key's wire form,
    protocol/channel.py `wire_key`)."""
    got = _native_keys(token_ids, block_size, ns_seed, parent, False)
    if got is not None:
        return got
    keys = array.array("Q", block_keys_list(token_ids, block_size, ns_seed, parent))
    if _BIG_ENDIAN:   # pragma: no cover - every host we run on is little-endian
        keys.byteswap()
    return keys.tobytes()


_first = itemgetter(0)


@lru_cache(maxsize=64)
def _chunks(step: int):
    """`iter_unpack` cutting a buffer into `step`-byte blocks (1-tuples of bytes)."""
    return struct.Struct(f"{step}s").iter_unpack


def _u32_bytes(token_ids, count: int) -> bytes:
    """The first `count` ids as u32 bytes (only those are range-checked, as the keys use only them)."""
    if type(token_ids) is list:
        arr = array.array("I")
        try:
            arr.fromlist(token_ids)     # ~1.5x faster than array("I", list); the same errors
        except (OverflowError, TypeError):
            arr = array.array("I", token_ids[:count])   # a bad id past the full blocks is not an error
        return arr.tobytes()     # ids past `count` are never read
    return array.array("I", token_ids[:count]).tobytes()


def block_keys_list(token_ids, block_size: int = 16, ns_seed: int = 0,
                    parent: int | None = None) -> list[int]:
    """Same as :func:`block_keys` but as a list of Python ints (what dict lookups want).

    Short inputs (KV events of a few blocks, a prompt of up to 160 blocks) skip numpy entirely:
    one pass of library calls over byte slices costs less than numpy's per-call overhead.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, found {block_size}")
    got = _native_keys(token_ids, block_size, ns_seed, parent, True)
    if got is not None:
        return got
    n = len(token_ids) // block_size
    if n >= _NUMPY_MIN_BLOCKS:
        return chain_keys(local_hashes(token_ids, block_size, ns_seed), parent)
    if isinstance(token_ids, np.ndarray):
        buf = tokens_to_u32(token_ids).tobytes()
    else:
        try:
            buf = _u32_bytes(token_ids, n * block_size)
        except OverflowError as e:
            raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
        except TypeError as e:
            raise ValueError(f"token ids must be a sequence of ints: {e}") from None
    seed = (CHAIN_SEED + ns_seed) & _M64
    step = block_size * 4
    h, pack = _xxh3, _pack_pair
    if n == 0:
        return []
    # the blocks' bytes cut and hashed by C iterators (no bytecode per block): 21 -> 16 us for the
    # fleet's 60-block prompt with the chain below (bench/RESULTS.md, issue 13)
    out = list(map(h, map(_first, _chunks(step)(memoryview(buf)[:n * step])), repeat(seed, n)))
    if parent is None:
        prev, first = out[0], 1
    else:
        prev, first = parent & _M64, 0
    for i in range(first, n):
        prev = out[i] = h(pack(prev, out[i]), CHAIN_SEED)
    return out


__all__.append("block_keys_list")
