"""`bench/coordinator.py --quick --no-write` runs end to end (small sizes, same code paths)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "coordinator.py"), "--quick", "--no-write",
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
    assert not results.exists()   # --no-write
