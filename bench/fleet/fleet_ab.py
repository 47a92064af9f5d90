#!/usr/bin/env python3
"""Fleet CPU per request of source trees side by side: aggregated round_robin, two-leg round_robin, two-leg kv_cache_aware.

For a change to the fleet's per-request cost on a shared box, where one run moves by tens of
percent: every round starts a fresh fleet of each tree (`--trees`, default this one) for each path,
in turn, against the same nginx mocks (bench/fleet/fleet.py's helpers), runs wrk, and reads the CPU of the
fleet processes and of the coordinator process, and the coordinator's channel batches per request
(`splitserve_coordinator_channel_batches_total`). Medians and minima per tree and path at the end
(contention only adds CPU time: the minimum is the least disturbed run), and each later tree's
fleet CPU over the first tree's, per round (the two ran back to back) and their median.

A baseline tree: `git archive REV | tar -x -C /tmp/base` (it runs with this interpreter).
`--together` loads every tree's fleet at the same time instead (each with its own wrk): all see the
same contention from the rest of the box, which on a shared box resolves differences of a few
percent that the in-turn rounds do not.

Usage: `python bench/fleet/fleet_ab.py [--trees /tmp/base,.] [--rounds 5] [--conns 16] [--duration 3s]
[--num-workers 2] [--paths two-leg-round_robin,two-leg-kv_cache_aware] [--together] [--json-out FILE]`
(`--paths` as bench/fleet/fleet.py's, default the two two-leg paths). Needs wrk and nginx; prints only.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
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

PATHS = {"aggregated-round_robin": ("aggregated round_robin", "round_robin", False),
         "two-leg-round_robin": ("two-leg round_robin", "round_robin", True),
         "two-leg-kv_cache_aware": ("two-leg kv_cache_aware", "kv_cache_aware", True)}


def _batches(coord_url: str) -> float | None:
    try:
        text = urllib.request.urlopen(coord_url + "/metrics", timeout=5).read().decode()
    except OSError:
        return None
    m = re.search(r"^splitserve_coordinator_channel_batches_total (\S+)", text, re.M)
    return float(m.group(1)) if m else None


def one(work: Path, tree: Path, tag: str, urls, policy: str, two_leg: bool, args, script: Path) -> dict:
    """One tree's fleet on its own (the in-turn rounds)."""
    return together(work, [tree], [tag], urls, policy, two_leg, args, script)[0]


