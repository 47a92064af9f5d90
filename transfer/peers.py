"""Which ranks talk to which, and who owns each destination.

Both ends run these same pure functions on the same RankInfos, so the generation side's set of
expected writers and the context side's set of destinations can never disagree.

- A (source, destination) rank pair are *peers* when they share at least one layer (PP overlap) and
  one KV head (TP overlap). Every peer sends a final result for a request — with data only where it
  owns the destination — so "all expected writers reported" is well defined on the receiver.
- Ownership, exactly one writer per destination byte:
  * kv views with head duplication (fewer KV heads than source TP ranks, `dup` ranks holding each
    head): the duplicate with `src.tp_rank % dup == (dst.dp_rank + dst.tp_rank) % dup` sends —
    rotated by the destination so the extra traffic spreads;
  * replicated views (identical on every TP rank): fan-in election among the candidates — the
    source ranks of the same PP stage that are peers of the destination, in flat-rank order — the
    one at index `(dst.dp_rank + dst.tp_rank) % len(candidates)` sends. (The reference's
    `src.tp % ratio == dst.dp % ratio` rule assumes TP ranks pair by rank ranges; with head
    duplication peers pair by heads and that rule elects two writers for one destination.)
- Pool matching: the destination group holding a source group's layers must be unique (and vice
  versa) — a group matching several peer groups means the two sides group layers differently, which
  raises rather than transferring only the first overlap. Within it, destination views with the same
  role and overlapping layers match; every source layer must find a destination.
- CP > 1 is refused (tokens would be split across ranks); ranks are still flattened CP-minor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UnsupportedTopology
from .mappers import PoolPairMapper, build_mapper
from .page_table import PageTable, PoolView
from .rank_info import RankInfo


def layer_range(pp_rank: int, pp_size: int, num_layers: int) -> tuple[int, int]:
    """[start, end) of a PP stage: an even split, earlier stages take one extra layer when uneven."""
    if not 0 <= pp_rank < pp_size or num_layers < pp_size:
        raise UnsupportedTopology(f"pp_rank {pp_rank} of pp_size {pp_size} over {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def head_range(tp_rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, int]:
    """(head_start, kv_heads) of a TP rank. With fewer heads than ranks each head is duplicated on
    `tp_size // total_kv_heads` consecutive ranks."""
    if not 0 <= tp_rank < tp_size:
        raise UnsupportedTopology(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise UnsupportedTopology(f"{total_kv_heads} KV heads do not split over TP {tp_size}")
        n = total_kv_heads // tp_size
        return tp_rank * n, n
    if tp_size % total_kv_heads:
        raise UnsupportedTopology(f"TP {tp_size} is not a multiple of {total_kv_heads} KV heads")
    return tp_rank // (tp_size // total_kv_heads), 1


def duplicate_factor(info: RankInfo) -> int:
    return max(1, info.tp_per_dp // max(1, info.total_kv_heads))


def layers_overlap(a: RankInfo, b: RankInfo) -> range:
    lo, hi = max(a.layer_start, b.layer_start), min(a.layer_end, b.layer_end)
    return range(lo, max(lo, hi))


def heads_overlap(a: RankInfo, b: RankInfo) -> bool:
    return max(a.head_start, b.head_start) < min(a.head_start + a.kv_heads, b.head_start + b.kv_heads)


def _check_cp(info: RankInfo) -> None:
    if info.cp_size != 1:
        raise UnsupportedTopology(f"{info.key}: context parallelism (cp_size={info.cp_size}) splits "
                                  f"tokens across ranks; KV transfer supports cp_size=1 only")


def are_peers(src: RankInfo, dst: RankInfo) -> bool:
    _check_cp(src)
    _check_cp(dst)
    return bool(layers_overlap(src, dst)) and heads_overlap(src, dst)


def owns_kv(src: RankInfo, dst: RankInfo) -> bool:
    dup = duplicate_factor(src)
    return dup == 1 or src.tp_rank % dup == (dst.dp_rank + dst.tp_rank) % dup


def owns_replicated(src: RankInfo, dst: RankInfo) -> bool:
    layout = src.instance_layout or ((src.layer_start, src.layer_end, src.head_start, src.kv_heads),)
    me = src.flat_rank if src.instance_layout else 0
    cands = [r for r, (ls, le, hs, nh) in enumerate(layout)
             if (ls, le) == (src.layer_start, src.layer_end)
             and max(ls, dst.layer_start) < min(le, dst.layer_end)
             and max(hs, dst.head_start) < min(hs + nh, dst.head_start + dst.kv_heads)]
    if not cands:
        return False
    return cands[(dst.dp_rank + dst.tp_rank) % len(cands)] == me


def match_views(src_pt: PageTable, dst_pt: PageTable, layers) -> list[tuple[int, PoolView, int, PoolView, frozenset]]:
    """(src_group, src_view, dst_group, dst_view, layers) for every matched view pair over `layers`
    (the global layers both ranks hold)."""
    want = set(layers)
    out = []
    for sgi, sg in enumerate(src_pt.groups):
        s_layers = set(sg.layer_ids) & want
        if not s_layers:
            continue
        try:
            dgs = {dst_pt.group_of_layer(x) for x in s_layers}
        except KeyError as e:
            raise UnsupportedTopology(f"destination holds no group for layer {e.args[0]}") from None
        if len(dgs) != 1:
            raise UnsupportedTopology(
                f"source group {sgi} (layers {sorted(s_layers)}) maps onto {len(dgs)} destination "
                f"groups {sorted(dgs)}: the two sides group layers differently")
        dgi = dgs.pop()
        dg = dst_pt.groups[dgi]
        stray = (set(dg.layer_ids) & want) - set(sg.layer_ids)
        if stray:
            raise UnsupportedTopology(
                f"destination group {dgi} also holds layers {sorted(stray)} that source group {sgi} "
                f"does not: the two sides group layers differently")
        if sg.sliding_window != dg.sliding_window:
            raise UnsupportedTopology(f"layers {sorted(s_layers)}: sliding window {sg.sliding_window} "
                                      f"vs {dg.sliding_window}")
        for sv in sg.views:
            sv_layers = set(sv.layer_ids) & s_layers
            if not sv_layers:
                continue
            covered: set[int] = set()
            for dv in dg.views:
                if dv.role != sv.role:
                    continue
                common = sv_layers & set(dv.layer_ids)
                if common:
                    out.append((sgi, sv, dgi, dv, frozenset(common)))
                    covered |= common
            if covered != sv_layers:
                raise UnsupportedTopology(
                    f"no destination pool with role {sorted(sv.role)} holds layers "
                    f"{sorted(sv_layers - covered)}")
    return out


@dataclass
class PairPlan:
    """What `src` sends to `dst`: the mappers of the view pairs it owns. `peers` false means the
    two share no layer or head (no result message either)."""

    src_key: str
    dst_key: str
    peers: bool
    mappers: list[PoolPairMapper] = field(default_factory=list)

    @property
    def sends_data(self) -> bool:
        return any(m.size.size for m in self.mappers)


def plan_pair(src: RankInfo, dst: RankInfo) -> PairPlan:
    if not are_peers(src, dst):
        return PairPlan(src.key, dst.key, False)
    plan = PairPlan(src.key, dst.key, True)
    kv_owner, rep_owner = owns_kv(src, dst), owns_replicated(src, dst)
    for sgi, sv, dgi, dv, layers in match_views(src.page_table, dst.page_table,
                                                layers_overlap(src, dst)):
        if (sv.kind == "replicated" and not rep_owner) or (sv.kind == "kv" and not kv_owner):
            continue
        plan.mappers.append(build_mapper(src.page_table, sgi, sv, dst.page_table, dgi, dv, layers))
    return plan


def peer_flat_ranks(me: RankInfo, other: RankInfo) -> list[int]:
    """Flat ranks of `other`'s instance (from its `instance_layout`) that are peers of `me`."""
    _check_cp(me)
    _check_cp(other)
    layout = other.instance_layout or ((other.layer_start, other.layer_end, other.head_start,
                                        other.kv_heads),)
    out = []
    for r, (ls, le, hs, nh) in enumerate(layout):
        if max(ls, me.layer_start) < min(le, me.layer_end) and \
                max(hs, me.head_start) < min(hs + nh, me.head_start + me.kv_heads):
            out.append(r)
    return out


def standard_layout(num_layers: int, total_kv_heads: int, tp_size: int, pp_size: int):
    """`instance_layout` of the standard sharding (`layer_range` × `head_range`), CP = 1."""
    out = []
    for pp in range(pp_size):
        ls, le = layer_range(pp, pp_size, num_layers)
        for tp in range(tp_size):
            hs, nh = head_range(tp, tp_size, total_kv_heads)
            out.append((ls, le, hs, nh))
    return tuple(out)


def peer_ranks(me: RankInfo, others: list[RankInfo]) -> list[RankInfo]:
    """The ranks of `others` that are peers of `me` (either direction: the relation is symmetric)."""
    return [o for o in others if are_peers(me, o)]
