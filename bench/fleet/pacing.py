#!/usr/bin/env python3
"""How late an open-loop load generator starts its sends: `asyncio.sleep` pacing against the
timerfd pacer of bench/coordinator/coordinator_load.py, on the stdlib loop and on uvloop.

bench/coordinator/coordinator.py's open loop measures each select's round trip from its scheduled send time, so
a send that starts late is charged to the coordinator. Paced by `asyncio.sleep`, sends start up to
~1.2 ms late at p99 on an idle 2-core box (and under uvloop up to 0.5 ms early: it rounds delays to
whole milliseconds), which is most of the ≤ 2 ms p99 target. This prints the lateness of each
pacer's starts (start time minus scheduled time) with nothing else running.

Usage: `python bench/fleet/pacing.py [--rate 2000] [--seconds 4]`
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np
import uvloop

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

from bench.coordinator.coordinator_load import _open_loop  # noqa: E402


async def sleep_paced(rate: float, seconds: float) -> np.ndarray:
    """The pacing bench/coordinator/coordinator_load.py used before the timerfd: sleep until each send is due."""
    n, interval = int(rate * seconds), 1.0 / rate
    t0 = time.perf_counter() + 0.05
    late = []
    for i in range(n):
        t_sched = t0 + i * interval
        now = time.perf_counter()
        if t_sched > now:
            await asyncio.sleep(t_sched - now)
        late.append(time.perf_counter() - t_sched)
    return np.asarray(late)


async def timerfd_paced(rate: float, seconds: float) -> np.ndarray:
    late = []

    async def one(_rid: int, t_sched: float) -> None:
        late.append(time.perf_counter() - t_sched)

    await _open_loop(one, rate, seconds, 0)
    return np.asarray(late)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=2000.0, help="starts per second")
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args(argv)
    print(f"lateness of each start (ms; negative = early), {a.rate:,.0f}/s for {a.seconds:g} s\n")
    print("| loop | pacer | starts | min | p50 | p90 | p99 | max |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for loop_name, run in (("asyncio", asyncio.run), ("uvloop", uvloop.run)):
        for pacer_name, pacer in (("asyncio.sleep", sleep_paced), ("timerfd", timerfd_paced)):
            ms = run(pacer(a.rate, a.seconds)) * 1e3
            p50, p90, p99 = np.percentile(ms, [50, 90, 99])
            print(f"| {loop_name} | {pacer_name} | {len(ms):,} | {ms.min():.3f} | {p50:.3f} | {p90:.3f} "
                  f"| {p99:.3f} | {ms.max():.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
