"""Batched copies (transfer/copy_kernels.py): the row table and both back ends move exactly the
bytes the descriptors name — scattered blocks in random order, sizes that are not multiples of the
tile or of 16 bytes, runs that merge — and nothing else."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from transfer.copy_kernels import TILE, host_copy, split_rows, strided_launch
from transfer.descs import Descs, strided
from transfer.errors import InvalidDescriptors

INTERP = os.environ.get("SPLITSERVE_TRITON_INTERPRET") == "1" and \
    importlib.util.find_spec("triton") is not None


def _scattered(rng, nblocks: int, block: int, partial_last: bool):
    """Descriptors moving `nblocks` blocks between random slots of two pools of 2·nblocks slots."""
    src_slots = rng.permutation(2 * nblocks)[:nblocks]
    dst_slots = rng.permutation(2 * nblocks)[:nblocks]
    size = np.full(nblocks, block, np.uint64)
    if partial_last and block > 1:
        size[-1] = int(rng.integers(1, block))
    return (src_slots.astype(np.uint64) * np.uint64(block),
            dst_slots.astype(np.uint64) * np.uint64(block), size)


def _reference(src_buf, dst_buf, s, d, n):
    out = dst_buf.copy()
    for a, b, m in zip(s.tolist(), d.tolist(), n.tolist()):
        out[b:b + m] = src_buf[a:a + m]
    return out


@pytest.mark.parametrize("block,tile", [(4096, TILE), (3 * TILE + 24, TILE), (100, 64), (1, 16)])
def test_rows_cover_exactly_the_descriptors(block, tile):
    rng = np.random.default_rng(block)
    s, d, n = _scattered(rng, 37, block, partial_last=True)
    rs, rd, rn = split_rows(s, d, n, tile)
    assert int(rn.max()) <= tile and int(rn.min()) > 0
    assert int(rn.sum()) == int(n.sum())
    src = rng.integers(0, 256, 2 * 37 * block, dtype=np.uint8)
    dst = rng.integers(0, 256, 2 * 37 * block, dtype=np.uint8)
    assert np.array_equal(_reference(src, dst, rs, rd, rn), _reference(src, dst, s, d, n))


def test_runs_contiguous_on_both_sides_merge_before_tiling():
    s = np.array([0, 100, 200, 1000], np.uint64)
    d = np.array([50, 150, 250, 0], np.uint64)
    n = np.array([100, 100, 100, 7], np.uint64)
    rs, rd, rn = split_rows(s, d, n, tile=1 << 20)
    assert rs.tolist() == [0, 1000] and rd.tolist() == [50, 0] and rn.tolist() == [300, 7]


def test_zero_length_rows_are_dropped_and_shapes_checked():
    rs, rd, rn = split_rows(np.array([8, 16], np.uint64), np.array([0, 64], np.uint64),
                            np.array([0, 4], np.uint64))
    assert rs.tolist() == [16] and rn.tolist() == [4]
    with pytest.raises(InvalidDescriptors, match="equal 1-D"):
        split_rows(np.zeros(2, np.uint64), np.zeros(3, np.uint64), np.zeros(2, np.uint64))


@pytest.mark.parametrize("block", [1, 48, 32 * 1024])
def test_host_copy_moves_scattered_blocks_bit_for_bit(block):
    rng = np.random.default_rng(7)
    nb = 64
    s, d, n = _scattered(rng, nb, block, partial_last=True)
    src = rng.integers(0, 256, 2 * nb * block, dtype=np.uint8)
    dst = np.full(2 * nb * block, 0xAB, np.uint8)   # poisoned: untouched bytes must stay so
    want = _reference(src, dst, s, d, n)
    moved = host_copy(s + np.uint64(src.ctypes.data), d + np.uint64(dst.ctypes.data), n)
    assert moved == int(n.sum())
    assert np.array_equal(dst, want)


def _slots(base: int, n: int, stride: int, length: int, dev: int = 0) -> Descs:
    """A pool's per-slot list as transfer/pump.py `_prepare` builds it."""
    a = np.zeros((n, 3), np.uint64)
    a[:, 0] = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(stride)
    a[:, 1], a[:, 2] = length, dev
    return Descs(a, "VRAM")


