"""fleet.snowflake: layout, rotation, uniqueness, ordering, clock handling."""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.snowflake import (
    EPOCH_MS,
    MAX_GLOBAL_ID,
    MIN_GLOBAL_ID,
    SnowflakeFields,
    SnowflakeGenerator,
    compose,
    decode,
    is_global_id,
    local_request_id,
)

# Timestamps below this decode unambiguously (see decode's docstring).
TS_UNAMBIGUOUS = (((1 << 63) - 1 - (1 << 40)) >> 24)


class FakeClock:
    """Wall clock in Unix ms that the test moves; `sleep` lets 1 ms pass (a stalled generator
    must make the clock advance, as real time does)."""

    def __init__(self, start_ms: int = EPOCH_MS + 1_000_000):
        self.now = start_ms
        self.sleeps = 0

    def __call__(self) -> int:
        return self.now

    def sleep(self, _s: float) -> None:
        self.sleeps += 1
        self.now += 1


def gen(clock: FakeClock, node: int = 1, proc: int = 2) -> SnowflakeGenerator:
    return SnowflakeGenerator(node, proc, clock_ms=clock, sleep=clock.sleep)


# ------------------------------------------------------------------------ layout and range

def test_layout_and_rotation_match_upstream_constants():
    # [0 | ts 39 | node 8 | process 6 | counter 10], then raw % (2**63-1 - 2**40) + 2**40.
    raw = (1 << 24) | (2 << 16) | (3 << 10) | 4
    assert compose(1, 2, 3, 4) == raw + (1 << 40)
    # The all-ones raw id is the one value that wraps: (2**63-1) % (2**63-1-2**40) + 2**40 = 2**41.
    assert compose((1 << 39) - 1, 255, 63, 1023) == 1 << 41
    assert compose(0, 0, 0, 0) == MIN_GLOBAL_ID
    assert MAX_GLOBAL_ID == (1 << 63) - 1


@given(ts=st.integers(0, TS_UNAMBIGUOUS - 1), node=st.integers(0, 255), proc=st.integers(0, 63),
       counter=st.integers(0, 1023))
def test_decode_inverts_compose(ts, node, proc, counter):
    rid = compose(ts, node, proc, counter)
    assert MIN_GLOBAL_ID <= rid < MAX_GLOBAL_ID
    assert decode(rid) == SnowflakeFields(ts, node, proc, counter)


@given(ts=st.integers(0, (1 << 45)), node=st.integers(0, 255), proc=st.integers(0, 63),
       counter=st.integers(0, 1023))
def test_every_id_is_in_the_global_range(ts, node, proc, counter):
    rid = compose(ts, node, proc, counter)
    assert MIN_GLOBAL_ID <= rid < MAX_GLOBAL_ID and rid < 1 << 63 and is_global_id(rid)


def test_bad_fields_and_ids_are_rejected():
    for kw in ({"node_id": 256}, {"node_id": -1}, {"process_id": 64}, {"node_id": True}):
        args = {"node_id": 0, "process_id": 0, **kw}
        with pytest.raises(ValueError):
            SnowflakeGenerator(**args)
    with pytest.raises(ValueError):
        compose(0, 0, 0, 1024)
    with pytest.raises(ValueError):
        compose(-1, 0, 0, 0)
    for bad in (MIN_GLOBAL_ID - 1, MAX_GLOBAL_ID, 0, -5, "123", True):
        with pytest.raises(ValueError):
            decode(bad)  # type: ignore[arg-type]
        assert not is_global_id(bad)


def test_local_ids_stay_below_the_global_range():
    assert local_request_id(0) == 1
    assert local_request_id(MIN_GLOBAL_ID - 1) == 0
    assert all(0 <= local_request_id(x) < MIN_GLOBAL_ID for x in (5, MIN_GLOBAL_ID + 7, 1 << 62))


def test_real_clock_fields():
    g = SnowflakeGenerator(201, 33)
    before = time.time_ns() // 1_000_000
    f = decode(g.next_id())
    after = time.time_ns() // 1_000_000
    assert (f.node_id, f.process_id, f.counter) == (201, 33, 0)
    assert before <= f.unix_ms <= after
    assert "node=201 process=33 counter=0" in str(f)


# ------------------------------------------------------------------------ counter and clock

