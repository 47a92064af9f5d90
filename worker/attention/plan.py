"""Host-side metadata of the paged decode kernel: rows, their key ranges and the split-K work units.

A decode row ``r`` reads table-local key slots ``lo[r] .. hi[r]-1`` of its block table (slot ``j`` is
absolute position ``key0[r] + j``): ``hi = pos + 1 - key0`` (causal), ``lo`` the first slot inside the
sliding window (0 without one). Every slot in ``[lo, hi)`` is visible, so the kernel needs no mask
beyond the range, and every tile it loads starts with a visible key (no all ``-inf`` row).

Rows are cut into *work units* of at most ``split`` slots (flash-decoding): unit ``u`` covers
``[unit_lo[u], unit_hi[u])`` of row ``unit_row[u]``; the units of row ``r`` are
``row_start[r] .. row_start[r+1]-1``. One kernel program per (unit, KV head) reads that range once for
all query heads of the KV head's group; a second kernel merges each row's units by their
log-sum-exp. When no row has more than one unit the first kernel writes the output itself
(``direct``). Units spread a long row over many programs while short rows stay one program each,
which is what keeps a 32k-token row from setting the step time.

The split size follows vLLM/SGLang's decode-attention launchers (vllm/attention/ops/
triton_decode_attention.py, sglang triton_ops/decode_attention.py: a fixed ``NUM_KV_SPLITS`` grid
dimension); here the split is in tokens and chosen per launch so the launch has about
``PROGRAMS_PER_SM`` programs per multiprocessor, which those kernels get from tuning the split count
per batch size. For a CUDA graph everything is sized from the graph's key (rows and blocks buckets),
so a replay only rewrites the buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PagedDecode", "build_paged_decode", "MIN_SPLIT", "PROGRAMS_PER_SM", "UNIT_ALIGN", "choose_split", "max_units",
           "row_ranges", "fill_units", "num_sms"]

#: Smallest work unit, in key slots (one BLOCK_N tile of the kernel). Timed on the H200 (bench/RESULTS.md,
#: "decode kernels (issue 17, third pass)"): at batch 1 and 8 and 1k context, 128-slot units beat 256 by 16%
#: and 5%.
MIN_SPLIT = 128
#: Target programs per multiprocessor for one decode launch, counted on the graph key's bucketed
#: lengths (up to twice the real ones), so about 4 per multiprocessor of real work.
PROGRAMS_PER_SM = 8
#: Unit boundaries fall on multiples of this many slots (the kernel's BLOCK_N at head_dim ≤ 64).
UNIT_ALIGN = 128


@dataclass
class PagedDecode:
    """Device metadata of one paged decode launch (all int64 tensors on the model's device).

    ``tables [R, T]`` block ids per row (table slot ``i`` holds key slots ``i·block_size ..``);
    ``pos [R]`` query positions; ``key0 [R]`` absolute position of each table's first slot;
    ``unit_row / unit_lo / unit_hi [U]`` the work units (``unit_hi == unit_lo`` marks an unused
    unit of a CUDA-graph buffer: its programs exit at once); ``row_start [R+1]`` each row's first unit;
    ``max_row_units`` an upper bound on any row's unit count (sizes the merge kernel's tile).
    ``token_start``: the decode rows are rows ``token_start ..`` of the flat batch."""

    tables: torch.Tensor
    pos: torch.Tensor
    key0: torch.Tensor
    unit_row: torch.Tensor
    unit_lo: torch.Tensor
    unit_hi: torch.Tensor
    row_start: torch.Tensor
    direct: bool
    token_start: int = 0
    max_row_units: int = 16


_SMS: dict[str, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 for the CPU interpreter: small grids, same code paths)."""
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return _SMS[key]