def test_a_pools_slot_list_is_strided_and_nothing_else_is():
    st = strided(_slots(1 << 20, 64, 4096, 1024, dev=3))
    assert (st.base, st.stride, st.length, st.dev, st.rows) == (1 << 20, 4096, 1024, 3, 64)
    assert strided(_slots(4096, 1, 8192, 100)).stride == 100   # one row: its own length
    uneven = _slots(0, 8, 4096, 1024).arr.copy()
    uneven[5, 0] += 16
    mixed_len = _slots(0, 8, 4096, 1024).arr.copy()
    mixed_len[7, 1] = 512                 # a partial last row: not one length
    two_devs = _slots(0, 8, 4096, 1024).arr.copy()
    two_devs[3, 2] = 1
    for arr in (uneven, mixed_len, two_devs, _slots(0, 8, 512, 1024).arr):   # last: overlapping
        assert strided(Descs(arr, "VRAM")) is None
    assert strided(Descs(np.zeros((0, 3), np.uint64), "VRAM")) is None


def test_a_peers_strided_list_is_mapped_once_when_every_row_may_go_direct():
    """DirectCopies.map_strided (at prep): the peer's per-slot list with this process's mapped
    base, or None (writes then take the general route, which names a bad row) when a row lies
    outside the peer's registrations or the list spans two allocations."""
    from transfer.descs import Coverage
    from transfer.direct import DirectCopies, _PeerMap

    A, B, M = 1 << 32, 1 << 33, 5 << 32     # the peer's two allocations; the first's mapping
    dc = DirectCopies()
    pm = _PeerMap()
    pm.base = np.array([A, B], np.uint64)
    pm.size = np.array([1 << 20, 1 << 20], np.uint64)
    pm.mapped = np.array([M, 7 << 32], np.uint64)
    pm.regions = Coverage([(A, 1 << 20, 0, "VRAM"), (B, 1 << 20, 0, "VRAM")])
    dc.peers["peer"] = pm

    def mapped(base, n, stride, length, peer="peer"):
        d = _slots(base, n, stride, length)
        return dc.map_strided(peer, strided(d), d)
    m = mapped(A + 4096, 16, 8192, 4096)
    assert (m.base, m.stride, m.length, m.rows) == (M + 4096, 8192, 4096, 16)
    assert mapped(A + 4096, 129, 8192, 4096) is None        # the last row is past A's region
    assert mapped(A + (1 << 20) - 8192, 2, B - A - (1 << 20) + 8192, 4096) is None   # A then B
    assert mapped(A, 16, 8192, 4096, peer="other") is None   # not mapped here
    assert dc.map_strided("peer", None, _slots(A, 16, 8192, 4096)) is None


