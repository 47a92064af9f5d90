"""Parts 2 and 3: one configuration (aggregated, disaggregated, pipelined or monolithic) started,
warmed up, run through the workload and stopped."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import aiohttp

from bench.transfer.disagg.client import Result, run_requests, run_stats, send_one
from bench.transfer.disagg.cluster import Cluster, Registry, WorkerSpec, http_call, metrics_delta
from bench.transfer.disagg.common import BenchError, say
from bench.transfer.disagg.workload import Req, Scale, warmup_plan


def _with_model(reqs: list[Req], model: str) -> list[Req]:
    return [dataclasses.replace(r, body={**r.body, "model": model}) for r in reqs]


async def _warm_round(url: str, long: Req | None, shorts: list[Req], timeout_s: float) -> list[Result]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.get_running_loop()
        if long is None:
            return list(await asyncio.gather(*(send_one(session, url, r, loop.time(), timeout_s) for r in shorts)))
        first = asyncio.Event()
        lt = asyncio.create_task(send_one(session, url, long, loop.time(), timeout_s, first))
        # Start the burst once the long request decodes; without a streamed first token (a worker that
        # sends no chunk for text-less tokens) after a generous prefill estimate.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(first.wait(), 0.5 + long.prompt_tokens / 20_000)
        rest = await asyncio.gather(*(send_one(session, url, r, loop.time(), timeout_s) for r in shorts))
        return [await lt, *rest]


def _warmup(cluster: Cluster, scale: Scale, reqs: list[Req], seed: int, timeout_s: float) -> dict:
    n_gen = max(1, sum(1 for w in cluster.workers if w.spec.role in ("generation", "both")))
    t0 = time.monotonic()
    plan = warmup_plan(scale, reqs, n_gen, seed, cluster.model)
    for long, shorts in plan:
        res = asyncio.run(_warm_round(cluster.url, long, shorts, timeout_s))
        bad = [r.error for r in res if not r.ok]
        if bad:
            raise BenchError(f"{cluster.name}: a warm-up request failed: {bad[0]}; logs in {cluster.logdir}")
    return {"rounds": len(plan), "requests": sum(len(s) + (long is not None) for long, s in plan),
            "long_prompt_tokens": [long.prompt_tokens for long, _ in plan if long is not None],
            "seconds": round(time.monotonic() - t0, 1)}


def run_config(label: str, args, reg: Registry, logdir: Path, specs: list[WorkerSpec], ctx_router: str | None,
               gen_router: str, reqs: list[Req], need_disagg: bool, pipeline: bool | None = None) -> dict:
    """Start one cluster, warm it up, replay the workload, stop it. ``{"skipped": why}`` when a
    disaggregated cluster turns out not to move KV (the generation worker answers 501)."""
    cluster = Cluster(label, args, reg, logdir, specs, ctx_router, gen_router)
    t0 = time.monotonic()
    info = {"workers": [{"name": s.name, "role": s.role, "gpu": s.gpu, "extra_args": list(s.extra)} for s in specs],
            "context_router": ctx_router, "generation_router": gen_router}
    try:
        say(label, f"starting {len(specs)} workers, coordinator and fleet")
        cluster.start(args.start_timeout)
        info["startup_s"] = round(time.monotonic() - t0, 1)
        ctx_info = [w for w in cluster.workers if w.spec.role == "context"]
        if ctx_info:
            st, body = http_call(ctx_info[0].url + "/server_info")
            tinfo = (json.loads(body).get("transfer") or {}) if st == 200 else {}
            info["transfer"] = tinfo
            info["transfer_pipeline"] = tinfo.get("pipeline")
            if pipeline is not None and tinfo.get("pipeline") is not pipeline:
                raise BenchError(f"{label}: the context worker reports transfer pipeline="
                                 f"{tinfo.get('pipeline')!r} in /server_info; this run needs {pipeline}")
        if need_disagg:
            mode = cluster.route_mode()
            if mode == "no_kv_transfer":
                why = ("the generation worker cannot receive KV (it answers 501 to generation_only: no KV "
                       "transfer in this worker build)")
                say(label, f"skipped: {why}")
                return {**info, "skipped": why}
            if mode != "disaggregated":
                raise BenchError(f"{label}: the fleet placed a probe request as {mode!r}, not 'disaggregated'; "
                                 f"see {logdir}")
        info["warmup"] = _warmup(cluster, args.scale, reqs, args.seed, args.request_timeout)
        before = cluster.worker_metrics()
        say(label, f"up in {info['startup_s']:g}s, warmed up in {info['warmup']['seconds']:g}s; running "
                    f"{len(reqs)} requests over {args.scale.duration_s:g}s")
        results = asyncio.run(run_requests(cluster.url, _with_model(reqs, cluster.model), args.request_timeout))
        stats = run_stats(results)
        stats["worker_metrics_delta"] = metrics_delta(before, cluster.worker_metrics())
        if need_disagg and stats["modes"].get("disaggregated", 0) < len(results):
            stats["warning"] = f"not every request was disaggregated: {stats['modes']}"
        return {**info, **stats}
    finally:
        cluster.stop()
        say(label, "stopped")


def e2e_specs(args) -> dict[str, list[WorkerSpec]]:
    """Workers of each configuration. With two GPUs: aggregated = one ``both`` worker per GPU;
    disaggregated = context on the first GPU, generation on the last. With one GPU both processes share
    it; on the CPU ``gpu`` is None."""
    g0, g1 = args.gpu_list[0], args.gpu_list[-1]
    return {"aggregated": [WorkerSpec("both0", "both", g0), WorkerSpec("both1", "both", g1)],
            "disaggregated": [WorkerSpec("ctx", "context", g0), WorkerSpec("gen", "generation", g1)]}


# The worker's switch for pipelined KV transfer (``splitserve worker --transfer-pipeline on|off``).
PIPELINE_SWITCH = {"how": "flag", "pipelined": ["--transfer-pipeline", "on"],
                   "monolithic": ["--transfer-pipeline", "off"]}
