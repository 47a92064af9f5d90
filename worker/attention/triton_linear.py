"""Small-M linear layers for decode steps (imported only by the ``triton`` attention backend).

A decode step multiplies every weight matrix by a handful of rows (M = the batch): a matrix-vector
product bound by reading the weights once. cuBLAS reaches 3.7–4.3 TB/s on the H200 for the wide
matrices of ``1b`` (gate_up, LM head) but only 1.4–2.5 TB/s on the narrow ones (o_proj and down_proj
with 2048 output columns, qkv with 3072), whose few column tiles leave most multiprocessors idle; its
split-K answer adds a reduction kernel (bench/results/history/worker.md, "decode kernels (issue 17, third pass)").

The kernel here streams ``W [N, K]`` in ``[BLOCK_N, BLOCK_K]`` tiles, multiplying each tile with all
``M ≤ BLOCK_M`` rows of ``x`` in one ``tl.dot`` (fp32 accumulation), and splits K over ``S``
programs per column tile so that even 2048 columns fill the GPU. Its output is then either

- **partials**: an fp32 tensor ``[S, M, N]`` whose sum over ``S`` is the product (bias included in
  split 0). No reduction kernel runs: the *consumer* sums the partials while it loads its input —
  the fused RoPE + KV-store kernel for qkv, the residual-add + RMSNorm kernel for o_proj and
  down_proj (worker/attention/triton_ops.py). A 3-D fp32 tensor is how those kernels recognise it.
- **SwiGLU**: for ``gate_up_proj`` a program reads the gate rows ``n`` and the up rows ``I + n`` and
  writes ``silu(gate)·up`` directly; the ``[M, 2I]`` product is never stored.

At M = 1 a launch may instead run :func:`_gemv_kernel`, the same streaming without ``tl.dot``
(per-matrix tiles: :data:`M1_ROLE_TILES`), and the LM head of a one-row step runs here too
(:func:`linear_m1`, :data:`M1_LM_HEAD_TILE`): its 525 MB stream faster than in cuBLAS.

Rounding points match the unfused path: the summed product is rounded to the model dtype before it
is added to the residual, rotated or fed to SiLU (gate and up each rounded), as cuBLAS's output would
be. Only the fp32 summation order differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.attention import _interp  # noqa: F401  (Triton interpreter fix-up, before any kernel runs)

__all__ = ["MAX_M", "use_small_m", "linear_partials", "gate_up_silu", "choose_splits", "merges_units",
           "merged_linear_partials", "linear_m1"]

#: Rows up to which decode steps use these kernels (bench/worker/worker.py measures batch 1/8/32).
MAX_M = 32
#: K elements per tile; every split's K range is a multiple of it.
BLOCK_K = 128
#: Programs per multiprocessor :func:`choose_splits` aims at. Swept on the H200 with ``1b`` at 1k context
#: (bench/results/history/worker.md, "decode kernels (issue 17, third pass)"): 2 gave 1.110 / 1.556 ms per step at batch 1 / 32,
#: 4 gave 1.141 / 1.625, 1 gave 1.127 / 1.561.
SPLITK_PROGRAMS_PER_SM = 2
#: Batch-1 decode (M = 1): ``(BLOCK_N, num_warps, BLOCK_K)`` and programs per multiprocessor of the split-K
#: launch. Swept on the H200 (bench/results/history/worker.md, "async scheduling and batch-1 linears (issue 17, fifth
#: pass)"): per matrix, narrow two-warp programs with 64-wide K tiles beat the M ≤ 32 tiles (qkv 6.85 →
#: 5.51, o_proj 5.73 → 4.53, down_proj 12.92 → 10.48 µs per layer); end to end (one process, variants
#: alternating) 2 programs per SM gave 1.042–1.049 ms per step at 1k context against 1.092–1.102 for the
#: general tiles, 4 gave 1.072–1.085, 8 gave 1.171; 64-wide or four-warp programs were slower; 1 and 1.5
#: gave 1.0835–1.0837 and 1.0626–1.0655 against 1.0216–1.0274 for 2 (bench/RESULTS.md, "issue 17, seventh
#: pass"). ``None`` keeps the general tiles at M = 1.
M1_TILE: tuple[int, int, int] | None = (32, 2, 64)
M1_PROGRAMS_PER_SM = 2
#: Software-pipeline depth (``num_stages``) of the M = 1 split-K launch of a matrix :data:`M1_ROLE_TILES`
#: does not name (o_proj).
M1_STAGES = 4
#: Batch-1 decode: per-matrix ``(GEMV, BLOCK_N, num_warps, BLOCK_K, num_stages)`` of the M = 1 split-K
#: launches, by the caller's ``role`` ("qkv", "o", "down"), in place of :data:`M1_TILE` + :data:`M1_STAGES`.
#: ``GEMV`` picks :func:`_gemv_kernel` (multiply-add in registers, one reduction after the loop) over
#: :func:`_small_m_kernel`'s 16-row ``tl.dot`` tile. Swept on the H200 (bench/RESULTS.md, "issue 17,
#: seventh pass"; ``bench/worker/decode_kernels.py --part m1``, µs per layer): qkv 5.87 (M1_TILE) → 5.32 with
#: 64-column four-warp GEMV programs at 128-wide K (8 splits), down_proj 10.57 → 10.35 with five stages;
#: o_proj's best (4.57) matched its 4.58. End to end (one process, variants alternating, ms per step at
#: 1k / 8k): qkv 1.0172–1.0173 / 1.0837–1.0887, down 1.0225–1.0231 / 1.0891–1.0904, neither
#: 1.0216–1.0274 / 1.0873–1.0953.
M1_ROLE_TILES: dict[str, tuple[bool, int, int, int, int]] = {
    "qkv": (True, 64, 4, 128, 1), "down": (False, 32, 2, 64, 5)}
#: Batch-1 decode: the LM head's tile at one row (:func:`linear_m1`, from the model's compute_logits);
#: ``None`` leaves it to cuBLAS. The 64-column dot tile read the 525 MB at 4.45 TB/s (117.7–118.0 µs)
#: against cuBLAS's 4.29–4.33 (121.4–121.8 µs); end to end about 5 µs per step at 1k and 8k
#: (bench/RESULTS.md, "issue 17, seventh pass").
M1_LM_HEAD_TILE: tuple[bool, int, int, int, int] | None = (False, 64, 4, 128, 4)
#: Batch-1 decode: o_proj merges the paged decode kernel's work units itself (:func:`merged_linear_partials`,
#: one launch fewer per layer) when the row has at most this many units (a graph key of ≤ 2048 key slots
#: at the launcher's 128-slot units: contexts up to ~2k). Each of o_proj's column tiles re-reads the
#: units of its K range: at 16 units, 2048 columns and H·D = 2048 that is 64 tiles × 16 × 2048 × 4 B =
#: 8 MB from L2, as much as the weight itself. 0 turns the fusion off, which is faster end to end: the
#: merge kernel + the plain split-K o_proj took 1.0105–1.0113 ms per step at 1k against 1.0216–1.0274
#: with the fusion (bench/RESULTS.md, "issue 17, seventh pass"; the sixth pass had seen the same within
#: its noise).
MERGE_MAX_UNITS = 0


@triton.jit
def _small_m_kernel(X, W, Bias, Out, M, N, K, k_per_split, stride_xm, stride_wn, stride_os, stride_om, up_off,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = s * k_per_split
    x_ptr = X + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        mk = (k_lo + k0 + offs_k) < K
        x = tl.load(x_ptr, mask=mask_m[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptr, mask=mask_n[:, None] & mk[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        if SWIGLU:
            wu = tl.load(w_ptr + up_off, mask=mask_n[:, None] & mk[None, :], other=0.0)
            acc_u += tl.dot(x, tl.trans(wu), input_precision=PREC)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        if s == 0:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_u += tl.load(Bias + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    optr = Out + s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    if PARTIAL:
        tl.store(optr, acc, mask=omask)
    else:
        dt = Out.dtype.element_ty
        if SWIGLU:
            g = acc.to(dt).to(tl.float32)
            u = acc_u.to(dt).to(tl.float32)
            tl.store(optr, (g / (1.0 + tl.exp(-g)) * u).to(dt), mask=omask)
        else:
            tl.store(optr, acc.to(dt), mask=omask)


@triton.jit
def _gemv_kernel(X, W, Bias, Out, N, K, k_per_split, stride_wn, stride_os, up_off,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PARTIAL: tl.constexpr):
    """:func:`_small_m_kernel` at M = 1 without ``tl.dot``: each thread multiplies its slice of the
    ``[BLOCK_N, BLOCK_K]`` weight tile with ``x`` and accumulates in fp32 registers; the K reduction
    runs once, after the loop. Same outputs and rounding points."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    k_lo = s * k_per_split
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_lo + k0 + offs_k
        mk = kk < K
        # x broadcast over the tile's rows as a [BLOCK_N, BLOCK_K] load: it then takes the weight tile's
        # layout (a [1, BLOCK_K] load gets its own and a layout conversion through shared memory per
        # iteration); the repeated addresses are L1 hits.
        x = tl.load(X + kk[None, :] + 0 * offs_n[:, None], mask=mk[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr, mask=mask_n[:, None] & mk[None, :], other=0.0)
        acc += w.to(tl.float32) * x
        if SWIGLU:
            wu = tl.load(w_ptr + up_off, mask=mask_n[:, None] & mk[None, :], other=0.0)
            acc_u += wu.to(tl.float32) * x
        w_ptr += BLOCK_K
    g = tl.sum(acc, 1)
    if HAS_BIAS:
        if s == 0:
            g += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    optr = Out + s * stride_os + offs_n
    if PARTIAL:
        tl.store(optr, g, mask=mask_n)
    else:
        dt = Out.dtype.element_ty
        if SWIGLU:
            u = tl.sum(acc_u, 1)
            if HAS_BIAS:
                u += tl.load(Bias + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            g = g.to(dt).to(tl.float32)
            u = u.to(dt).to(tl.float32)
            tl.store(optr, (g / (1.0 + tl.exp(-g)) * u).to(dt), mask=mask_n)
        else:
            tl.store(optr, g.to(dt), mask=mask_n)


@triton.jit
def _merged_m1_kernel(MidO, MidL, RowStart, W, Bias, Out, N, K, k_per_split, stride_mu, stride_lu, stride_wn,
                      stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_U: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """:func:`_small_m_kernel`'s split-K partials at M = 1 for ``x`` = the attention output of one
    decode row, merged here from the paged decode kernel's units instead of by its merge kernel
    (worker/attention/triton_ops.py ``_merge_kernel``): per K tile, the row's units ``RowStart[0] ..
    RowStart[1]-1`` (at most ``BLOCK_U``) are combined by their log-sum-exp ``MidL [U, H]`` and their
    outputs ``MidO [U, H·D]`` (column ``k`` is head ``k // HEAD_DIM``), rounded to the weight dtype
    as the merge kernel's output is, then multiplied with the weight tile."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    us = tl.load(RowStart).to(tl.int32)
    ue = tl.load(RowStart + 1).to(tl.int32)
    offs_u = us + tl.arange(0, BLOCK_U)
    mask_u = offs_u < ue
    k_lo = s * k_per_split
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    dt = W.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_lo + k0 + offs_k
        mk = kk < K
        um = mask_u[:, None] & mk[None, :]
        o = tl.load(MidO + offs_u[:, None] * stride_mu + kk[None, :], mask=um, other=0.0)
        if HEAD_DIM % BLOCK_K == 0:  # the tile lies inside one head (tiles start at multiples of BLOCK_K)
            inside = k_lo + k0 < K
            lse = tl.load(MidL + offs_u * stride_lu + (k_lo + k0) // HEAD_DIM, mask=mask_u & inside,
                          other=float("-inf"))
            mx = tl.where(inside, tl.max(lse, 0), 0.0)  # finite inside K: a row has at least one unit
            wgt = tl.exp2(lse - mx)
            den = tl.where(inside, tl.sum(wgt, 0), 1.0)
            xm = (tl.sum(wgt[:, None] * o, 0) / den).to(dt)
        else:  # several heads per tile: each column's head
            lse = tl.load(MidL + offs_u[:, None] * stride_lu + (kk // HEAD_DIM)[None, :], mask=um,
                          other=float("-inf"))
            mx = tl.where(mk, tl.max(lse, 0), 0.0)
            wgt = tl.exp2(lse - mx[None, :])
            den = tl.where(mk, tl.sum(wgt, 0), 1.0)
            xm = (tl.sum(wgt * o, 0) / den).to(dt)
        x = tl.where(offs_m[:, None] == 0, xm[None, :], tl.zeros([BLOCK_M, BLOCK_K], dt))
        w = tl.load(w_ptr, mask=mask_n[:, None] & mk[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        w_ptr += BLOCK_K
    if HAS_BIAS:
        if s == 0:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    optr = Out + s * stride_os + offs_m[:, None] * 0 + offs_n[None, :]
    tl.store(optr, acc, mask=(offs_m[:, None] == 0) & mask_n[None, :])


def use_small_m(x: torch.Tensor) -> bool:
    """Whether the rows ``x [M, K]`` of a decode step go through these kernels: M ≤ :data:`MAX_M`,
    a float dtype, contiguous rows; on CUDA, or on the CPU under Triton's interpreter (tests)."""
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    if x.is_cuda:
        return True
    from worker.attention import interpreting
    return interpreting()


def _num_sms(dev: torch.device) -> int:
    from worker.attention.plan import num_sms
    return num_sms(dev)


def _tiles(m: int, n: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: 16 columns per program below 4096 columns (the narrow matrices need every
    program they can get), 32 up to 16k, 64 above (the LM head)."""
    return (16 if m <= 16 else 32), (16 if n <= 4096 else 32 if n <= 16384 else 64)


def choose_splits(m: int, n: int, k: int, block_n: int, sms: int, block_k: int = BLOCK_K,
                  per_sm: float | None = None) -> int:
    """K splits (a power of two) so the launch has about ``per_sm`` (default
    :data:`SPLITK_PROGRAMS_PER_SM`) programs per multiprocessor, each split at least 2 tiles of
    ``block_k``, and the fp32 partials at most 1/8 of the weight's bytes."""
    per_sm = SPLITK_PROGRAMS_PER_SM if per_sm is None else per_sm
    tiles = triton.cdiv(n, block_n)
    s = 1
    while tiles * s < per_sm * sms and k // (2 * s) >= 2 * block_k and 2 * s * m * 16 <= k:
        s *= 2
    return s


def _prec(x: torch.Tensor) -> str | None:
    return "ieee" if x.dtype == torch.float32 else None


#: A launch's tile: ``(GEMV, BLOCK_N, num_warps, BLOCK_K, num_stages)``; ``GEMV`` (M = 1 only) runs
#: :func:`_gemv_kernel` instead of :func:`_small_m_kernel`.
Tile = tuple[bool, int, int, int, int]


def _general_tile(block_n: int) -> Tile:
    """The M ≤ :data:`MAX_M` tile: ``tl.dot``, 4 warps, :data:`BLOCK_K`-wide K, 4 stages."""
    return (False, block_n, 4, BLOCK_K, 4)


def _m1_split_tile(role: str | None) -> Tile | None:
    if M1_TILE is None:
        return None
    return M1_ROLE_TILES.get(role) or (False, M1_TILE[0], M1_TILE[1], M1_TILE[2], M1_STAGES)


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, n: int, k: int,
            kps: int, s: int, stride_os: int, up_off: int, tile: Tile, bm: int, swiglu: bool, partial: bool) -> None:
    gemv, bn, warps, bk, stages = tile
    b = bias if bias is not None else w
    if gemv:
        if x.shape[0] != 1:
            raise ValueError(f"the GEMV tile takes one row, got {x.shape[0]}")
        _gemv_kernel[(triton.cdiv(n, bn), s)](
            x, w, b, out, n, k, kps, w.stride(0), stride_os, up_off, BLOCK_N=bn, BLOCK_K=bk, SWIGLU=swiglu,
            HAS_BIAS=bias is not None, PARTIAL=partial, num_warps=warps, num_stages=stages)
        return
    _small_m_kernel[(triton.cdiv(n, bn), s)](
        x, w, b, out, x.shape[0], n, k, kps, x.stride(0), w.stride(0), stride_os, out.stride(-2), up_off,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWIGLU=swiglu, HAS_BIAS=bias is not None, PARTIAL=partial,
        PREC=_prec(x), num_warps=warps, num_stages=stages)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    splits: int | None = None, tile: Tile | None = None, role: str | None = None) -> torch.Tensor:
    """Split-K partial products of ``F.linear(x, weight, bias)`` for ``x [M ≤ MAX_M, K]``: fp32
    ``[S, M, N]`` whose sum over dim 0 is the product (see the module docstring). ``role`` names the
    matrix for :data:`M1_ROLE_TILES`; ``tile`` overrides the launch's tile (benchmarks sweep it)."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn = _tiles(m, n)
    if tile is None and m == 1:
        tile = _m1_split_tile(role)
    per_sm = M1_PROGRAMS_PER_SM if m == 1 and tile is not None else None
    tile = tile or _general_tile(bn)
    bn, bk = tile[1], tile[3]
    s = splits or choose_splits(m, n, k, bn, _num_sms(x.device), bk, per_sm)
    kps = triton.cdiv(triton.cdiv(k, s), bk) * bk
    s = triton.cdiv(k, kps)
    out = torch.empty(s, m, n, dtype=torch.float32, device=x.device)
    _launch(x, weight, bias, out, n, k, kps, s, out.stride(0), 0, tile, bm, swiglu=False, partial=True)
    return out


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None,
                 tile: Tile | None = None) -> torch.Tensor:
    """``silu(gate)·up`` of ``F.linear(x, gate_up, bias)`` split at its middle column (gate first),
    ``[M, I]`` in the model dtype. ``tile`` overrides the launch's tile (benchmarks sweep it)."""
    m, k = x.shape
    inter = gate_up.shape[0] // 2
    bm, bn = _tiles(m, inter)
    if tile is None:  # at M = 1 too: no M = 1 tile beat the general one (bench/RESULTS.md, seventh pass)
        tile = _general_tile(bn)
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, bias, out, inter, k, k, 1, 0, inter * gate_up.stride(0), tile, bm, swiglu=True,
            partial=False)
    return out


def linear_m1(x: torch.Tensor, weight: torch.Tensor, tile: Tile | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight)`` of one row ``x [1, K]`` in the model dtype, unsplit, with ``tile``
    (default :data:`M1_LM_HEAD_TILE`); ``None`` when no tile is set (the caller runs cuBLAS)."""
    tile = tile or M1_LM_HEAD_TILE
    if tile is None:
        return None
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(x, weight, None, out, n, k, k, 1, 0, 0, tile, 16, swiglu=False, partial=False)
    return out


def merges_units(m: int, units_per_row: int, direct: bool) -> bool:
    """Whether a decode-only step of ``m`` rows whose rows have at most ``units_per_row`` work units
    runs :func:`merged_linear_partials` for o_proj (one row, units to merge, at most
    :data:`MERGE_MAX_UNITS` of them, the M = 1 tile in use) instead of the merge kernel + split-K o_proj."""
    return m == 1 and not direct and units_per_row <= MERGE_MAX_UNITS and M1_TILE is not None


def merged_linear_partials(mid_o: torch.Tensor, mid_l: torch.Tensor, row_start: torch.Tensor, units_per_row: int,
                           weight: torch.Tensor, bias: torch.Tensor | None = None,
                           splits: int | None = None) -> torch.Tensor:
    """:func:`linear_partials` of the one decode row whose attention output is still the paged decode
    kernel's unmerged units ``mid_o [U, H, D]`` / ``mid_l [U, H]`` (fp32; the row's units are
    ``row_start[0] .. row_start[1]-1``, at most ``units_per_row``): fp32 ``[S, 1, N]``."""
    _, nh, d = mid_o.shape
    k, n = nh * d, weight.shape[0]
    if weight.shape[1] != k or mid_o.stride(2) != 1 or mid_o.stride(1) != d or mid_l.stride(1) != 1:
        raise ValueError(f"expected contiguous [U, H, D] partials of width {weight.shape[1]}, found "
                         f"{tuple(mid_o.shape)} with strides {mid_o.stride()}")
    bn, warps, bk = M1_TILE
    s = splits or choose_splits(1, n, k, bn, _num_sms(mid_o.device), bk, M1_PROGRAMS_PER_SM)
    kps = triton.cdiv(triton.cdiv(k, s), bk) * bk
    s = triton.cdiv(k, kps)
    out = torch.empty(s, 1, n, dtype=torch.float32, device=mid_o.device)
    _merged_m1_kernel[(triton.cdiv(n, bn), s)](
        mid_o, mid_l, row_start, weight, bias if bias is not None else weight, out, n, k, kps, mid_o.stride(0),
        mid_l.stride(0), weight.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_U=max(2, triton.next_power_of_2(units_per_row)), HEAD_DIM=d, HAS_BIAS=bias is not None,
        PREC=_prec(weight), num_warps=warps, num_stages=4)
    return out
