"""Triton kernels over the worker's block pool (imported only by the ``triton`` attention backend).

Pool layout (worker/runner.py): ``kv_cache[block, layer, kv, token, kv_head, dim]``, contiguous. A
layer's K of block ``b``, token ``t``, head ``h`` starts at ``kv_cache[:, layer, 0]`` +
``b·stride(0) + t·stride(3) + h·head_dim``; V is the same offset from ``kv_cache[:, layer, 1]``. The
kernels compute these addresses from each row's block table, so K/V are read where they lie: no
gathered copy of a context is ever made.

Design borrowed from the flash-decoding kernels of vLLM (vllm/attention/ops/
triton_decode_attention.py, ``_fwd_grouped_kernel_stage1`` / ``_fwd_kernel_stage2``, itself from
SGLang and LightLLM): query heads of one KV head are the rows of a ``tl.dot`` tile (padded to 16),
so each K/V tile is loaded once for the whole GQA group; online softmax in fp32 with base-2
exponentials; partial outputs plus their log-sum-exp merged by a second kernel. Differences: work
units are explicit (:mod:`worker.attention.plan`) rather than a fixed split count per row, the
sliding window is a key range, and the merge is skipped when every row is one unit.

All kernels accept any block size (``PAGE`` is a compile-time constant; powers of two turn the
divisions into shifts) and any head_dim (padded to a power of two ≥ 16 with masks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.attention import _interp  # noqa: F401  (Triton interpreter fix-up, before any kernel runs)
from worker.attention.plan import PagedDecode
from worker.attention.triton_linear import (MAX_M, gate_up_silu, linear_m1, linear_partials, merged_linear_partials,
                                            merges_units, use_small_m)

__all__ = ["rope_store", "paged_decode", "paged_decode_units", "paged_prefill", "add_rms_norm", "embed_rms_norm",
           "silu_mul", "use_small_m", "linear_partials", "gate_up_silu", "merged_linear_partials", "merges_units",
           "linear_m1", "decode_config"]

_LOG2E = 1.4426950408889634
#: Keys per tile. Shapes picked from ``ptxas -v`` and the TTGIR for sm_90 with the launcher's
#: specialisation (16-aligned pointers and strides), then timed on the H200 (bench/results/history/worker.md, "decode
#: kernels (issue 17, third pass)"): decode 128 keys × 16 query rows, 4 warps at head_dim ≤ 64 (64 keys,
#: 8 warps at 128), K/V/table loads software-pipelined with cp.async, no spills — 128 keys were 1–16%
#: faster than 64 at batch 1–32 × 1k, batch 1 × 32k and one 32k row + 30 short ones, 3–7% slower at
#: batch 8 × 32k and batch 32 × 8k (where the step is long and bandwidth-bound); prefill 128 query rows × 64 keys,
#: 8 warps, wgmma, 121 registers (4 warps took 255). vLLM's/SGLang's grouped decode kernel uses 32
#: keys × 16 rows, 4 warps, 2 stages.
DECODE_BLOCK_N = 128
PREFILL_BLOCK_N = 64


def decode_config(block_d: int) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` of the decode kernel at a padded head_dim."""
    return (DECODE_BLOCK_N, 4, 2) if block_d <= 64 else (64, 8, 2)




def _prec(q: torch.Tensor) -> str | None:
    """fp32 models keep fp32 products (``tl.dot`` would use TF32 on the GPU); bf16/fp16 take the default."""
    return "ieee" if q.dtype == torch.float32 else None


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------- RoPE + KV store


