#!/usr/bin/env python3
"""Disaggregation benchmark on one host: KV transfer across GPUs, and the end-to-end TTFT/TPOT
benefit of context/generation disaggregation over aggregated serving (issue 8).

    python bench/transfer/disagg_e2e.py --gpus 0,1                    # the real run: ctx on GPU 0, gen on GPU 1
    python bench/transfer/disagg_e2e.py --gpus 0                      # one-GPU dry run: both workers share GPU 0
    python bench/transfer/disagg_e2e.py --device cpu --model tiny     # CPU smoke run (CI), --scale tiny implied

Every cluster is real processes started here: a ``splitserve coordinator``, a ``splitserve serve``
fleet that uses it, and ``splitserve worker`` processes pinned to GPUs with ``CUDA_VISIBLE_DEVICES``
(the random-weight ``--model`` preset, bf16 on CUDA). Three parts:

1. **transfer** — KV bytes, time, GB/s and descriptors per transfer for each ``--sizes`` prompt: a
   context pool on the first GPU and a generation pool on the last, each in its own process, moved by
   the ``KvTransceiver`` the workers use (``--transfer-agent``), every copy checked byte-exact. Next
   to it the ceiling, measured in the same run: a torch copy of the same bytes from the first GPU to
   the last (peer-to-peer with two GPUs; a device-local copy when both share one GPU, so one-GPU
   percentages are not the cross-GPU target; on the CPU bench/transfer/transfer.py's memcpy baseline).
   bench/transfer/transfer.py's rank processes are not reused because their pools are fixed to the 1b shape;
   here the pools are real ``ModelRunner`` pools of ``--model`` (tiny, 1b or 8b), pinned per GPU.
2. **end to end** — one fixed workload (seeded, fixed arrival times): a steady stream of short chat
   requests decoding while long-prompt requests (8k–32k tokens at ``--scale full``) arrive, sent as
   streaming requests through the fleet, against (a) *aggregated*: two ``both`` workers, one per
   GPU, ``load_balancing``; (b) *disaggregated* 1P1D: a context and a generation worker,
   ``kv_cache_aware``. Per request the client records the arrival time of every streamed token.
   A disaggregated run whose generation worker cannot receive KV (501) is reported as skipped.
3. **pipelined vs monolithic** — (b) with the context worker sending each finished prefill chunk's
   KV right away (pipelined) and again with one transfer after the whole prefill (monolithic); the
   mode each context worker reports in ``/server_info`` is checked (``--transfer-pipeline on|off``).
4. **TTFT alone** (``--parts ttft``, not in the default set) — one request at a time, prompts of
   ``--ttft-sizes`` tokens (2k/8k/32k), aggregated (one ``both`` worker) vs disaggregated
   (generation_first, pipelined) vs disaggregated monolithic: what disaggregation adds to a
   request's TTFT when nothing else runs (bench/transfer/disagg/ttft.py). The issue-37 dry run:
   ``python bench/transfer/disagg_e2e.py --gpus 0 --parts ttft`` (about 2 minutes on one H100).

Metrics (all client-side, from token arrival times):

- TTFT: request sent → first token received.
- ITL, reported as *TPOT*: the gap before each token after the first (a chunk carrying k tokens
  contributes k gaps of 1/k of its interval, so the gaps of one request sum to its decode time);
  p50/p99 over all tokens of a class. ``tpot_req_*`` is the per-request mean (decode time / (n-1)).
  Requests ask for ``return_token_ids``; a worker that streams only text chunks (none for tokens
  without text) leaves tokens untimed: ``timed_token_coverage`` says how many were timed alone.
- output tokens/s: completion tokens of all requests / (last token − first send).

The targets line compares to issue 8: transfer ≥ 80% of the ceiling at 16k tokens; short-request
TPOT p99 disaggregated ≤ ½ of aggregated at equal or better output tokens/s (not judged when fewer
than 95% of the tokens were timed alone).

Every process started here is stopped on exit (also on Ctrl-C, SIGTERM and errors; their pids are
listed in ``<logs>/pids``); logs go to a new temporary directory (or ``--log-dir``) whose path is
printed. ``--out FILE`` writes every number as JSON; ``--write-results`` replaces (or appends) the
``## disagg_e2e`` section of bench/RESULTS.md with the command, machine, date and the tables.

This file is the command line (flags, defaults, the order of the parts); the parts live in
bench/transfer/disagg/: ``workload`` (scales, the seeded requests, warm-up rounds), ``client`` (streaming
client, TTFT/TPOT statistics), ``cluster`` (coordinator + workers + fleet processes, the process
registry), ``kv_transfer`` (part 1), ``e2e`` (parts 2 and 3: one configuration's run), ``report``
(tables, targets line, bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

from bench.transfer.disagg.cluster import Registry, WorkerSpec  # noqa: E402
from bench.transfer.disagg.common import BenchError, say  # noqa: E402
from bench.transfer.disagg.e2e import PIPELINE_SWITCH, e2e_specs, run_config  # noqa: E402
from bench.transfer.disagg.kv_transfer import transfer_part  # noqa: E402
from bench.transfer.disagg.report import machine, render, results_title, targets, targets_line, write_results  # noqa: E402
from bench.transfer.disagg.ttft import TTFT_SIZES, ttft_part  # noqa: E402
from bench.transfer.disagg.workload import SCALES, Req, build_workload, parse_scale, workload_summary  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"


def max_context(model: str) -> int:
    """The model's context length (preset or HF ``config.json``)."""
    path = Path(model)
    if path.is_dir():
        return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings") or 1 << 20)
    from worker.presets import preset_config
    return preset_config(model).max_position_embeddings


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K+V bytes of one token across all layers, from the preset or the HF ``config.json``."""
    elt = 2 if dtype == "bfloat16" else 4
    path = Path(model)
    if path.is_dir():
        c = json.loads((path / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * elt
    from worker.presets import preset_config
    c = preset_config(model)
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * elt


def default_num_blocks(args, reqs: list[Req], block_size: int = 16) -> int:
    """KV blocks per worker: the whole workload resident at once (+25%) or the largest transfer size,
    capped at ``--kv-gib`` GiB. Explicit because two workers sharing one GPU must not each size their
    pool from all of its memory."""
    need = 0
    if "e2e" in args.parts or "pipeline" in args.parts:
        need = sum(math.ceil((r.prompt_tokens + 64 + r.max_tokens) / block_size) for r in reqs)
    if "transfer" in args.parts:
        need = max(need, math.ceil(max(args.sizes) / block_size) + 16)
    if "ttft" in args.parts:   # two prompts resident (a pinned one and the next), and cache
        need = max(need, 3 * math.ceil((max(args.ttft_sizes) + 64) / block_size))
    need = int(need * 1.25) + 64
    cap = int(args.kv_gib * (1 << 30) // (kv_bytes_per_token(args.model, args.dtype) * block_size))
    if need > cap:
        print(f"note: the workload would use {need} KV blocks per worker; --kv-gib {args.kv_gib:g} caps the pool at "
              f"{cap} (the scheduler evicts cached prefixes and preempts beyond that)", flush=True)
    return max(64, min(need, cap))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="0,1",
                   help="GPU ids: '0,1' = context/first worker on GPU 0, generation/second on GPU 1; '0' = "
                        "one-GPU dry run, both processes share GPU 0; ignored with --device cpu")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="1b", help="worker model: preset (tiny, 1b, 8b) or HF directory")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--scale", type=parse_scale, default=None,
                   help="workload size: full (issue 8's sizes), dry, tiny, or a factor of full "
                        "(default: full with two GPUs, dry with one, tiny on cpu)")
    p.add_argument("--sizes", default=None,
                   help="transfer prompt sizes in tokens, comma separated (default: the scale's, "
                        "1024,4096,16384,65536 on GPUs)")
    p.add_argument("--parts", default="transfer,e2e,pipeline",
                   help="comma separated subset of transfer, e2e, pipeline, ttft")
    p.add_argument("--ttft-sizes", default=",".join(map(str, TTFT_SIZES)),
                   help="prompt sizes of the ttft part, comma separated")
    p.add_argument("--ttft-repeats", type=int, default=3,
                   help="measured requests per size in the ttft part (after one warm-up)")
    p.add_argument("--transfer-agent", choices=("auto", "nixl", "tcp", "shm"), default="auto",
                   help="KV transfer agent of the workers and of the transfer part (auto = nixl when installed)")
    p.add_argument("--fleet-workers", type=int, default=None, help="fleet processes (default: 2 on cuda, 1 on cpu)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: sized from the workload)")
    p.add_argument("--kv-gib", type=float, default=None,
                   help="cap of one worker's KV pool in GiB when sizing it (default 24 on cuda, 1 on cpu)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument for every worker (repeat; e.g. --worker-arg=--max-num-tokens=4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=None, help="seconds for a cluster to come up")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="log level of the started processes")
    p.add_argument("--log-dir", default=None, help="where process logs go (default: a new temp directory)")
    p.add_argument("--out", default=None, help="write every number as JSON to this file")
    p.add_argument("--write-results", action="store_true",
                   help="replace (or append) the '## disagg_e2e' section of bench/RESULTS.md")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="run nothing: print (and with --write-results record) the tables of a saved --out file")
    p.add_argument("--results", default=str(RESULTS), help=argparse.SUPPRESS)
    return p


def resolve_args(args) -> None:
    """Fill the defaults that depend on other flags; BenchError on inconsistent flags."""
    if args.device == "cpu":
        args.gpu_list = [None]
    else:
        gl = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if not gl or len(gl) > 2 or not all(g.isdigit() for g in gl):
            raise BenchError(f"--gpus: expected one or two GPU ids like '0' or '0,1', found {args.gpus!r}")
        args.gpu_list = gl
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.scale is None:
        args.scale = SCALES["tiny" if args.device == "cpu" else ("full" if len(args.gpu_list) == 2 else "dry")]
    try:
        args.sizes = ([int(x) for x in args.sizes.split(",") if x.strip()] if args.sizes
                      else list(args.scale.transfer_sizes))
    except ValueError:
        raise BenchError(f"--sizes: expected comma separated token counts, found {args.sizes!r}") from None
    if not args.sizes or any(s < 16 for s in args.sizes):
        raise BenchError(f"--sizes: every size must be at least 16 tokens, found {args.sizes}")
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in ("transfer", "e2e", "pipeline", "ttft")]
    if bad or not parts:
        raise BenchError(f"--parts: expected a subset of transfer,e2e,pipeline,ttft, found {args.parts!r}")
    args.parts = parts
    try:
        args.ttft_sizes = [int(x) for x in str(args.ttft_sizes).split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--ttft-sizes: expected comma separated token counts, found "
                         f"{args.ttft_sizes!r}") from None
    if "ttft" in parts and (not args.ttft_sizes or min(args.ttft_sizes) < 16 or args.ttft_repeats < 1):
        raise BenchError(f"--ttft-sizes / --ttft-repeats: expected sizes ≥ 16 tokens and ≥ 1 repeat, "
                         f"found {args.ttft_sizes} / {args.ttft_repeats}")
    if args.fleet_workers is None:
        args.fleet_workers = 2 if args.device == "cuda" else 1
    if args.kv_gib is None:
        args.kv_gib = 24.0 if args.device == "cuda" else 1.0
    if args.start_timeout is None:
        args.start_timeout = 600.0 if args.device == "cuda" else 120.0


def check_model(args) -> None:
    """The model exists and holds the workload's longest request (BenchError otherwise)."""
    try:
        limit = max_context(args.model)
    except (KeyError, OSError, ValueError) as e:
        raise BenchError(f"--model {args.model!r}: {e}") from None
    longest = 0
    if "e2e" in args.parts or "pipeline" in args.parts:
        longest = max(r.prompt_tokens + 64 + r.max_tokens for r in build_workload(args.scale, args.seed, ""))
    if "ttft" in args.parts:
        longest = max(longest, max(args.ttft_sizes) + 64)
    if longest:
        if longest > limit:
            raise BenchError(f"--model {args.model}: its context is {limit} tokens, but the workload's longest "
                             f"request needs about {longest} (--scale {args.scale.name}); pick a smaller --scale "
                             f"factor or another model")


