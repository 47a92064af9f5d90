#!/usr/bin/env python3
"""A client no one here wrote: NVIDIA's aiperf replays the same Mooncake trace against the fleet.

One sim cluster (bench/routing/routing.py's latency model and KV capacity) whose workers, fleet and aiperf
all use one small Hugging Face tokenizer written to a temporary model directory (aiperf
synthesizes *text* prompts from `hash_ids` with a tokenizer; the fleet and workers must count
those tokens the same way). The same sampled requests are replayed twice on the same policy:

1. bench/routing/routing.py's replayer (token-id prompts built from the hash ids);
2. aiperf `profile --custom-dataset-type mooncake_trace --fixed-schedule` on a derived trace
   file (outside the repository) whose timestamps are the wall-clock arrival times of run 1 and
   whose lengths are scaled to `--tokens-per-block` tokens per 512-token trace block
   (`--isl-block-size` the same).

aiperf lives in its own virtualenv (`bench/.aiperf-venv`, gitignored; `python -m venv
bench/.aiperf-venv && bench/.aiperf-venv/bin/pip install aiperf==0.13.0`), never a project
dependency. Its TTFT and ITL are read from its JSON export and divided by the dilation like ours.

Usage: python bench/routing/routing_aiperf.py [--workers 8] [--policy kv_cache_aware] [--no-write]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
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

from bench.routing import _trace as T  # noqa: E402
from bench.routing import routing as R  # noqa: E402
from bench._common import replace_subsection  # noqa: E402

AIPERF = ROOT / "bench" / ".aiperf-venv" / "bin" / "aiperf"
VOCAB = 400


def model_dir(root: Path) -> Path:
    """A tokenizer-only model directory (tests/fleet/routing_fixtures.py builds the same kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = root / "aiperf-model"
    d.mkdir(exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "to be or not to be, that is the question",
              "all the world's a stage, and all the men and women merely players"] * 30
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (d / "tokenizer.json").write_text(tok.to_str())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20}))
    (d / "config.json").write_text(json.dumps({"vocab_size": tok.get_vocab_size(),
                                               "max_position_embeddings": 1 << 20}))
    return d


def derived_trace(reqs: list[T.Req], args, path: Path) -> None:
    """The sampled requests with wall-clock ms timestamps and lengths in synthetic tokens."""
    scale = args.dilation / args.compress
    k = args.tokens_per_block / T.TRACE_BLOCK
    with open(path, "w") as f:
        for r in reqs:
            n = len(r.hash_ids)
            # as bench/_trace.Tokens cuts it, kept within aiperf's rule for the last block
            # (0 < final block <= block size)
            isl = min(max(math.ceil(r.input_length * k), (n - 1) * args.tokens_per_block + 1),
                      n * args.tokens_per_block)
            f.write(json.dumps({"timestamp": int(round(r.t_s * scale * 1000)),
                                "input_length": isl,
                                "output_length": r.output_length, "hash_ids": r.hash_ids}) + "\n")


HUB_NAME = "local/splitserve-bench-tokenizer"


