"""router/_chain.c, the native block keys: XXH3-64 against the xxhash library at every length it
handles, and the keys against the pure-Python recipe of router/block_keys.py for every block size,
input type, parent and namespace, with the same errors."""

from __future__ import annotations

import array
import os
import random

import numpy as np
import pytest
import xxhash

import router.block_keys as bk

# CI installs with a C compiler: there a build that silently fell back to Python is a failure
if os.environ.get("CI"):
    import router._chain as native
else:
    native = pytest.importorskip("router._chain")


def test_native_module_is_what_block_keys_uses():
    assert bk.NATIVE and bk._native is native and native.MAX_BLOCK_SIZE == 60


@pytest.mark.parametrize("length", range(0, 241))
def test_xxh3_every_length_matches_the_library(length):
    rng = random.Random(length)
    data = rng.randbytes(length)
    for seed in (0, 1, 1337, 2**32 - 1, 2**63, 2**64 - 1, rng.getrandbits(64)):
        assert native.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), (length, seed)


def _python_keys(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setattr(bk, "_native", None)
        return bk.block_keys_list(*args, **kw)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 8, 15, 16, 17, 32, 33, 59, 60])
def test_keys_match_the_python_recipe(block_size, monkeypatch):
    rng = random.Random(block_size)
    for n in (0, 1, block_size - 1, block_size, 7 * block_size + 3, 200 * block_size):
        # small ids, ids past one 30-bit digit and up to the u32 limit (the C fast path and the
        # generic conversion)
        ids = [rng.choice((rng.randrange(300), rng.randrange(2**30, 2**32))) for _ in range(n)]
        for parent in (None, 0, rng.getrandbits(64)):
            for ns in (0, rng.getrandbits(64)):
                expect = _python_keys(monkeypatch, ids, block_size, ns, parent)
                assert bk.block_keys_list(ids, block_size, ns, parent) == expect
                assert bk.block_keys_list(tuple(ids), block_size, ns, parent) == expect
                assert bk.block_keys_list(np.array(ids, dtype=np.int64), block_size, ns, parent) == expect
                assert bk.block_keys(ids, block_size, ns, parent).tolist() == expect
                want = np.array(expect, dtype="<u8").tobytes()
                assert bk.block_keys_bytes(ids, block_size, ns, parent) == want
                seed = (1337 + ns) % 2**64
                assert native.chain(array.array("I", ids).tobytes(), block_size, seed, parent, False) == want


def test_other_sequences_and_bools(monkeypatch):
    ids = range(100)
    assert bk.block_keys_list(ids, 16) == _python_keys(monkeypatch, list(ids), 16)
    assert bk.block_keys_list([True, False] * 8, 16) == _python_keys(monkeypatch, [1, 0] * 8, 16)


@pytest.mark.parametrize("bad, match", [([5] * 15 + [-1], r"\[0, 2\*\*32\)"),
                                        ([5] * 15 + [2**32], r"\[0, 2\*\*32\)"),
                                        ([5] * 15 + [2**70], r"\[0, 2\*\*32\)"),
                                        ([5] * 15 + [1.5], "sequence of ints"),
                                        ([5] * 15 + ["a"], "sequence of ints")])
def test_bad_ids_in_a_full_block_raise_value_error(bad, match, monkeypatch):
    with pytest.raises(ValueError, match=match):
        bk.block_keys_list(bad, 16)
    with pytest.raises(ValueError, match=match):
        bk.block_keys_bytes(bad, 16)
    with pytest.raises(ValueError, match="token ids"):
        _python_keys(monkeypatch, bad, 16)


def test_ids_past_the_full_blocks_are_not_read(monkeypatch):
    ids = list(range(32)) + [-1, "x"]
    assert bk.block_keys_list(ids, 16) == _python_keys(monkeypatch, ids, 16)


def test_argument_errors():
    with pytest.raises(ValueError, match="block_size"):
        native.chain([1] * 61, 61, 1337, None, True)
    with pytest.raises(ValueError, match="block_size"):
        native.chain([1], 0, 1337, None, True)
    with pytest.raises(ValueError, match="multiple of 4"):
        native.chain(b"\x00" * 6, 1, 1337, None, False)
    with pytest.raises(ValueError, match="list or tuple"):
        native.chain(object(), 1, 1337, None, False)
    with pytest.raises(TypeError):
        native.chain([1], 1, 1337)
    with pytest.raises(ValueError, match="at most 240"):
        native.xxh3_64(b"\x00" * 241, 0)


def test_blocks_over_60_tokens_stay_on_the_python_path(monkeypatch):
    ids = list(range(200))
    calls = []
    monkeypatch.setattr(bk, "_native", type("Spy", (), {"chain": lambda *a: calls.append(a)})())
    first = xxhash.xxh3_64_intdigest(array.array("I", ids[:64]).tobytes(), 1337)
    assert bk.block_keys_list(ids, 64)[0] == first and not calls