def dry_note(args) -> str | None:
    if args.device == "cpu":
        return "CPU smoke run: not a measurement"
    if len(args.gpu_list) == 1:
        return "one-GPU dry run: both workers share GPU 0, the ceiling is a device-local copy"
    return None


def run_all(args, reg: Registry, logdir: Path) -> dict:
    reqs = build_workload(args.scale, args.seed, model="")
    if args.num_blocks is None:
        args.num_blocks = default_num_blocks(args, reqs)
    result: dict = {"meta": {
        "command": "python bench/transfer/disagg_e2e.py " + shlex.join(args.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "model": args.model, "dtype": args.dtype, "device": args.device,
        "gpus": ",".join(g for g in args.gpu_list if g is not None), "scale": args.scale.name,
        "scale_params": dataclasses.asdict(args.scale), "seed": args.seed, "num_blocks": args.num_blocks,
        "fleet_workers": args.fleet_workers, "transfer_agent": args.transfer_agent, "logs": str(logdir),
        "dry_run": dry_note(args), "parts": list(args.parts)}}
    t0 = time.monotonic()
    if "transfer" in args.parts:
        say("transfer", f"prompt sizes {args.sizes}")
        result["transfer"] = transfer_part(args, reg, logdir)
    else:
        result["transfer"] = {"skipped": "not selected (--parts)"}
    specs = e2e_specs(args)
    switch = PIPELINE_SWITCH if "pipeline" in args.parts else None
    runs: dict = {}
    if "e2e" in args.parts:
        runs["aggregated"] = run_config("aggregated", args, reg, logdir, specs["aggregated"], None,
                                        "load_balancing", reqs, need_disagg=False)

    def disagg(mode: str | None) -> list[WorkerSpec]:
        return [dataclasses.replace(s, extra=tuple(switch[mode])) if mode and s.role == "context" else s
                for s in specs["disaggregated"]]

    if "e2e" in args.parts or "pipeline" in args.parts:
        # (b) is the pipelined run of part 3: its mode is set explicitly and checked, not assumed.
        runs["disaggregated"] = run_config("disaggregated", args, reg, logdir,
                                           disagg("pipelined" if switch else None), "kv_cache_aware",
                                           "kv_cache_aware", reqs, need_disagg=True,
                                           pipeline=True if switch else None)
    result["e2e"] = {"workload": workload_summary(reqs), "runs": runs}
    if "pipeline" not in args.parts:
        result["pipeline"] = {"skipped": "not selected (--parts)"}
    elif "skipped" in runs["disaggregated"]:
        result["pipeline"] = {"skipped": runs["disaggregated"]["skipped"]}
    else:
        mono = run_config("monolithic", args, reg, logdir, disagg("monolithic"), "kv_cache_aware",
                          "kv_cache_aware", reqs, need_disagg=True, pipeline=False)
        result["pipeline"] = {"switch": switch, "pipelined": runs["disaggregated"], "monolithic": mono}
    if "ttft" in args.parts:
        say("ttft", f"one request at a time, prompts of {args.ttft_sizes} tokens")
        result["ttft"] = ttft_part(args, reg, logdir, specs, PIPELINE_SWITCH)
    result["meta"]["wall_s"] = round(time.monotonic() - t0, 1)
    result["targets"] = targets(result)
    result["targets_line"] = targets_line(result["targets"], dry_note(args))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.from_json:
        try:
            result = json.loads(Path(args.from_json).read_text())
            text = render(result)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"disagg_e2e: --from-json {args.from_json}: not a saved result ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        print(text, end="")
        if args.write_results:
            write_results(Path(args.results), text, results_title(result))
            print(f"disagg_e2e: updated '{results_title(result)}' in {args.results}")
        return 0
    try:
        resolve_args(args)
        check_model(args)
    except BenchError as e:
        print(f"disagg_e2e: {e}", file=sys.stderr)
        return 2
    logdir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="splitserve-disagg-e2e-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"disagg_e2e: logs in {logdir}", flush=True)
    reg = Registry(logdir)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old = signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C raises here too: with the default handler asyncio.run turns it into a cancellation of
    # its main task, which Python 3.11's wait_for can lose when the awaited future completes at the
    # same moment; an interrupted run then went on and ended 0 (once, in a full run of
    # tests/bench/test_disagg_e2e_smoke.py).
    old_sigint = signal.signal(signal.SIGINT, on_term)
    try:
        result = run_all(args, reg, logdir)
    except BenchError as e:
        print(f"disagg_e2e: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("disagg_e2e: interrupted; stopping every started process", file=sys.stderr)
        return 130
    finally:
        # A second Ctrl-C must not cut the cleanup short and leave workers holding GPU memory.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            reg.stop_all()
        finally:
            signal.signal(signal.SIGINT, old_sigint)
            signal.signal(signal.SIGTERM, old)
    text = render(result)
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"disagg_e2e: wrote {args.out}")
    if args.write_results:
        write_results(Path(args.results), text, results_title(result))
        print(f"disagg_e2e: updated '{results_title(result)}' in {args.results}")
    print(f"disagg_e2e: logs in {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