def hub_cache(model: Path, root: Path) -> Path:
    """The tokenizer as a Hugging Face hub cache entry. aiperf 0.13.0's mooncake_trace
    conversion workers force HF_HUB_OFFLINE and resolve the tokenizer with
    `snapshot_download(local_files_only=True)` (aiperf/dataset/loader/parallel_convert.py,
    aiperf/common/tokenizer.py `_resolve_local_snapshot`), which rejects a directory path; a
    cached repo id loads offline in every process."""
    rev = "0" * 40
    repo = root / "hub" / ("models--" + HUB_NAME.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    for f in model.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    return root / "hub"


def run_aiperf(url: str, model: Path, trace: Path, n: int, args, out: Path) -> dict:
    hub = hub_cache(model, out.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(hub))
    cmd = [str(AIPERF), "profile", "--model-names", model.name, "--tokenizer", HUB_NAME,
           "--url", url, "--endpoint-type", "completions", "--streaming",
           "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
           "--fixed-schedule", "--fixed-schedule-auto-offset",
           "--isl-block-size", str(args.tokens_per_block), "--use-server-token-count",
           "--request-count", str(n), "--request-timeout-seconds", "900",
           "--artifact-dir", str(out), "--ui-type", "none", "--random-seed", "0"]
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    (out / "aiperf.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"aiperf failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    exp = next(out.rglob("profile_export_aiperf.json"))
    data = json.loads(exp.read_text())
    return {"wall_s": round(time.time() - t, 1), "export": data, "cmd": " ".join(cmd),
            "hit_ratio": cache_hit_ratio(next(out.rglob("profile_export.jsonl")))}


def cache_hit_ratio(records: Path) -> float | None:
    """Σ usage_prompt_cache_read_tokens / Σ input tokens over aiperf's per-request records (the
    workers' `cached_tokens`, as aiperf read them)."""
    cached = prompt = 0
    for line in records.read_text().splitlines():
        m = json.loads(line).get("metrics") or {}
        cached += (m.get("usage_prompt_cache_read_tokens") or {}).get("value", 0)
        prompt += (m.get("input_sequence_length") or {}).get("value", 0)
    return cached / prompt if prompt else None


def _stat(data: dict, tag: str) -> dict:
    m = data.get(tag) or next((x for x in data.get("records", []) if x.get("tag") == tag), None) or {}
    return {k: m.get(k) for k in ("avg", "p50", "p90", "p99", "unit", "count") if k in m}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=T.DEFAULT_TRACE)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--policy", default="kv_cache_aware")
    ap.add_argument("--sample", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--compress", type=float, default=120.0)
    ap.add_argument("--dilation", type=float, default=4.0)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--kv-ratio", type=float, default=0.5)
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--keep", default=None, help="work directory to keep (logs, aiperf artifacts)")
    args = ap.parse_args(argv)
    args.no_reuse_worker = False
    if not AIPERF.exists():
        print(f"no aiperf at {AIPERF}: python -m venv bench/.aiperf-venv && "
              "bench/.aiperf-venv/bin/pip install aiperf==0.13.0")
        return 2
    reqs = T.load(args.trace, sample=args.sample, limit=args.limit)
    with tempfile.TemporaryDirectory(prefix="bench-aiperf-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = model_dir(work)
        # token-id prompts must stay inside the trained vocabulary (smaller than asked for)
        tokens = T.Tokens(args.tokens_per_block,
                          vocab=json.loads((model / "config.json").read_text())["vocab_size"])
        procs = R.Procs(work)
        try:
            ws = T.working_set_blocks(reqs, args.tokens_per_block, R.BLOCK)
            per_worker = max(64, int(ws * args.kv_ratio / args.workers))
            urls = R.start_workers(procs, args.workers, per_worker, args, model=str(model))
            furl, _, front = R.start_front(procs, work, urls, args.policy, {}, model=str(model))
            ours = T.summarize(asyncio.run(R.replay(furl, reqs, tokens, args, model=model.name)),
                               urls, args.dilation)
            print(f"bench/routing/routing.py: {ours['ok']}/{ours['requests']} ok, TTFT p50 "
                  f"{ours['ttft_p50_ms']:.1f} ms, TPOT p50 {ours['tpot_p50_ms']:.2f} ms, hit "
                  f"{ours['hit_ratio']:.3f} {ours['error_samples']}", flush=True)
            for p in front:
                procs.stop(p)
            R.reset_workers(urls, procs)
            furl, _, front = R.start_front(procs, work, urls, args.policy, {}, model=str(model))
            trace = work / "trace.jsonl"
            derived_trace(reqs, args, trace)
            ap_out = run_aiperf(furl, model, trace, len(reqs), args, work / "aiperf")
            hit_after = R.worker_state(urls, procs)
        finally:
            procs.stop_all()
    data = ap_out["export"]
    d = args.dilation
    theirs = {tag: _stat(data, tag) for tag in ("time_to_first_token", "inter_token_latency",
                                                 "request_latency", "request_count",
                                                 "output_sequence_length", "input_sequence_length")}
    print(json.dumps(theirs, indent=1))
    result = {"ours": {k: v for k, v in ours.items() if k != "ttft_ms_sorted"}, "aiperf": theirs,
              "dilation": d, "args": vars(args) | {"trace": str(args.trace)},
              "aiperf_cmd": ap_out["cmd"], "workers_after": hit_after,
              "aiperf_hit_ratio": ap_out["hit_ratio"],
              "blocks_per_worker": per_worker, "working_set_blocks": ws}
    out = R.OUTDIR / "routing_aiperf.json"
    if not args.no_write:
        R.OUTDIR.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        replace_subsection(R.RESULTS, "routing", "### aiperf beside bench/routing/routing.py",
                           report(result))
    return 0


def report(res: dict) -> str:
    o, a, d = res["ours"], res["aiperf"], res["dilation"]

    def ms(stat: dict, q: str) -> str:
        v = stat.get(q)
        return "–" if v is None else f"{v / d:,.1f}"
    t, itl = a["time_to_first_token"], a["inter_token_latency"]
    rows = [
        "| client | requests ok | prompt tokens | hit ratio | TTFT p50 ms | TTFT p90 ms | "
        "TTFT p99 ms | TPOT/ITL p50 ms | TPOT/ITL p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| bench/routing/routing.py | {o['ok']} | {o['prompt_tokens']:,} | {o['hit_ratio']:.3f} | "
        f"{o['ttft_p50_ms']:,.1f} | – | {o['ttft_p99_ms']:,.1f} | {o['tpot_p50_ms']:.2f} | "
        f"{o['tpot_p99_ms']:.2f} |",
        f"| aiperf 0.13.0 | {(a['request_count'] or {}).get('avg', '–')} | "
        f"{(a['input_sequence_length'] or {}).get('avg', 0) * (a['request_count'] or {}).get('avg', 0):,.0f} | "
        f"{res.get('aiperf_hit_ratio') or float('nan'):.3f} | {ms(t, 'p50')} | "
        f"{ms(t, 'p90')} | {ms(t, 'p99')} | {ms(itl, 'p50')} | {ms(itl, 'p99')} |"]
    args = res["args"]
    return "\n".join([
        f"{args['workers']} sim workers, policy `{args['policy']}`, the same "
        f"{o['requests']} sampled requests, {res.get('blocks_per_worker', '?')} KV blocks per worker "
        f"({args['kv_ratio']:.0%} of the working set over the cluster), arrivals compressed "
        f"{args['compress']:g}×, "
        f"dilation {d:g} (both clients' times divided by it). Command: "
        f"`python bench/routing/routing_aiperf.py --workers {args['workers']} --policy {args['policy']}`; "
        f"aiperf: `{res['aiperf_cmd'].split(' --artifact-dir')[0].replace(str(ROOT) + '/', '')}`.",
        "", *rows, ""])


if __name__ == "__main__":
    sys.exit(main())
