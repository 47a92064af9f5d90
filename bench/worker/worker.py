#!/usr/bin/env python3
"""Worker model throughput next to its roofline, both measured in the same run.

    python bench/worker/worker.py                          # tiny on CPU (fp32)
    python bench/worker/worker.py --device cuda --model 1b # Llama-3.2-1B shapes, bf16 on a GPU
    python bench/worker/worker.py --quick --no-write       # smoke run
    python bench/worker/worker.py --model smollm2-135m     # SmolLM2-135M-Instruct (GGUF, real weights)

Prefill: one ``ModelRunner.step`` over ``batch`` prompts of ``--prompt-len`` tokens. Its roofline is the
time of the model's own GEMMs alone — ``F.linear`` with the model's weight matrices on an activation of
``batch·prompt_len`` rows, every layer, plus the LM head on the last rows — so 100% means "attention,
norms, RoPE, cache writes and Python cost nothing".

Decode: ``--decode-steps`` steps of ``batch`` single-token chunks at each context of ``--context``
(default 1k/8k/32k on CUDA, the prompt length on the CPU). Its roofline is bytes/bandwidth: the
weights read once per step (the embedding table only where it doubles as the LM head) plus every
sequence's K/V read once, over the copy bandwidth of a large ``Tensor.copy_`` measured here (counting
read + write bytes). Decode contexts are not prefilled: the cache is filled with noise once (values do
not change a step's work, and 32 prefills of 32k tokens would dominate the run).

``--attention-backend`` (``auto``, ``triton``, ``torch`` or ``both``; default ``both`` on CUDA) picks
the runner's attention (worker/attention); ``both`` runs every case on each backend in the same
process, the torch path first, so the two are compared on one machine state.

Mixed decode (``--mixed-decode``): one long context (``--long-len``) decoding in the same batch as
``--short-rows`` short ones (``--short-len``), timed per step twice in the same run: with decode rows
grouped by table length (the runner's default) and forced into one batch padded to the longest table
(``max_decode_groups = 1``, the old behaviour) on the torch backend, and through the paged kernel
(which reads each row's own range: no grouping) on the triton backend. The K/V cache is left zero instead of prefilled:
values do not change the work a step does, and a 32k prefill would dominate the run. Those modes call
``ModelRunner.step`` and wait for each step. Then the same batch runs through the worker's own step loop
(``TorchEngine``: real requests, prefilled by the engine, greedy, detokenized), with synchronous and with
async scheduling alternately (``--serving-repeats`` pairs; ``--no-serving`` skips them): the step time a
served request sees, the host's planning included.

Needs only torch and this repository. Appends (or replaces) a ``## worker`` section in bench/RESULTS.md
unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench._common import cpu_model, replace_subsection  # noqa: E402
from worker.loader import load_model, resolve_device, resolve_dtype  # noqa: E402
from worker.attention import resolve_backend  # noqa: E402
from worker.runner import Chunk, ModelRunner  # noqa: E402

BATCHES = (1, 8, 32)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(dev: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s moved by a large device-local copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), dev, repeats, warmup=2)
    return 2 * src.numel() * 4 / t


def gemm_time(model, rows: int, out_rows: int, dev: torch.device, repeats: int) -> float:
    """Seconds for the model's GEMMs on ``rows`` tokens (LM head on ``out_rows``)."""
    cfg = model.config
    x = {}
    mats = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        mats += [a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight]
    for w in {w.shape[1] for w in mats}:
        x[w] = torch.randn(rows, w, device=dev, dtype=model.dtype)
    head_in = torch.randn(out_rows, cfg.hidden_size, device=dev, dtype=model.dtype)

    def run():
        for w in mats:
            F.linear(x[w.shape[1]], w)
        F.linear(head_in, model.output_weight)

    with torch.inference_mode():
        return timed(run, dev, repeats, warmup=2)


def gemm_flops(model, rows: int, out_rows: int) -> int:
    total = 0
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        for w in (a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight):
            total += 2 * rows * w.shape[0] * w.shape[1]
    return total + 2 * out_rows * model.output_weight.numel()


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter except an untied input embedding (only B rows of
    it are touched)."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight" and model.lm_head is not None:
            continue
        total += p.numel() * p.element_size()
    return total


