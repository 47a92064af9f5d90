#!/usr/bin/env python3
"""CPU µs per request of the fleet's tracing (`otlp_config`, fleet/tracing.py): off (the request
path's `is None` tests) against on (OpenTelemetry's SDK: the request span with the client's
traceparent, the placement span with a kv_cache_aware route receipt of 4 candidates per role, two
leg spans with their traceparent headers, the end), the spans batched and exported over OTLP/HTTP to
a receiver in the same process that discards them (its thread's CPU and the exporter's count).

Each run is a child process replaying `--n` requests after a warm-up, timed with
`time.process_time` (every thread of the process); off, on (every trace recorded) and sampled
(`OTEL_TRACES_SAMPLER=parentbased_traceidratio`, 1%, no client traceparent) alternate, `--rounds`
each, and the medians are compared (a shared box moves single runs by tens of percent).

Usage: `python bench/fleet/tracing_cost.py [--rounds 5] [--n 20000]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import asyncio, json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from coordinator.config import load_config
from fleet.placement import Placement
from fleet.tracing import FleetTracing

class Sink(BaseHTTPRequestHandler):
    spans = 0
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass

srv = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
threading.Thread(target=srv.serve_forever, daemon=True).start()
on = sys.argv[1] != "off"
n = int(sys.argv[2])
cfg = load_config({"otlp_config": {"otlp_traces_endpoint":
                   f"http://127.0.0.1:{srv.server_address[1]}/v1/traces"}} if on else {}, env={})
tracing = FleetTracing.from_config(cfg)

class Req:
    method, path = "POST", "/v1/chat/completions"
    # a client's sampled trace; none under a ratio sampler (the fleet's root decides then)
    headers = ({} if sys.argv[1] == "sampled" else
               {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})

class Scope:
    request_id, alias, mode, trace = 1 << 50, None, "disaggregated", None
    attempts = {"context": 0, "generation": 0}

def cands(role):
    return [{"server": f"http://10.0.0.{i}:8000", "matched_tokens": 512 * (i % 2), "score": 0.1 * i,
             "load_requests": i, "load_tokens": 900 * i} for i in range(4)]

places = tuple(Placement(role, "http://10.0.0.1:8000", 1, True, "kv_cache_aware",
                         {"policy": "kv_cache_aware", "matched_tokens": 512, "score": 0.1,
                          "candidates": cands(role)}) for role in ("context", "generation"))

async def placed():
    return places

async def one(req, scope):
    if tracing is None:                    # the request path with tracing off: these tests only
        scope.trace is None; scope.trace is None; scope.trace is None; scope.trace is None
        return
    scope.trace = tr = tracing.start(req, scope)
    await tr.placement(scope, placed())
    tr.leg("context", "http://10.0.0.1:8000", 0)
    tr.leg_done("context")
    tr.leg("generation", "http://10.0.0.2:8000", 0)
    tr.end(scope, None, 200)

async def main():
    req, scope = Req(), Scope()
    for _ in range(2000):
        await one(req, scope)
    t0 = time.process_time()
    for _ in range(n):
        await one(req, scope)
    if tracing is not None:
        tracing.shutdown()                 # the export of what is still batched counts too
    return time.process_time() - t0

cpu = asyncio.run(main())
print(json.dumps({"us_per_request": cpu / n * 1e6}))
"""


def run(kind: str, n: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if kind == "sampled":      # the SDK's own sampler settings: 1 trace in 100 recorded
        env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0.01")
    out = subprocess.run([sys.executable, "-c", _CHILD, kind, str(n)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout)["us_per_request"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20_000, help="requests replayed per run")
    args = ap.parse_args()
    res: dict[str, list[float]] = {"off": [], "on": [], "sampled": []}
    for _ in range(args.rounds):
        for kind in res:
            res[kind].append(run(kind, args.n))
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in res.items():
        print(f"tracing {k:7s}: median {med[k]:.2f} µs CPU/request, runs "
              + " ".join(f"{x:.2f}" for x in v))
    print(f"on - off: {med['on'] - med['off']:.1f} µs CPU per two-leg request; sampled 1%: "
          f"{med['sampled'] - med['off']:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
