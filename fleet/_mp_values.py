"""A cheaper write path for prometheus_client's multiprocess values, same files, same format.

In multiprocess mode every `inc()`/`observe()` of prometheus_client's `MmapedValue` takes a global
lock, calls `os.getpid()` (a system call) to notice a fork, and looks the sample's offset up in the
file's key table: ~3× the cost of an in-memory value, on ~25 value writes per two-leg request
(bench/results/history/fleet.md, "fleet CPU per request"). The fleet's metric updates all run on its one event-loop
thread, its processes are started by exec (never forked after import), and a sample's offset in its
file never moves once allocated. So the lean value keeps prometheus_client's own `MmapedValue`
for everything but the hot path — it opens and shares the per-process file, allocates the sample
and reads its start value — then writes the 16-byte (value, timestamp) record at the cached offset
itself, exactly as `MmapedDict.write_value` does. Readers (`MultiProcessCollector`, any process's
`/metrics`) see every write at once, as before. A fork is handled by `os.register_at_fork`, not by a
per-write pid check.

Relies on `MmapedDict._positions` / `_m` and `MmapedValue._file` / `_key` (prometheus_client ≥ 0.19
has them all); when a release lacks them, `install_lean_values()` leaves prometheus_client's class
in place.
"""
from __future__ import annotations

import os
import struct
import weakref

from prometheus_client import values

_pack = struct.Struct(b"dd").pack
_lean: "weakref.WeakSet[_LeanBase]" = weakref.WeakSet()


class _LeanBase:
    _multiprocess = True
    _std_class: type = object

    __slots__ = ("_std", "_file", "_pos", "_value", "__weakref__")

    def __init__(self, *args, **kwargs):
        self._std = self._std_class(*args, **kwargs)
        self._bind()
        _lean.add(self)

    def _bind(self) -> None:
        std = self._std
        std.get()        # after a fork: prometheus_client reopens this process's file and re-reads
        f = std._file
        self._file = f
        self._pos = f._positions[std._key]   # allocated by the MmapedValue's read_value
        self._value = std._value

    def inc(self, amount) -> None:
        self._value += amount
        # a slice assignment, not pack_into: a reader never sees a half-written zero (mmap_dict.py)
        p = self._pos
        self._file._m[p:p + 16] = _pack(self._value, 0.0)

    def set(self, value, timestamp=None) -> None:
        self._value = value
        p = self._pos
        self._file._m[p:p + 16] = _pack(value, timestamp or 0.0)

    def set_exemplar(self, exemplar) -> None:
        return      # not supported in multiprocess mode (as prometheus_client)

    def get(self):
        return self._value

    def get_exemplar(self):
        return None


def _rebind_after_fork() -> None:
    for v in list(_lean):
        v._bind()


_installed = False


def install_lean_values() -> bool:
    """Make metrics created from now on in this process use the lean multiprocess value (only in
    multiprocess mode, i.e. when prometheus_client's ValueClass is its `MmapedValue`)."""
    global _installed
    std = values.ValueClass
    if _installed or not getattr(std, "_multiprocess", False):
        return _installed
    from prometheus_client.mmap_dict import MmapedDict
    probe = MmapedDict.__init__.__code__.co_names + MmapedDict.write_value.__code__.co_names
    if "_positions" not in probe or "_m" not in probe:
        return False
    values.ValueClass = type("LeanMmapedValue", (_LeanBase,), {"_std_class": std, "__slots__": ()})
    os.register_at_fork(after_in_child=_rebind_after_fork)
    _installed = True
    return True