def together(work: Path, trees: list[Path], tags: list[str], urls, policy: str, two_leg: bool, args,
             script: Path) -> list[dict]:
    """One fleet per tree, all loaded at once by their own wrk (same connections, same duration):
    with `--together` every tree sees the same contention from the rest of the box; with one tree
    it is a round's run of that tree (`one`). Each one's CPU per request is its own processes'
    ticks over its own requests."""
    from concurrent.futures import ThreadPoolExecutor
    groups, ports = [], []
    try:
        for tree, tag in zip(trees, tags):
            F.ROOT = tree            # start_fleet runs `python -m splitserve_cli` in F.ROOT
            port = F.free_port_pair()
            cfg = F.fleet_config(work, tag, port, urls["gen"], urls["ctx"] if two_leg else [], policy,
                                 args.num_workers)
            groups.append(F.start_fleet(work, tag, cfg))
            ports.append(port)
        for g, port in zip(groups, ports):
            F.wait_http(f"http://127.0.0.1:{port}/v1/completions", 90, g, body=F.BODY)
        with ThreadPoolExecutor(len(groups)) as ex:
            list(ex.map(lambda p: F.wrk(f"http://127.0.0.1:{p}", script, args.conns, "1s", args.wrk_threads),
                        ports))
            time.sleep(0.5)      # see bench/fleet/fleet.py measure_group: wrk's port reuse after a run
            before = [(_batches(f"http://127.0.0.1:{p - 1}"), g.ticks_split()) for g, p in zip(groups, ports)]
            runs = list(ex.map(lambda p: F.wrk(f"http://127.0.0.1:{p}", script, args.conns, args.duration,
                                                     args.wrk_threads),
                               ports))
            after = [(_batches(f"http://127.0.0.1:{p - 1}"), g.ticks_split()) for g, p in zip(groups, ports)]
    finally:
        for g in groups:
            g.stop()
    out = []
    for r, (b0, c0), (b1, c1) in zip(runs, before, after):
        n = max(1, r["n"])
        out.append({"rps": r["rps"], "errors": r["errors"], "p99_ms": r["p99_ms"],
                    "fleet_us": (c1["fleet"] - c0["fleet"]) / F.CLK_TCK / n * 1e6,
                    "coord_us": (c1["coordinator"] - c0["coordinator"]) / F.CLK_TCK / n * 1e6,
                    "batches_per_req": (b1 - b0) / n if b0 is not None and b1 is not None else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=str(F.ROOT), help="comma-separated source trees")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (-t) per fleet")
    ap.add_argument("--duration", default="3s")
    ap.add_argument("--num-workers", type=int, default=2, help="> 1: the coordinator is its own process")
    ap.add_argument("--backend-workers", type=int, default=1)
    ap.add_argument("--paths", default="two-leg-round_robin,two-leg-kv_cache_aware",
                    help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--together", action="store_true",
                    help="load every tree's fleet at once (same contention for all) instead of in turn")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    paths = [PATHS[p] for p in args.paths.split(",")]
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    work = Path(__import__("tempfile").mkdtemp(prefix="fleet-ab-"))
    nginx, urls = F.mock_backends(work, args.backend_workers)
    script = F.lua(work, "completions", "/v1/completions", F.BODY)
    res: dict[str, list[dict]] = {}
    try:
        for i in range(args.rounds):
            if args.together:
                done = []
                for name, policy, two_leg in paths:
                    tags = [f"t{t}-{name.split()[0]}-{policy}-{i}" for t in range(len(trees))]
                    rs = together(work, trees, tags, urls, policy, two_leg, args, script)
                    done += [(f"{tree.name or tree} · {name}", r) for tree, r in zip(trees, rs)]
            else:
                done = ((f"{tree.name or tree} · {name}",
                         one(work, tree, f"t{t}-{name.split()[0]}-{policy}-{i}", urls, policy, two_leg, args,
                             script))
                        for t, tree in enumerate(trees) for name, policy, two_leg in paths)
            for key, r in done:
                res.setdefault(key, []).append(r)
                bpr = "-" if r["batches_per_req"] is None else f"{r['batches_per_req']:.2f}"
                print(f"round {i} {key}: {r['rps']:.0f} req/s, fleet {r['fleet_us']:.0f} µs/req, "
                      f"coordinator {r['coord_us']:.0f} µs/req, batches/req {bpr}, p99 {r['p99_ms']:.1f} ms, "
                      f"errors {r['errors']}", flush=True)
    finally:
        nginx.stop()
    print("\n| tree · path | fleet µs/req median (min) | coordinator µs/req median (min) | batches/req | req/s | "
          "p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, rs in res.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        low = lambda k: min(r[k] for r in rs)  # noqa: E731
        b = [r["batches_per_req"] for r in rs if r["batches_per_req"] is not None]
        print(f"| {key} | {med('fleet_us'):.0f} ({low('fleet_us'):.0f}) | {med('coord_us'):.0f} ({low('coord_us'):.0f}) | "
              f"{statistics.median(b):.2f} | {med('rps'):,.0f} | {med('p99_ms'):.1f} | {sum(r['errors'] for r in rs)} |"
              if b else
              f"| {key} | {med('fleet_us'):.0f} ({low('fleet_us'):.0f}) | {med('coord_us'):.0f} ({low('coord_us'):.0f}) | - | "
              f"{med('rps'):,.0f} | {med('p99_ms'):.1f} | {sum(r['errors'] for r in rs)} |")
    if len(trees) > 1:
        # Same-round pairs (the trees ran back to back): the box's drift between rounds cancels out.
        print("\n| path · tree / first tree | fleet µs/req ratio, median of rounds (each round) |")
        print("|---|---|")
        base = trees[0].name or str(trees[0])
        for name, _policy, _two in paths:
            for tree in trees[1:]:
                t = tree.name or str(tree)
                a, b = res.get(f"{base} · {name}"), res.get(f"{t} · {name}")
                if not a or not b:
                    continue
                ratios = [y["fleet_us"] / x["fleet_us"] for x, y in zip(a, b) if x["fleet_us"] > 0]
                if ratios:
                    print(f"| {name} · {t} / {base} | **{statistics.median(ratios):.2f}** "
                          f"({' '.join(f'{r:.2f}' for r in ratios)}) |")
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