def _strided_case(rng, nslots, src_stride, dst_stride, length, off):
    src = rng.integers(0, 256, nslots * src_stride + 64, dtype=np.uint8)
    dst = np.full(nslots * dst_stride + 64, 0xAB, np.uint8)
    si = rng.permutation(nslots)[:nslots // 2].astype(np.int64)
    di = rng.permutation(nslots)[:nslots // 2].astype(np.int64)
    want = dst.copy()
    for a, b in zip(si.tolist(), di.tolist()):
        want[b * dst_stride + off:b * dst_stride + off + length] = \
            src[a * src_stride + off:a * src_stride + off + length]
    return src, dst, si, di, want


# (src stride, dst stride, length, offset in the slot, tile): 16-byte words and bytes, rows of
# several tiles and a partial last tile, a fragment inside its slot (a TP-split head range)
STRIDED = [(4096, 8192, 4096, 0, 1024), (4096, 4096, 1024, 2048, 256), (1000, 1200, 999, 1, 256),
           (48, 64, 48, 0, 16), (4096, 4096, 4096, 0, TILE)]


@pytest.mark.skipif(not INTERP, reason="set SPLITSERVE_TRITON_INTERPRET=1 (with triton "
                    "installed) to run the kernel on the CPU")
@pytest.mark.parametrize("ss,ds,length,off,tile", STRIDED)
def test_the_strided_kernel_moves_exactly_the_picked_rows(ss, ds, length, off, tile):
    """`_copy_strided` under Triton's interpreter, launched as DeviceCopier.copy_strided
    launches it (`strided_launch`): bit for bit, nothing outside the destination rows."""
    import torch

    from transfer.copy_kernels import _strided_kernel

    rng = np.random.default_rng(ss + ds + length)
    src, dst, si, di, want = _strided_case(rng, 24, ss, ds, length, off)
    sb, db = src.ctypes.data + off, dst.ctypes.data + off
    grid, scalars, meta = strided_launch(sb, ss, db, ds, length, si.size, tile)
    assert meta["VEC"] == (2 if not (sb | ss | db | ds | length) % 16 else 1)
    idx = torch.from_numpy(np.concatenate([si, di]))
    _strided_kernel()[grid](sb, db, idx, *scalars, **meta)
    assert np.array_equal(dst, want)


# ---------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("block,aligned", [(512 * 1024, True), (16 * 1024 + 16, True),
                                           (4096 + 3, False), (1 << 20, True)])
