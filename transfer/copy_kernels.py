"""Batched copies: many `(src, dst, size)` descriptors moved by one launch.

A paged KV pool after minutes of serving hands the transfer layer hundreds to thousands of
scattered blocks. Posted one descriptor at a time (UCX's cuda_ipc issues one copy per descriptor,
~8 µs each, measured on an H200 on 2026-11-29), 1,024 scattered 512 KiB blocks ran at ~4% of a
device copy. One kernel that walks a descriptor table moves them at the speed of one copy: each
program copies one `TILE`-byte tile of one *row* (a descriptor, runs merged), so every program
does the same amount of work whatever the block size, and the host builds a table of one entry per
descriptor, not per tile.

| where        | how                                                                    |
|--------------|------------------------------------------------------------------------|
| CUDA         | the Triton kernel `_copy_rows` on the caller's stream (16-byte words when every address and size is a multiple of 16, bytes otherwise) |
| host memory  | `ctypes.memmove` per merged run (the same table, the same interface)   |

Addresses are absolute; the kernel reads and writes `base + offset` with offsets relative to the
first source and destination address, so descriptors may span several registered regions and,
through CUDA IPC, another process's memory mapped into this one (transfer/cuda_ipc.py).
"""
from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

from .descs import merge_runs
from .errors import InvalidDescriptors

log = logging.getLogger("splitserve.transfer.copy_kernels")

TILE = 64 * 1024          # bytes per program: a 512 KiB KV block is 8 programs
MAX_ROW = 8 << 20         # longer runs are cut: a row's tiles are one stretch of the grid
WORD = 16                 # the wide path's unit: one 16-byte vector per lane
BYTE_TILE = 2048          # rows of the byte path (addresses or sizes not multiples of 16)


def split_rows(src: np.ndarray, dst: np.ndarray, size: np.ndarray, tile: int = TILE):
    """Cut descriptors into rows of at most `tile` bytes (merging runs contiguous on both sides
    first). Returns (src, dst, size) uint64 arrays, one entry per row, in descriptor order."""
    src = np.asarray(src, np.uint64)
    dst = np.asarray(dst, np.uint64)
    size = np.asarray(size, np.uint64)
    if not (src.shape == dst.shape == size.shape) or src.ndim != 1:
        raise InvalidDescriptors(f"src, dst and size must be equal 1-D arrays; found "
                                 f"{src.shape} {dst.shape} {size.shape}")
    keep = size > 0
    src, dst, size = merge_runs(src[keep], dst[keep], size[keep])
    if not size.size:
        z = np.zeros(0, np.uint64)
        return z, z, z
    n = (size + np.uint64(tile - 1)) // np.uint64(tile)
    rows = int(n.sum())
    if rows == size.size:
        return src, dst, size
    first = np.repeat(np.cumsum(n) - n, n.astype(np.int64))
    k = (np.arange(rows, dtype=np.uint64) - first.astype(np.uint64)) * np.uint64(tile)
    rep = n.astype(np.int64)
    rsize = np.minimum(np.repeat(size, rep) - k, np.uint64(tile))
    return np.repeat(src, rep) + k, np.repeat(dst, rep) + k, rsize


