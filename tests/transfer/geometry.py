"""Synthetic ranks for mapper / peer tests: page tables over fake address spaces.

Every rank's pools live at a distinct fake base (`rank_index << 40 | pool << 32`), so copies from
the mappers can be applied to numpy byte buffers by subtracting bases. The logical KV content of a
request is a hash of (layer, k/v, position, head, byte) — duplicated heads hold identical bytes on
every rank that holds them, exactly like a real TP-duplicated cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.page_table import LayerGroup, PageTable, PhysicalPool, PoolView
from transfer.peers import head_range, layer_range, standard_layout
from transfer.rank_info import RankInfo


@dataclass
class Side:
    tp: int
    pp: int
    layout: str          # "NHD" | "HND"
    block_major: bool
    num_slots: int


@dataclass
class Model:
    num_layers: int
    kv_heads: int
    head_bytes: int      # bytes of one head of one token (head_dim × dtype size)
    tpb: int
    groups: list[tuple[int, int]]  # contiguous [start, end) layer groups, same on both sides
    windows: list | None = None    # sliding window per group (None = full attention)


@dataclass
class Rank:
    info: RankInfo
    buffers: list[np.ndarray]  # one per pool
    idx: int
    gmap: list[int]            # rank's group index -> model group index


def build_rank(model: Model, side: Side, tp_rank: int, pp_rank: int, instance: str, idx: int,
               replicated_bytes: int = 0) -> Rank:
    ls, le = layer_range(pp_rank, side.pp, model.num_layers)
    hs, nh = head_range(tp_rank, side.tp, model.kv_heads)
    entry = nh * model.tpb * model.head_bytes
    pools, groups, buffers, gmap = [], [], [], []
    for mgi, (g0, g1) in enumerate(model.groups):
        layers = [x for x in range(g0, g1) if ls <= x < le]
        if not layers:
            continue
        gmap.append(mgi)
        views = []
        for kind in (["kv", "replicated"] if replicated_bytes else ["kv"]):
            n = len(layers)
            region = 2 * entry if kind == "kv" else replicated_bytes
            if side.block_major:
                layer_stride, slot_stride = region, n * region
            else:
                layer_stride, slot_stride = side.num_slots * region, region
            base = (idx + 1) << 40 | (len(pools) + 1) << 32
            pool = PhysicalPool(base=base, layer_stride=layer_stride, slot_stride=slot_stride,
                                slot_bytes=region, num_slots=side.num_slots, layers=n)
            if kind == "kv":
                entries = tuple((i, c * entry, entry) for i in range(n) for c in (0, 1))
            else:
                entries = tuple((i, 0, replicated_bytes) for i in range(n))
            views.append(PoolView(pool=len(pools), role=frozenset([kind]), layer_ids=tuple(layers),
                                  buffer_entries=entries, layout=side.layout, kind=kind,
                                  head_start=hs, kv_heads=nh))
            pools.append(pool)
            buffers.append(np.zeros(pool.extent, np.uint8))
        window = model.windows[mgi] if model.windows else None
        groups.append(LayerGroup(layer_ids=tuple(layers), views=tuple(views), sliding_window=window))
    pt = PageTable(tokens_per_block=model.tpb, pools=tuple(pools), groups=tuple(groups),
                   dtype="bytes").validate()
    info = RankInfo(instance_id=instance, role="x", endpoint="", agent_kind="test",
                    agent_name=f"{instance}-{idx}", agent_desc=b"", page_table=pt,
                    num_layers=model.num_layers, total_kv_heads=model.kv_heads, layer_start=ls,
                    layer_end=le, head_start=hs, kv_heads=nh, tp_size=side.tp, tp_rank=tp_rank,
                    pp_size=side.pp, pp_rank=pp_rank,
                    instance_layout=standard_layout(model.num_layers, model.kv_heads, side.tp,
                                                    side.pp))
    return Rank(info, buffers, idx, gmap)


def build_instance(model: Model, side: Side, instance: str, first_idx: int, replicated_bytes=0):
    return [build_rank(model, side, tp, pp, instance, first_idx + pp * side.tp + tp, replicated_bytes)
            for pp in range(side.pp) for tp in range(side.tp)]


def logical_value(layer, c, pos, head, b):
    x = (layer * 1_000_003 + c * 7919 + pos * 104_729 + head * 31 + b * 13 + 0x5bd1) & 0xFFFFFFFF
    x = (x ^ (x >> 13)) * 0x5BD1E995 & 0xFFFFFFFF
    return ((x ^ (x >> 15)) & 0xFF).astype(np.uint8)


def kv_elements(model: Model, rank: Rank, block_ids_per_group: list[list[int]]):
    """For every logical KV byte the rank holds in the request's blocks: (pool, offset, value).
    Computed from first principles (layout rules), independently of the mappers."""
    pt = rank.info.page_table
    out_pool, out_off, out_val = [], [], []
    for gi, g in enumerate(pt.groups):
        ids = block_ids_per_group[rank.gmap[gi]]
        for v in g.views:
            if v.kind != "kv":
                continue
            pool = pt.pools[v.pool]
            nh, T, B = v.kv_heads, model.tpb, model.head_bytes
            entry = nh * T * B
            for li, layer in enumerate(v.layer_ids):
                for bi, slot in enumerate(ids):
                    if slot < 0:
                        continue
                    c, t, h, b = np.meshgrid(np.arange(2), np.arange(T), np.arange(nh), np.arange(B),
                                             indexing="ij")
                    c, t, h, b = c.ravel(), t.ravel(), h.ravel(), b.ravel()
                    inner = (h * T + t) * B + b if v.layout == "HND" else (t * nh + h) * B + b
                    off = li * pool.layer_stride + slot * pool.slot_stride + c * entry + inner
                    val = logical_value(layer, c, bi * T + t, v.head_start + h, b)
                    out_pool.append(np.full(off.size, v.pool))
                    out_off.append(off)
                    out_val.append(val)
    if not out_off:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0, np.uint8)
    return np.concatenate(out_pool), np.concatenate(out_off), np.concatenate(out_val)


def replicated_elements(model: Model, rank: Rank, block_ids_per_group, nbytes: int):
    pt = rank.info.page_table
    out_pool, out_off, out_val = [], [], []
    for gi, g in enumerate(pt.groups):
        ids = block_ids_per_group[rank.gmap[gi]]
        for v in g.views:
            if v.kind != "replicated":
                continue
            pool = pt.pools[v.pool]
            for li, layer in enumerate(v.layer_ids):
                for bi, slot in enumerate(ids):
                    if slot < 0:
                        continue
                    b = np.arange(nbytes)
                    out_pool.append(np.full(nbytes, v.pool))
                    out_off.append(li * pool.layer_stride + slot * pool.slot_stride + b)
                    out_val.append(logical_value(layer, 9, bi, 0, b))
    if not out_off:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0, np.uint8)
    return np.concatenate(out_pool), np.concatenate(out_off), np.concatenate(out_val)


def fill(rank: Rank, pools, offs, vals) -> None:
    for p in np.unique(pools):
        m = pools == p
        rank.buffers[int(p)][offs[m]] = vals[m]


def locate(ranks: list[Rank], addr: int):
    idx = (addr >> 40) - 1
    pool = ((addr >> 32) & 0xFF) - 1
    r = next(r for r in ranks if r.idx == idx)
    base = r.info.page_table.pools[pool].base
    return r, pool, addr - base


def realize(rank: Rank, shared: bool = False) -> Rank:
    """Give a synthetic rank real memory: one buffer per pool, the page table rebased onto it."""
    import msgspec

    from transfer.memory import alloc_shared_array

    pt = rank.info.page_table
    bufs, pools = [], []
    for p in pt.pools:
        b = alloc_shared_array(p.extent) if shared else np.zeros(p.extent, np.uint8)
        bufs.append(b)
        pools.append(msgspec.structs.replace(p, base=int(b.ctypes.data), total_bytes=p.extent))
    pt = msgspec.structs.replace(pt, pools=tuple(pools))
    info = msgspec.structs.replace(rank.info, page_table=pt)
    return Rank(info, bufs, rank.idx, rank.gmap)
