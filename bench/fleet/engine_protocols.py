#!/usr/bin/env python3
"""Engine-protocol benchmark: the fleet's CPU per two-leg request for each protocol (fleet/legs/).

The fleet runs in front of mock engines (tests/fleet/peers/recorder.py, recording off) that answer
like TensorRT-LLM, vLLM or SGLang servers, so what is measured is the fleet: its CPU time (every
process of its group: fleet + in-process or implicit coordinator) per request and the client-side
latency, for `trtllm` (the baseline, same run), `vllm` (sequential, `kv_transfer_params`) and
`sglang` (both legs at once, bootstrap fields), with `round_robin` and `kv_cache_aware` placement.
The load generator (aiohttp, in this process) keeps `--concurrency` requests in flight.

Usage: `python bench/fleet/engine_protocols.py [--requests 1500] [--concurrency 16] [--no-write]`; results are
printed and written as the "## engine protocols" section of bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
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

from bench._common import cpu_model, replace_subsection  # noqa: E402
from bench.fleet.fleet import Group as _Group  # noqa: E402
from splitserve_testing import free_port, free_port_pair, wait_http  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
BODY = {"model": "mock", "prompt": "hello world " * 80, "max_tokens": 16}
ENGINE_PROTOCOLS = ("trtllm", "vllm", "sglang")


class Group(_Group):
    def cpu_ns(self) -> int:
        """CPU time of every thread of the group in ns (/proc/<pid>/task/*/schedstat: tick-based
        utime/stime is 10 ms coarse, too coarse for a few hundred µs per request)."""
        total = 0
        for pid, _ in self.members():
            try:
                for t in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                        total += int(f.read().split()[0])
            except (OSError, ValueError):
                continue
        return total


def mocks(work: Path, engine: str) -> tuple[list[Group], str, str]:
    groups, urls = [], []
    for role in ("prefill", "decode"):
        port = free_port()
        argv = [sys.executable, "-m", "tests.fleet.peers.recorder", "--port", str(port), "--record", "",
                "--engine", engine, "--role", role, "--tokens", "4"]
        if engine == "sglang" and role == "prefill":
            argv += ["--bootstrap-port", str(free_port())]
        groups.append(Group(argv, work / f"mock-{engine}-{role}.log", cwd=str(ROOT)))
        urls.append(f"http://127.0.0.1:{port}")
    for u, g in zip(urls, groups):
        wait_http(u + "/health", 20, g)
    return groups, urls[0], urls[1]


def fleet(work: Path, engine: str, policy: str, ctx: str, gen: str) -> tuple[Group, str]:
    import yaml
    port = free_port_pair()
    doc = {"hostname": "127.0.0.1", "port": port, "model": "mock", "tokenizer": "tiny", "log_level": "warning",
           "context_servers": {"urls": [ctx.split("//")[1]], "router": {"type": policy}, "protocol": engine},
           "generation_servers": {"urls": [gen.split("//")[1]], "router": {"type": policy}, "protocol": engine}}
    cfg = work / f"fleet-{engine}-{policy}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    g = Group([sys.executable, "-m", "splitserve_cli", "serve", "-c", str(cfg)], work / f"fleet-{engine}-{policy}.log",
              cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/completions", 90, g, body=BODY)
    return g, url


async def load(url: str, n: int, conc: int) -> tuple[list[float], int]:
    import aiohttp
    lat: list[float] = []
    bad = 0
    todo = iter(range(n))
    async with aiohttp.ClientSession() as s:
        async def one_worker():
            nonlocal bad
            for _ in todo:
                t = time.perf_counter()
                async with s.post(url + "/v1/completions", json=BODY) as r:
                    await r.read()
                    bad += r.status != 200
                lat.append(time.perf_counter() - t)
        await asyncio.gather(*(one_worker() for _ in range(conc)))
    return lat, bad


def measure(work: Path, engine: str, policy: str, n: int, conc: int) -> dict:
    ms, ctx, gen = mocks(work, engine)
    f = None
    try:
        f, url = fleet(work, engine, policy, ctx, gen)
        asyncio.run(load(url, max(50, n // 8), conc))          # warm up
        c0, t0 = f.cpu_ns(), time.monotonic()
        lat, bad = asyncio.run(load(url, n, conc))
        c1, el = f.cpu_ns(), time.monotonic() - t0
    finally:
        for g in ([f] if f else []) + ms:
            g.stop()
    lat.sort()
    return {"protocol": engine, "policy": policy, "n": n, "errors": bad, "rps": n / el,
            "us_per_req": (c1 - c0) / 1e3 / n, "p50_ms": statistics.median(lat) * 1e3,
            "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--policies", default="round_robin,kv_cache_aware")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for policy in a.policies.split(","):
            for engine in ENGINE_PROTOCOLS:
                r = measure(Path(d), engine, policy, a.requests, a.concurrency)
                rows.append(r)
                print(f"  {policy:15s} {engine:7s} {r['rps']:7.0f} req/s  {r['us_per_req']:6.0f} µs CPU/req  "
                      f"p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  errors {r['errors']}", flush=True)
    base = {r["policy"]: r for r in rows if r["protocol"] == "trtllm"}
    lines = [f"`python bench/fleet/engine_protocols.py --requests {a.requests} --concurrency {a.concurrency}` — "
             f"{time.strftime('%Y-%m-%d', time.gmtime())}, {cpu_model()}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}. Mock engines (tests/fleet/peers/recorder.py) answer "
             f"like each engine; fleet CPU = every process of the fleet's group. Ratios against "
             f"`trtllm` with the same policy, same run.", "",
             "| policy | protocol | req/s | fleet CPU µs/req | vs trtllm | p50 ms | p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["us_per_req"] / base[r["policy"]]["us_per_req"]
        lines.append(f"| {r['policy']} | {r['protocol']} | {r['rps']:.0f} | {r['us_per_req']:.0f} | "
                     f"{ratio:.2f}× | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
    text = "\n".join(lines)
    print(text)
    if not a.no_write:
        replace_subsection(RESULTS, "engine protocols", "### engine protocols (trtllm / vllm / sglang)", text)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
