"""router/prefix_pins.py: a prompt prefix's latest server, found by its marks (every stride-th
block key for the first NEAR marks, then every FAR * stride-th), the deepest registered one by a
binary search; router/_prefix_pins.c's table against the Python recipe."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router import prefix_pins
from router.prefix_pins import PrefixPins, count, position

IMPLS = [False] + ([True] if prefix_pins.NATIVE else [])


def test_mark_positions():
    # NEAR 8 marks every 4 keys, then every 16
    assert [position(4, j) for j in range(1, 12)] == [3, 7, 11, 15, 19, 23, 27, 31, 47, 63, 79]
    assert [count(4, n) for n in (0, 3, 4, 31, 32, 47, 48, 80)] == [0, 0, 1, 7, 8, 8, 9, 11]


def _put(p, keys, server):
    p.find(keys)
    p.put(server)


@pytest.mark.parametrize("native", IMPLS)
def test_deepest_registered_prefix_and_its_latest_server(native):
    p = PrefixPins(4, 1000, native=native)
    keys = list(range(100, 180))                     # 80 keys: 11 marks
    assert p.find(keys) == (None, 0) and p.find(keys[:3]) == (None, 0)
    _put(p, keys[:24], "a")                          # marks 1..6
    assert len(p) == 6
    assert p.find(keys) == ("a", 24)                 # a prompt extending the registered one
    assert p.find(keys[:14]) == ("a", 12)            # one sharing part of it
    assert p.find(keys[:24]) == ("a", 24)            # a repeat
    assert p.find([1, 2, 3, 4, 5]) == (None, 0)
    _put(p, keys, "a")
    assert p.find(keys) == ("a", 80) and len(p) == 11
    _put(p, keys[:48], "b")                          # moved: its whole prefix goes along
    assert p.find(keys[:48]) == ("b", 48) and p.find(keys[:9]) == ("b", 8)
    assert p.find(keys) == ("a", 80)                 # the deeper prompt's own marks stay
    p.remove_server("a")
    assert p.find(keys) == (None, 0)                 # its deepest mark's server left
    assert p.find(keys[:48]) == ("b", 48)
    _put(p, keys, "a")                               # a server of that name again: a new id
    assert p.find(keys) == ("a", 80)
    p.remove_server("nobody")


@pytest.mark.parametrize("native", IMPLS)
def test_find_is_the_deepest_registered_mark(native):
    """Against brute force over a random prefix tree: prompts that extend one another."""
    rng = random.Random(5)
    p = PrefixPins(2, 10**6, native=native)
    trunk = list(range(1000, 1200))
    latest: dict[int, str] = {}
    for i in range(300):
        cut = rng.randrange(0, 200)
        prompt = trunk[:cut] + [10**6 + i * 1000 + k for k in range(rng.randrange(0, 60))]
        marks = [prompt[position(2, j)] for j in range(1, count(2, len(prompt)) + 1)]
        want = max((j for j, k in enumerate(marks, 1) if k in latest), default=0)
        s, covered = p.find(np.array(prompt, dtype=np.uint64) if i % 2 else prompt)
        assert s == (latest[marks[want - 1]] if want else None)
        assert covered == (position(2, want) + 1 if want else 0)
        server = rng.choice("abc")
        p.put(server)
        latest.update((k, server) for k in marks)


# Where the suite was installed without a C compiler, setup.py leaves router/_prefix_pins.c out and
# the Python recipe runs alone; CI builds it (tests/helm/test_dockerfile.py fails if it did not).
needs_native = pytest.mark.skipif(not prefix_pins.NATIVE, reason="router/_prefix_pins.c not built "
                                  "(no C compiler at install): only the Python recipe exists to compare")


def _prompt(rng, docs: list, tail: int) -> np.ndarray:
    """One of `docs`' prefixes (0-40 keys) then up to `tail` random keys: prompts sharing trees."""
    d = docs[int(rng.integers(0, len(docs)))]
    return np.concatenate([d[:int(rng.integers(0, 41))],
                           rng.integers(0, 2**64, size=int(rng.integers(0, tail)), dtype=np.uint64)])


