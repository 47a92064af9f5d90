"""Small-M linear kernels of the triton backend (worker/attention/triton_linear.py) and their fused
consumers (worker/attention/triton_ops.py) against plain torch.

``cuda`` mode (marked ``gpu``): the ``1b`` preset's shapes in bf16 at M = 1…32. ``interp`` mode
(Triton's CPU interpreter, marked ``slow``, needs ``SPLITSERVE_TRITON_INTERPRET=1``): small shapes in
fp32 (the interpreter's bf16 ``tl.dot`` is broken in Triton 3.6).

Tolerance: the kernels sum in fp32 in another order than the reference and round once to the
output dtype, so a bf16 result may differ from torch's by one rounding step of the output:
``atol = rtol = 1e-2`` relative to the output's scale in bf16, ``1e-4`` in fp32.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

INTERP = os.environ.get("SPLITSERVE_TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
MODES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("interp", marks=[pytest.mark.slow, pytest.mark.skipif(
        not INTERP, reason="set SPLITSERVE_TRITON_INTERPRET=1 (with triton installed) to run kernels on the CPU")]),
]


#: M = 1 tiles ``(GEMV, BLOCK_N, num_warps, BLOCK_K, num_stages)`` beside the launchers' own: the
#: register GEMV kernel at several shapes (BLOCK_K past K, BLOCK_N past N) and the ``tl.dot`` one.
M1_TILES = [(True, 8, 4, 256, 1), (True, 16, 2, 128, 1), (True, 4, 1, 512, 1), (False, 32, 2, 64, 3),
            (False, 16, 1, 128, 5)]


def setup(mode):
    if mode == "interp":
        from worker.attention import interpreting
        interpreting()
    from worker.attention import triton_linear as TL, triton_ops as T
    dev, dtype = ("cuda", torch.bfloat16) if mode == "cuda" else ("cpu", torch.float32)
    return TL, T, dev, dtype


def close(got, ref, dtype, what):
    tol = 1e-2 if dtype != torch.float32 else 1e-4
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [False, True])
def test_partials_sum_to_linear(mode, bias):
    """Split-K partials sum to ``F.linear`` for every M up to MAX_M, K not a multiple of the tile or
    the split, forced split counts (1 … beyond K's tiles) and the launcher's choice."""
    TL, _, dev, dtype = setup(mode)
    g = torch.Generator().manual_seed(1)
    shapes = [(3072, 2048), (2048, 2048), (2048, 8192), (128256, 2048), (200, 333)] if mode == "cuda" else \
        [(48, 256), (40, 300), (17, 130)]
    ms = [1, 2, 7, 16, 17, 32] if mode == "cuda" else [1, 5, 17]
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype)
        b = torch.randn(n, generator=g).to(dev, dtype) if bias else None
        for m in ms:
            x = torch.randn(m, k, generator=g).to(dev, dtype)
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            for splits in (None, 1, 2, 3, 64):
                p = TL.linear_partials(x, w, b, splits=splits)
                assert p.dtype == torch.float32 and p.shape[1:] == (m, n)
                close(p.sum(0), ref, torch.float32 if dtype == torch.float32 else torch.bfloat16,
                      f"n={n} k={k} m={m} splits={splits}->{p.shape[0]}")
            if m == 1:
                for tile in M1_TILES:  # the LM head's one-row launch: unsplit, output in the model dtype
                    out = TL.linear_m1(x, w, tile=tile)
                    assert out.dtype == dtype and out.shape == (1, n)
                    close(out, F.linear(x.float(), w.float()), dtype, f"linear_m1 n={n} k={k} tile={tile}")
            for tile in (M1_TILES if m == 1 else ()):
                for splits in (None, 1, 3):
                    p = TL.linear_partials(x, w, b, splits=splits, tile=tile)
                    close(p.sum(0), ref, torch.float32 if dtype == torch.float32 else torch.bfloat16,
                          f"n={n} k={k} tile={tile} splits={splits}->{p.shape[0]}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_matches_unfused(mode, bias):
    """``silu(gate)·up`` with the gate and up products rounded to the model dtype first, as the
    unfused path (``gate_up_proj`` then the SiLU·up kernel) rounds them."""
    TL, _, dev, dtype = setup(mode)
    g = torch.Generator().manual_seed(2)
    shapes = [(2 * 8192, 2048), (2 * 100, 96)] if mode == "cuda" else [(2 * 40, 256), (2 * 24, 130)]
    for two_i, k in shapes:
        w = (torch.randn(two_i, k, generator=g) / k ** 0.5).to(dev, dtype)
        b = torch.randn(two_i, generator=g).to(dev, dtype) if bias else None
        for m in ([1, 8, 32] if mode == "cuda" else [1, 9]):
            x = torch.randn(m, k, generator=g).to(dev, dtype)
            gu = F.linear(x, w, b)
            gate, up = gu.float().split(two_i // 2, -1)
            ref = F.silu(gate) * up
            close(TL.gate_up_silu(x, w, b), ref, dtype, f"2I={two_i} k={k} m={m}")
            for tile in (M1_TILES if m == 1 else ()):
                close(TL.gate_up_silu(x, w, b, tile=tile), ref, dtype, f"2I={two_i} k={k} tile={tile}")


@pytest.mark.parametrize("mode", MODES)
def test_consumers_sum_partials(mode):
    """The residual-add + RMSNorm and the RoPE + KV-store kernels given split-K partials equal the
    same kernels given the summed, rounded product."""
    TL, T, dev, dtype = setup(mode)
    g = torch.Generator().manual_seed(3)
    hidden, m = (2048, 5) if mode == "cuda" else (96, 3)
    x = torch.randn(m, 4 * hidden, generator=g).to(dev, dtype)
    w = (torch.randn(hidden, 4 * hidden, generator=g) / (4 * hidden) ** 0.5).to(dev, dtype)
    res = torch.randn(m, hidden, generator=g).to(dev, dtype)
    nw = torch.rand(hidden, generator=g).to(dev, dtype)
    p = TL.linear_partials(x, w, splits=4)
    assert p.shape[0] >= 2, "more than one split reaches the consumer"
    prod = p.sum(0).to(dtype)
    h1, y1 = T.add_rms_norm(p, res, nw, 1e-5)
    h2, y2 = T.add_rms_norm(prod, res, nw, 1e-5)
    close(h1, h2, dtype, "h")
    close(y1, y2, dtype, "y")

    heads, kvh, d, bs = 4, 2, 32, 16
    width = (heads + 2 * kvh) * d
    wq = (torch.randn(width, hidden, generator=g) / hidden ** 0.5).to(dev, dtype)
    xin = torch.randn(m, hidden, generator=g).to(dev, dtype)
    p = TL.linear_partials(xin, wq, splits=2)
    pos = torch.arange(m, device=dev) + 40
    ang = pos[:, None].float() / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))[None, :]
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin = torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)
    blk = torch.tensor([3, 0, 5, 1, 2][:m], device=dev)
    off = pos % bs
    caches = [torch.zeros(8, 2, 2, bs, kvh, d, device=dev, dtype=dtype) for _ in range(2)]
    q1 = T.rope_store(p, cos, sin, caches[0], 1, blk, off, heads, kvh, d)
    q2 = T.rope_store(p.sum(0).to(dtype), cos, sin, caches[1], 1, blk, off, heads, kvh, d)
    close(q1, q2, dtype, "q")
    close(caches[0], caches[1], dtype, "cache")
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
def test_add_rms_norm_matches_torch(mode):
    """``h = x + residual`` rounded to the model dtype, then ``F.rms_norm(h)``, from a product or from
    its split-K partials, at one row and several."""
    TL, T, dev, dtype = setup(mode)
    g = torch.Generator().manual_seed(5)
    hidden, k = (2048, 8192) if mode == "cuda" else (96, 256)
    w = (torch.randn(hidden, k, generator=g) / k ** 0.5).to(dev, dtype)
    nw = torch.rand(hidden, generator=g).to(dev, dtype)
    for rows in (1, 5):
        x = torch.randn(rows, k, generator=g).to(dev, dtype)
        res = torch.randn(rows, hidden, generator=g).to(dev, dtype)
        p = TL.linear_partials(x, w)
        for inp in (p, p.sum(0).to(dtype)):
            h, y = T.add_rms_norm(inp, res, nw, 1e-5)
            ref_h = (p.sum(0).to(dtype).float() + res.float()).to(dtype)
            close(h, ref_h, dtype, f"h rows={rows} {tuple(inp.shape)}")
            close(y, F.rms_norm(ref_h.float(), (hidden,), nw.float(), 1e-5), dtype, f"y rows={rows}")


@pytest.mark.parametrize("mode", MODES)
def test_embed_rms_norm_matches_embedding_then_norm(mode):
    """The one-row decode step's embedding lookup + first input norm in one kernel equals
    ``F.embedding`` then ``F.rms_norm`` (the lookup exactly; the norm to the tolerance above: fp32
    sums in another order, one rounding to the output dtype)."""
    _, T, dev, dtype = setup(mode)
    g = torch.Generator().manual_seed(4)
    vocab, hidden = (128256, 2048) if mode == "cuda" else (300, 96)
    table = torch.randn(vocab, hidden, generator=g).to(dev, dtype)
    nw = torch.rand(hidden, generator=g).to(dev, dtype)
    ids = torch.tensor([vocab - 1, 0, 7, 7], device=dev)
    for rows in (1, 4):
        h, y = T.embed_rms_norm(ids[:rows], table, nw, 1e-5)
        ref_h = F.embedding(ids[:rows], table)
        assert torch.equal(h, ref_h)
        close(y, F.rms_norm(ref_h, (hidden,), nw, 1e-5), dtype, "y")


@pytest.mark.slow
@pytest.mark.skipif(not INTERP, reason="set SPLITSERVE_TRITON_INTERPRET=1 (with triton installed) to run kernels on the CPU")
def test_decode_kernels_bench_runs_under_the_interpreter():
    """bench/worker/decode_kernels.py (the sweep behind the launchers' constants) runs end to end on tiny."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "bench/worker/decode_kernels.py", "--model", "tiny", "--device", "cpu"], cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("| 1 | ") == 4 and "| b1_200 |" in out.stdout and "| b4_100 |" in out.stdout
    out = subprocess.run([sys.executable, "bench/worker/decode_kernels.py", "--model", "tiny", "--device", "cpu",
                          "--part", "m1"], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| lm_head | cuBLAS |" in out.stdout and "| gate_up | launcher |" in out.stdout
    assert "failed" not in out.stdout
