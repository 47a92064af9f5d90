"""Canonical block keys: the numpy XXH3 path against the xxhash library, chaining, validation."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import router.block_keys as bk
from router.block_keys import (KEY_SCHEME, block_keys, block_keys_list, chain_keys, local_hashes,
                               salt_seed)

TOKENS = [(i * 7919 + 13) % 152064 for i in range(300)]


def _reference_keys(tokens, block_size, ns_seed=0, parent=None):
    """The §9.1 recurrence written out with one library call per step."""
    seed = (1337 + ns_seed) % 2**64
    out, prev = [], parent
    for i in range(len(tokens) // block_size):
        blk = b"".join(t.to_bytes(4, "little") for t in tokens[i * block_size:(i + 1) * block_size])
        local = xxhash.xxh3_64_intdigest(blk, seed)
        prev = local if prev is None else xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "little") + local.to_bytes(8, "little"), 1337)
        out.append(prev)
    return out


def test_scheme_name_is_pinned():
    assert KEY_SCHEME == "xxh3_chain_v1"


def test_dynamo_vector():
    # docs/reference/kv_events.md §10.4: [1,2,3,4]*8 at block size 32
    assert local_hashes([1, 2, 3, 4] * 8, 32).tolist() == [15883719750896736839]
    assert block_keys([1, 2, 3, 4] * 8, 32).tolist() == [15883719750896736839]


@pytest.mark.parametrize("block_size", [1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 48, 60, 61, 64, 128])
def test_matches_reference_for_every_path(block_size, monkeypatch):
    rng = np.random.default_rng(block_size)
    toks = rng.integers(0, 2**32, size=block_size * 40 + 3, dtype=np.uint64).tolist()
    expect = _reference_keys(toks, block_size, ns_seed=12345)
    # the native module (where built), then the numpy path, then the per-block path
    for native, threshold in ((bk._native, 0), (None, 0), (None, 10**9)):
        monkeypatch.setattr(bk, "_native", native)
        monkeypatch.setattr(bk, "_NUMPY_MIN_BLOCKS", threshold)
        assert bk.block_keys_bytes(toks, block_size, ns_seed=12345) == np.array(
            expect, dtype="<u8").tobytes()
        assert block_keys(toks, block_size, ns_seed=12345).tolist() == expect
        assert block_keys(np.array(toks, dtype=np.uint32), block_size, ns_seed=12345).tolist() == expect
        assert block_keys_list(toks, block_size, ns_seed=12345) == expect
        assert block_keys_list(np.array(toks, dtype=np.uint32)[::1], block_size,
                               ns_seed=12345) == expect


def test_numpy_path_chunks_large_inputs(monkeypatch):
    monkeypatch.setattr(bk, "_CHUNK_ELEMS", 8)
    toks = TOKENS * 4
    assert block_keys(toks, 16).tolist() == _reference_keys(toks, 16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([4, 16, 32]),
       st.integers(0, 2**64 - 1))
def test_resumable_chain(tokens, block_size, ns_seed):
    full = block_keys_list(tokens, block_size, ns_seed)
    n = len(full)
    assert block_keys_list(tokens[: (n // 2) * block_size], block_size, ns_seed) == full[: n // 2]
    if n >= 2:
        m = n // 2
        rest = block_keys_list(tokens[m * block_size:], block_size, ns_seed, parent=full[m - 1])
        assert rest == full[m:]


def test_partial_block_ignored_and_empty_input():
    assert len(block_keys(TOKENS, 16)) == 300 // 16
    assert block_keys([], 16).dtype == np.uint64
    assert block_keys(TOKENS[:15], 16).size == 0
    assert chain_keys([]) == []


def test_namespace_changes_every_key():
    a = block_keys(TOKENS, 16)
    b = block_keys(TOKENS, 16, ns_seed=salt_seed("tenant-a"))
    assert not set(a.tolist()) & set(b.tolist())


def test_salt_seed_matches_dynamo_compute_salt_hash():
    assert salt_seed() == 0 and salt_seed("", "") == 0
    lora = xxhash.xxh3_64_intdigest(b"my-lora", 0)
    ns = xxhash.xxh3_64_intdigest(b"ns", 1)
    assert salt_seed("ns", "my-lora") == (lora + ns) % 2**64
    assert salt_seed(None, "my-lora") == lora


@pytest.mark.parametrize("bad", [[-1], [2**32], np.array([-3, 4]), np.array([2**33]),
                                 np.array([1.5]), ["a"], [1.5]])
def test_invalid_tokens_raise_value_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        block_keys(bad, 1)


def test_invalid_block_size():
    with pytest.raises(ValueError, match="block_size"):
        block_keys(TOKENS, 0)


def test_strided_arrays_accepted():
    arr = np.array(TOKENS * 2, dtype=np.uint32)[::2]
    assert block_keys(arr, 16).tolist() == block_keys(arr.copy(), 16).tolist()
    assert block_keys_list(arr, 4) == block_keys_list(arr.tolist(), 4)


def test_numpy_dtypes_accepted():
    expect = block_keys(TOKENS, 16).tolist()
    for dt in (np.int32, np.int64, np.uint32, np.uint64):
        assert block_keys(np.array(TOKENS, dtype=dt), 16).tolist() == expect
    small = [t % 65536 for t in TOKENS]
    assert block_keys(np.array(small, dtype=np.uint16), 16).tolist() == block_keys(small, 16).tolist()