def test_device_copier_matches_a_reference_copy(block, aligned):
    import torch      # the gpu marker skips this case without torch or a CUDA device (tests/conftest.py)
    from transfer.copy_kernels import DeviceCopier

    rng = np.random.default_rng(block)
    nb = 96
    s, d, n = _scattered(rng, nb, block, partial_last=True)
    if not aligned:
        s += np.uint64(1)
    g = torch.Generator(device="cuda").manual_seed(block)
    src = torch.randint(0, 256, (2 * nb * block + 8,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full((2 * nb * block + 8,), 0xAB, dtype=torch.uint8, device="cuda")
    want = torch.from_numpy(_reference(src.cpu().numpy(), dst.cpu().numpy(), s, d, n))
    c = DeviceCopier(0)
    rows = c.copy(s + np.uint64(src.data_ptr()), d + np.uint64(dst.data_ptr()), n)
    torch.cuda.synchronize()
    assert rows >= nb
    assert torch.equal(dst.cpu(), want)
    # the same copier again, other descriptors: its table slots are reused safely
    s2, d2, n2 = _scattered(rng, nb, block, partial_last=False)
    want2 = torch.from_numpy(_reference(src.cpu().numpy(), dst.cpu().numpy(), s2, d2, n2))
    for _ in range(12):
        c.copy(s2 + np.uint64(src.data_ptr()), d2 + np.uint64(dst.data_ptr()), n2)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want2)


@pytest.mark.gpu
def test_the_copy_runs_on_its_stream_after_its_work_and_leaves_the_callers_stream():
    """The copy (its table upload and its kernel) goes on the stream it is given, after what is
    queued there, and the calling thread's current stream is what it was (the engine's thread
    launches copies too)."""
    import torch
    from transfer.copy_kernels import DeviceCopier

    n = 1 << 20
    src = torch.zeros(n, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    c = DeviceCopier(0)
    s = torch.cuda.Stream()
    caller = torch.cuda.current_stream()
    for value in (7, 9):
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)   # tens of ms on the stream before the source is set
            src.fill_(value)
        c.copy(np.array([src.data_ptr()], np.uint64), np.array([dst.data_ptr()], np.uint64),
               np.array([n], np.uint64), s)
        assert torch.cuda.current_stream() == caller
        s.synchronize()
        assert int(dst.min()) == int(dst.max()) == value


@pytest.mark.gpu
@pytest.mark.parametrize("ss,ds,length,off,tile", STRIDED + [(512 * 1024, 512 * 1024, 512 * 1024,
                                                              0, TILE)])
def test_device_copier_strided_matches_a_reference_copy(ss, ds, length, off, tile):
    """DeviceCopier.copy_strided (index upload through the staging slots, the kernel on the
    given stream), repeatedly with other picks so the slots are reused."""
    import torch
    from transfer.copy_kernels import DeviceCopier

    c = DeviceCopier(0, tile=tile)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(length)
    for _ in range(10):
        src, dst, si, di, want = _strided_case(rng, 24, ss, ds, length, off)
        s = torch.from_numpy(src).cuda()
        d = torch.from_numpy(dst).cuda()
        torch.cuda.synchronize()
        assert c.copy_strided(s.data_ptr() + off, ss, si, d.data_ptr() + off, ds, di, length,
                              stream) == si.size
        stream.synchronize()
        assert np.array_equal(d.cpu().numpy(), want)


def _interp_agent(src: np.ndarray, dst: np.ndarray, nslots: int, ss: int, ds: int, length: int,
                  regions_len: int | None = None):
    """A NixlAgent whose peer "peer" (this process) owns `dst`, with its NIXL calls and the
    copier's CUDA calls (staging copy, stream, events) stubbed: prep_descs, map_strided,
    submit_prepped, write_strided and the strided kernel (under Triton's interpreter) are real."""
    import threading

    import torch

    import transfer.copy_kernels as ck
    import transfer.direct as dr
    import transfer.nixl_agent as na
    from transfer.descs import Coverage

    class Ev:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    class Stream:
        def wait_event(self, ev):
            pass

    class Nixl:
        def prep_xfer_dlist(self, *a):
            return object()

    copier = ck.DeviceCopier.__new__(ck.DeviceCopier)
    copier.torch, copier.tile, copier.warps, copier.mapped_ids = torch, 256, None, False
    copier._next = 0

    def slot(cap):
        host = torch.zeros(cap, dtype=torch.int64)
        return host, torch.zeros(cap, dtype=torch.int64), Ev(), host.numpy()
    copier._slot = slot
    copier._slots = [slot(64) for _ in range(2)]
    copier._enter = lambda stream: None
    copier._leave = lambda prev: None
    dc = dr.DirectCopies()
    dc._copiers[0], dc._streams[0], dc._events[0] = copier, Stream(), [(Ev(), b"t" * 64)]
    pm = dr._PeerMap()
    pm.base = pm.mapped = np.array([dst.ctypes.data], np.uint64)
    pm.size = np.array([dst.size], np.uint64)
    pm.dev, pm.owned = [0], [False]
    pm.regions = Coverage([(dst.ctypes.data, regions_len or dst.size, 0, "VRAM")])
    dc.peers["peer"] = pm
    a = na.NixlAgent.__new__(na.NixlAgent)
    a._lock, a._remotes, a._direct, a._preps = threading.RLock(), {"peer"}, dc, {}
    a._local = Coverage([(src.ctypes.data, src.size, 0, "VRAM")])
    a._nixl_inflight, a._errors, a._agent = set(), (), Nixl()
    lp = a.prep_descs(None, _slots(src.ctypes.data, nslots, ss, length))
    rp = a.prep_descs("peer", _slots(dst.ctypes.data, nslots, ds, length))
    return a, lp, rp


@pytest.mark.skipif(not INTERP, reason="set SPLITSERVE_TRITON_INTERPRET=1 (with triton "
                    "installed) to run the kernel on the CPU")
def test_submit_prepped_between_strided_lists_moves_the_picked_blocks():
    """NixlAgent.submit_prepped's direct path from prep to kernel, on the CPU: the plans made
    at prep_descs, one launch per transfer, the bytes of the picked slots and nothing else; a
    peer list with a row outside its registrations keeps the general route, which refuses a
    transfer naming that row (OutOfRange) and still moves one that does not."""
    from transfer.errors import OutOfRange

    rng = np.random.default_rng(5)
    nslots, ss, ds, length = 32, 1024, 1536, 1000
    src, dst, si, di, want = _strided_case(rng, nslots, ss, ds, length, 0)
    a, lp, rp = _interp_agent(src, dst, nslots, ss, ds, length)
    assert lp.direct is not None and rp.direct is not None
    x = a.submit_prepped("peer", lp, si, rp, di)
    assert (x.ready, x.ndescs, x.nbytes) == (b"t" * 64, si.size, si.size * length)
    assert np.array_equal(dst, want)
    # the peer registered only its first 20 slots: no plan, and the general route checks rows
    src, dst, si, di, want = _strided_case(rng, nslots, ss, ds, length, 0)
    a, lp, rp = _interp_agent(src, dst, nslots, ss, ds, length, regions_len=20 * ds)
    assert rp.direct is None
    with pytest.raises(OutOfRange):
        a.submit_prepped("peer", lp, np.array([0, 1]), rp, np.array([3, 25]))
    low = di < 20
    x = a.submit_prepped("peer", lp, si[low], rp, di[low])
    assert x.ready == b"t" * 64
    want = dst.copy()
    for s_, d_ in zip(si[low].tolist(), di[low].tolist()):
        want[d_ * ds:d_ * ds + length] = src[s_ * ss:s_ * ss + length]
    assert np.array_equal(dst, want)


def _logging_copier(log: list, cap: int = 64):
    """A DeviceCopier whose CUDA calls (events, device synchronize, stream switch) are stubbed
    and logged; its staging slots are CPU tensors (the upload is a CPU copy)."""
    import torch

    import transfer.copy_kernels as ck

    class Ev:
        def __init__(self, name):
            self.name = name

        def record(self, stream=None):
            log.append(("record", self.name))

        def synchronize(self):
            log.append(("sync slot", self.name))

    class Torch:   # torch, with cuda.synchronize logged
        def __getattr__(self, k):
            return getattr(torch, k)

        class cuda:
            @staticmethod
            def synchronize(device=None):
                log.append(("sync device",))

    copier = ck.DeviceCopier.__new__(ck.DeviceCopier)
    copier.torch, copier.tile, copier.warps, copier.mapped_ids = Torch(), 256, None, False
    copier.device = "cuda:0"
    copier._next = 0
    made = []

    def slot(c):
        host = torch.zeros(c, dtype=torch.int64)
        made.append(c)
        log.append(("alloc", c))
        return host, torch.zeros(c, dtype=torch.int64), Ev(len(made) - 1), host.numpy()
    copier._slot = slot
    copier._slots = [slot(cap) for _ in range(3)]
    copier._enter = lambda stream: None
    copier._leave = lambda prev: None
    log.clear()
    return copier


class _LoggedStream:
    def __init__(self, log):
        self.log = log

    def wait_event(self, ev):
        self.log.append(("wait", ev))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton not installed (CUDA hosts only): strided_launch takes the "
                           "kernel's element types from triton.language")