@needs_native
def test_native_table_is_the_python_recipe():
    """Same answers, generations included, on u64 keys (numpy arrays, strided ones, lists), over a
    bound small enough to roll over many times."""
    rng = np.random.default_rng(3)
    a, b = PrefixPins(2, 64, native=True), PrefixPins(2, 64, native=False)
    docs = [rng.integers(0, 2**64, size=40, dtype=np.uint64) for _ in range(12)]
    for i in range(2000):
        keys = _prompt(rng, docs, 30)
        if i % 3 == 0:
            keys = keys.tolist()
        elif i % 7 == 0:
            keys = np.repeat(keys, 2)[::2]          # not contiguous
        elif i % 11 == 0:
            keys = keys.view(np.int64)              # the same bits, signed
        assert a.find(keys) == b.find(keys), i
        s = "abcd"[int(rng.integers(0, 4))]
        a.put(s)
        b.put(s)
        assert len(a) == len(b) <= 64, i
        if i % 500 == 499:
            a.remove_server("d")
            b.remove_server("d")


@needs_native
def test_native_credit_is_the_python_recipe():
    """`credit` (find, then the implicit session's credit in one native call) answers what
    `session_credit` over `find` does, bit for bit: the bonus only where the session's server
    holds the most (ties, a match elsewhere as deep, none at all), the registered prefix capped,
    float and int weights and bonuses; a mapping that is not a dict, or non-int matches, is a
    TypeError (the policy then runs the recipe)."""
    rng = np.random.default_rng(5)
    a, b = PrefixPins(2, 256, native=True), PrefixPins(2, 256, native=False)
    docs = [rng.integers(0, 2**64, size=40, dtype=np.uint64) for _ in range(6)]
    seen = set()
    for i in range(3000):
        keys = _prompt(rng, docs, 8)
        if i % 3 == 0:
            keys = keys.tolist()
        bs = int(rng.choice([1, 16]))
        nt = len(keys) * bs
        cap = max(0, nt - 1 - int(rng.integers(0, 3)) * bs)
        md = {s: int(rng.integers(0, len(keys) + 1)) for s in "abcde"[:int(rng.integers(0, 6))]}
        w = [2.0, 1, 0.37][i % 3]
        bonus = [0.25, 0, 1.0][i % 5 % 3]
        got = a.credit(keys, md, bs, cap, nt, w, bonus)
        assert got == b.credit(keys, md, bs, cap, nt, w, bonus), i
        assert got == prefix_pins.session_credit(b.find(keys), md, bs, cap, nt, w, bonus), i
        assert type(got[1]) is type(b.credit(keys, md, bs, cap, nt, w, bonus)[1]), i
        seen.add((got[0] is not None, got[1] == 0, got[1] == bonus))
        s = "abcd"[int(rng.integers(0, 4))]
        a.put(s)
        b.put(s)
    assert len(seen) >= 4, seen         # no server; zeroed; kept; credited
    with pytest.raises(TypeError, match="matched must be a dict"):
        a.credit([1, 2, 3, 4], {"a": 1}.items(), 16, 63, 64, 2.0, 0.25)
    a.find([1, 2, 3, 4])
    a.put("a")
    with pytest.raises(TypeError, match="matched values must be ints"):
        a.credit([1, 2, 3, 4], {"a": np.int64(1)}, 16, 63, 64, 2.0, 0.25)


@pytest.mark.parametrize("native", IMPLS)
def test_the_bound_drops_the_older_generation(native):
    p = PrefixPins(2, 10, native=native)             # generations of 5 marks
    first = list(range(10, 20))                      # 5 marks
    _put(p, first, "a")
    assert len(p) == 5 and p.find(first) == ("a", 10)
    second = list(range(100, 110))
    _put(p, second, "b")                             # a new generation; the first is the old one
    assert p.find(first) == ("a", 10) and p.find(second) == ("b", 10) and len(p) == 10
    _put(p, list(range(200, 204)), "c")              # another: the first is dropped
    assert p.find(first) == (None, 0) and p.find(second) == ("b", 10)
    # numpy keys read as the same u64s as ints
    assert p.find(np.arange(100, 110, dtype=np.uint64)) == ("b", 10)


@pytest.mark.parametrize("native", IMPLS)
def test_keys_that_are_not_u64_are_errors(native):
    p = PrefixPins(2, 10, native=native)
    with pytest.raises((OverflowError, ValueError, TypeError)):
        p.find([1, -2, 3, 4])
    with pytest.raises((OverflowError, ValueError, TypeError)):
        p.find([1, 2**64, 3, 4])
    with pytest.raises((ValueError, TypeError)):
        p.find(np.zeros((2, 4), dtype=np.uint64))


@pytest.mark.parametrize("stride, bound", [(0, 10), (2, 1), (2.0, 10)])
def test_bad_arguments_name_themselves(stride, bound):
    with pytest.raises(ValueError, match="stride|max_marks"):
        PrefixPins(stride, bound)
