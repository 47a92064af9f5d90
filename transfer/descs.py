"""Descriptor lists: our own `(addr, len, dev)` Nx3 uint64 arrays plus a memory type.

NIXL types never leave `nixl_agent.py`; on the wire and between modules a descriptor list is a
plain numpy array, so metadata formats stay ours (no pickle) and the fallback agents share them.

Invariants of a `Descs`: `arr` is C-contiguous uint64 of shape (N, 3); columns are address,
length in bytes, device id; `mem_type` is one of `MEM_TYPES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .errors import InvalidDescriptors

MEM_TYPES = ("DRAM", "VRAM")


def as_desc_array(descs) -> np.ndarray:
    """Normalise `descs` (Nx3 array-like or iterable of (addr, len, dev)) to Nx3 uint64."""
    if isinstance(descs, np.ndarray):
        arr = descs
    else:
        rows = list(descs)
        arr = np.array(rows, dtype=np.uint64) if rows else np.zeros((0, 3), np.uint64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise InvalidDescriptors(f"descriptor array must have shape (N, 3); found {arr.shape}")
    if arr.dtype != np.uint64:
        if arr.dtype.kind not in "iu":
            raise InvalidDescriptors(f"descriptor array must be integer; found dtype {arr.dtype}")
        if arr.size and int(arr.min()) < 0:
            raise InvalidDescriptors("descriptor array holds a negative address, length or device")
        arr = arr.astype(np.uint64)
    return np.ascontiguousarray(arr)


@dataclass(frozen=True)
class Descs:
    """A descriptor list and the memory type all its rows live in."""

    arr: np.ndarray
    mem_type: str = "DRAM"

    def __post_init__(self):
        object.__setattr__(self, "arr", as_desc_array(self.arr))
        if self.mem_type not in MEM_TYPES:
            raise InvalidDescriptors(f"mem_type must be one of {MEM_TYPES}; found {self.mem_type!r}")

    def __len__(self) -> int:
        return int(self.arr.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.arr[:, 1].sum()) if len(self) else 0


def check_pair(local: Descs, remote: Descs) -> None:
    """Raise unless `local` and `remote` describe the same byte counts row by row."""
    if len(local) != len(remote):
        raise InvalidDescriptors(
            f"local and remote descriptor lists differ in length: {len(local)} vs {len(remote)}")
    if len(local) and not np.array_equal(local.arr[:, 1], remote.arr[:, 1]):
        bad = int(np.flatnonzero(local.arr[:, 1] != remote.arr[:, 1])[0])
        raise InvalidDescriptors(
            f"descriptor {bad}: local length {int(local.arr[bad, 1])} != remote length "
            f"{int(remote.arr[bad, 1])}")


def merge_runs(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray):
    """Merge consecutive fragments that are contiguous on BOTH sides into one.

    `src`, `dst`, `sizes` are 1-D uint64 arrays in transfer order. Returns new (src, dst, sizes).
    A fragment i+1 merges into i iff src[i]+sizes[i] == src[i+1] and dst[i]+sizes[i] == dst[i+1]
    (device ids are per pool and equal within a call).
    """
    n = int(sizes.shape[0])
    if n <= 1:
        return src, dst, sizes
    cont = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    if starts.shape[0] == n:
        return src, dst, sizes
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)


@dataclass(frozen=True)
class Strided:
    """A descriptor list whose row i is `(base + i * stride, length, dev)`: what a pool's
    per-slot list is (transfer/pump.py `_prepare`). Rows picked by index then need no table
    of addresses: a copy computes them (transfer/copy_kernels.py `DeviceCopier.copy_strided`)."""

    base: int
    stride: int
    length: int
    dev: int
    rows: int


def strided(descs: Descs) -> Strided | None:
    """`descs` as a `Strided` list, or None when its rows are not evenly spaced, equally long,
    on one device, and non-overlapping. Computed once per prepared list, never per transfer."""
    arr = descs.arr
    n = len(descs)
    if not n:
        return None
    a0, length, dev = (int(v) for v in arr[0])
    stride = int(arr[1, 0]) - a0 if n > 1 else length
    if length <= 0 or stride < length:
        return None
    if n > 1 and not (np.all(arr[:, 1] == arr[0, 1]) and np.all(arr[:, 2] == arr[0, 2])
                      and np.array_equal(arr[:, 0], np.uint64(a0) + np.uint64(stride)
                                         * np.arange(n, dtype=np.uint64))):
        return None
    return Strided(base=a0, stride=stride, length=length, dev=dev, rows=n)


def build_pair(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, src_dev: int, dst_dev: int,
               src_mem: str, dst_mem: str) -> tuple[Descs, Descs]:
    """Descs for (src, dst, sizes) fragment arrays of one device pair."""
    n = sizes.shape[0]
    la = np.empty((n, 3), np.uint64)
    ra = np.empty((n, 3), np.uint64)
    la[:, 0], la[:, 1], la[:, 2] = src, sizes, src_dev
    ra[:, 0], ra[:, 1], ra[:, 2] = dst, sizes, dst_dev
    return Descs(la, src_mem), Descs(ra, dst_mem)


class Coverage:
    """Union of registered intervals per (mem_type, dev), for fast "is this covered" checks.

    Overlapping or adjacent registrations are coalesced so a descriptor spanning two adjacent
    registrations counts as covered (NIXL behaves the same for one backend).
    """

    def __init__(self, regions: Iterable[tuple[int, int, int, str]] = ()):
        self._by_key: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._raw: list[tuple[int, int, int, str]] = []
        self.add(regions)

    def add(self, regions: Iterable[tuple[int, int, int, str]]) -> None:
        self._raw.extend((int(a), int(n), int(d), str(m)) for a, n, d, m in regions)
        self._rebuild()

    def remove(self, regions: Sequence[tuple[int, int, int, str]]) -> None:
        for r in regions:
            key = (int(r[0]), int(r[1]), int(r[2]), str(r[3]))
            if key in self._raw:
                self._raw.remove(key)
        self._rebuild()

    def _rebuild(self) -> None:
        groups: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for a, n, d, m in self._raw:
            if n > 0:
                groups.setdefault((m, d), []).append((a, a + n))
        self._by_key = {}
        for key, iv in groups.items():
            iv.sort()
            merged: list[list[int]] = []
            for s, e in iv:
                if merged and s <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], e)
                else:
                    merged.append([s, e])
            arr = np.array(merged, dtype=np.uint64)
            self._by_key[key] = (arr[:, 0].copy(), arr[:, 1].copy())

    @property
    def regions(self) -> list[tuple[int, int, int, str]]:
        return list(self._raw)

    def uncovered(self, descs: Descs) -> int:
        """Index of the first row of `descs` not covered, or -1 when all are covered."""
        if not len(descs):
            return -1
        arr = descs.arr
        bad = np.zeros(len(descs), dtype=bool)
        devs = arr[:, 2]
        for dev in np.unique(devs):
            rows = np.flatnonzero(devs == dev)
            key = (descs.mem_type, int(dev))
            if key not in self._by_key:
                bad[rows] = True
                continue
            starts, ends = self._by_key[key]
            addr = arr[rows, 0]
            end = addr + arr[rows, 1]
            idx = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
            ok = idx >= 0
            safe = np.where(ok, idx, 0)
            ok &= end <= ends[safe]
            bad[rows] = ~ok
        hits = np.flatnonzero(bad)
        return int(hits[0]) if hits.size else -1

    def covers(self, descs: Descs) -> bool:
        return self.uncovered(descs) < 0
