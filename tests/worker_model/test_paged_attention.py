"""Paged attention kernels (worker/attention/triton_ops.py) against a plain torch reference, and the
``triton`` backend of the runner against the ``torch`` one.

Each case runs in two modes: ``cuda`` (marked ``gpu``: full sizes, contexts up to 32k tokens, bf16)
and ``interp`` (Triton's CPU interpreter, small sizes, fp32/fp16; marked ``slow`` and run only with
``SPLITSERVE_TRITON_INTERPRET=1`` and triton installed — the interpreter's bf16 ``tl.dot`` is
broken in Triton 3.6, so bf16 is checked on the GPU only).

Tolerances: fp32 1e-4 (fp32 products, ``input_precision="ieee"``); fp16 / bf16 outputs against
an fp32 reference over the same K/V: ``atol = rtol = 1e-2`` for bf16 (output rounding ≤ 2^-8
relative, plus P rounded to bf16 before P·V as in flash attention), ``2e-3`` for fp16.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch

from worker.attention import AttentionBackendError, resolve_backend
from worker.attention.plan import build_paged_decode
from worker.model import LlamaForCausalLM
from worker.presets import build_preset, init_random_weights, preset_config
from worker.runner import Chunk, ModelRunner

INTERP = os.environ.get("SPLITSERVE_TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
MODES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("interp", marks=[pytest.mark.slow, pytest.mark.skipif(
        not INTERP, reason="set SPLITSERVE_TRITON_INTERPRET=1 (with triton installed) to run kernels on the CPU")]),
]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def ops():
    from worker.attention import triton_ops
    return triton_ops


def device_of(mode: str) -> str:
    return "cuda" if mode == "cuda" else "cpu"


def pool(mode, rows_blocks: list[int], bs: int, kv_heads: int, dim: int, dtype, seed: int):
    """A 2-layer pool filled with noise, and per row a full block table of random, non-contiguous ids."""
    g = torch.Generator().manual_seed(seed)
    need = sum(rows_blocks)
    total = need + 7
    kv = torch.randn(total, 2, 2, bs, kv_heads, dim, generator=g).to(device_of(mode), dtype)
    ids = torch.randperm(total, generator=g)[:need].tolist()
    tables, o = [], 0
    for n in rows_blocks:
        tables.append(np.asarray(ids[o:o + n], dtype=np.int64))
        o += n
    return kv, tables


def reference(q, kv, layer, table, qpos: list[int], window, scale):
    """fp32 attention of queries at ``qpos`` over the keys their position and window allow, K/V
    gathered position by position through the full block table ``table``."""
    bs, kvh = kv.shape[3], kv.shape[4]
    group = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    t = torch.as_tensor(table, device=kv.device)
    for i, p in enumerate(qpos):
        keys = torch.arange(max(0, p - window + 1) if window else 0, p + 1, device=kv.device)
        k = kv[t[keys // bs], layer, 0, keys % bs].float()  # [n, kvh, D]
        v = kv[t[keys // bs], layer, 1, keys % bs].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_paged_decode_matches_reference(mode, group, window, bs):
    big = mode == "cuda"
    lengths = [1, 2, 17, 100, 1000, 4097, 32768, 700] if big else [1, 2, 17, 70, 150, 600]  # 600: > 16 units at split 32
    win = (1500 if big else 40) if window else None
    # fp16 at one block size only: every extra dtype is another set of kernel compiles on the GPU
    dtypes = ([torch.bfloat16] + ([torch.float16] if bs == 16 else [])) if big else [torch.float32, torch.float16]
    kvh, dim = 2, 64 if big else 32
    heads = group * kvh
    rng = np.random.default_rng(bs * 10 + group)
    lengths = [lengths[i] for i in rng.permutation(len(lengths))]
    for dtype in dtypes:
        kv, tables = pool(mode, [-(-n // bs) for n in lengths], bs, kvh, dim, dtype, seed=group + bs)
        q = torch.randn(len(lengths), heads, dim).to(kv.device, dtype)
        pos = [n - 1 for n in lengths]
        # As the runner does: each table starts at the first block a key of the window lies in.
        first = [(max(0, p - win + 1) // bs) if win else 0 for p in pos]
        ref = torch.cat([reference(q[i:i + 1], kv, 1, tables[i], [p], win, dim ** -0.5) for i, p in enumerate(pos)])
        for split in (None, 32, 1 << 20):  # the launcher's choice, many units per row (merge), one unit (direct)
            meta, read = build_paged_decode([t[f:] for t, f in zip(tables, first)], pos, [f * bs for f in first],
                                            win, kvh, kv.device, split=split)
            assert read == sum(min(n, win or n) for n in lengths)
            assert meta.direct == (meta.unit_row.numel() == len(pos))
            if split is not None:
                assert meta.direct == (split != 32), "the forced splits reach both the merge and the direct path"
            out = ops().paged_decode(q, kv, 1, meta, dim ** -0.5, torch.empty_like(q))
            tol = TOL[dtype]
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol,
                                       msg=lambda m: f"{dtype} split={split} lengths={lengths}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("bs", [16, 64])
def test_paged_prefill_matches_reference(mode, group, window, bs):
    """A chunk after a cached prefix (a prefix-cache hit or chunked prefill) attends to the prefix
    in place and causally inside itself; a chunk at position 0 is the fresh-prompt case."""
    big = mode == "cuda"
    cases = [(0, 300), (1000, 300), (30000, 77)] if big else [(0, 37), (40, 37), (75, 5)]
    win = (700 if big else 30) if window else None
    dtype = torch.bfloat16 if big else torch.float32
    kvh, dim = 2, 64 if big else 32
    for start, n in cases:
        end = start + n
        kv, (table,) = pool(mode, [-(-end // bs)], bs, kvh, dim, dtype, seed=start + group)
        q = torch.randn(n, group * kvh, dim).to(kv.device, dtype)
        f = (max(0, start - win + 1) // bs) if win else 0
        out = ops().paged_prefill(q, kv, 1, torch.as_tensor(table[f:], device=kv.device), start, f * bs,
                                  dim ** -0.5, win, torch.empty_like(q))
        ref = reference(q, kv, 1, table, list(range(start, end)), win, dim ** -0.5)
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype],
                                   msg=lambda m: f"start={start} n={n}: {m}")


def _tables(lengths, extra, bs):
    tables, first = [], 0
    for n in lengths:
        nb = -(-(n + extra) // bs)
        tables.append(list(range(first, first + nb)))
        first += nb
    return tables, first


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 24])
def test_runner_triton_backend_equals_torch(mode, window):
    """The same steps through both backends: fresh prompts (one longer than the window), a
    prefix-cache hit (a second sequence reusing the first's full blocks), chunked prefill mixed
    with decode rows in one step, then decode steps; logits agree every step."""
    dev = device_of(mode)
    cfg = dataclasses.replace(preset_config("tiny"), sliding_window=window, name="tiny-paged")
    dtypes = [torch.float32, torch.bfloat16] if mode == "cuda" else [torch.float32]
    bs = 16
    for dtype in dtypes:
        model = LlamaForCausalLM(cfg, device=dev, dtype=dtype)
        init_random_weights(model)
        lengths = [5, 70, 33, 150]
        seqs = [[(i * 31 + j * 7 + 3) % 250 for j in range(n)] for i, n in enumerate(lengths)]
        tables, nblocks = _tables(lengths, 12, bs)
        hit = seqs[1][:32] + [9, 8, 7, 6, 5]  # shares seqs[1]'s first two blocks
        hit_table = tables[1][:2] + list(range(nblocks, nblocks + 2))

        def run(backend):
            r = ModelRunner(model, nblocks + 4, bs, cuda_graphs=False, attention_backend=backend)
            assert r.attention_backend == backend
            out = [r.step([Chunk(seqs[0], 0, tables[0]), Chunk(seqs[1], 0, tables[1]),
                           Chunk(seqs[2][:20], 0, tables[2])])]
            # chunked prefill (starts > 0) and a decode row in one step
            out.append(r.step([Chunk(seqs[2][20:], 20, tables[2]), Chunk(seqs[3][:100], 0, tables[3]),
                               Chunk([4], len(seqs[0]), tables[0])]))
            out.append(r.step([Chunk(seqs[3][100:], 100, tables[3]), Chunk(hit[32:], 32, hit_table)]))
            for k in range(6):
                ctx = [len(seqs[0]) + 1 + k, len(seqs[1]) + k, len(seqs[2]) + k, len(seqs[3]) + k]
                out.append(r.step([Chunk([(k + i) % 250], c, t) for i, (c, t) in enumerate(zip(ctx, tables))]
                                  + [Chunk([k], len(hit) + k, hit_table)]))
                if backend == "triton":
                    assert r.last_step_stats["decode_groups"] == 1
            return out

        ref, got = run("torch"), run("triton")
        for i, (a, b) in enumerate(zip(ref, got)):
            tol = TOL[dtype] * 5 * a.abs().max().item()  # logits: errors of every layer add up
            torch.testing.assert_close(b, a, atol=tol, rtol=0, msg=lambda m: f"{dtype} step {i}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_o_proj_merges_decode_units(mode, bias, monkeypatch):
    """Batch-1 decode's o_proj reading the paged decode kernel's unmerged units
    (``merged_linear_partials``) sums to the merge kernel + split-K o_proj path and to ``F.linear``
    of the reference attention: rows of 2 … 16 units, graph-style unit buffers with empty units past
    the row's, head_dim equal to, below and above the 64-wide K tile, forced split counts. The launcher
    has the fusion off (``MERGE_MAX_UNITS`` 0: bench/RESULTS.md, "issue 17, seventh pass"); it is tested
    at the 16 units it ran with.

    Tolerance: bf16 as :data:`TOL` relative to the output's scale (both paths round the merged
    attention output to bf16 once, then sum fp32 products in different orders); fp32 1e-4."""
    import torch.nn.functional as F

    from worker.attention import triton_linear as TL
    from worker.attention.plan import PagedDecode

    monkeypatch.setattr(TL, "MERGE_MAX_UNITS", 16)
    big = mode == "cuda"
    dtype = torch.bfloat16 if big else torch.float32
    cases = [(8, 4, 64, 1025), (8, 4, 64, 2048), (8, 4, 64, 130), (2, 4, 128, 1500), (4, 2, 32, 700)] if big else \
        [(2, 3, 16, 150), (2, 2, 32, 33), (1, 4, 16, 300), (1, 3, 64, 200), (1, 2, 128, 90)]
    split = 128 if big else 32
    g = torch.Generator().manual_seed(5)
    for kvh, group, dim, length in cases:
        bs = 16
        kv, (table,) = pool(mode, [-(-length // bs)], bs, kvh, dim, dtype, seed=length)
        heads = kvh * group
        q = torch.randn(1, heads, dim, generator=g).to(kv.device, dtype)
        meta, _ = build_paged_decode([table], [length - 1], [0], None, kvh, kv.device, split=split)
        units = meta.unit_row.numel()
        assert not meta.direct and units == -(-length // split) <= TL.MERGE_MAX_UNITS
        # As a CUDA graph's buffers: more units than the row has (empty ones), max_row_units the key's bound.
        pad = TL.MERGE_MAX_UNITS - units
        z = torch.zeros(pad, dtype=torch.int64, device=kv.device)
        meta = dataclasses.replace(meta, unit_row=torch.cat([meta.unit_row, z]), unit_lo=torch.cat([meta.unit_lo, z]),
                                   unit_hi=torch.cat([meta.unit_hi, z]), max_row_units=TL.MERGE_MAX_UNITS)
        assert TL.merges_units(1, meta.max_row_units, meta.direct) and not TL.merges_units(2, 4, False)
        n_out = 2048 if big else 40
        w = (torch.randn(n_out, heads * dim, generator=g) / (heads * dim) ** 0.5).to(kv.device, dtype)
        b = torch.randn(n_out, generator=g).to(kv.device, dtype) if bias else None
        mid_o, mid_l = ops().paged_decode_units(q, kv, 1, meta, dim ** -0.5)
        attn = ops().paged_decode(q, kv, 1, meta, dim ** -0.5, torch.empty_like(q)).view(1, -1)
        unfused = TL.linear_partials(attn, w, b).sum(0)
        ref = F.linear(reference(q, kv, 1, table, [length - 1], None, dim ** -0.5).view(1, -1).to(dtype).float(),
                       w.float(), None if b is None else b.float())
        tol = TOL[dtype]
        scale = ref.abs().max().item()
        for splits in (None, 1, 2, 3, 64):  # K = 192 at 2 splits: the last split's second tile lies past K
            got = TL.merged_linear_partials(mid_o, mid_l, meta.row_start, meta.max_row_units, w, b, splits=splits)
            assert got.dtype == torch.float32 and got.shape[1:] == (1, n_out)
            what = f"kvh={kvh} group={group} dim={dim} length={length} splits={splits}"
            torch.testing.assert_close(got.sum(0), unfused, atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(got.sum(0), ref, atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 200])
def test_one_row_decode_through_merged_o_proj_equals_torch(mode, window, monkeypatch):
    """Batch-1 decode over several work units takes the merged o_proj path (no merge kernel) in eager
    steps and, on CUDA, in captured graphs; logits equal the torch backend's at every step. The launcher
    has the fusion off (``MERGE_MAX_UNITS`` 0); it is tested at the 16 units it ran with."""
    from worker.attention import triton_linear as TL

    monkeypatch.setattr(TL, "MERGE_MAX_UNITS", 16)
    dev = device_of(mode)
    cfg = dataclasses.replace(preset_config("tiny"), sliding_window=window, name="tiny-merged")
    dtypes = [torch.float32, torch.bfloat16] if mode == "cuda" else [torch.float32]
    bs, length, steps = 16, 600 if mode == "cuda" else 300, 6 if mode == "cuda" else 3
    seq = [(j * 7 + 3) % 250 for j in range(length)]
    table = list(range(-(-(length + steps) // bs)))
    calls = []
    T = ops()
    real = T.merged_linear_partials
    monkeypatch.setattr(T, "merged_linear_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    for dtype in dtypes:
        model = LlamaForCausalLM(cfg, device=dev, dtype=dtype)
        init_random_weights(model)

        def run(backend, graphs):
            r = ModelRunner(model, len(table) + 4, bs, cuda_graphs=graphs, attention_backend=backend)
            out = [r.step([Chunk(seq, 0, table)])]
            out += [r.step([Chunk([(5 * k) % 250], length + k, table)]) for k in range(steps)]
            assert not graphs or r.graphs.captured
            return torch.cat(out)

        ref = run("torch", False)
        calls.clear()
        runs = {"eager": run("triton", False)}
        assert len(calls) == steps * cfg.num_hidden_layers, "eager one-row steps did not merge units in o_proj"
        if mode == "cuda":
            runs["graphed"] = run("triton", True)
        for name, got in runs.items():
            tol = TOL[dtype] * 5 * ref.abs().max().item()
            torch.testing.assert_close(got, ref, atol=tol, rtol=0, msg=lambda m: f"{dtype} {name}: {m}")


@pytest.mark.gpu
def test_1b_greedy_tokens_equal_torch_path():
    """``1b`` bf16, CUDA graphs on: a batch of short rows and one long row (prefilled in two chunks,
    the second through the paged prefill kernel) decodes greedily on the torch path; the triton
    backend, fed the same tokens, gives logits within bf16 noise of it and the same greedy token at
    most steps.

    Why not every step: the preset's logits have a spread of about 2 over 128k tokens, so the top-2
    gap (≈ 0.4 on average, exponentially distributed) is below the two paths' bf16 rounding
    difference (≈ 0.1 between two logits of a row; 0.35 at most over a 31-row step on the H200) at a
    fair share of steps, where either token is an equally correct greedy choice. A free-running
    comparison diverged that way on the H200 (one token at step 2). Wrong attention (a missed block,
    a bad mask) moves logits by whole units and leaves the tokens agreeing at chance level."""
    model = build_preset("1b", device="cuda", dtype=torch.bfloat16)
    lengths = [5, 40, 300, 20000]
    steps, bs = 24, 16
    seqs = [[(i * 131 + j * 17 + 3) % 250 for j in range(n)] for i, n in enumerate(lengths)]
    tables, nblocks = _tables(lengths, steps + 4, bs)

    def run(backend, forced=None):
        r = ModelRunner(model, nblocks, bs, attention_backend=backend)
        half = lengths[-1] // 2
        short = r.step([Chunk(s, 0, t) for s, t in zip(seqs[:-1], tables[:-1])]
                       + [Chunk(seqs[-1][:half], 0, tables[-1])])
        long = r.step([Chunk(seqs[-1][half:], half, tables[-1])])
        logits = [torch.cat([short[:-1], long])]
        for k in range(steps):
            feed = (forced[k] if forced is not None else logits[-1].argmax(-1)).tolist()
            logits.append(r.step([Chunk([feed[i]], n + k, t) for i, (n, t) in enumerate(zip(lengths, tables))]))
        assert r.graphs.captured, "decode steps did not replay CUDA graphs"
        return torch.stack(logits)  # [steps + 1, rows, vocab]

    ref = run("torch")
    got = run("triton", forced=ref.argmax(-1))
    # 16 bf16 layers: 8% of the largest logit (the 4-layer tiny runner case uses 5%)
    torch.testing.assert_close(got, ref, atol=8e-2 * ref.abs().max().item(), rtol=0)
    same = got.argmax(-1) == ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1])[~same].tolist()
    assert same.float().mean() >= 0.5, f"{int(same.sum())} of {same.numel()} greedy tokens agree; gaps where not: {gaps}"


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(AttentionBackendError, match="attention backend must be one of"):
        resolve_backend("flash", "cpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(AttentionBackendError, match="triton"):
            ModelRunner(build_preset("tiny"), 4, 16, attention_backend="triton")
    assert ModelRunner(build_preset("tiny"), 4, 16).attention_backend == "torch"


def test_work_units_cover_each_row_once():
    """Units partition every row's visible range in order, none longer than the split; a graph
    buffer sized by ``max_units`` from the rows' buckets always holds them, its tail left empty."""
    from worker.attention.plan import MIN_SPLIT, choose_split, fill_units, max_units, row_ranges

    rng = np.random.default_rng(0)
    for window in (None, 300):
        for _ in range(50):
            rows = int(rng.integers(1, 40))
            pos = rng.integers(0, 40000, rows)
            bs = int(rng.choice([16, 32, 64]))
            first = (np.maximum(0, pos - window + 1) // bs) if window else np.zeros(rows, dtype=np.int64)
            lo, hi = row_ranges(pos, first * bs, window)
            assert (hi - lo >= 1).all() and (hi - lo <= (window or 1 << 30)).all()
            need = -(-(hi) // bs)  # blocks each table holds from its first block
            bucket = 1 << np.ceil(np.log2(np.maximum(need, 1))).astype(int)
            split = choose_split(int((bucket * bs).sum()), 8, 132)
            assert split >= MIN_SPLIT and split & (split - 1) == 0
            cap = max_units([(1, int(b) * bs) for b in bucket], split)
            u_row, u_lo, u_hi = (np.full(cap, -7, dtype=np.int64) for _ in range(3))
            row_start = np.full(rows + 1, -7, dtype=np.int64)
            n = fill_units(lo, hi, split, u_row, u_lo, u_hi, row_start)
            assert (u_lo[n:] == u_hi[n:]).all(), "unused units are empty"
            for r in range(rows):
                us, ue = row_start[r], row_start[r + 1]
                assert (u_row[us:ue] == r).all()
                assert u_lo[us] == lo[r] and u_hi[ue - 1] == hi[r]
                assert (u_lo[us + 1:ue] == u_hi[us:ue - 1]).all(), "contiguous, no overlap"
                assert (u_hi[us:ue] - u_lo[us:ue] <= split).all() and (u_hi[us:ue] > u_lo[us:ue]).all()
    with pytest.raises(ValueError, match="work units"):
        fill_units(np.array([0]), np.array([5000]), 256, *(np.zeros(3, dtype=np.int64) for _ in range(3)),
                   np.zeros(2, dtype=np.int64))


def _sig(names: str, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    sig = {n: types.get(n, "i32") for n in names.split()}
    sig.update({k: "constexpr" for k in constexprs})
    return sig


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs triton compiling for a real GPU target (the GPU host), not its CPU interpreter")
@pytest.mark.parametrize("dim", [64, 128])
def test_kernels_compile_for_hopper_without_spills(dim):
    """Every kernel compiles to sm_90 machine code with Triton's bundled ptxas (no GPU needed); the
    bf16 decode/prefill kernels spill no registers at the launchers' block shapes and their K/V
    loads are software-pipelined (cp.async)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    T = ops()
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    bf, i64 = "*bf16", "*i64"

    def build(fn, names, types, const, num_warps, pipelined=False):
        # As the JIT specialises a launch: pointers and these strides are multiples of 16.
        hinted = [i for i, n in enumerate(names.split()) if types.get(n, "").startswith("*")
                  or n in ("stride_qt", "stride_qh", "stride_blk", "stride_tok", "stride_ot", "stride_oh",
                           "stride_mu", "stride_mh", "stride_lu", "stride_xm", "stride_wn", "stride_om", "K",
                           "k_per_split")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in hinted}
        k = triton.compile(ASTSource(fn, _sig(names, types, const), const, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": 2})
        if pipelined:
            assert "async_copy_global_to_local" in k.asm["ttgir"], f"{fn.__name__}: K/V loads are not pipelined"
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        arch = re.search(r"\.target (\w+)", k.asm["ptx"]).group(1)
        out = subprocess.run([ptxas, "--gpu-name", arch, "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True)
        os.unlink(f.name)
        spills = re.search(r"(\d+) bytes spill stores", out.stderr + out.stdout)
        return int(spills.group(1)) if spills else 0

    bd = dim
    dec_types = {n: bf for n in ("Q", "K", "V", "Out")} | {n: i64 for n in ("Tables", "Pos", "Key0", "URow", "ULo", "UHi")}
    dec_types |= {"MidO": "*fp32", "MidL": "*fp32", "stride_blk": "i64", "qk_scale": "fp32"}
    for direct in (False, True):
        block_n, warps, _ = T.decode_config(bd)
        const = {"GROUP": 4, "BLOCK_H": 16, "HEAD_DIM": dim, "BLOCK_D": bd, "BLOCK_N": block_n, "PAGE": 16,
                 "DIRECT": direct, "PREC": None}
        assert build(T._decode_kernel, "Q K V Tables Pos Key0 URow ULo UHi Out MidO MidL stride_qt stride_qh "
                     "stride_blk stride_tok stride_tab stride_ot stride_oh stride_mu stride_mh stride_lu qk_scale",
                     dec_types, const, warps, pipelined=True) == 0
    pre_types = {n: bf for n in ("Q", "K", "V", "Out")} | {"Table": i64, "stride_blk": "i64", "qk_scale": "fp32"}
    for window in (0, 100):
        const = {"GROUP": 4, "GROUP_P": 4, "BLOCK_T": (128 if dim <= 64 else 64) // 4, "HEAD_DIM": dim, "BLOCK_D": bd,
                 "BLOCK_N": T.PREFILL_BLOCK_N, "PAGE": 16, "WINDOW": window, "PREC": None}
        assert build(T._prefill_kernel, "Q K V Table Out q_pos0 num_q key0 stride_qt stride_qh stride_blk stride_tok "
                     "stride_ot stride_oh qk_scale", pre_types, const, 8, pipelined=True) == 0
    build(T._merge_kernel, "MidO MidL RowStart Out stride_mu stride_mh stride_lu stride_ot stride_oh",
          {"MidO": "*fp32", "MidL": "*fp32", "RowStart": i64, "Out": bf},
          {"HEAD_DIM": dim, "BLOCK_D": bd, "BLOCK_U": 16}, 2)
    for nsplit in (0, 4):
        qkv = "*fp32" if nsplit else bf
        build(T._rope_store_kernel, "QKV Cos Sin K V SlotBlock SlotOff QOut stride_qkv stride_cos stride_blk "
              "stride_tok stride_qo stride_split", {n: bf for n in ("Cos", "Sin", "K", "V", "QOut")}
              | {"QKV": qkv, "SlotBlock": i64, "SlotOff": i64, "stride_blk": "i64"},
              {"NQ": 32, "NKV": 8, "HEAD_DIM": dim, "HALF": dim // 2, "BLOCK_HALF": dim // 2, "NSPLIT": nsplit}, 1)
        build(T._add_rms_norm_kernel, "X R W H Y stride_x stride_r stride_h stride_y stride_split n eps",
              {n: bf for n in "R W H Y".split()} | {"X": qkv, "eps": "fp32"}, {"BLOCK": 2048, "NSPLIT": nsplit}, 8)
    from worker.attention import triton_linear as TL
    m1 = TL.M1_TILE or (16, 4, TL.BLOCK_K)  # the batch-1 tile: (BLOCK_N, num_warps, BLOCK_K)
    for bm, bn, swiglu, partial, bk, warps in ((16, 16, False, True, TL.BLOCK_K, 4), (32, 16, False, True, TL.BLOCK_K, 4),
                                               (16, 32, True, False, TL.BLOCK_K, 4), (32, 64, False, False, TL.BLOCK_K, 4),
                                               (16, m1[0], False, True, m1[2], m1[1])):
        assert build(TL._small_m_kernel, "X W Bias Out M N K k_per_split stride_xm stride_wn stride_os stride_om "
                     "up_off", {"X": bf, "W": bf, "Bias": bf, "Out": "*fp32" if partial else bf},
                     {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SWIGLU": swiglu, "HAS_BIAS": False,
                      "PARTIAL": partial, "PREC": None}, warps, pipelined=True) == 0
    # The batch-1 tiles the launchers are set to (the LM head, per-matrix split-K), and the register GEMV
    # kernel in its three output modes.
    tiles = [(t, False, False) for t in [TL.M1_LM_HEAD_TILE] if t]
    tiles += [(t, False, True) for t in TL.M1_ROLE_TILES.values()]
    tiles += [((True, 8, 4, 256, 1), sw, part) for sw, part in ((True, False), (False, True), (False, False))]
    for (gemv, bn, warps, bk, _), swiglu, partial in tiles:
        const = {"BLOCK_N": bn, "BLOCK_K": bk, "SWIGLU": swiglu, "HAS_BIAS": False, "PARTIAL": partial}
        types = {"X": bf, "W": bf, "Bias": bf, "Out": "*fp32" if partial else bf}
        if gemv:
            assert build(TL._gemv_kernel, "X W Bias Out N K k_per_split stride_wn stride_os up_off", types, const,
                         warps) == 0
        else:
            assert build(TL._small_m_kernel, "X W Bias Out M N K k_per_split stride_xm stride_wn stride_os stride_om "
                         "up_off", types, const | {"BLOCK_M": 16, "PREC": None}, warps, pipelined=True) == 0
    build(T._silu_mul_kernel, "GU Out stride_gu stride_o inter", {"GU": bf, "Out": bf}, {"BLOCK": 1024}, 4)
    assert build(T._embed_rms_norm_kernel, "Ids E W H Y stride_e stride_h stride_y n eps",
                 {"Ids": i64, "E": bf, "W": bf, "H": bf, "Y": bf, "eps": "fp32"}, {"BLOCK": 2048}, 8) == 0
    assert build(TL._merged_m1_kernel, "MidO MidL RowStart W Bias Out N K k_per_split stride_mu stride_lu stride_wn "
                 "stride_os", {"MidO": "*fp32", "MidL": "*fp32", "RowStart": i64, "W": bf, "Bias": bf, "Out": "*fp32"},
                 {"BLOCK_M": 16, "BLOCK_N": m1[0], "BLOCK_K": m1[2], "BLOCK_U": TL.MERGE_MAX_UNITS or 16, "HEAD_DIM": dim,
                  "HAS_BIAS": False, "PREC": None}, m1[1], pipelined=True) == 0
