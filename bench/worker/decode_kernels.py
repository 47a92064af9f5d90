#!/usr/bin/env python3
"""The triton backend's decode kernels alone, at the shapes of one model, next to what they replace.

    python bench/worker/decode_kernels.py --model 1b            # on a GPU: both parts below
    python bench/worker/decode_kernels.py --part gemm           # small-M linears only
    python bench/worker/decode_kernels.py --part m1 --json m1.json   # batch-1 tiles (not part of "all")

``gemm``: every weight matrix of the model (all layers: their bytes do not fit in L2, as in a real
step) multiplied by M = 1 / 8 / 32 rows, through cuBLAS (``F.linear``) and through the split-K kernel
of worker/attention/triton_linear.py at the launcher's split count and at forced ones (gate_up: the
fused SwiGLU kernel). Each cell is µs per matrix, from a CUDA graph replaying all layers.

``m1``: batch-1 (M = 1) tiles of worker/attention/triton_linear.py per matrix, the LM head included,
against cuBLAS: µs per matrix and GB/s of weight read.

``attn``: the paged decode kernel (worker/attention/triton_ops.py) over a pool of the model's KV
shape, one launch per layer, for batch × context cases, at every work-unit size (``split``) and
tile variant ``(BLOCK_N, num_warps, num_stages)``: µs per step (all layers) and GB/s of K/V read.

Prints only (the numbers that set the launchers' constants are quoted in bench/RESULTS.md). On the
CPU it runs under Triton's interpreter (``SPLITSERVE_TRITON_INTERPRET=1``) at ``--model tiny`` with
wall-clock timing, as a smoke test of the code path, not a measurement.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from worker.attention import interpreting  # noqa: E402
from worker.loader import load_model, resolve_device, resolve_dtype  # noqa: E402


def step_time(fn, dev: torch.device, reps: int = 20) -> float:
    """µs per call of ``fn``: median of 5 rounds of ``reps`` CUDA-graph replays (wall clock on the CPU)."""
    if dev.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(rounds)


def gemm(model, dev, ms) -> None:
    from worker.attention import triton_linear as TL

    layers = model.layers
    mats = {"qkv": [l.self_attn.qkv_proj.weight for l in layers], "o": [l.self_attn.o_proj.weight for l in layers],
            "gate_up": [l.mlp.gate_up_proj.weight for l in layers], "down": [l.mlp.down_proj.weight for l in layers]}
    print("| M | matrix | N × K | cuBLAS µs | triton µs (launcher's split) | forced splits: µs |")
    print("|---:|---|---|---:|---:|---|")
    for m in ms:
        for name, ws in mats.items():
            n, k = ws[0].shape
            x = torch.randn(m, k, device=dev, dtype=model.dtype)
            per = len(ws)
            cub = step_time(lambda: [F.linear(x, w) for w in ws], dev) / per
            if name == "gate_up":
                ours = step_time(lambda: [TL.gate_up_silu(x, w) for w in ws], dev) / per
                forced = "SwiGLU fused (no split)"
            else:
                ours = step_time(lambda: [TL.linear_partials(x, w) for w in ws], dev) / per
                forced = " ".join(f"{s}: {step_time(lambda: [TL.linear_partials(x, w, splits=s) for w in ws], dev) / per:.1f}"
                                  for s in (1, 2, 4, 8, 16))
            print(f"| {m} | {name} | {n} × {k} | {cub:.1f} | {ours:.1f} | {forced} |")


#: M = 1 tiles ``(GEMV, BLOCK_N, num_warps, BLOCK_K, num_stages)`` that ``--part m1`` times besides the
#: launchers' own (worker/attention/triton_linear.py; bench/RESULTS.md, "issue 17, seventh pass").
M1_SWEEP = {
    "gate_up": [(False, 32, 2, 128, 4), (False, 16, 1, 128, 3), (True, 4, 1, 256, 1), (True, 8, 4, 256, 1)],
    "split": [(False, 32, 2, 64, 4), (False, 32, 2, 64, 5), (True, 32, 4, 256, 1), (True, 32, 8, 256, 1),
              (True, 64, 8, 256, 1), (True, 32, 4, 512, 1), (True, 16, 2, 256, 1), (True, 64, 4, 128, 1)],
    "lm_head": [(False, 64, 4, 128, 4), (False, 64, 4, 128, 5), (False, 64, 4, 128, 6), (False, 128, 4, 128, 4),
                (False, 128, 8, 128, 4), (False, 64, 8, 128, 4), (False, 64, 4, 256, 3), (False, 64, 2, 128, 4),
                (True, 4, 4, 512, 1)],
}


def m1(model, dev, quick: bool, json_path: str | None) -> None:
    """Batch-1 tiles: gate_up (SwiGLU), the split-K matrices at the launcher's split for each tile, and
    the LM head (:func:`worker.attention.triton_linear.linear_m1` against cuBLAS), µs per matrix."""
    import json

    from worker.attention import triton_linear as TL

    layers = model.layers
    mats = {"qkv": [l.self_attn.qkv_proj.weight for l in layers], "o": [l.self_attn.o_proj.weight for l in layers],
            "down": [l.mlp.down_proj.weight for l in layers], "gate_up": [l.mlp.gate_up_proj.weight for l in layers],
            "lm_head": [model.output_weight] * 4}
    sweep = {k: v[:2] for k, v in M1_SWEEP.items()} if quick else M1_SWEEP
    out: dict[str, dict[str, float | None]] = {}

    def timed(fn, ws) -> float | None:
        try:
            return step_time(lambda: [fn(w) for w in ws], dev) / len(ws)
        except Exception as e:  # a tile over the shared-memory limit, say
            print(f"<!-- {type(e).__name__}: {str(e)[:120]} -->")
            return None

    print("\n| matrix | tile (GEMV, BLOCK_N, warps, BLOCK_K, stages) | K splits | µs | GB/s |")
    print("|---|---|---:|---:|---:|")
    for name, ws in mats.items():
        n, k = ws[0].shape
        x = torch.randn(1, k, device=dev, dtype=model.dtype)
        nbytes = ws[0].numel() * ws[0].element_size()
        cells = [("cuBLAS", 1, lambda w: F.linear(x, w))]
        if name == "gate_up":
            cells.append(("launcher", 1, lambda w: TL.gate_up_silu(x, w)))
            cells += [(t, 1, lambda w, t=t: TL.gate_up_silu(x, w, tile=t)) for t in sweep["gate_up"]]
        elif name == "lm_head":
            cells += [(t, 1, lambda w, t=t: TL.linear_m1(x, w, tile=t)) for t in sweep["lm_head"]]
        else:
            cells.append(("launcher", TL.linear_partials(x, ws[0], role=name).shape[0],
                          lambda w: TL.linear_partials(x, w, role=name)))
            cells += [(t, TL.linear_partials(x, ws[0], tile=t).shape[0],
                       lambda w, t=t: TL.linear_partials(x, w, tile=t)) for t in sweep["split"]]
        out[name] = {}
        for tile, splits, fn in cells:
            us = timed(fn, ws)
            out[name][str(tile)] = us
            cell = "failed" if us is None else f"{us:.2f} | {nbytes / us / 1e3:.0f}"
            print(f"| {name} | {tile} | {splits} | {cell} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)


def attn(model, dev, quick: bool) -> None:
    from worker.attention import triton_ops as T
    from worker.attention.plan import build_paged_decode, choose_split, num_sms

    cfg = model.config
    layers, kvh, d, nq, bs = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads, 16
    cases = ({"b1_200": [200], "b4_100": [100] * 4} if quick else
             {"b1_1k": [1056], "b8_1k": [1056] * 8, "b32_1k": [1056] * 32, "b1_32k": [32784], "b8_32k": [32784] * 8,
              "b32_8k": [8208] * 32, "mixed 32k+30x512": [32784] + [528] * 30})
    blocks = max(sum(-(-n // bs) for n in v) for v in cases.values()) + 4
    kv = torch.randn(blocks, layers, 2, bs, kvh, d, device=dev, dtype=model.dtype)
    variants = [None] if quick else [None, (64, 4, 2), (32, 4, 2), (128, 4, 3), (32, 2, 3)]
    splits = (64, 128) if quick else (64, 128, 256, 512, 1024, 2048, 4096, 1 << 20)
    print("\n| case | K/V MB per step | launcher split | launcher µs | best µs (split, units, variant) | best GB/s |")
    print("|---|---:|---:|---:|---|---:|")
    for name, lengths in cases.items():
        tables, o = [], 0
        for n in lengths:
            tables.append(np.arange(o, o + -(-n // bs)))
            o += len(tables[-1])
        pos = [n - 1 for n in lengths]
        q = torch.randn(len(lengths), nq, d, device=dev, dtype=model.dtype)
        out = torch.empty_like(q)
        nbytes = sum(lengths) * layers * 2 * kvh * d * kv.element_size()
        default = choose_split(sum(lengths), kvh, num_sms(q.device))
        res = []
        for split in sorted(set(splits) | {default}):
            meta, _ = build_paged_decode(tables, pos, [0] * len(lengths), None, kvh, q.device, split=split)
            for var in variants:
                t = step_time(lambda: [T.paged_decode(q, kv, layer, meta, d ** -0.5, out, cfg=var)
                                       for layer in range(layers)], dev)
                res.append((t, split, meta.unit_row.numel(), var or T.decode_config(T._pow2(d))))
        launcher = next(t for t, s, _, v in res if s == default and v == T.decode_config(T._pow2(d)))
        best = min(res)
        print(f"| {name} | {nbytes / 1e6:.1f} | {default} | {launcher:.1f} | {best[0]:.1f} ({best[1]}, {best[2]}, "
              f"{best[3]}) | {nbytes / best[0] / 1e3:.0f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--part", choices=["gemm", "attn", "m1", "all"], default="all",
                   help="all = gemm + attn; m1 = the batch-1 tile sweep")
    p.add_argument("--json", default=None, help="--part m1: also write its numbers here")
    args = p.parse_args(argv)
    dev = resolve_device(args.device)
    if dev.type != "cuda" and not interpreting():
        print("bench/worker/decode_kernels.py needs a CUDA device (or SPLITSERVE_TRITON_INTERPRET=1 for a smoke run)")
        return 2
    dtype = resolve_dtype(None, dev)
    model, _, _ = load_model(args.model, dev, dtype)
    quick = dev.type != "cuda"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    print(f"## decode kernels: {args.model}, {str(dtype).removeprefix('torch.')}, {name}, torch {torch.__version__}\n")
    with torch.inference_mode():
        if args.part in ("gemm", "all"):
            gemm(model, dev, (1, 3) if quick else (1, 8, 32))
        if args.part in ("attn", "all"):
            attn(model, dev, quick)
        if args.part == "m1":
            m1(model, dev, quick, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
