#!/usr/bin/env python3
"""Where a fleet's requests wait: per-process CPU and connections, the coordinator's CPU, the host's
busy share and the fleet's own latency histograms, over the steady state of one wrk run.

bench/fleet/fleet.py gives req/s and CPU per request; when a path stops scaling this says whether the
fleet processes are saturated (100% each), waiting (idle while the host is not busy) or starved
(the host is), and what a request waits for: the fleet's `splitserve_fleet_coordinator_rtt_seconds`,
`..._leg_latency_seconds` and `..._e2e_request_latency_seconds` (means over the window), and the
coordinator's channel batches per request. Same mock backends and request as bench/fleet/fleet.py.

Usage: `python bench/fleet/fleet_wait.py [--policy kv_cache_aware] [--num-workers 8] [--conns 256]
[--wrk-threads 4] [--backend-workers 4] [--seconds 3]`. Needs wrk and nginx. Prints only.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

from bench.fleet import fleet as F  # noqa: E402
from bench.fleet.fleet_ab import _batches  # noqa: E402
from splitserve_testing import free_port, free_port_pair  # noqa: E402
from splitserve_testing.proctable import connections_on, splitserve_role  # noqa: E402

HISTOGRAMS = ("coordinator_rtt_seconds", "leg_latency_seconds", "e2e_request_latency_seconds")


def _histograms(url: str) -> dict[tuple[str, str, str], float]:
    """{(histogram, labels, "sum" | "count"): value} of the fleet's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name.removeprefix("splitserve_fleet_")
        if name not in HISTOGRAMS:
            continue
        for smp in fam.samples:
            part = smp.name.rsplit("_", 1)[1]
            if part in ("sum", "count"):
                k = (name, ",".join(f'{k}="{v}"' for k, v in sorted(smp.labels.items())), part)
                out[k] = out.get(k, 0.0) + smp.value
    return out


def _host_ticks() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the host from /proc/stat."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v), v[3] + v[4]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="kv_cache_aware", choices=("kv_cache_aware", "round_robin"))
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--conns", type=int, default=256)
    ap.add_argument("--wrk-threads", type=int, default=4)
    ap.add_argument("--backend-workers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0, help="measured window inside the wrk run")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="splitserve-bench-wait-"))
    nginx, urls = F.mock_backends(work, a.backend_workers)
    script = F.lua(work, "completions", "/v1/completions", F.BODY)
    port = free_port_pair() if a.num_workers > 1 else free_port()
    cfg = F.fleet_config(work, "fleet", port, urls["gen"], urls["ctx"], a.policy, a.num_workers)
    g = F.start_fleet(work, "fleet", cfg)
    url = f"http://127.0.0.1:{port}"
    coord = f"http://127.0.0.1:{port - 1}" if a.num_workers > 1 else None
    try:
        F.wait_http(url + "/v1/completions", 90, g, body=F.BODY)
        F.wrk(url, script, a.conns, "2s", a.wrk_threads)
        time.sleep(1.0)      # see bench/fleet/fleet.py measure_group: wrk's port reuse after a run
        res: dict = {}
        run = threading.Thread(target=lambda: res.update(F.wrk(url, script, a.conns,
                                                                 f"{a.seconds + 3:g}s", a.wrk_threads)))
        run.start()
        time.sleep(1.5)
        pids = [pid for pid, _ in g.members()]
        conns = {pid: connections_on(pid, port) for pid in pids}
        roles = {pid: splitserve_role(pid) or "?" for pid in pids}
        h0, b0, host0 = _histograms(url), _batches(coord) if coord else None, _host_ticks()
        c0, t0 = {pid: F.cpu_ticks(f) for pid, f in g.members()}, time.monotonic()
        time.sleep(a.seconds)
        c1, el = {pid: F.cpu_ticks(f) for pid, f in g.members()}, time.monotonic() - t0
        h1, b1, host1 = _histograms(url), _batches(coord) if coord else None, _host_ticks()
        run.join()
    finally:
        g.stop()
        nginx.stop()
    served = sum(h1.get(k, 0) - h0.get(k, 0) for k in h1
                 if k[0] == "e2e_request_latency_seconds" and k[2] == "count")
    rps = served / el
    tot, idle = host1[0] - host0[0], host1[1] - host0[1]
    print(f"{a.policy}, {a.num_workers} process(es), wrk {a.wrk_threads}×{a.conns}: wrk {res.get('rps', 0):,.0f} "
          f"req/s (p50 {res.get('p50_ms', 0):.2f} ms, p99 {res.get('p99_ms', 0):.2f} ms, errors "
          f"{res.get('errors')}); {rps:,.0f} req/s answered in the {el:.1f} s window; host busy "
          f"{(1 - idle / tot) * 100:.0f}% of {os.cpu_count()} cores")
    if b0 is not None and b1 is not None and served:
        print(f"coordinator channel batches per request: {(b1 - b0) / served:.3f}")
    print("\n| process | CPU | client connections | its CPU µs per request served (by all) |\n|---|---:|---:|---:|")
    for pid in sorted(c0, key=lambda p: roles.get(p, "?")):
        cpu_s = (c1.get(pid, c0[pid]) - c0[pid]) / F.CLK_TCK
        if cpu_s / el > 0.01:
            per = f"{cpu_s / served * 1e6:.1f}" if served else "-"
            print(f"| {roles.get(pid, '?')} | {cpu_s / el:.0%} | {conns.get(pid, 0)} | {per} |")
    print("\n| histogram | labels | mean ms | samples |\n|---|---|---:|---:|")
    for k in sorted(h1):
        if k[2] != "sum":
            continue
        n = h1.get((k[0], k[1], "count"), 0) - h0.get((k[0], k[1], "count"), 0)
        if n:
            print(f"| {k[0]} | {k[1]} | {(h1[k] - h0.get(k, 0)) / n * 1e3:.3f} | {n:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
