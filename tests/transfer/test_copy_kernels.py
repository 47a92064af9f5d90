"""Batched copies (transfer/copy_kernels.py): the row table and both back ends move exactly the
bytes the descriptors name — scattered blocks in random order, sizes that are not multiples of the
tile or of 16 bytes, runs that merge — and nothing else."""
from __future__ import annotations

import numpy as np
import pytest

from transfer.copy_kernels import TILE, host_copy, split_rows
from transfer.errors import InvalidDescriptors


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