@pytest.mark.parametrize("mapped", [False, True])
def test_a_strided_copy_uploads_its_indices_before_waiting_for_its_event(monkeypatch, mapped):
    """copy_strided with `after`: the index upload (its slot's event) is queued before the
    stream waits for `after`, the kernel after both; the kernel reads the picked indices."""
    import transfer.copy_kernels as ck

    log: list = []
    copier = _logging_copier(log)
    copier.mapped_ids = mapped
    seen = {}

    class Launch:
        def __getitem__(self, grid):
            def run(sb, db, idx, nrows, *rest, **meta):
                log.append(("kernel",))
                seen["idx"] = idx[:2 * nrows].tolist()
            return run
    monkeypatch.setitem(ck._KERNELS, "strided", Launch())
    stream = _LoggedStream(log)
    si, di = np.array([5, 1, 3], np.int64), np.array([0, 7, 2], np.int64)
    assert copier.copy_strided(1 << 20, 4096, si, 1 << 30, 4096, di, 4096, stream,
                               after="prefill") == 3
    assert seen["idx"] == [5, 1, 3, 0, 7, 2]
    if mapped:   # the kernel reads the pinned slot: its event follows the kernel
        assert log == [("sync slot", 0), ("wait", "prefill"), ("kernel",), ("record", 0)]
    else:        # the slot is free once uploaded, whatever `after` still waits for
        assert log == [("sync slot", 0), ("record", 0), ("wait", "prefill"), ("kernel",)]
    log.clear()
    assert copier.copy_strided(0, 16, si[:0], 0, 16, di[:0], 16, stream, after="e") == 0
    assert log == [("wait", "e")]   # nothing to copy: what follows still waits for `after`


