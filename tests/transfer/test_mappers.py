"""Mappers and peer ownership against a brute-force byte-by-byte reference.

Random geometries (layers, KV heads, bytes per head, tokens per block, layer groups, TP and PP on
each side, HND/NHD, block-major or layer-major pools, replicated pools) are built as fake address
spaces; every (source rank, destination rank) plan is applied byte by byte to numpy buffers. Each
destination byte the destination rank holds must end up with the logical value, written exactly
once, and nothing else may be written.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transfer.geometry import (Model, Side, build_instance, fill, kv_elements, locate,
                                     replicated_elements)
from transfer.errors import UnsupportedTopology
from transfer.mappers import build_mapper
from transfer.page_table import LayerGroup, PageTable, PhysicalPool, PoolView
from transfer.peers import head_range, layer_range, peer_flat_ranks, plan_pair, standard_layout
from transfer.rank_info import flatten_rank


def _tp_choices(heads):
    return [t for t in (1, 2, 4) if heads % t == 0 or t % heads == 0]


@st.composite
def geometries(draw):
    L = draw(st.integers(1, 4))
    H = draw(st.sampled_from([1, 2, 4]))
    cuts = sorted(draw(st.sets(st.integers(1, L - 1), max_size=2))) if L > 1 else []
    bounds = [0, *cuts, L]
    groups = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    model = Model(num_layers=L, kv_heads=H, head_bytes=draw(st.sampled_from([1, 2, 3, 4, 8])),
                  tpb=draw(st.sampled_from([1, 2, 4])), groups=groups)
    layout = draw(st.sampled_from(["NHD", "HND"]))
    nblocks = draw(st.integers(1, 5))

    def side():
        return Side(tp=draw(st.sampled_from(_tp_choices(H))), pp=draw(st.integers(1, min(L, 3))),
                    layout=layout, block_major=draw(st.booleans()),
                    num_slots=nblocks + draw(st.integers(0, 4)))

    src, dst = side(), side()

    def ids(num_slots):
        out = []
        for _ in groups:
            if draw(st.booleans()):
                start = draw(st.integers(0, num_slots - nblocks))
                out.append(list(range(start, start + nblocks)))
            else:
                out.append(draw(st.permutations(range(num_slots)))[:nblocks])
        return out

    rep = draw(st.sampled_from([0, 0, 5, 16]))
    return model, src, dst, ids(src.num_slots), ids(dst.num_slots), rep


def run_transfer(model, src_side, dst_side, src_ids, dst_ids, rep):
    srcs = build_instance(model, src_side, "ctx", 0, rep)
    dsts = build_instance(model, dst_side, "gen", 100, rep)
    for s in srcs:
        fill(s, *kv_elements(model, s, src_ids))
        if rep:
            fill(s, *replicated_elements(model, s, src_ids, rep))
    writes = {(d.idx, p): np.zeros(b.size, np.int32) for d in dsts for p, b in enumerate(d.buffers)}
    ndesc = 0
    for s in srcs:
        for d in dsts:
            plan = plan_pair(s.info, d.info)
            for m in plan.mappers:
                sg, dg = s.gmap[m.src_group], d.gmap[m.dst_group]
                src, dst, size = m.copies(src_ids[sg], dst_ids[dg])
                ndesc += len(size)
                for a, b, n in zip(src.tolist(), dst.tolist(), size.tolist()):
                    sr, sp, so = locate(srcs, a)
                    dr, dp, do = locate(dsts, b)
                    assert sr is s and dr is d
                    assert so + n <= sr.buffers[sp].size and do + n <= dr.buffers[dp].size
                    dr.buffers[dp][do:do + n] = sr.buffers[sp][so:so + n]
                    writes[(d.idx, dp)][do:do + n] += 1
    return srcs, dsts, writes, ndesc


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries())
def test_every_destination_byte_written_once_with_the_right_value(g):
    model, src_side, dst_side, src_ids, dst_ids, rep = g
    _srcs, dsts, writes, _ = run_transfer(model, src_side, dst_side, src_ids, dst_ids, rep)
    for d in dsts:
        expected = [kv_elements(model, d, dst_ids)]
        if rep:
            expected.append(replicated_elements(model, d, dst_ids, rep))
        total = 0
        for pools, offs, vals in expected:
            for p in np.unique(pools):
                m = pools == p
                got = d.buffers[int(p)][offs[m]]
                assert (got == vals[m]).all(), f"rank {d.idx} pool {p}: wrong bytes"
                assert (writes[(d.idx, int(p))][offs[m]] == 1).all(), \
                    f"rank {d.idx} pool {p}: a byte was written {writes[(d.idx, int(p))][offs[m]].max()} times"
            total += offs.size
        written = sum(int(w.sum()) for (idx, _), w in writes.items() if idx == d.idx)
        assert written == total, "bytes outside the request's blocks were written"


def test_intact_block_major_merges_consecutive_runs_into_one_descriptor():
    model = Model(num_layers=4, kv_heads=2, head_bytes=8, tpb=4, groups=[(0, 4)])
    side = Side(tp=1, pp=1, layout="NHD", block_major=True, num_slots=16)
    ids_src = [[2, 3, 4, 5, 9, 10]]
    ids_dst = [[7, 8, 9, 10, 0, 1]]
    *_, ndesc = run_transfer(model, side, side, ids_src, ids_dst, 0)
    assert ndesc == 2  # two runs contiguous on both sides
    srcs = build_instance(model, side, "a", 0)
    dsts = build_instance(model, side, "b", 10)
    m = plan_pair(srcs[0].info, dsts[0].info).mappers[0]
    assert m.kind == "intact" and m.fragments_per_block == 1
    assert m.bytes_per_block == 4 * 2 * 2 * 4 * 8


def test_descriptor_counts_per_mapper_kind():
    model = Model(num_layers=4, kv_heads=4, head_bytes=8, tpb=4, groups=[(0, 4)])
    bm = Side(tp=1, pp=1, layout="HND", block_major=True, num_slots=8)
    # PP2 -> PP1: half the layers per source rank, contiguous in the block: one per block per rank
    pp2 = Side(tp=1, pp=2, layout="HND", block_major=True, num_slots=8)
    *_, ndesc = run_transfer(model, pp2, bm, [[0, 1, 2]], [[0, 1, 2]], 0)
    assert ndesc == 2 * 3
    # TP1 -> TP2 HND: one contiguous head range per (layer, K/V) per block
    tp2 = Side(tp=2, pp=1, layout="HND", block_major=True, num_slots=8)
    *_, ndesc = run_transfer(model, bm, tp2, [[0, 1, 2]], [[5, 6, 7]], 0)
    assert ndesc == 2 * (4 * 2 * 3)
    # TP1 -> TP2 NHD: one fragment per (layer, K/V, token)
    bmn = Side(tp=1, pp=1, layout="NHD", block_major=True, num_slots=8)
    tp2n = Side(tp=2, pp=1, layout="NHD", block_major=True, num_slots=8)
    *_, ndesc = run_transfer(model, bmn, tp2n, [[0, 1, 2]], [[5, 6, 7]], 0)
    assert ndesc == 2 * (4 * 2 * 4 * 3)


def test_head_duplication_elects_exactly_one_sender_per_destination():
    model = Model(num_layers=2, kv_heads=2, head_bytes=4, tpb=2, groups=[(0, 2)])
    src = Side(tp=4, pp=1, layout="NHD", block_major=True, num_slots=4)
    dst = Side(tp=1, pp=1, layout="NHD", block_major=True, num_slots=4)
    srcs = build_instance(model, src, "ctx", 0)
    dsts = build_instance(model, dst, "gen", 10)
    senders = [s.info.tp_rank for s in srcs if plan_pair(s.info, dsts[0].info).sends_data]
    assert senders == [0, 2]  # one of each duplicate pair (heads 0 and 1)
    # every source rank is a peer (it will send a final result, with or without data)
    assert all(plan_pair(s.info, dsts[0].info).peers for s in srcs)
    assert peer_flat_ranks(dsts[0].info, srcs[0].info) == [0, 1, 2, 3]


def test_group_mismatch_fails_loudly():
    def pt(groups):
        pools, gl = [], []
        for i, (a, b) in enumerate(groups):
            n = b - a
            pools.append(PhysicalPool(base=(i + 1) << 32, layer_stride=16, slot_stride=16 * n,
                                      slot_bytes=16, num_slots=4, layers=n))
            gl.append(LayerGroup(layer_ids=tuple(range(a, b)), views=(PoolView(
                pool=i, role=frozenset(["kv"]), layer_ids=tuple(range(a, b)),
                buffer_entries=tuple((j, 0, 16) for j in range(n)), kv_heads=1),)))
        return PageTable(tokens_per_block=1, pools=tuple(pools), groups=tuple(gl)).validate()

    from transfer.peers import match_views

    with pytest.raises(UnsupportedTopology, match="group layers differently"):
        match_views(pt([(0, 4)]), pt([(0, 2), (2, 4)]), range(4))
    with pytest.raises(UnsupportedTopology, match="group layers differently"):
        match_views(pt([(0, 2), (2, 4)]), pt([(0, 4)]), range(4))
    assert len(match_views(pt([(0, 2), (2, 4)]), pt([(0, 2), (2, 4)]), range(4))) == 2


def test_uneven_buffers_per_layer_are_refused():
    pool = PhysicalPool(base=1 << 32, layer_stride=64, slot_stride=128, slot_bytes=64, num_slots=2,
                        layers=2)
    view = PoolView(pool=0, role=frozenset(["kv"]), layer_ids=(0, 1),
                    buffer_entries=((0, 0, 16), (1, 0, 16), (1, 16, 16), (1, 32, 16)))
    with pytest.raises(UnsupportedTopology, match="same number of buffer entries"):
        PageTable(tokens_per_block=1, pools=(pool,), groups=(LayerGroup((0, 1), (view,)),)).validate()


def test_bytes_per_head_must_divide():
    model = Model(num_layers=1, kv_heads=2, head_bytes=4, tpb=1, groups=[(0, 1)])
    a = build_instance(model, Side(1, 1, "HND", True, 2), "a", 0)[0].info
    b = build_instance(model, Side(2, 1, "HND", True, 2), "b", 10)[0].info
    bad_view = a.page_table.groups[0].views[0]
    bad_view = PoolView(pool=0, role=bad_view.role, layer_ids=bad_view.layer_ids,
                        buffer_entries=((0, 0, 7), (0, 7, 7)), layout="HND", head_start=0, kv_heads=2)
    pt = PageTable(tokens_per_block=1, pools=a.page_table.pools,
                   groups=(LayerGroup((0,), (bad_view,)),)).validate()
    with pytest.raises(UnsupportedTopology, match="do not divide"):
        build_mapper(pt, 0, bad_view, b.page_table, 0, b.page_table.groups[0].views[0], [0])


def test_layout_mismatch_raises():
    model = Model(num_layers=1, kv_heads=2, head_bytes=4, tpb=2, groups=[(0, 1)])
    a = build_instance(model, Side(1, 1, "HND", True, 2), "a", 0)[0].info
    b = build_instance(model, Side(1, 1, "NHD", True, 2), "b", 10)[0].info
    with pytest.raises(UnsupportedTopology, match="layout mismatch"):
        plan_pair(a, b)


def test_cp_minor_flattening_and_ranges():
    # pp·(TP·CP) + tp·CP + cp: with tp=2, cp=2 the TP-minor formula would swap (tp=1,cp=0)/(tp=0,cp=1)
    assert [flatten_rank(0, tp, cp, 2, 2) for tp in (0, 1) for cp in (0, 1)] == [0, 1, 2, 3]
    assert flatten_rank(1, 0, 0, 2, 2) == 4
    assert [layer_range(r, 3, 8) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [head_range(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [head_range(r, 2, 8) for r in range(2)] == [(0, 4), (4, 4)]
    assert len(standard_layout(4, 2, 2, 2)) == 4
    with pytest.raises(UnsupportedTopology):
        head_range(0, 3, 2)
