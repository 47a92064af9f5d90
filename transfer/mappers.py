"""Mappers: turn a matched (source view, destination view) pair into `(src, dst, size)` copies.

A mapper is built once per pool pair from the two page tables and holds a per-block *template*:
fragments `(src_offset, dst_offset, size)` relative to the two slots' addresses. Transfers then
expand it for block-id pairs with numpy (`slot_address + offset`), and merge fragments that are
contiguous on both sides — within a block (all layers of a block-major pool become one copy) and
across blocks (runs of consecutive ids on both sides become one copy).

| kind       | when                                  | fragment                                     |
|------------|---------------------------------------|----------------------------------------------|
| intact     | same heads on both sides (any layout) | each buffer entry whole                      |
| hnd        | head mismatch, `[head, token, dim]`   | one contiguous head range per entry          |
| nhd        | head mismatch, `[token, head, dim]`   | one head range per (entry, token)            |
| replicated | identical bytes on every TP rank      | each buffer entry whole (fan-in owner sends) |

Byte geometry comes from the registered entry sizes: bytes per head = entry size / heads, bytes per
token = entry size / tokens per block; a size that does not divide evenly raises instead of
guessing (sub-byte dtypes stay exact). Head ranges are global: a view holds heads
`[head_start, head_start + kv_heads)`, so the copied heads are the intersection of the two ranges
and duplication (GQA with fewer KV heads than TP ranks) needs no special case here — choosing which
duplicate sends is ownership (`peers.py`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .descs import merge_runs
from .errors import UnsupportedTopology
from .page_table import PageTable, PhysicalPool, PoolView

log = logging.getLogger("splitserve.transfer.mappers")

MAPPER_KINDS = ("intact", "hnd", "nhd", "replicated")
# Warn when one block expands to this many descriptors (NHD head mismatch: ~one per token).
MANY_FRAGMENTS = 256


def mapper_kind(src: PoolView, dst: PoolView) -> str:
    """The mapper for a view pair, or `UnsupportedTopology` when the two cannot be mapped."""
    if src.kind != dst.kind:
        raise UnsupportedTopology(f"mapper-kind mismatch: source view is {src.kind!r}, "
                                  f"destination view is {dst.kind!r}")
    if src.kind == "replicated":
        return "replicated"
    if src.layout != dst.layout:
        raise UnsupportedTopology(f"layout mismatch: source {src.layout}, destination {dst.layout} "
                                  f"(a transposing mapper is not implemented)")
    if (src.head_start, src.kv_heads) == (dst.head_start, dst.kv_heads):
        return "intact"
    return "hnd" if src.layout == "HND" else "nhd"


def head_overlap(src: PoolView, dst: PoolView) -> tuple[int, int]:
    """(first global head, count) both views hold; count 0 when disjoint."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.kv_heads, dst.head_start + dst.kv_heads)
    return lo, max(0, hi - lo)


def _div(total: int, parts: int, what: str) -> int:
    if parts <= 0 or total % parts:
        raise UnsupportedTopology(f"{what}: {total} bytes do not divide into {parts} equal parts")
    return total // parts