def test_staging_slots_grow_only_after_the_device_is_done_with_them():
    """A list longer than the staging slots hold: the slots are reallocated only after the
    device finished with the old ones (kernels queued earlier still read their indices)."""
    log: list = []
    copier = _logging_copier(log, cap=8)
    copier._take_slot(8)
    assert ("sync device",) not in log
    log.clear()
    host, _dev, _ev, _view = copier._take_slot(20)
    assert log[0] == ("sync slot", 1) and log[1] == ("sync device",)
    assert log[2:] == [("alloc", 40)] * 3 and host.numel() == 40


def _sparse(nbytes: int):
    """`nbytes` of address space, zero-filled on touch (MAP_NORESERVE: only the rows a case
    writes take memory), or a skip where the kernel refuses that much."""
    import mmap

    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)
    except (OSError, OverflowError, ValueError) as e:   # 0x4000: Linux's MAP_NORESERVE
        pytest.skip(f"no {nbytes >> 30} GiB of address space here: {e}")
    return m, np.frombuffer(m, np.uint8)


# (stride, length): bytes with offsets past 4 GiB; 16-byte words with offsets past 2**31 int64
# elements (16 GiB): a 32-bit offset anywhere in the kernel's arithmetic wraps and misses
LARGE = [((1 << 30) + 1, 3000, [4, 0, 2], [1, 4, 0]),
         ((4 << 30) + 16, 4096 + 48, [4, 1, 0], [0, 4, 3])]


@pytest.mark.skipif(not INTERP, reason="set SPLITSERVE_TRITON_INTERPRET=1 (with triton "
                    "installed) to run the kernel on the CPU")
@pytest.mark.parametrize("stride,length,si,di", LARGE, ids=["bytes-4GiB", "words-16GiB"])
def test_the_strided_kernel_reaches_rows_past_32_bit_offsets(stride, length, si, di):
    """Pools larger than 2 GiB (byte path) and 16 GiB (16-byte words): the picked rows are
    addressed with 64-bit offsets (the index loaded as int64 times the stride)."""
    import torch

    from transfer.copy_kernels import _strided_kernel

    span = stride * (max(si + di) + 1)
    (ms, src), (md, dst) = _sparse(span), _sparse(span)
    rng = np.random.default_rng(length)
    for a in si:
        src[a * stride:a * stride + length] = rng.integers(1, 256, length, dtype=np.uint8)
    sb, db = src.ctypes.data, dst.ctypes.data
    grid, scalars, meta = strided_launch(sb, stride, db, stride, length, len(si), 1024)
    assert meta["VEC"] == (2 if stride % 16 == 0 else 1)
    _strided_kernel()[grid](sb, db, torch.tensor(si + di, dtype=torch.int64), *scalars, **meta)
    for a, b in zip(si, di):
        assert np.array_equal(dst[b * stride:b * stride + length],
                              src[a * stride:a * stride + length]), (a, b)
        assert dst[b * stride + length] == 0 and (b == 0 or dst[b * stride - 1] == 0)
    del src, dst
    ms.close(), md.close()


