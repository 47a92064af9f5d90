#!/usr/bin/env python3
"""The coordinator's cost per pair over time: channel windows back to back, past the speculative TTL.

`bench/coordinator/coordinator.py`'s fresh coordinators live ~10 s; a coordinator that has served longer than
`speculative_ttl_s` (default 30 s) meets the steady state of routed tails, where they expire as
fast as they are added (bench/results/history/coordinator.md, "coordinator · native prefix walk"). This runs one
coordinator (and with `--baseline DIR` another tree's, started together on the same core and
cluster, windows alternating) under `bench/coordinator/coordinator.py`'s setup (32 stand-in workers, 4k-token
prompts, the fleet channel) and prints the CPU µs per select+finish pair of every window.

    python bench/coordinator/coordinator_aging.py [--seconds 70] [--window 2.5] [--ttl 30] [--baseline DIR]
"""
from __future__ import annotations

import argparse
import json
import os
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

from bench.coordinator import coordinator as bc  # noqa: E402
from bench.coordinator.coordinator_load import ClientPool  # noqa: E402


def _us(w: dict) -> float:
    return w["cpu_s"] / w["pairs"] * 1e6 if w["pairs"] else float("nan")


def run(a) -> list[dict]:
    cpus = sorted(os.sched_getaffinity(0))
    coord_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    tmp = Path(tempfile.mkdtemp(prefix="splitserve-bench-aging-"))
    env = bc.bench_env()
    helper, urls = bc.start_workers(32, 64, env, client_cpu, tmp)
    procs = []
    rows = []
    try:
        conf = bc.cluster_conf(tmp, urls, {"type": "kv_cache_aware", "speculative_ttl_s": a.ttl})
        if client_cpu is not None:
            os.sched_setaffinity(0, {client_cpu})
        args = argparse.Namespace(servers=32, docs=64, prompts=512, conns=16, client_procs=2, seed=0)
        pool = ClientPool(args, client_cpu)
        try:
            trees = [("this tree", ROOT)] + ([("baseline", Path(a.baseline).resolve())] if a.baseline else [])
            targets = []
            for i, (name, root) in enumerate(trees):
                uds = str(tmp / f"coord-{i}.sock")
                p, t, _ = bc._start_coordinator(conf, uds, "fast", env, coord_cpu, 32, root=root)
                procs.append(p)
                targets.append((name, t, "unix://" + uds))
            t0 = time.monotonic()
            for _, t, _ in targets:       # fill the indexes with routed blocks first
                pool.window("select", t, min(1.0, a.window))
            while not rows or time.monotonic() - t0 < a.seconds:     # at least one window
                row = {"t_s": round(time.monotonic() - t0, 1)}
                for name, t, url in targets:
                    row[name] = round(_us(pool.window("channel", t, a.window, url=url)), 1)
                if a.baseline:
                    row["baseline / this tree"] = round(row["baseline"] / row["this tree"], 2)
                rows.append(row)
                print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        finally:
            pool.close()
    finally:
        for p in procs:
            bc._stop(p)
        bc._stop(helper)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=70.0, help="run length")
    ap.add_argument("--window", type=float, default=2.5, help="seconds per channel window")
    ap.add_argument("--ttl", type=float, default=30.0, help="the policies' speculative_ttl_s")
    ap.add_argument("--baseline", default=None, help="another checkout's root, windows alternating")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    rows = run(a)
    if a.json:
        a.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