def choose_split(total_slots: int, kv_heads: int, sms: int) -> int:
    """Work-unit size (a power of two ≥ :data:`MIN_SPLIT`) for a launch reading ``total_slots`` key
    slots per KV head: about ``PROGRAMS_PER_SM·sms`` programs in all."""
    want = -(-int(total_slots) * kv_heads // (PROGRAMS_PER_SM * sms))
    split = MIN_SPLIT
    while split < want:
        split *= 2
    return split


def max_units(rows_and_slots, split: int) -> int:
    """Upper bound on the units of rows whose ranges are at most the given slot counts:
    ``rows_and_slots`` pairs ``(rows, slots per row)``."""
    return int(sum(r * -(-s // split) for r, s in rows_and_slots))


def row_ranges(pos: np.ndarray, key0: np.ndarray, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Table-local ``[lo, hi)`` key-slot ranges of decode rows at ``pos`` whose tables start at ``key0``."""
    hi = pos + 1 - key0
    lo = np.maximum(0, pos - window + 1) - key0 if window else np.zeros_like(hi)
    return lo, hi


def fill_units(lo: np.ndarray, hi: np.ndarray, split: int, unit_row: np.ndarray, unit_lo: np.ndarray,
               unit_hi: np.ndarray, row_start: np.ndarray, align: int = UNIT_ALIGN) -> int:
    """Cut rows ``[lo, hi)`` into units of ≤ ``split`` slots, written into the given arrays (which may
    be longer: entries past the last unit become empty units of row 0). Returns the unit count.

    A row needing ``n`` units gets ``n`` about equal ones (a multiple of ``align`` slots, a kernel
    tile, except the last), not ``n-1`` full ones and a sliver: the programs of one row finish together."""
    length = hi - lo
    n = -(-length // split)
    step = min(align, split)
    size = -(-(-(-length // n)) // step) * step
    n = -(-length // size)
    row_start[0] = 0
    np.cumsum(n, out=row_start[1:lo.size + 1])
    row_start[lo.size + 1:] = row_start[lo.size]
    total = int(row_start[lo.size])
    if total > unit_row.size:
        raise ValueError(f"decode rows need {total} work units, the buffer holds {unit_row.size}")
    rows = np.repeat(np.arange(lo.size), n)
    k = np.arange(total) - row_start[rows]
    unit_row[:total] = rows
    unit_lo[:total] = lo[rows] + k * size[rows]
    unit_hi[:total] = np.minimum(unit_lo[:total] + size[rows], hi[rows])
    unit_row[total:] = 0
    unit_lo[total:] = 0
    unit_hi[total:] = 0
    return total


def build_paged_decode(tables, pos, key0, window: int | None, kv_heads: int, device: torch.device,
                       split: int | None = None, token_start: int = 0) -> tuple[PagedDecode, int]:
    """Metadata of one eager decode launch, uploaded in one host→device copy, and the number of key
    slots it reads. ``tables``: each row's block ids from position ``key0[r]`` on; ``split``
    overrides :func:`choose_split` (tests force the merge path with it)."""
    r = len(tables)
    width = max(len(t) for t in tables)
    pos_a, key0_a = np.asarray(pos, dtype=np.int64), np.asarray(key0, dtype=np.int64)
    lo, hi = row_ranges(pos_a, key0_a, window)
    read = int((hi - lo).sum())
    split = split or choose_split(read, kv_heads, num_sms(torch.device(device)))
    per_row = -(-(hi - lo) // split)
    units = int(per_row.sum())  # an upper bound: fill_units may need fewer
    sizes = (r * width, r, r, units, units, units, r + 1)
    buf = np.zeros(sum(sizes), dtype=np.int64)
    parts, o = [], 0
    for n in sizes:
        parts.append(buf[o:o + n])
        o += n
    tab = parts[0].reshape(r, width)
    for j, t in enumerate(tables):
        tab[j, :len(t)] = t
    parts[1][:], parts[2][:] = pos_a, key0_a
    units = fill_units(lo, hi, split, parts[3], parts[4], parts[5], parts[6])
    sizes = sizes[:3] + (units, units, units) + sizes[6:]
    buf = np.concatenate([parts[0], parts[1], parts[2], parts[3][:units], parts[4][:units], parts[5][:units],
                          parts[6]])
    d = torch.from_numpy(buf)
    # Pinned and non-blocking: a pageable copy would wait for every step queued before this one.
    d = d.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else d.to(device)
    dev_parts, o = [], 0
    for n in sizes:
        dev_parts.append(d[o:o + n])
        o += n
    meta = PagedDecode(dev_parts[0].view(r, width), *dev_parts[1:], direct=units == r, token_start=token_start,
                       max_row_units=int(per_row.max()))
    return meta, read