@pytest.mark.gpu
@pytest.mark.parametrize("stride,length,si,di", LARGE, ids=["bytes-4GiB", "words-16GiB"])
def test_device_copier_strided_reaches_rows_past_32_bit_offsets(stride, length, si, di):
    """The compiled kernel as DeviceCopier.copy_strided launches it, on pools of 5 and 17 GiB
    (two each): rows past 4 GiB (bytes) and past 2**31 int64 elements (16-byte words)."""
    import torch
    from transfer.copy_kernels import DeviceCopier

    span = stride * (max(si + di) + 1)
    if torch.cuda.mem_get_info()[0] < 2 * span + (1 << 30):
        pytest.skip(f"needs {2 * span >> 30} GiB free on the device")
    src = torch.empty(span, dtype=torch.uint8, device="cuda")
    dst = torch.empty(span, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(length)
    for a in si:
        src[a * stride:a * stride + length] = torch.randint(1, 256, (length,), dtype=torch.uint8,
                                                            device="cuda", generator=g)
    for b in di:   # the row and 16 bytes either side: what the copy may and may not touch
        dst[max(0, b * stride - 16):b * stride + length + 16].zero_()
    c, stream = DeviceCopier(0), torch.cuda.Stream()
    torch.cuda.synchronize()
    assert c.copy_strided(src.data_ptr(), stride, np.array(si, np.int64), dst.data_ptr(), stride,
                          np.array(di, np.int64), length, stream) == len(si)
    stream.synchronize()
    for a, b in zip(si, di):
        assert torch.equal(dst[b * stride:b * stride + length], src[a * stride:a * stride + length])
        assert not dst[b * stride + length:b * stride + length + 16].any()
        assert not dst[max(0, b * stride - 16):b * stride].any()
    del src, dst
    torch.cuda.empty_cache()


def test_a_peer_load_that_fails_midway_leaves_its_map_aligned(monkeypatch):
    """DirectCopies.load: an allocation whose IPC handle does not open refuses the peer's new
    allocations, closes what this load had opened, and leaves the peer's map as it was, so a
    later load and the close at drop pair each mapping with its own device and ownership."""
    import transfer.cuda_ipc as ci
    from transfer.direct import DirectCopies

    opened, closed = [], []

    def open_handle(h, dev):
        if h == b"bad":
            raise ci.IpcUnavailable("does not open")
        opened.append(h)
        return 0x7000 + len(opened) * 0x100
    monkeypatch.setattr(ci, "open_handle", open_handle)
    monkeypatch.setattr(ci, "close", lambda m, d: closed.append((m, d)))
    dc = DirectCopies()
    dc.regions = [(0x10, 0x10, 2)]   # this process's device: 2

    def desc(*allocs):
        return {"host": dc.host, "pid": dc.pid + 1, "regions": [],
                "allocs": [[b, 0x100, 0, h] for b, h in allocs]}
    dc.load("p", desc((0x3000, b"a")))
    dc.load("p", desc((0x3000, b"a"), (0x1000, b"b"), (0x2000, b"bad")))
    assert "p" in dc.refused and closed == [(0x7200, 2)]   # b's mapping, opened then closed
    pm = dc.peers["p"]
    assert pm.base.tolist() == [0x3000] and pm.dev == [2] and pm.owned == [True]
    dc.load("p", desc((0x3000, b"a"), (0x1000, b"c")))
    pm = dc.peers["p"]
    assert pm.base.tolist() == [0x1000, 0x3000] and pm.mapped.tolist() == [0x7300, 0x7100]
    assert pm.dev == [2, 2] and pm.owned == [True, True] and "p" not in dc.refused
    closed.clear()
    dc.drop("p")
    assert sorted(closed) == [(0x7100, 2), (0x7300, 2)]
