"""The router-core benchmark must keep running (a smoke run on small sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_runs_and_reports_every_measure(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "routing" / "router_core.py"), "--quick", "--no-write",
         "--results", str(results)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("## router core", "block keys", "event apply", "select p50 / p99",
                   "TRT-LLM-style sets", "speedup"):
        assert needle in out
    assert not results.exists()  # --no-write


def test_bench_writes_and_replaces_its_section(tmp_path):
    sys.path.insert(0, str(ROOT))
    from bench._common import replace_section as write_results
    path = tmp_path / "RESULTS.md"
    write_results(path, ["## router core", "", "first"])
    assert path.read_text().startswith("# Benchmark results\n")
    path.write_text(path.read_text() + "\n## other bench\n\nkeep me\n")
    write_results(path, ["## router core", "", "second"])
    text = path.read_text()
    assert "second" in text and "first" not in text and "keep me" in text
    assert text.count("## router core") == 1