def machine(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"{cpu_model()}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads (torch {torch.__version__})"


def backends(args: argparse.Namespace, dev: torch.device) -> list[str]:
    if args.attention_backend == "both":
        return ["torch", "triton"]
    if args.attention_backend is None:
        return ["torch", "triton"] if dev.type == "cuda" else ["torch"]
    return [args.attention_backend]


def run(args: argparse.Namespace) -> tuple[list[dict], dict]:
    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    t_load = time.perf_counter()
    model, _, cfg = load_model(args.model, dev, dtype, cache_dir=args.cache_dir)
    t_load = time.perf_counter() - t_load
    quick = args.quick
    prompt_len = args.prompt_len or (64 if quick else (1024 if dev.type == "cuda" else 256))
    contexts = tuple(args.context) if args.context else ((1024, 8192, 32768) if dev.type == "cuda" and not quick
                                                          else (prompt_len,))
    steps = args.decode_steps or (4 if quick else (32 if dev.type == "cuda" else 16))
    # A served request never passes the model's trained context (worker/engine.py sets max_model_len to
    # max_position_embeddings, and the runner's CUDA-graph tables stop there): decode contexts past it
    # are clipped to the longest one a worker would run, warm-up steps included.
    limit = cfg.max_position_embeddings - 2 * steps - 2
    clipped = [c for c in contexts if c > limit]
    contexts = tuple(dict.fromkeys(min(c, limit) for c in contexts))
    repeats = 2 if quick else 5
    batches = tuple(args.batch) if args.batch else BATCHES
    bs = args.block_size
    blocks_per_seq = (max(prompt_len, *contexts) + 2 * steps + 2 + bs - 1) // bs + 1
    bw = copy_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (256 << 20), repeats=5)
    wbytes = weight_bytes(model)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    graphs = False
    used, failures = [], []
    for backend in backends(args, dev):
        try:
            runner = ModelRunner(model, num_blocks=max(batches) * blocks_per_seq, block_size=bs,
                                 device=dev, dtype=dtype, attention_backend=backend)
            used.append(runner.attention_backend)
            if args.cuda_graphs is not None:
                runner.use_cuda_graphs = args.cuda_graphs
            graphs = runner.use_cuda_graphs
            kv_token_bytes = runner.block_stride // bs
            for b in batches:
                tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
                prompts = [torch.randint(0, min(cfg.vocab_size, 256), (prompt_len,), generator=gen).tolist()
                           for _ in range(b)]
                prefill = [Chunk(prompts[i], 0, tables[i]) for i in range(b)]
                t_prefill = timed(lambda: runner.step(prefill), dev, repeats)
                t_gemm = gemm_time(model, b * prompt_len, b, dev, repeats)
                flops = gemm_flops(model, b * prompt_len, b)
                rows.append({"phase": "prefill", "backend": runner.attention_backend, "batch": b, "context": prompt_len,
                             "tokens": b * prompt_len, "tok_s": b * prompt_len / t_prefill,
                             "roof_tok_s": b * prompt_len / t_gemm, "step_ms": 1e3 * t_prefill,
                             "basis": f"GEMMs {flops / t_gemm / 1e12:.2f} TFLOP/s"})
            runner.kv_cache.normal_()  # decode contexts hold noise, not prefilled K/V (see the docstring)
            for ctx in contexts:
                # Each table as long as a scheduler's would be (the blocks its positions fill, warm-up
                # included), not the longest context's: the runner's host side walks what it is given.
                need = (ctx + 2 * steps + 1) // bs + 1
                for b in batches:
                    tables = [list(range(i * blocks_per_seq, i * blocks_per_seq + need)) for i in range(b)]
                    last = [(7 * i + 1) % 250 for i in range(b)]

                    def decode(base: int):
                        for s in range(steps):
                            runner.step([Chunk([last[i]], base + s, tables[i]) for i in range(b)])

                    decode(ctx + steps + 1)  # warm-up and CUDA-graph capture at positions past the timed ones
                    t_dec = timed(lambda: decode(ctx), dev, max(1, repeats // 2), warmup=0)
                    avg_ctx = ctx + (steps + 1) / 2
                    step_bytes = wbytes + b * avg_ctx * kv_token_bytes
                    rows.append({"phase": "decode", "backend": runner.attention_backend, "batch": b, "context": ctx,
                                 "tokens": b * steps, "tok_s": b * steps / t_dec, "roof_tok_s": b / (step_bytes / bw),
                                 "step_ms": 1e3 * t_dec / steps,
                                 "basis": f"{step_bytes / 1e6:.1f} MB/step @ {bw / 1e9:.0f} GB/s"})
            del runner
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # report and go on: the other backend's rows still get written
            traceback.print_exc()
            failures.append(f"{backend}: {type(e).__name__}: {e}")
            runner = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    info = {
        "model": args.model, "device": str(dev), "dtype": str(dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()), "weight_bytes": wbytes,
        "copy_bw": bw, "prompt_len": prompt_len, "decode_steps": steps, "block_size": bs,
        "machine": machine(dev), "cuda_graphs": bool(graphs), "backends": used, "failures": failures,
        "load_s": t_load, "clipped": clipped, "limit": limit,
    }
    return rows, info


def serving_loop(runner, tokenizer, lengths: list[int], slack: list[int], async_scheduling: bool,
                 seed: int = 0) -> dict:
    """The mixed batch through the worker's own step loop (``TorchEngine``: scheduler, sampling,
    detokenizing, token events), synchronous or with async scheduling. Every row is a real request
    (random prompt of its length, prefilled by the engine); the step time is the median interval
    between the long row's tokens while every short row is still decoding."""
    from worker.engine import TorchEngine
    from worker.requests import EngineRequest, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    long_max = max(2, min(16, slack[0]))
    short_max = min(min(slack[1:]), long_max + 32)
    reqs = [EngineRequest(f"r{i}", torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(
        max_tokens=long_max if i == 0 else short_max, temperature=0.0, ignore_eos=True))
        for i, n in enumerate(lengths)]
    engine = TorchEngine(runner, tokenizer, max_batch_size=max(64, len(lengths)), max_num_tokens=8192,
                         async_scheduling=async_scheduling)

    async def go() -> tuple[list[float], float]:
        await engine.start()
        ends: list[float] = []

        async def consume(r, times):
            stream = await engine.submit(r)
            async for ev in stream:
                if times is not None and ev.token_ids:
                    times.append(time.perf_counter())
            ends.append(time.perf_counter())

        try:
            long_times: list[float] = []
            # short rows first: they prefill and start decoding, then the long row prefills beside them
            await asyncio.gather(*(consume(r, None) for r in reqs[1:]), consume(reqs[0], long_times))
            return long_times, min(ends[1:] or ends)
        finally:
            await engine.stop()

    times, first_short_end = asyncio.run(go())
    # Intervals after the long row's first token (its prefill step) and before any short row ended.
    iv = [b - a for a, b in zip(times[1:], times[2:]) if b <= first_short_end]
    stats = engine.stats()
    return {"mode": f"serving loop ({'async' if async_scheduling else 'sync'} scheduling)",
            "ms": 1e3 * statistics.median(iv) if iv else float("nan"), "groups": "-", "key_slots": len(iv),
            "context_slots": "-", "steps": stats["steps_total"], "async": engine.async_scheduling}


def mixed_decode(args: argparse.Namespace) -> tuple[list[dict], dict]:
    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    model, tokenizer, cfg = load_model(args.model, dev, dtype, cache_dir=args.cache_dir)
    gpu = dev.type == "cuda"
    long_len = args.long_len or (32768 if gpu else 4096)
    short_len = args.short_len or (512 if gpu else 64)
    shorts = args.short_rows
    steps = args.decode_steps or (4 if args.quick else (32 if gpu else 8))
    bs = args.block_size
    lengths = [long_len] + [short_len] * shorts
    tables, first, slack = [], 0, []
    for n in lengths:
        nb = (n + steps + 4 + bs - 1) // bs
        tables.append(list(range(first, first + nb)))
        slack.append(nb * bs - n)
        first += nb
    rows, logits = [], {}
    modes = []
    for backend in backends(args, dev):
        if backend == "torch":
            modes += [("one padded batch", "torch", 1), ("grouped by length", "torch", 3)]
        else:
            modes.append((f"paged kernel ({backend})", backend, 3))
    runner, failures, graphs = None, [], False
    for label, backend, groups in modes:
        try:
            if runner is None or runner.attention_backend != resolve_backend(backend, dev):
                runner = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                runner = ModelRunner(model, num_blocks=first, block_size=bs, device=dev, dtype=dtype,
                                     attention_backend=backend)
                if args.cuda_graphs is not None:
                    runner.use_cuda_graphs = args.cuda_graphs
                graphs = runner.use_cuda_graphs
            runner.max_decode_groups = groups
            runner.kv_cache.zero_()

            def step(k: int):
                return runner.step([Chunk([(i + k) % 250], n + k, t) for i, (n, t) in enumerate(zip(lengths, tables))])

            for k in range(2):  # warm-up (and CUDA-graph capture) at positions the timed steps do not reuse
                step(steps + 2 + k)
            sync(dev)
            times = []
            for k in range(steps):
                t0 = time.perf_counter()
                out = step(k)
                sync(dev)
                times.append(time.perf_counter() - t0)
            logits[label] = out.float().cpu()
            st = runner.last_step_stats
            rows.append({"mode": label, "ms": 1e3 * statistics.median(times), "groups": st["decode_groups"],
                         "key_slots": st["decode_key_slots"], "context_slots": st["decode_context_slots"]})
        except Exception as e:  # report and go on with the other modes
            traceback.print_exc()
            failures.append(f"{label}: {type(e).__name__}: {e}")
            runner = None
    # The same batch through the worker's step loop, on the last runner (its graphs already captured):
    # sync, async, sync, async (alternating, so drift shows).
    if runner is not None and not args.no_serving:
        runner.max_decode_groups = 3
        for flag in (False, True) * max(1, args.serving_repeats):
            try:
                rows.append(serving_loop(runner, tokenizer, lengths, slack, flag))
            except Exception as e:
                traceback.print_exc()
                failures.append(f"serving loop async={flag}: {type(e).__name__}: {e}")
    vals = list(logits.values()) or [torch.zeros(1)]
    a = vals[0]
    diff = max((float((a - b).abs().max()) for b in vals[1:]), default=0.0)
    info = {"model": args.model, "device": str(dev), "dtype": str(dtype).removeprefix("torch."),
            "machine": machine(dev), "block_size": bs, "long_len": long_len, "short_len": short_len,
            "short_rows": shorts, "decode_steps": steps,
            "cuda_graphs": graphs,
            "max_abs_diff": diff, "logit_scale": float(a.abs().max()), "first_mode": next(iter(logits), "-"),
            "failures": failures}
    return rows, info


def profile_decode(args: argparse.Namespace) -> int:
    """Where a decode step's time goes: ``--profile-decode BATCH:CONTEXT`` replays 8 steps per backend
    under torch.profiler and prints the kernels by GPU time per step, and their sum against the wall
    time per step (the difference is launch gaps and host work). Prints only; writes nothing."""
    from torch.profiler import ProfilerActivity, profile

    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    model, _, cfg = load_model(args.model, dev, dtype)
    b, ctx = (int(x) for x in args.profile_decode.split(":"))
    bs, steps = args.block_size, 8
    per_seq = (ctx + 4 * steps + bs - 1) // bs + 1
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for backend in backends(args, dev):
        runner = ModelRunner(model, num_blocks=b * per_seq, block_size=bs, device=dev, dtype=dtype,
                             attention_backend=backend)
        if args.cuda_graphs is not None:
            runner.use_cuda_graphs = args.cuda_graphs
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]

        def run(base: int) -> None:
            for k in range(steps):
                runner.step([Chunk([(7 * i + k) % 250], base + k, tables[i]) for i in range(b)])

        run(ctx + 2 * steps)  # compile, capture
        sync(dev)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            run(ctx)
            sync(dev)
            wall = (time.perf_counter() - t0) / steps
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
        kernels = [e for e in events if dev.type != "cuda"
                   or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA] or events
        total = sum(getattr(e, key, 0) for e in kernels) / steps
        print(f"\n### {backend}: batch {b}, context {ctx}: {1e3 * wall:.3f} ms/step wall, "
              f"{total / 1e3:.3f} ms/step in {'kernels' if dev.type == 'cuda' else 'ops'}\n")
        print("| kernel | calls/step | µs/step | µs/call |\n|---|---:|---:|---:|")
        for e in kernels[:args.profile_top]:
            t = getattr(e, key, 0)
            print(f"| `{e.key[:90]}` | {e.count / steps:.1f} | {t / steps:.1f} | {t / max(1, e.count):.2f} |")
        del runner
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def sampling_bench(args: argparse.Namespace) -> int:
    """``--sampling``: worker/sampling.py's batched ``sample`` against ``sample_reference`` (one row at a
    time) on the same fp32 logits ``[batch, --vocab]``, every row non-greedy (temperature 0.8, top-k 50,
    top-p 0.95, its own seed); median ms per call of each over ``--sampling-repeats`` calls, same run.
    Prints only."""
    from worker.requests import SamplingParams
    from worker.sampling import make_generator, sample, sample_reference

    dev = resolve_device(args.device)
    gen = torch.Generator().manual_seed(0)
    print(f"## sampling — vocab {args.vocab:,}, {machine(dev)}\n")
    print("| batch | one row at a time ms | batched ms | speedup |\n|---:|---:|---:|---:|")
    for b in (tuple(args.batch) if args.batch else BATCHES):
        logits = (torch.randn(b, args.vocab, generator=gen) * 2).to(dev)
        params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i) for i in range(b)]

        def call(fn):
            return lambda: fn(logits, [(i, p, make_generator(p, dev)) for i, p in enumerate(params)])

        t_ref = timed(call(sample_reference), dev, args.sampling_repeats)
        t_new = timed(call(sample), dev, args.sampling_repeats)
        print(f"| {b} | {1e3 * t_ref:.3f} | {1e3 * t_new:.3f} | {t_ref / t_new:.1f}x |")
    return 0