@dataclass
class PoolPairMapper:
    """Copy template between source pool `src_pool` and destination pool `dst_pool` for `layers`.

    Invariant: `src_off`, `dst_off`, `size` are equal-length uint64 arrays, merged so that no two
    consecutive fragments are contiguous on both sides; every fragment lies inside one
    (layer, slot) region on each side.
    """

    kind: str
    src_group: int
    dst_group: int
    src_pool_idx: int
    dst_pool_idx: int
    src_pool: PhysicalPool
    dst_pool: PhysicalPool
    layers: tuple[int, ...]
    src_off: np.ndarray
    dst_off: np.ndarray
    size: np.ndarray
    sliding_window: int | None = None

    @property
    def fragments_per_block(self) -> int:
        return int(self.size.shape[0])

    @property
    def bytes_per_block(self) -> int:
        return int(self.size.sum())

    def copies(self, src_ids, dst_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Absolute (src, dst, size) arrays for block-id pairs; pairs with a -1 on either side are
        skipped; contiguous runs are merged."""
        s = np.asarray(src_ids, dtype=np.int64).reshape(-1)
        d = np.asarray(dst_ids, dtype=np.int64).reshape(-1)
        if s.shape != d.shape:
            raise UnsupportedTopology(f"block id lists differ in length: {s.size} vs {d.size}")
        keep = (s >= 0) & (d >= 0)
        s, d = s[keep], d[keep]
        if s.size and (s.max() >= self.src_pool.num_slots or d.max() >= self.dst_pool.num_slots):
            raise UnsupportedTopology(
                f"block id out of range: source max {int(s.max())} (pool has "
                f"{self.src_pool.num_slots}), destination max {int(d.max())} (pool has "
                f"{self.dst_pool.num_slots})")
        if not s.size or not self.size.size:
            z = np.zeros(0, np.uint64)
            return z, z, z
        sb = np.uint64(self.src_pool.base) + np.uint64(self.src_pool.slot_stride) * s.astype(np.uint64)
        db = np.uint64(self.dst_pool.base) + np.uint64(self.dst_pool.slot_stride) * d.astype(np.uint64)
        src = (sb[:, None] + self.src_off[None, :]).ravel()
        dst = (db[:, None] + self.dst_off[None, :]).ravel()
        size = np.broadcast_to(self.size[None, :], (s.size, self.size.size)).ravel()
        return merge_runs(src, dst, np.ascontiguousarray(size))


def build_mapper(src_pt: PageTable, src_group: int, src_view: PoolView, dst_pt: PageTable,
                 dst_group: int, dst_view: PoolView, layers) -> PoolPairMapper:
    """The mapper for `layers` (global ids held by both views) between two views."""
    if src_pt.tokens_per_block != dst_pt.tokens_per_block:
        raise UnsupportedTopology(f"tokens per block differ: {src_pt.tokens_per_block} vs "
                                  f"{dst_pt.tokens_per_block}")
    tpb = src_pt.tokens_per_block
    kind = mapper_kind(src_view, dst_view)
    sp, dp = src_pt.pools[src_view.pool], dst_pt.pools[dst_view.pool]
    s_loc, d_loc = src_view.local_index(), dst_view.local_index()
    h0, nh = head_overlap(src_view, dst_view)
    rows: list[tuple[int, int, int]] = []
    for g in sorted(layers):
        ls, ld = s_loc[g], d_loc[g]
        se, de = src_view.entries_of(ls), dst_view.entries_of(ld)
        if len(se) != len(de):
            raise UnsupportedTopology(f"layer {g}: {len(se)} source buffers vs {len(de)} "
                                      f"destination buffers")
        s_base, d_base = ls * sp.layer_stride, ld * dp.layer_stride
        for (so, ss), (do, ds) in zip(se, de):
            if kind in ("intact", "replicated"):
                if ss != ds:
                    raise UnsupportedTopology(f"layer {g}: buffer sizes differ ({ss} vs {ds} bytes) "
                                              f"for an {kind} copy")
                rows.append((s_base + so, d_base + do, ss))
                continue
            if nh == 0:
                continue
            if kind == "hnd":
                bph_s = _div(ss, src_view.kv_heads, f"layer {g} source buffer per head")
                bph_d = _div(ds, dst_view.kv_heads, f"layer {g} destination buffer per head")
                if bph_s != bph_d:
                    raise UnsupportedTopology(f"layer {g}: bytes per head differ ({bph_s} vs {bph_d})")
                rows.append((s_base + so + (h0 - src_view.head_start) * bph_s,
                             d_base + do + (h0 - dst_view.head_start) * bph_d, nh * bph_s))
            else:  # nhd
                bpt_s = _div(ss, tpb, f"layer {g} source buffer per token")
                bpt_d = _div(ds, tpb, f"layer {g} destination buffer per token")
                bph_s = _div(bpt_s, src_view.kv_heads, f"layer {g} source token per head")
                bph_d = _div(bpt_d, dst_view.kv_heads, f"layer {g} destination token per head")
                if bph_s != bph_d:
                    raise UnsupportedTopology(f"layer {g}: bytes per head differ ({bph_s} vs {bph_d})")
                so2 = s_base + so + (h0 - src_view.head_start) * bph_s
                do2 = d_base + do + (h0 - dst_view.head_start) * bph_d
                for t in range(tpb):
                    rows.append((so2 + t * bpt_s, do2 + t * bpt_d, nh * bph_s))
    arr = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    src_off, dst_off, size = merge_runs(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())
    window = src_pt.groups[src_group].sliding_window
    m = PoolPairMapper(kind=kind, src_group=src_group, dst_group=dst_group,
                       src_pool_idx=src_view.pool, dst_pool_idx=dst_view.pool, src_pool=sp,
                       dst_pool=dp, layers=tuple(sorted(layers)), src_off=src_off, dst_off=dst_off,
                       size=size, sliding_window=window)
    if m.fragments_per_block >= MANY_FRAGMENTS:
        log.warning("%s mapper: %d descriptors per block (head mismatch on a token-major layout); "
                    "a 1k-token prompt needs ~%d descriptors", kind, m.fragments_per_block,
                    m.fragments_per_block * (1024 // tpb))
    return m
