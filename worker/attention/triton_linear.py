"""Small-M linear layers for decode steps (imported only by the ``triton`` attention backend).

A decode step multiplies every weight matrix by a handful of rows (M = the batch): a matrix-vector
product bound by reading the weights once. cuBLAS reaches 3.7–4.3 TB/s on the H200 for the wide
matrices of ``1b`` (gate_up, LM head) but only 1.4–2.5 TB/s on the narrow ones (o_proj and down_proj
with 2048 output columns, qkv with 3072), whose few column tiles leave most multiprocessors idle; its
split-K answer adds a reduction kernel (bench/RESULTS.md, "decode kernels (issue 17, third pass)").

The kernel here streams ``W [N, K]`` in ``[BLOCK_N, BLOCK_K]`` tiles, multiplying each tile with all
``M ≤ BLOCK_M`` rows of ``x`` in one ``tl.dot`` (fp32 accumulation), and splits K over ``S``
programs per column tile so that even 2048 columns fill the GPU. Its output is then either

- **partials**: an fp32 tensor ``[S, M, N]`` whose sum over ``S`` is the product (bias included in
  split 0). No reduction kernel runs: the *consumer* sums the partials while it loads its input —
  the fused RoPE + KV-store kernel for qkv, the residual-add + RMSNorm kernel for o_proj and
  down_proj (worker/attention/triton_ops.py). A 3-D fp32 tensor is how those kernels recognise it.
- **SwiGLU**: for ``gate_up_proj`` a program reads the gate rows ``n`` and the up rows ``I + n`` and
  writes ``silu(gate)·up`` directly; the ``[M, 2I]`` product is never stored.

Rounding points match the unfused path: the summed product is rounded to the model dtype before it
is added to the residual, rotated or fed to SiLU (gate and up each rounded), as cuBLAS's output would
be. Only the fp32 summation order differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.attention import _interp  # noqa: F401  (Triton interpreter fix-up, before any kernel runs)

__all__ = ["MAX_M", "use_small_m", "linear_partials", "gate_up_silu", "choose_splits"]

#: Rows up to which decode steps use these kernels (bench/worker.py measures batch 1/8/32).
MAX_M = 32
#: K elements per tile; every split's K range is a multiple of it.
BLOCK_K = 128
#: Programs per multiprocessor :func:`choose_splits` aims at. Swept on the H200 with ``1b`` at 1k context
#: (bench/RESULTS.md, "decode kernels (issue 17, third pass)"): 2 gave 1.110 / 1.556 ms per step at batch 1 / 32,
#: 4 gave 1.141 / 1.625, 1 gave 1.127 / 1.561.
SPLITK_PROGRAMS_PER_SM = 2
#: Batch-1 decode (M = 1): ``(BLOCK_N, num_warps, BLOCK_K)`` and programs per multiprocessor of the split-K
#: launch. Swept on the H200 (bench/RESULTS.md, "async scheduling and batch-1 linears (issue 17, fifth
#: pass)"): per matrix, narrow two-warp programs with 64-wide K tiles beat the M ≤ 32 tiles (qkv 6.85 →
#: 5.51, o_proj 5.73 → 4.53, down_proj 12.92 → 10.48 µs per layer); end to end (one process, variants
#: alternating) 2 programs per SM gave 1.042–1.049 ms per step at 1k context against 1.092–1.102 for the
#: general tiles, 4 gave 1.072–1.085, 8 gave 1.171; 64-wide or four-warp programs were slower. ``None``
#: keeps the general tiles at M = 1.
M1_TILE: tuple[int, int, int] | None = (32, 2, 64)
M1_PROGRAMS_PER_SM = 2


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


def linear_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Split-K partial products of ``F.linear(x, weight, bias)`` for ``x [M ≤ MAX_M, K]``: fp32
    ``[S, M, N]`` whose sum over dim 0 is the product (see the module docstring)."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn = _tiles(m, n)
    bk, warps, per_sm = BLOCK_K, 4, None
    if m == 1 and M1_TILE is not None and block_n is None:
        bn, warps, bk = M1_TILE
        per_sm = M1_PROGRAMS_PER_SM
    bn = block_n or bn
    s = splits or choose_splits(m, n, k, bn, _num_sms(x.device), bk, per_sm)
    kps = triton.cdiv(triton.cdiv(k, s), bk) * bk
    s = triton.cdiv(k, kps)
    out = torch.empty(s, m, n, dtype=torch.float32, device=x.device)
    _small_m_kernel[(triton.cdiv(n, bn), s)](
        x, weight, bias if bias is not None else weight, out, m, n, k, kps, x.stride(0), weight.stride(0),
        out.stride(0), out.stride(1), 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWIGLU=False,
        HAS_BIAS=bias is not None, PARTIAL=True, PREC=_prec(x), num_warps=warps, num_stages=4)
    return out


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None,
                 block_n: int | None = None) -> torch.Tensor:
    """``silu(gate)·up`` of ``F.linear(x, gate_up, bias)`` split at its middle column (gate first),
    ``[M, I]`` in the model dtype."""
    m, k = x.shape
    inter = gate_up.shape[0] // 2
    bm, bn = _tiles(m, inter)
    bn = block_n or bn
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    _small_m_kernel[(triton.cdiv(inter, bn), 1)](
        x, gate_up, bias if bias is not None else gate_up, out, m, inter, k, k, x.stride(0), gate_up.stride(0),
        0, out.stride(0), inter * gate_up.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, SWIGLU=True,
        HAS_BIAS=bias is not None, PARTIAL=False, PREC=_prec(x), num_warps=4, num_stages=4)
    return out
