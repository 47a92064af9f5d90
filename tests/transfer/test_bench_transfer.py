"""`bench/transfer/transfer.py --quick --no-write` runs end to end (small sizes, the same code paths)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_runs_and_does_not_write(tmp_path):
    results = tmp_path / "RESULTS.md"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer" / "transfer.py"), "--quick",
                        "--no-write", "--results", str(results)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "## transfer — cpu" in out
    assert "| 4,096 | 128 |" in out            # 4k tokens of the 1b shape = 128 MiB
    assert "TTFT of a 4,096-token prompt" in out and "| tcp |" in out
    assert not results.exists()


def test_submit_host_probe_runs_against_this_tree():
    """`bench/transfer/submit_host.py` (a direct write's host work with the device stubbed)
    drives this tree's `NixlAgent.submit_prepped` down the direct path (it asserts so per call)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "transfer" / "submit_host.py"),
                        "--calls", "20", "--rounds", "1", "--blocks", "64"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"| {ROOT} | 64 |" in r.stdout
