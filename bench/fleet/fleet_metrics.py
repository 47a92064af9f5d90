#!/usr/bin/env python3
"""CPU µs per request of the fleet's Prometheus updates in multiprocess mode (num_workers > 1):
prometheus_client's own MmapedValue and Histogram hot path against the fleet's lean value
(fleet/_mp_values.py) and histogram (fleet/metrics.py `_Histogram`).

Each measured process imports fleet.metrics with PROMETHEUS_MULTIPROC_DIR set (a fresh directory)
and replays the metric updates one two-leg kv_cache_aware request makes on the fleet's path
(fleet/server.py, flow.py, placement.py, relay.py: 22 value writes, 2 `labels()` lookups), `--n`
times, timing them with `time.process_time`. The two kinds run in alternating child processes,
`--rounds` each; the medians are compared (a shared box moves single runs by tens of percent).

Usage: `python bench/fleet/fleet_metrics.py [--rounds 7] [--n 50000]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys, time
if sys.argv[1] == "prometheus_client":
    import fleet._mp_values as mv
    mv.install_lean_values = lambda: False
import fleet.metrics as M
from prometheus_client import Histogram, values
if sys.argv[1] == "prometheus_client":      # and the stock Histogram hot path
    M._Histogram.observe, M._Histogram.labels = Histogram.observe, Histogram.labels
n = int(sys.argv[2])
req = M.REQUESTS.labels("/v1/completions", "200")        # the fleet binds these children once
leg = {r: M.LEG_REQUESTS.labels(r) for r in ("context", "generation")}
place = M.PLACEMENT.labels("disaggregated")
rtt = M.COORD_RTT.labels("select_pair")
lat = {r: M.LEG_LATENCY.labels(r) for r in ("context", "generation")}
tok = {r: (M.PROMPT_TOKENS.labels(r, "http://w:1"), M.CACHED_TOKENS.labels(r, "http://w:1"),
           M.PREDICTED_TOKENS.labels(r, "http://w:1")) for r in ("context", "generation")}

def one():
    M.INFLIGHT.inc()                       # server: the request takes a slot
    rtt.observe(0.0004)                    # placement: select_pair round trip
    place.inc()                            # flow: mode disaggregated
    leg["context"].inc()
    lat["context"].observe(0.0011)
    for m in tok["context"]:               # relay.observe_usage: prompt, cached, predicted tokens
        m.inc(960)
    leg["generation"].inc()
    lat["generation"].observe(0.0012)
    for m in tok["generation"]:
        m.inc(960)
    M.TTFT.labels("disaggregated").observe(0.0031)
    M.E2E.labels("disaggregated").observe(0.0031)
    req.inc()
    M.INFLIGHT.dec()

for _ in range(2000):
    one()
t0 = time.process_time()
for _ in range(n):
    one()
cpu = time.process_time() - t0
print(json.dumps({"value_class": values.ValueClass.__name__, "us_per_request": cpu / n * 1e6}))
"""


def run(kind: str, n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fleet-metrics-") as d:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": d}
        out = subprocess.run([sys.executable, "-c", _CHILD, kind, str(n)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=50_000, help="requests replayed per run")
    args = ap.parse_args()
    res: dict[str, list[float]] = {"prometheus_client": [], "lean": []}
    names = {}
    for _ in range(args.rounds):
        for kind in res:
            r = run(kind, args.n)
            names[kind] = r["value_class"]
            res[kind].append(r["us_per_request"])
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in res.items():
        print(f"{k:18s} ({names[k]}): median {med[k]:.2f} µs/request, runs "
              + " ".join(f"{x:.2f}" for x in v))
    print(f"lean / prometheus_client: {med['lean'] / med['prometheus_client']:.2f}  "
          f"(saves {med['prometheus_client'] - med['lean']:.2f} µs CPU per two-leg request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