@triton.jit
def _rope_store_kernel(QKV, Cos, Sin, K, V, SlotBlock, SlotOff, QOut,
                       stride_qkv, stride_cos, stride_blk, stride_tok, stride_qo, stride_split,
                       NQ: tl.constexpr, NKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, NSPLIT: tl.constexpr):
    """One program per (token, head slot): slot < NQ rotates a query head into QOut, the next NKV
    rotate key heads into the cache, the last NKV copy value heads into the cache. ``NSPLIT > 0``:
    ``QKV`` holds that many fp32 split-K partials of the qkv product (worker/attention/
    triton_linear.py), summed and rounded to the model dtype here."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    m = offs < HALF
    src = QKV + t * stride_qkv + h * HEAD_DIM
    # The cache slot is loaded before the product it stores, not after the rotation: its round trip
    # then overlaps the product's instead of following it (bench/RESULTS.md, "issue 17, seventh pass").
    blk = tl.load(SlotBlock + t).to(tl.int64)
    off = tl.load(SlotOff + t).to(tl.int64)
    if NSPLIT > 0:
        a1 = tl.zeros([BLOCK_HALF], tl.float32)
        a2 = tl.zeros([BLOCK_HALF], tl.float32)
        for sp in tl.static_range(NSPLIT):
            a1 += tl.load(src + sp * stride_split + offs, mask=m, other=0.0)
            a2 += tl.load(src + sp * stride_split + HALF + offs, mask=m, other=0.0)
        x1 = a1.to(QOut.dtype.element_ty)
        x2 = a2.to(QOut.dtype.element_ty)
    else:
        x1 = tl.load(src + offs, mask=m, other=0.0)
        x2 = tl.load(src + HALF + offs, mask=m, other=0.0)
    if h < NQ + NKV:
        c1 = tl.load(Cos + t * stride_cos + offs, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + t * stride_cos + HALF + offs, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + t * stride_cos + offs, mask=m, other=0.0).to(tl.float32)  # sin, first half negated
        s2 = tl.load(Sin + t * stride_cos + HALF + offs, mask=m, other=0.0).to(tl.float32)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        y1 = (f1 * c1 + f2 * s1).to(x1.dtype)
        y2 = (f2 * c2 + f1 * s2).to(x1.dtype)
    else:
        y1 = x1
        y2 = x2
    if h < NQ:
        dst = QOut + t * stride_qo + h * HEAD_DIM
    else:
        base = blk * stride_blk + off * stride_tok
        if h < NQ + NKV:
            dst = K + base + (h - NQ) * HEAD_DIM
        else:
            dst = V + base + (h - NQ - NKV) * HEAD_DIM
    tl.store(dst + offs, y1, mask=m)
    tl.store(dst + HALF + offs, y2, mask=m)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, kv_cache: torch.Tensor,
               layer: int, slot_block: torch.Tensor, slot_offset: torch.Tensor, num_heads: int,
               num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate q and k of ``qkv [n, (H + 2·Hkv)·D]`` (RoPE, "rotate half"), store k and v into their
    cache slots and return the rotated q ``[n, H, D]``: the work of ``apply_rope`` plus the two
    index-put stores of the torch path in one launch. ``qkv`` may be split-K partials
    ``[S, n, (H + 2·Hkv)·D]`` (fp32), summed here."""
    nsplit = qkv.shape[0] if qkv.dim() == 3 else 0
    n = qkv.shape[-2]
    q = torch.empty(n, num_heads, head_dim, dtype=kv_cache.dtype, device=qkv.device)
    if n == 0:
        return q
    if cos.stride() != sin_signed.stride() or cos.stride(1) != 1:
        raise ValueError(f"cos/sin tables must be row-major alike, found strides {cos.stride()} and {sin_signed.stride()}")
    half = head_dim // 2
    _rope_store_kernel[(n, num_heads + 2 * num_kv_heads)](
        qkv, cos, sin_signed, kv_cache[:, layer, 0], kv_cache[:, layer, 1], slot_block, slot_offset, q,
        qkv.stride(-2), cos.stride(0), kv_cache.stride(0), kv_cache.stride(3), q.stride(0),
        qkv.stride(0) if nsplit else 0,
        NQ=num_heads, NKV=num_kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        NSPLIT=nsplit, num_warps=1)
    return q


# ----------------------------------------------------------------------------- decode