def test_counter_is_per_millisecond_and_waits_on_overflow():
    clock = FakeClock()
    g = gen(clock)
    ids = [g.next_id() for _ in range(1024)]
    fields = [decode(i) for i in ids]
    assert [f.counter for f in fields] == list(range(1024))
    assert {f.timestamp_ms for f in fields} == {clock.now - EPOCH_MS}
    assert clock.sleeps == 0
    nxt = decode(g.next_id())  # the 1025th id in the same ms must wait for the next ms
    assert clock.sleeps == 1 and g.overflow_waits == 1
    assert (nxt.timestamp_ms, nxt.counter) == (clock.now - EPOCH_MS, 0)
    clock.now += 5
    assert decode(g.next_id()).counter == 0  # a new millisecond resets the counter


def test_clock_going_backwards_never_moves_ids_backwards():
    clock = FakeClock()
    g = gen(clock)
    a = g.next_id()
    t0 = decode(a).timestamp_ms
    clock.now -= 10_000  # NTP step back by 10 s
    b = g.next_id()
    assert b > a and decode(b).timestamp_ms == t0 and decode(b).counter == 1
    assert g.clock_regressions == 1
    # Exhausting the millisecond while the clock is behind advances logically, without stalling.
    ids = [g.next_id() for _ in range(3000)]
    assert clock.sleeps == 0
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert decode(ids[-1]).timestamp_ms == t0 + 2
    clock.now += 20_000  # the wall clock catches up: timestamps follow it again
    assert decode(g.next_id()).timestamp_ms == clock.now - EPOCH_MS


@pytest.mark.parametrize("start_ms", [0, EPOCH_MS + 5])
def test_frozen_or_pre_epoch_clock_does_not_stall(start_ms):
    clock = FakeClock(start_ms=start_ms)
    g = SnowflakeGenerator(1, 2, clock_ms=clock, sleep=lambda _s: None)  # the clock never moves
    ids = [g.next_id() for _ in range(5000)]
    assert len(set(ids)) == 5000 and ids == sorted(ids)
    assert g.overflow_waits == 4


# ------------------------------------------------------------------------ uniqueness (property)

steps = st.lists(st.tuples(st.integers(-3000, 3),          # clock delta in ms (may go back)
                           st.integers(0, 7),              # which simulated process issues ids
                           st.integers(1, 1500)),          # how many ids it issues now
                 min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 255), st.integers(0, 63)), min_size=1, max_size=8,
                      unique=True),
       script=steps)
def test_unique_and_ordered_across_simulated_processes(pairs, script):
    # One shared (misbehaving) wall clock, several generators with distinct (node, process) pairs,
    # as in a fleet; bursts overflow the per-ms counter and the clock jumps back and forth.
    clock = FakeClock()
    gens = [gen(clock, n, p) for n, p in pairs]
    seen: set[int] = set()
    last = [0] * len(gens)
    total = 0
    for delta, who, count in script:
        clock.now += delta
        g_idx = who % len(gens)
        g = gens[g_idx]
        for _ in range(count):
            rid = g.next_id()
            assert MIN_GLOBAL_ID <= rid < MAX_GLOBAL_ID
            assert rid > last[g_idx], "ids of one generator must strictly increase"
            last[g_idx] = rid
            f = decode(rid)
            assert (f.node_id, f.process_id) == pairs[g_idx]
            seen.add(rid)
            total += 1
    assert len(seen) == total


def test_unique_and_ordered_across_threads():
    g = SnowflakeGenerator(9, 4)
    n_threads, per_thread = 8, 5000
    out: list[list[int]] = [[] for _ in range(n_threads)]
    barrier = threading.Barrier(n_threads)

    def work(i: int) -> None:
        barrier.wait()
        out[i] = [g.next_id() for _ in range(per_thread)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [x for seq in out for x in seq]
    assert len(set(flat)) == n_threads * per_thread
    for seq in out:
        assert seq == sorted(seq) and len(set(seq)) == len(seq)
    assert all(decode(x).counter <= 1023 for x in flat)


def test_distinct_pairs_in_real_threads_never_collide():
    gens = [SnowflakeGenerator(n, p) for n in (0, 1) for p in (0, 63)]
    out: list[list[int]] = [[] for _ in gens]

    def work(i: int) -> None:
        out[i] = [gens[i].next_id() for _ in range(3000)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [x for seq in out for x in seq]
    assert len(set(flat)) == len(flat)
