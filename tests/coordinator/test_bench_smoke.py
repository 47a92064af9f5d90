"""`bench/coordinator/coordinator.py --quick` runs end to end (small sizes, same code paths) and writes only its own
subsection of the results file's coordinator section."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# r\n\n## coordinator\n\n### another run\n\nkeep me\n\n## fleet\n\nand me\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "coordinator" / "coordinator.py"), "--quick",
         "--servers", "4", "--docs", "4", "--seconds", "0.3", "--rate", "200", "--rate-seconds", "0.3",
         "--client-procs", "1",
         "--results", str(results)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "## coordinator" in out and "msgpack over UDS" in out and "JSON over TCP" in out
    assert "select round trip p50" in out and "msgpack/UDS vs JSON/TCP" in out
    # every phase completed without an error answer
    for line in out.splitlines():
        if line.startswith("| ") and "pairs/s" not in line and "---" not in line and "target" not in line \
                and "≥" not in line and "≤" not in line:
            assert line.rstrip(" |").endswith("| 0"), line
    assert "(0 errors" in out
    text = results.read_text()
    assert "keep me" in text and "and me" in text
    assert text.count("### coordinator · ") == 1 and "select round trip p50" in text


def test_open_loop_starts_every_send_at_or_after_its_scheduled_time():
    """bench/coordinator/coordinator_load.py's open loop (timerfd-paced): every send starts once, in order,
    with its own scheduled time on an exact grid, and never before it (uvloop's `asyncio.sleep`
    pacing started sends up to 0.5 ms early: it rounds delays to whole milliseconds)."""
    import asyncio
    import time

    import uvloop

    sys.path.insert(0, str(ROOT))
    from bench.coordinator.coordinator_load import _open_loop

    for run in (asyncio.run, uvloop.run):
        starts: list[tuple[int, float, float]] = []

        async def one(rid: int, t_sched: float) -> None:
            starts.append((rid, t_sched, time.perf_counter()))
            await asyncio.sleep(0.002)   # sends overlap, as round trips do

        late = run(_open_loop(one, 1000.0, 0.25, 100))
        assert [r for r, _, _ in starts] == list(range(101, 351))
        gaps = [b[1] - a[1] for a, b in zip(starts, starts[1:])]
        assert max(abs(g - 0.001) for g in gaps) < 1e-9
        assert all(t >= t_sched for _, t_sched, t in starts)
        # a send counted late (its wake-up came > 1 ms after its scheduled time) started later still
        assert late <= sum(t - t_sched > 0.001 for _, t_sched, t in starts)


def test_aging_bench_smoke(tmp_path):
    """bench/coordinator/coordinator_aging.py: windows on one coordinator and on a baseline tree (this tree again),
    each a CPU cost per pair, with their ratio."""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "coordinator" / "coordinator_aging.py"), "--seconds", "0.5", "--window", "0.3",
         "--ttl", "0.5", "--baseline", str(ROOT), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows and all(r["this tree"] > 0 and r["baseline"] > 0 and r["baseline / this tree"] > 0 for r in rows)