def render_mixed(rows: list[dict], info: dict, command: str) -> str:
    lines = [
        f"- command: `{command}`",
        f"- machine: {info['machine']}",
        f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- model `{info['model']}` ({info['dtype']}), device `{info['device']}`, block size {info['block_size']}, "
        f"CUDA graphs {'on' if info['cuda_graphs'] else 'off'}: one row at {info['long_len']} tokens + "
        f"{info['short_rows']} rows at {info['short_len']} tokens, median of {info['decode_steps']} steps",
        f"- last-step logits, every mode vs {info['first_mode']}: max |diff| {info['max_abs_diff']:.2e} "
        f"(max |logit| {info['logit_scale']:.2f})",
        *[f"- FAILED {f}" for f in info.get("failures", [])],
        "",
        "| decode batch | step ms | groups | key slots read / layer | keys the rows need |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "steps" in r:  # a serving-loop row: key_slots holds the intervals measured
            lines.append(f"| {r['mode']} | {r['ms']:.2f} | - | median of {r['key_slots']} steps "
                         f"({r['steps']} engine steps in all) | - |")
            continue
        lines.append(f"| {r['mode']} | {r['ms']:.2f} | {r['groups']} | {r['key_slots']:,} | {r['context_slots']:,} |")
    return "\n".join(lines) + "\n"


def render(rows: list[dict], info: dict, command: str) -> str:
    lines = [
        f"- command: `{command}`",
        f"- machine: {info['machine']}",
        f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- model: `{info['model']}` ({info['params'] / 1e6:.1f} M params, {info['dtype']}, "
        f"{info['weight_bytes'] / 1e6:.1f} MB read per decode step), device `{info['device']}`, "
        f"block size {info['block_size']}, prompt {info['prompt_len']} tokens, "
        f"{info['decode_steps']} decode steps per context, CUDA graphs {'on' if info['cuda_graphs'] else 'off'}",
        f"- measured copy bandwidth: {info['copy_bw'] / 1e9:.1f} GB/s; model load {info['load_s']:.2f}s; "
        f"attention backends: {', '.join(info['backends'])}",
        *[f"- FAILED {f}" for f in info.get("failures", [])],
        *([f"- contexts {', '.join(map(str, info['clipped']))} clipped to {info['limit']}: the model's "
           f"max_position_embeddings less the decode steps (a worker serves no longer context)"]
          if info.get("clipped") else []),
        "",
        "| phase | batch | tokens/s | roofline tokens/s | % of roofline | backend | context | step ms | roofline basis |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['batch']} | {r['tok_s']:,.0f} | {r['roof_tok_s']:,.0f} | "
                     f"{100 * r['tok_s'] / r['roof_tok_s']:.1f}% | {r['backend']} | {r['context']} | "
                     f"{r['step_ms']:.3f} | {r['basis']} |")
    return "\n".join(lines) + "\n"


def write_results(path: Path, body: str, info: dict, kind: str = "") -> None:
    """Replace this configuration's subsection under ``## worker`` (or add it), keeping other text."""
    title = f"### {kind}{info['model']} · {info['device']} · {info['dtype']}"
    if info["device"].startswith("cuda"):
        title += " · CUDA graphs " + ("on" if info["cuda_graphs"] else "off")
        title += " · attention " + "+".join(info.get("backends") or [])
    replace_subsection(path, "worker", title, body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny",
                   help="preset (tiny, 1b, 8b), named GGUF model (smollm2-135m), .gguf file or HF directory")
    p.add_argument("--cache-dir", default=None, help="converted-GGUF cache (default ~/.cache/splitserve)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--batch", type=int, action="append", help=f"batch sizes (default {BATCHES})")
    p.add_argument("--prompt-len", type=int, default=0, help="prompt length (prefill)")
    p.add_argument("--context", type=int, action="append",
                   help="decode context length (repeatable; default 1024, 8192, 32768 on CUDA, the prompt length on CPU)")
    p.add_argument("--attention-backend", choices=["auto", "triton", "torch", "both"], default=None,
                   help="runner attention backend(s) (default: both on CUDA, torch on CPU)")
    p.add_argument("--decode-steps", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None,
                   help="force CUDA graphs for decode on (default: the runner's choice)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    p.add_argument("--profile-decode", default=None, metavar="BATCH:CONTEXT",
                   help="profile decode steps at this batch and context per backend (prints only)")
    p.add_argument("--profile-top", type=int, default=25, help="kernels listed by --profile-decode")
    p.add_argument("--mixed-decode", action="store_true",
                   help="time one long context decoding with short rows, grouped vs one padded batch")
    p.add_argument("--long-len", type=int, default=0, help="mixed decode: long context (32768 GPU, 4096 CPU)")
    p.add_argument("--short-len", type=int, default=0, help="mixed decode: short contexts (512 GPU, 64 CPU)")
    p.add_argument("--short-rows", type=int, default=30, help="mixed decode: number of short rows")
    p.add_argument("--no-serving", action="store_true",
                   help="mixed decode: skip the runs through the worker's step loop (sync and async scheduling)")
    p.add_argument("--serving-repeats", type=int, default=2,
                   help="mixed decode: sync/async serving-loop pairs, alternating (default 2)")
    p.add_argument("--sampling", action="store_true",
                   help="time the batched sampler against one row at a time (prints only)")
    p.add_argument("--vocab", type=int, default=128256, help="--sampling: vocabulary size (default Llama 3's)")
    p.add_argument("--sampling-repeats", type=int, default=20, help="--sampling: calls timed per batch")
    p.add_argument("--no-write", action="store_true", help="do not touch bench/RESULTS.md")
    p.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    args = p.parse_args(argv)
    command = "python bench/worker/worker.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.profile_decode:
        return profile_decode(args)
    if args.sampling:
        return sampling_bench(args)
    if args.mixed_decode:
        rows, info = mixed_decode(args)
        body = render_mixed(rows, info, command.strip())
        print(f"## worker mixed decode — {info['model']} on {info['device']} ({info['dtype']})\n")
        print(body)
        if not args.no_write:
            write_results(Path(args.results), body, info, kind="mixed decode · ")
            print(f"written to {args.results}")
        return 1 if info["failures"] else 0
    rows, info = run(args)
    body = render(rows, info, command.strip())
    print(f"## worker — {info['model']} on {info['device']} ({info['dtype']})\n")
    print(body)
    if not args.no_write:
        write_results(Path(args.results), body, info)
        print(f"written to {args.results}")
    return 1 if info["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