def host_copy(src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> int:
    """Copy host-memory descriptors (runs merged); returns the bytes moved."""
    s, d, n = merge_runs(np.asarray(src, np.uint64), np.asarray(dst, np.uint64),
                         np.asarray(size, np.uint64))
    for a, b, m in zip(s.tolist(), d.tolist(), n.tolist()):
        if m:
            ctypes.memmove(b, a, m)
    return int(n.sum()) if n.size else 0


# ---------------------------------------------------------------------------------- CUDA
_KERNELS: dict = {}


def _kernel():
    """The Triton kernel, defined on first use (Triton reads TRITON_INTERPRET at definition).

    Each program loads its whole row (at most `TILE` bytes) before storing any of it: loads then
    have no store to wait behind (the compiler must assume `src` and `dst` may alias) and a
    thread keeps 16 independent 16-byte loads in flight, which is what it takes to reach a device
    copy's bandwidth. The base addresses come in as 64-bit integers cast to pointers in the
    kernel: the launcher's fast path takes only tensors and integers, and the peer's memory
    mapped by IPC is neither a tensor nor wanted as one."""
    if "int" in _KERNELS:
        return _KERNELS["int"]
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows_int(src_addr, dst_addr, table, nrows, tiles, VEC: tl.constexpr,
                       TILE_E: tl.constexpr, ELT: tl.constexpr):
        # table: [3, nrows] int64 = source offset, destination offset, length, in units of
        # VEC elements (a 16-byte word on the wide path): multiplying by the constant VEC lets
        # Triton prove 16-byte alignment and emit vector loads and stores. Program `pid` copies
        # tile `pid % tiles` of row `pid // tiles` (nothing when the row is shorter).
        src = src_addr.to(tl.pointer_type(ELT))
        dst = dst_addr.to(tl.pointer_type(ELT))
        pid = tl.program_id(0)
        r = pid // tiles          # program = (row, tile of that row)
        t = pid % tiles
        so = tl.load(table + r) * VEC + t * TILE_E
        do = tl.load(table + nrows + r) * VEC + t * TILE_E
        n = tl.load(table + 2 * nrows + r) * VEC - t * TILE_E
        idx = tl.arange(0, TILE_E)
        m = idx < n
        v = tl.load(src + so + idx, mask=m, cache_modifier=".cg")
        tl.store(dst + do + idx, v, mask=m, cache_modifier=".cs")

    _KERNELS["int"] = _copy_rows_int
    return _copy_rows_int


def _strided_kernel():
    """`_copy_strided`: the same tiles as `_copy_rows`, for rows picked by index from two
    evenly spaced lists (`descs.Strided`: a pool's per-slot list). The table is only the picked
    indices, `[2, nrows]` int64 (source slot, destination slot); the addresses are computed on
    the device (`base + slot * stride`), so the host builds nothing per row: no merge, no row
    cut, no offsets (every row has the same length, so the grid is as large as `_copy_rows`'
    after merging)."""
    if "strided" in _KERNELS:
        return _KERNELS["strided"]
    import triton
    import triton.language as tl

    # nrows varies per transfer: not specialised (a new value would not compile a variant)
    @triton.jit(do_not_specialize=["nrows"])
    def _copy_strided(src_addr, dst_addr, idx, nrows, tiles, src_stride, dst_stride, length,
                      VEC: tl.constexpr, TILE_E: tl.constexpr, ELT: tl.constexpr):
        # strides and length in units of VEC elements (a 16-byte word on the wide path), as
        # _copy_rows' table: the constant VEC proves 16-byte alignment.
        src = src_addr.to(tl.pointer_type(ELT))
        dst = dst_addr.to(tl.pointer_type(ELT))
        pid = tl.program_id(0)
        r = pid // tiles
        t = pid % tiles
        si = tl.load(idx + r)
        di = tl.load(idx + nrows + r)
        so = si * src_stride * VEC + t * TILE_E
        do = di * dst_stride * VEC + t * TILE_E
        n = length * VEC - t * TILE_E
        i = tl.arange(0, TILE_E)
        m = i < n
        v = tl.load(src + so + i, mask=m, cache_modifier=".cg")
        tl.store(dst + do + i, v, mask=m, cache_modifier=".cs")

    _KERNELS["strided"] = _copy_strided
    return _copy_strided


def strided_launch(src_base: int, src_stride: int, dst_base: int, dst_stride: int, length: int,
                   nrows: int, tile: int = TILE, warps: int | None = None):
    """(grid, scalar arguments after the index table, meta-parameters) of `_copy_strided` for
    `nrows` rows of `length` bytes: 16-byte words when every base, stride and the length are
    multiples of 16, bytes otherwise. One function for `DeviceCopier` and the tests."""
    import triton.language as tl

    wide = not ((src_base | src_stride | dst_base | dst_stride | length) % WORD)
    unit, tile = (WORD, tile) if wide else (1, BYTE_TILE)
    tiles = -(-length // tile)
    tile_e = tile // (8 if wide else 1)
    return ((nrows * tiles,), (nrows, tiles, src_stride // unit, dst_stride // unit,
                               length // unit),
            dict(VEC=2 if wide else 1, TILE_E=tile_e, ELT=tl.int64 if wide else tl.uint8,
                 num_warps=warps or (8 if tile_e >= 4096 else 4)))


class DeviceCopier:
    """Launches `_copy_rows` for descriptor lists in one device's memory (local, or another
    process's mapped in). The table goes to the device through a pinned staging buffer."""

    SLOTS = 8   # tables in flight: a slot is rewritten only after its copy to the device ran

    def __init__(self, device: int = 0, tile: int = TILE, warps: int | None = None,
                 mapped_ids: bool = False) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", device)
        self.tile = tile
        self.warps = warps   # the strided kernel's num_warps (None: by tile; a probe sweeps it)
        # An experiment (bench/transfer/submit_probe.py), off: copy_strided's kernel reads the
        # picked indices from the pinned slot itself (Triton maps the host pointer to its device
        # address) instead of after a copy to the device: no copy to queue and wait behind, each
        # program's two index loads cross PCIe instead.
        self.mapped_ids = mapped_ids
        self._slots: list = []
        self._next = 0
        self._fast = all(hasattr(torch._C, f) for f in
                         ("_cuda_getDevice", "_cuda_getCurrentStream", "_cuda_setStream"))
        self._checked = False
        for _ in range(self.SLOTS):   # pinned memory is slow to allocate: never in a transfer
            self._slots.append(self._slot(3 * 16384))

    def _slot(self, cap: int):
        torch = self.torch
        host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
        return (host, torch.empty(cap, dtype=torch.int64, device=self.device), torch.cuda.Event(),
                host.numpy())

    def _take_slot(self, n: int):
        """The next staging slot with room for `n` int64, once its previous upload left it."""
        i = self._next % len(self._slots)
        self._next += 1
        slot = self._slots[i]
        slot[2].synchronize()   # its previous upload has left the pinned buffer
        if slot[0].numel() < n:   # grown once, for every slot, to twice the need
            # The old slots may still be read on the device: a kernel queued behind other work
            # reads its indices from a slot's device buffer (or, with mapped_ids, its pinned
            # one) after the slot's event. Freed now, the caching allocators would hand them to
            # the next allocation while those kernels run (wrong indices: bytes written into
            # other blocks). Growing is rare (a list of >16k rows): wait for the device once.
            self.torch.cuda.synchronize(self.device)
            self._slots = [self._slot(2 * n) for _ in self._slots]
            slot = self._slots[i]
        return slot

    def _upload(self, table: np.ndarray, stream):
        n = table.size
        host, dev, ev, view = self._take_slot(n)
        view[:n] = table.ravel()
        dev[:n].copy_(host[:n], non_blocking=True)   # on the current stream: copy()'s `stream`
        ev.record(stream)
        return dev[:n]

    def _upload_ids(self, si: np.ndarray, di: np.ndarray, stream):
        """`[si, di]` to the device through one staging slot: two slice assignments, one copy."""
        n = si.size
        host, dev, ev, view = self._take_slot(2 * n)
        view[:n] = si
        view[n:2 * n] = di
        dev[:2 * n].copy_(host[:2 * n], non_blocking=True)
        ev.record(stream)
        return dev

    def _enter(self, stream):
        """Make `stream` current on this thread (and our device current); returns what
        `_leave` restores. torch's `cuda.device`/`cuda.stream` context managers resolve device
        indices in Python several times (a profile on the H100 put up to ~100 µs of a 240 µs
        copy there, profiler overhead included: bench/transfer/submit_probe.py); the two calls
        they end in cost a few µs. Checked once
        against torch's public API (`_check_fast`); falls back to the context managers where
        those calls are missing or behave otherwise."""
        torch = self.torch
        C = torch._C
        here = self._fast and C._cuda_getDevice() == stream.device_index == self.device.index
        if here and not self._checked:
            self._check_fast(stream)
            here = self._fast
        if here:
            prev = C._cuda_getCurrentStream(self.device.index)
            C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                              device_type=stream.device_type)
            return prev
        cms = (torch.cuda.device(self.device), torch.cuda.stream(stream))
        for cm in cms:
            cm.__enter__()
        return cms

    def _check_fast(self, stream) -> None:
        """Once: the driver-level calls do what torch's public API says they do (the current
        stream becomes `stream`, then what it was); else use the context managers."""
        torch = self.torch
        C = torch._C
        self._checked = True
        before = torch.cuda.current_stream(self.device)
        try:
            prev = C._cuda_getCurrentStream(self.device.index)
            C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                              device_type=stream.device_type)
            ok = torch.cuda.current_stream(self.device) == stream
            C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
            ok = ok and torch.cuda.current_stream(self.device) == before
        except Exception as e:   # a torch without them, or other signatures
            log.info("stream switch through torch._C unavailable (%s: %s)", type(e).__name__, e)
            ok = False
        if not ok:
            self._fast = False
            torch.cuda.set_stream(before)

    def _leave(self, prev) -> None:
        if isinstance(prev, tuple) and len(prev) == 3 and not hasattr(prev[0], "__exit__"):
            self.torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1],
                                          device_type=prev[2])
            return
        for cm in reversed(prev):
            cm.__exit__(None, None, None)

    def copy(self, src: np.ndarray, dst: np.ndarray, size: np.ndarray, stream=None,
             after=None) -> int:
        """Queue the copies on `stream` (default: the current stream); returns the rows launched.
        The copies are ordered after the work already queued on `stream`, and after the CUDA
        event `after` when given (waited between the table's upload and the kernel: the upload
        needs nothing from it, and a staging slot is then free again without waiting for the
        work behind `after`, e.g. a prefill chunk still computing)."""
        import triton.language as tl

        torch = self.torch
        src, dst, size = (np.asarray(x, np.uint64) for x in (src, dst, size))
        live = size > 0
        wide = not ((src[live] | dst[live] | size[live]) % np.uint64(WORD)).any()
        unit, tile = (WORD, self.tile) if wide else (1, BYTE_TILE)
        stream = stream or torch.cuda.current_stream(self.device)
        s, d, n = split_rows(src, dst, size, MAX_ROW)   # merges runs; cuts only the longest
        if not n.size:
            if after is not None:   # what the caller records next still follows `after`
                stream.wait_event(after)
            return 0
        tiles = -(-int(n.max()) // tile)
        s0, d0 = int(s[0]), int(d[0])
        so = (s.astype(np.int64) - s0) // unit   # signed: rows may lie below the first address
        do = (d.astype(np.int64) - d0) // unit
        table = np.stack([so, do, (n // np.uint64(unit)).astype(np.int64)])
        tile_e = tile // (8 if wide else 1)
        prev = self._enter(stream)   # the upload and the kernel both go on `stream`
        try:
            dev = self._upload(table, stream)
            if after is not None:
                stream.wait_event(after)
            _kernel()[(n.size * tiles,)](s0, d0, dev, n.size, tiles, VEC=2 if wide else 1,
                                         TILE_E=tile_e, ELT=tl.int64 if wide else tl.uint8,
                                         num_warps=8 if tile_e >= 4096 else 4)
        finally:
            self._leave(prev)
        return int(n.size)


    def copy_strided(self, src_base: int, src_stride: int, si: np.ndarray, dst_base: int,
                     dst_stride: int, di: np.ndarray, length: int, stream, after=None) -> int:
        """Queue on `stream` the copy of rows `si` of a strided source list (row k at
        `src_base + k * src_stride`) to rows `di` of a strided destination list, `length` bytes
        each (`descs.Strided`; int64 index arrays of equal size, in range: the caller checked).
        The per-transfer host work is one upload of the indices and one launch. `after`: a CUDA
        event the kernel waits for (not the upload, as in `copy`). Returns the rows launched."""
        n = int(si.size)
        if not n:
            if after is not None:   # what the caller records next still follows `after`
                stream.wait_event(after)
            return 0
        grid, scalars, meta = strided_launch(src_base, src_stride, dst_base, dst_stride, length,
                                             n, self.tile, self.warps)
        prev = self._enter(stream)
        try:
            if self.mapped_ids:
                host, _dev, ev, view = self._take_slot(2 * n)
                view[:n] = si
                view[n:2 * n] = di
                if after is not None:
                    stream.wait_event(after)
                _strided_kernel()[grid](src_base, dst_base, host, *scalars, **meta)
                ev.record(stream)   # the slot is rewritten only once the kernel has read it
            else:
                idx = self._upload_ids(si, di, stream)
                if after is not None:
                    stream.wait_event(after)
                _strided_kernel()[grid](src_base, dst_base, idx, *scalars, **meta)
        finally:
            self._leave(prev)
        return n


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
