"""Part 4 (``--parts ttft``): the TTFT one request sees alone, aggregated vs disaggregated, per prompt
size — what disaggregation costs a request when nothing else runs (issue 37: within 5% at 8k).

Configurations (each its own cluster, started, measured, stopped): *aggregated* = one ``both``
worker on the first GPU; *disaggregated* = the context worker on the first GPU and the generation
worker on the last (both on GPU 0 in the one-GPU dry run), ``generation_first`` (the generation
leg posts its receive before the prefill starts, so pipelined chunks have somewhere to go), KV
transfer pipelined; and the same with ``--transfer-pipeline off`` (*monolithic*). Requests go one at
a time through the fleet: completions of exactly ``size`` random token ids (a fresh prompt each
time: no prefix reuse), two output tokens, streamed; TTFT = request sent → first token received.
The first request of each size is a warm-up and not counted."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from pathlib import Path

import aiohttp

from bench.transfer.disagg.client import send_one
from bench.transfer.disagg.cluster import Cluster, Registry, WorkerSpec
from bench.transfer.disagg.common import BenchError, say
from bench.transfer.disagg.workload import Req

TTFT_SIZES = (2048, 8192, 32768)
SCHEDULE = "generation_first"


def ttft_requests(sizes, repeats: int, seed: int, model: str) -> list[Req]:
    """Per size: 1 warm-up + ``repeats`` measured prompts, each distinct from its first token."""
    rng = random.Random(seed + 104729)
    out = []
    for size in sizes:
        for i in range(repeats + 1):
            ids = [rng.randrange(256) for _ in range(size)]
            body = {"model": model, "prompt": ids, "max_tokens": 2, "ignore_eos": True,
                    "temperature": 0.0, "stream": True, "return_token_ids": True}
            out.append(Req(len(out), "warmup" if i == 0 else "ttft", 0.0, "/v1/completions", body,
                           size, 2))
    return out


async def _one_at_a_time(url: str, reqs: list[Req], timeout_s: float) -> list:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.get_running_loop()
        return [await send_one(session, url, r, loop.time(), timeout_s) for r in reqs]


def run_ttft(label: str, args, reg: Registry, logdir: Path, specs: list[WorkerSpec],
             ctx_router: str | None, need_disagg: bool, pipeline: bool | None = None) -> dict:
    cluster = Cluster(label, args, reg, logdir, specs, ctx_router, "kv_cache_aware" if need_disagg
                      else "load_balancing", schedule_style=SCHEDULE if need_disagg else None)
    t0 = time.monotonic()
    info: dict = {"workers": [{"name": s.name, "role": s.role, "gpu": s.gpu,
                               "extra_args": list(s.extra)} for s in specs],
                  "schedule_style": SCHEDULE if need_disagg else None}
    try:
        say(label, f"starting {len(specs)} workers, coordinator and fleet")
        cluster.start(args.start_timeout)
        info["startup_s"] = round(time.monotonic() - t0, 1)
        if pipeline is not None:
            tinfo = cluster.transfer_info()
            if tinfo.get("pipeline") is not pipeline:
                raise BenchError(f"{label}: the context worker reports transfer pipeline="
                                 f"{tinfo.get('pipeline')!r}; this run needs {pipeline}")
        if need_disagg and cluster.route_mode() != "disaggregated":
            raise BenchError(f"{label}: the fleet does not place requests disaggregated; see {logdir}")
        reqs = ttft_requests(args.ttft_sizes, args.ttft_repeats, args.seed, cluster.model)
        results = asyncio.run(_one_at_a_time(cluster.url, reqs, args.request_timeout))
        bad = [r.error for r in results if not r.ok]
        if bad:
            raise BenchError(f"{label}: a request failed: {bad[0]}; logs in {logdir}")
        sizes: dict = {}
        for req, r in zip(reqs, results):
            if req.kind != "ttft":
                continue
            first = next(t for t, n in r.chunks if n > 0)
            row = sizes.setdefault(str(req.prompt_tokens), {"ttft_ms": [], "modes": {}})
            row["ttft_ms"].append(round((first - r.sent) * 1e3, 3))
            row["modes"][str(r.mode)] = row["modes"].get(str(r.mode), 0) + 1
        for row in sizes.values():
            row["p50_ms"] = round(statistics.median(row["ttft_ms"]), 3)
        say(label, " ".join(f"{k}: {v['p50_ms']:.1f} ms" for k, v in sizes.items()))
        return {**info, "sizes": sizes}
    finally:
        cluster.stop()
        say(label, "stopped")


def ttft_part(args, reg: Registry, logdir: Path, specs: dict, switch: dict) -> dict:
    """The three configurations, aggregated first."""
    ctx_first = [s for s in specs["disaggregated"] if s.role == "context"]
    if not ctx_first:
        raise BenchError("the disaggregated configuration has no context worker")

    def disagg(mode: str) -> list[WorkerSpec]:
        return [dataclasses.replace(s, extra=tuple(switch[mode])) if s.role == "context" else s
                for s in specs["disaggregated"]]

    runs = {"aggregated": run_ttft("ttft-aggregated", args, reg, logdir, specs["aggregated"][:1],
                                   None, need_disagg=False),
            "disaggregated": run_ttft("ttft-disaggregated", args, reg, logdir, disagg("pipelined"),
                                      "kv_cache_aware", need_disagg=True, pipeline=True),
            "monolithic": run_ttft("ttft-monolithic", args, reg, logdir, disagg("monolithic"),
                                   "kv_cache_aware", need_disagg=True, pipeline=False)}
    return {"sizes": list(args.ttft_sizes), "repeats": args.ttft_repeats, "runs": runs}


def ttft_table(part: dict) -> str:
    if "skipped" in part:
        return f"TTFT alone: skipped — {part['skipped']}\n"
    runs = part["runs"]
    lines = ["TTFT of one request alone (median ms, request sent → first token; disaggregated: "
             f"{SCHEDULE}; {part['repeats']} requests per size after one warm-up):", "",
             "| prompt tokens | aggregated | disaggregated (pipelined) | disagg − agg | "
             "disagg ÷ agg | disaggregated (monolithic) | monolithic − agg |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for size in part["sizes"]:
        a = runs["aggregated"]["sizes"][str(size)]["p50_ms"]
        d = runs["disaggregated"]["sizes"][str(size)]["p50_ms"]
        m = runs["monolithic"]["sizes"][str(size)]["p50_ms"]
        lines.append(f"| {size:,} | {a:,.1f} | {d:,.1f} | {d - a:+,.1f} | {d / a:.3f}× | "
                     f"{m:,.1f} | {m - a:+,.1f} |")
    return "\n".join(lines) + "\n"


def ttft_target(part: dict, size: int = 8192) -> dict | None:
    """Issue 37: disaggregated TTFT within 5% of aggregated at 8k prompts (one GPU)."""
    if "skipped" in part or size not in part["sizes"]:
        return None
    a = part["runs"]["aggregated"]["sizes"][str(size)]["p50_ms"]
    d = part["runs"]["disaggregated"]["sizes"][str(size)]["p50_ms"]
    return {"size": size, "ratio": round(d / a, 4), "target": 1.05, "met": d / a <= 1.05}
