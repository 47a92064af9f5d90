"""Snowflake request ids (docs/design.md §3).

Layout of the 63-bit raw id, most significant first::

    [ 0 | timestamp_ms 39 | node_id 8 | process_id 6 | counter 10 ]

rotated into `[2**40, 2**63 - 1)` exactly as TensorRT-LLM does
(`raw % (2**63 - 1 - 2**40) + 2**40`), so the id space is shared with upstream workers and
`[0, 2**40)` stays free for worker-local ids. `timestamp_ms` counts from `EPOCH_MS`.

Improvements over the reference implementation (which uses `time.monotonic()` and a counter that is
never reset):
- the counter is per millisecond; when 1024 ids were issued in one millisecond, the generator waits
  for the next one;
- the timestamp never moves backwards: if the wall clock steps back, the generator keeps the last
  millisecond it used (and, should that millisecond's counter run out, advances it logically instead
  of stalling until the wall clock catches up);
- `(node_id, process_id)` comes from the caller (leased from the coordinator), so uniqueness across a
  fleet holds as long as no two live generators share a pair.

Invariants of one `SnowflakeGenerator`: ids are strictly increasing in issue order (until the
39-bit timestamp wraps, in 2042), all distinct, and each lies in `[MIN_GLOBAL_ID, MAX_GLOBAL_ID)`.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = [
    "EPOCH_MS", "TIMESTAMP_BITS", "NODE_ID_BITS", "PROCESS_ID_BITS", "COUNTER_BITS",
    "MIN_GLOBAL_ID", "MAX_GLOBAL_ID", "NODE_ID_SPACE", "PROCESS_ID_SPACE",
    "SnowflakeFields", "SnowflakeGenerator", "compose", "decode", "is_global_id",
    "local_request_id",
]

# 2025-01-01T00:00:00Z. A recent epoch buys the 39-bit millisecond field its full 17.4 years.
EPOCH_MS = 1_735_689_600_000

TIMESTAMP_BITS = 39
NODE_ID_BITS = 8
PROCESS_ID_BITS = 6
COUNTER_BITS = 10

NODE_ID_SPACE = 1 << NODE_ID_BITS
PROCESS_ID_SPACE = 1 << PROCESS_ID_BITS
_COUNTER_MASK = (1 << COUNTER_BITS) - 1
_TIMESTAMP_MASK = (1 << TIMESTAMP_BITS) - 1
_PROCESS_SHIFT = COUNTER_BITS
_NODE_SHIFT = PROCESS_ID_BITS + COUNTER_BITS
_TIMESTAMP_SHIFT = NODE_ID_BITS + PROCESS_ID_BITS + COUNTER_BITS

_MAX_INT64 = (1 << 63) - 1
MIN_GLOBAL_ID = 1 << 40
# Exclusive upper bound of global ids, as upstream's modulus leaves it.
MAX_GLOBAL_ID = _MAX_INT64
_SPAN = _MAX_INT64 - MIN_GLOBAL_ID


class SnowflakeFields(NamedTuple):
    """The fields of a global id. `timestamp_ms` counts from `EPOCH_MS`."""
    timestamp_ms: int
    node_id: int
    process_id: int
    counter: int

    @property
    def unix_ms(self) -> int:
        return self.timestamp_ms + EPOCH_MS

    def __str__(self) -> str:
        t = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.unix_ms // 1000))
        return (f"{t}.{self.unix_ms % 1000:03d}Z node={self.node_id} "
                f"process={self.process_id} counter={self.counter}")


def _check_int(name: str, value: object, space: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < space:
        raise ValueError(f"{name} must be an int in [0, {space}), got {value!r}")
    return value


def compose(timestamp_ms: int, node_id: int, process_id: int, counter: int) -> int:
    """Pack fields into a global id (the timestamp is masked to 39 bits, as upstream does)."""
    _check_int("node_id", node_id, NODE_ID_SPACE)
    _check_int("process_id", process_id, PROCESS_ID_SPACE)
    _check_int("counter", counter, _COUNTER_MASK + 1)
    if isinstance(timestamp_ms, bool) or not isinstance(timestamp_ms, int) or timestamp_ms < 0:
        raise ValueError(f"timestamp_ms must be a non-negative int, got {timestamp_ms!r}")
    raw = (((timestamp_ms & _TIMESTAMP_MASK) << _TIMESTAMP_SHIFT) | (node_id << _NODE_SHIFT)
           | (process_id << _PROCESS_SHIFT) | counter)
    return raw % _SPAN + MIN_GLOBAL_ID


def decode(request_id: int) -> SnowflakeFields:
    """Split a global id into its fields (for logs and debugging).

    The rotation is a plain offset for every raw id below `2**63 - 1 - 2**40`, i.e. for timestamps
    up to ~65 s before the 39-bit field wraps; ids minted in that last minute alias ones from the
    first minute after `EPOCH_MS` and decode as those. Raises ValueError outside the global range.
    """
    if isinstance(request_id, bool) or not isinstance(request_id, int) \
            or not MIN_GLOBAL_ID <= request_id < MAX_GLOBAL_ID:
        raise ValueError(f"not a global request id (expected an int in [2**40, 2**63 - 1)): "
                         f"{request_id!r}")
    raw = request_id - MIN_GLOBAL_ID
    return SnowflakeFields(
        timestamp_ms=raw >> _TIMESTAMP_SHIFT,
        node_id=(raw >> _NODE_SHIFT) & (NODE_ID_SPACE - 1),
        process_id=(raw >> _PROCESS_SHIFT) & (PROCESS_ID_SPACE - 1),
        counter=raw & _COUNTER_MASK,
    )


def is_global_id(request_id: object) -> bool:
    """True for ids in the snowflake range (client-supplied ids there are used as is)."""
    return (isinstance(request_id, int) and not isinstance(request_id, bool)
            and MIN_GLOBAL_ID <= request_id < MAX_GLOBAL_ID)


def local_request_id(last_id: int) -> int:
    """The next worker-local id after `last_id`, wrapping inside `[0, 2**40)` (as upstream)."""
    return (last_id + 1) & (MIN_GLOBAL_ID - 1)


_MAX_NAPS = 50


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class SnowflakeGenerator:
    """Thread-safe id source for one `(node_id, process_id)` pair.

    `clock_ms` returns wall-clock Unix milliseconds and `sleep` pauses; both are injectable for
    tests. `clock_regressions` counts the times the wall clock was seen going backwards and
    `overflow_waits` the times a millisecond's 1024 ids ran out.
    """

    __slots__ = ("node_id", "process_id", "_clock", "_sleep", "_lock", "_last_ms",
                 "_counter", "clock_regressions", "overflow_waits", "_prefix")

    def __init__(self, node_id: int, process_id: int = 0, *,
                 clock_ms: Callable[[], int] = _wall_ms,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.node_id = _check_int("node_id", node_id, NODE_ID_SPACE)
        self.process_id = _check_int("process_id", process_id, PROCESS_ID_SPACE)
        self._clock = clock_ms
        self._sleep = sleep
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0
        self._prefix = (node_id << _NODE_SHIFT) | (process_id << _PROCESS_SHIFT)
        self.clock_regressions = 0
        self.overflow_waits = 0

    def _now(self) -> int:
        return max(0, int(self._clock()) - EPOCH_MS)

    def next_id(self) -> int:
        with self._lock:
            now = self._now()
            last = self._last_ms
            if now > last:
                self._last_ms = now
                self._counter = 0
            else:
                if now < last:
                    self.clock_regressions += 1
                self._counter += 1
                if self._counter > _COUNTER_MASK:
                    self.overflow_waits += 1
                    self._last_ms = self._next_ms(last, now)
                    self._counter = 0
            raw = ((self._last_ms & _TIMESTAMP_MASK) << _TIMESTAMP_SHIFT) | self._prefix \
                | self._counter
        return raw % _SPAN + MIN_GLOBAL_ID

    __call__ = next_id

    def _next_ms(self, last: int, now: int) -> int:
        # Wait for the wall clock to reach the next millisecond. If it is behind `last` (it
        # stepped back), or does not move (frozen, or before EPOCH_MS), waiting could take as long
        # as the clock is off, so advance logically instead; 50 naps are well over a millisecond.
        for _ in range(_MAX_NAPS):
            if now != last:
                break
            self._sleep(0.0001)
            now = self._now()
        return now if now > last else last + 1

    def decode(self, request_id: int) -> SnowflakeFields:
        return decode(request_id)

    def __repr__(self) -> str:
        return f"SnowflakeGenerator(node_id={self.node_id}, process_id={self.process_id})"
