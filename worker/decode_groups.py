"""Decode-row grouping of a step: ``plan_decode_groups`` (which rows share one padded batch) and
``decode_stats`` (the shape of a step's decode attention that ``ModelRunner.last_step_stats`` reports).
Used by the eager step (worker/runner.py) and the CUDA-graph step (worker/graphs.py) alike, so both
plan a batch the same way."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["decode_stats", "plan_decode_groups"]


def plan_decode_groups(need_blocks: Sequence[int], max_groups: int = 3,
                       overhead_blocks: float = 0.0) -> list[np.ndarray]:
    """Partition decode rows into at most ``max_groups`` groups (capped at 3) that each pad to their
    own longest row.

    ``need_blocks[i]`` is how many blocks row ``i`` reads. Returns the row indices of each group,
    groups ordered longest first and rows inside a group longest first (a stable order, so equal
    inputs always give equal plans: every rank of a tensor-parallel group plans alike).

    A group costs ``rows × its longest row`` gathered block-rows plus ``overhead_blocks`` (the extra
    kernels of one more gather + attention, in block-row equivalents). Splits are considered only
    where the power-of-two bucket of the need changes, so within a group padding is bounded by the
    bucket (< 2× a row's own need unless the split was not worth its overhead) and the candidates
    are few (≤ log2 of the longest table), which keeps planning cheap and CUDA-graph keys few."""
    need = np.asarray(need_blocks, dtype=np.int64).reshape(-1)
    order = np.argsort(-need, kind="stable")
    n = order.size
    if n <= 1 or max_groups <= 1:
        return [order]
    srt = need[order]
    bucket = np.left_shift(1, np.ceil(np.log2(np.maximum(srt, 1))).astype(np.int64))
    cuts = (np.flatnonzero(bucket[1:] != bucket[:-1]) + 1).tolist()

    def cost(bounds: tuple[int, ...]) -> float:
        edges = (0,) + bounds + (n,)
        return sum((edges[i + 1] - edges[i]) * int(srt[edges[i]]) for i in range(len(edges) - 1)) \
            + overhead_blocks * (len(edges) - 1)

    best, best_cost = (), cost(())
    for a in cuts:
        c = cost((a,))
        if c < best_cost:
            best, best_cost = (a,), c
        if max_groups >= 3:
            for b in cuts:
                if b > a:
                    c = cost((a, b))
                    if c < best_cost:
                        best, best_cost = (a, b), c
    return np.split(order, list(best))


def decode_stats(rows: int, groups: int, key_slots: int, context_slots: int) -> dict[str, int]:
    """``ModelRunner.last_step_stats`` of a step (see its attribute comment for the keys)."""
    return {"decode_rows": rows, "decode_groups": groups, "decode_key_slots": key_slots,
            "decode_context_slots": context_slots}
