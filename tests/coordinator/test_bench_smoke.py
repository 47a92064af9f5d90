"""`bench/coordinator.py --quick` runs end to end (small sizes, same code paths) and writes only its own
subsection of the results file's coordinator section."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# r\n\n## coordinator\n\n### another run\n\nkeep me\n\n## fleet\n\nand me\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "coordinator.py"), "--quick",
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