@triton.jit
def _decode_kernel(Q, K, V, Tables, Pos, Key0, URow, ULo, UHi, Out, MidO, MidL,
                   stride_qt, stride_qh, stride_blk, stride_tok, stride_tab,
                   stride_ot, stride_oh, stride_mu, stride_mh, stride_lu, qk_scale,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DIRECT: tl.constexpr,
                   PREC: tl.constexpr):
    u = tl.program_id(0)
    kvh = tl.program_id(1)
    # The three unit loads are independent (one round trip), the table then K/V depend on them.
    lo = tl.load(ULo + u).to(tl.int32)
    hi = tl.load(UHi + u).to(tl.int32)
    row = tl.load(URow + u)
    if hi > lo:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_h
        qm = mask_h[:, None] & mask_d[None, :]
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=qm, other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        tab = Tables + row * stride_tab
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            blk = tl.load(tab + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
            off = blk * stride_blk + (offs_n % PAGE).to(tl.int64) * stride_tok + kvh * HEAD_DIM
            kvm = valid[:, None] & mask_d[None, :]
            k = tl.load(K + off[:, None] + offs_d[None, :], mask=kvm, other=0.0)
            v = tl.load(V + off[:, None] + offs_d[None, :], mask=kvm, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            # Slot ``start`` is visible (plan.py), so every row of the tile has a finite maximum.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        if DIRECT:
            o_ptr = Out + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptr, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=qm)
        else:
            tl.store(MidO + u * stride_mu + heads[:, None] * stride_mh + offs_d[None, :], acc / l_i[:, None], mask=qm)
            tl.store(MidL + u * stride_lu + heads, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _merge_kernel(MidO, MidL, RowStart, Out, stride_mu, stride_mh, stride_lu, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_U: tl.constexpr):
    """One program per (row, query head): merge the row's units by log-sum-exp, ``BLOCK_U`` units per
    load (the launcher sizes it to the longest row's unit count) so a 32k-token row's few dozen
    partials cost one round trip, not one per unit."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    us = tl.load(RowStart + row).to(tl.int32)
    ue = tl.load(RowStart + row + 1).to(tl.int32)
    m = -float("inf")
    s = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for u0 in range(us, ue, BLOCK_U):
        offs_u = u0 + tl.arange(0, BLOCK_U)
        mu = offs_u < ue
        lse = tl.load(MidL + offs_u * stride_lu + h, mask=mu, other=float("-inf"))
        o = tl.load(MidO + offs_u[:, None] * stride_mu + h * stride_mh + offs_d[None, :],
                    mask=mu[:, None] & mask_d[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: every chunk holds at least one unit
        a = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * a + tl.sum(w[:, None] * o, 0)
        s = s * a + tl.sum(w, 0)
        m = m_new
    tl.store(Out + row * stride_ot + h * stride_oh + offs_d, (acc / s).to(Out.dtype.element_ty), mask=mask_d)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: PagedDecode, scale: float,
                 out: torch.Tensor, cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Attention of single-token rows ``q [R, H, D]`` over their paged contexts into ``out [R, H, D]``.
    ``cfg`` overrides ``(BLOCK_N, num_warps, num_stages)`` (benchmarks sweep it)."""
    rows, nq, d = q.shape
    bd = _pow2(d)
    if meta.direct:
        _decode_launch(q, kv_cache, layer, meta, scale, out, out, out, cfg)
        return out
    mid_o, mid_l = paged_decode_units(q, kv_cache, layer, meta, scale, cfg)
    # All of a row's units in one load (at most 128 of them; more take several rounds).
    bu = min(128, max(2, triton.next_power_of_2(meta.max_row_units)))
    _merge_kernel[(rows, nq)](mid_o, mid_l, meta.row_start, out, mid_o.stride(0), mid_o.stride(1), mid_l.stride(0),
                              out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=bd, BLOCK_U=bu,
                              num_warps=4 if bu >= 32 else 2)
    return out


def paged_decode_units(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: PagedDecode, scale: float,
                       cfg: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of :func:`paged_decode` when rows span several units (``meta.direct`` false):
    each unit's normalised output ``mid_o [U, H, D]`` and base-2 log-sum-exp ``mid_l [U, H]`` (fp32),
    left for a consumer to merge (``_merge_kernel``, or o_proj at one row:
    worker/attention/triton_linear.py ``merged_linear_partials``)."""
    if meta.direct:
        raise ValueError("paged_decode_units needs rows split into units; a direct launch has no partials")
    units, (_, nq, d) = meta.unit_row.shape[0], q.shape
    mid_o = torch.empty(units, nq, d, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(units, nq, dtype=torch.float32, device=q.device)
    _decode_launch(q, kv_cache, layer, meta, scale, q, mid_o, mid_l, cfg)
    return mid_o, mid_l


def _decode_launch(q, kv_cache, layer, meta: PagedDecode, scale, out, mid_o, mid_l, cfg) -> None:
    _, nq, d = q.shape
    nkv = kv_cache.shape[4]
    group = nq // nkv
    bd = _pow2(d)
    units = meta.unit_row.shape[0]
    k, v = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    block_n, warps, stages = cfg or decode_config(bd)
    smu, smh, slu = (0, 0, 0) if meta.direct else (mid_o.stride(0), mid_o.stride(1), mid_l.stride(0))
    _decode_kernel[(units, nkv)](
        q, k, v, meta.tables, meta.pos, meta.key0, meta.unit_row, meta.unit_lo, meta.unit_hi, out, mid_o, mid_l,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(3), meta.tables.stride(0),
        out.stride(0), out.stride(1), smu, smh, slu, scale * _LOG2E,
        GROUP=group, BLOCK_H=_pow2(group), HEAD_DIM=d, BLOCK_D=bd, BLOCK_N=block_n, PAGE=kv_cache.shape[3],
        DIRECT=meta.direct, PREC=_prec(q), num_warps=warps, num_stages=stages)


# ----------------------------------------------------------------------------- prefill


@triton.jit
def _prefill_kernel(Q, K, V, Table, Out, q_pos0, num_q, key0,
                    stride_qt, stride_qh, stride_blk, stride_tok, stride_ot, stride_oh, qk_scale,
                    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr,
                    PREC: tl.constexpr):
    """Queries of ``BLOCK_T`` consecutive chunk tokens × the ``GROUP`` heads of one KV head form the
    ``BLOCK_T·GROUP_P`` rows of one tile; keys come from the chunk's table (cached prefix and the
    chunk's own K/V, stored before attention), causal and windowed by absolute position."""
    mt = tl.program_id(0)
    kvh = tl.program_id(1)
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_P
    r = tl.arange(0, BLOCK_M)
    t = mt * BLOCK_T + r // GROUP_P
    g = r % GROUP_P
    mask_r = (t < num_q) & (g < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + g
    qm = mask_r[:, None] & mask_d[None, :]
    q = tl.load(Q + t[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=qm, other=0.0)
    qpos = q_pos0 + t
    first_t = mt * BLOCK_T
    last_t = tl.minimum(first_t + BLOCK_T, num_q) - 1
    hi = q_pos0 + last_t + 1 - key0
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(q_pos0 + first_t - WINDOW + 1 - key0, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < hi
        blk = tl.load(Table + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
        off = blk * stride_blk + (offs_n % PAGE).to(tl.int64) * stride_tok + kvh * HEAD_DIM
        kvm = valid[:, None] & mask_d[None, :]
        k = tl.load(K + off[:, None] + offs_d[None, :], mask=kvm, other=0.0)
        v = tl.load(V + off[:, None] + offs_d[None, :], mask=kvm, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        kpos = key0 + offs_n
        vis = valid[None, :] & (kpos[None, :] <= qpos[:, None])
        if WINDOW > 0:
            vis = vis & (kpos[None, :] > qpos[:, None] - WINDOW)
        qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key in this tile
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only: every real query sees its own key
    o_ptr = Out + t[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=qm)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, table: torch.Tensor, start_pos: int,
                  key0: int, scale: float, window: int | None, out: torch.Tensor) -> torch.Tensor:
    """Attention of a chunk's queries ``q [Lq, H, D]`` (positions ``start_pos ..``) over keys
    ``key0 .. start_pos+Lq-1`` read through ``table`` (block ids from position ``key0``), into ``out``."""
    lq, nq, d = q.shape
    nkv = kv_cache.shape[4]
    group = nq // nkv
    gp = triton.next_power_of_2(group)
    block_t = max(1, 64 // gp) if d > 64 else max(1, 128 // gp)
    grid = (triton.cdiv(lq, block_t), nkv)
    _prefill_kernel[grid](
        q, kv_cache[:, layer, 0], kv_cache[:, layer, 1], table, out, start_pos, lq, key0,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(3), out.stride(0), out.stride(1),
        scale * _LOG2E,
        GROUP=group, GROUP_P=gp, BLOCK_T=block_t, HEAD_DIM=d, BLOCK_D=_pow2(d), BLOCK_N=PREFILL_BLOCK_N,
        PAGE=kv_cache.shape[3], WINDOW=window or 0, PREC=_prec(q), num_warps=8, num_stages=2)
    return out


# ----------------------------------------------------------------------------- per-row fusions
# A decode step is a few hundred small kernels; at batch 1 their launches, not bytes, fill most of
# the step. These two fold the residual add into the post-attention RMSNorm and SiLU into the
# gate·up product (one kernel each instead of two), with the torch path's rounding points kept:
# the residual sum is rounded to the model dtype before it is normalised.


@triton.jit
def _add_rms_norm_kernel(X, R, W, H, Y, stride_x, stride_r, stride_h, stride_y, stride_split, n, eps,
                         BLOCK: tl.constexpr, NSPLIT: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    dt = H.dtype.element_ty
    # The weight first: loaded after the reduction (a barrier) its latency, from HBM in a decode
    # step, would follow the partials' instead of overlapping it (bench/RESULTS.md, "issue 17,
    # seventh pass").
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + offs, mask=m, other=0.0)
    if NSPLIT > 0:  # split-K partials of the product feeding the residual (triton_linear.py)
        acc = tl.zeros([BLOCK], tl.float32)
        for sp in tl.static_range(NSPLIT):
            acc += tl.load(X + sp * stride_split + row * stride_x + offs, mask=m, other=0.0)
        x = acc.to(dt)
    else:
        x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(H + row * stride_h + offs, h, mask=m)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n + eps)
    tl.store(Y + row * stride_y + offs, (hf * rstd * w).to(dt), mask=m)


#: Warps of the add + RMSNorm kernel's one program per row on decode steps (at most ``MAX_M`` rows):
#: 16 took 0.9988–1.0002 ms per batch-1 step at 1k against 1.0216–1.0274 for 8 and 1.0275–1.0300 for 4
#: (bench/RESULTS.md, "issue 17, seventh pass"): the single program sums up to 8 split-K partials of
#: 2048 columns. Longer launches (prefill) keep one warp per 256 elements (8 at hidden 2048): at 16,
#: 1024 rows no longer fit the GPU in one wave.
DECODE_NORM_WARPS = 16


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and ``rms_norm(h) · weight`` of ``[rows, hidden]`` in one launch. ``x`` may
    be split-K partials ``[S, rows, hidden]`` (fp32) of the product, summed here."""
    nsplit = x.shape[0] if x.dim() == 3 else 0
    rows, n = residual.shape
    h, y = torch.empty_like(residual), torch.empty_like(residual)
    if rows:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](x, residual, weight, h, y, x.stride(-2), residual.stride(0), h.stride(0),
                                      y.stride(0), x.stride(0) if nsplit else 0, n, eps, BLOCK=block,
                                      NSPLIT=nsplit,
                                      num_warps=DECODE_NORM_WARPS if rows <= MAX_M else min(16, max(1, block // 256)))
    return h, y


@triton.jit
def _embed_rms_norm_kernel(Ids, E, W, H, Y, stride_e, stride_h, stride_y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)  # first, as in _add_rms_norm_kernel
    tok = tl.load(Ids + row).to(tl.int64)
    h = tl.load(E + tok * stride_e + offs, mask=m, other=0.0)
    tl.store(H + row * stride_h + offs, h, mask=m)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n + eps)
    tl.store(Y + row * stride_y + offs, (hf * rstd * w).to(H.dtype.element_ty), mask=m)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = table[ids]`` and ``rms_norm(h) · weight`` of ``[rows, hidden]`` in one launch: the
    embedding lookup and the first layer's input norm of a decode step (the norm as
    :func:`add_rms_norm`'s, with nothing to add)."""
    rows, n = ids.shape[0], table.shape[1]
    h = torch.empty(rows, n, dtype=table.dtype, device=table.device)
    y = torch.empty_like(h)
    if rows:
        block = triton.next_power_of_2(n)
        _embed_rms_norm_kernel[(rows,)](ids, table, weight, h, y, table.stride(0), h.stride(0), y.stride(0), n, eps,
                                        BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return h, y


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    g = tl.load(GU + row * stride_gu + offs, mask=m, other=0.0)
    u = tl.load(GU + row * stride_gu + inter + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    tl.store(Out + row * stride_o + offs, (gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``gate_up [rows, 2·I]`` (gate columns first) → ``[rows, I]``."""
    rows, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                            BLOCK=block, num_warps=4)
    return out
