"""bench/worker/worker.py runs end to end (tiny, CPU, quick) and prints its roofline table."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_worker_quick(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## router\n\nkeep me\n")
    out = subprocess.run([sys.executable, "bench/worker/worker.py", "--quick", "--batch", "1", "--batch", "4",
                          "--results", str(results)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| (prefill|decode) \| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)% \| (\w+) \| (\d+) \|",
                      out.stdout, re.M)
    assert [(r[0], r[1]) for r in rows] == [("prefill", "1"), ("prefill", "4"), ("decode", "1"), ("decode", "4")]
    assert {(r[5], r[6]) for r in rows} == {("torch", "64")}, "CPU: the torch backend, context = prompt length"
    assert all(int(r[2].replace(",", "")) > 0 and float(r[4]) > 0 for r in rows)
    text = results.read_text()
    # its own subsection (a second run replaces it: tests/bench/test_results_file.py)
    assert "keep me" in text and "## worker" in text and text.count("### tiny · cpu · float32") == 1


def test_bench_worker_mixed_decode(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = subprocess.run([sys.executable, "bench/worker/worker.py", "--mixed-decode", "--quick", "--long-len", "2000",
                          "--short-len", "20", "--short-rows", "10", "--results", str(results)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| (one padded batch|grouped by length) \| ([\d.]+) \| (\d) \| ([\d,]+) \| ([\d,]+) \|",
                      out.stdout, re.M)
    assert [(r[0], r[2]) for r in rows] == [("one padded batch", "1"), ("grouped by length", "2")]
    single, grouped = (int(r[3].replace(",", "")) for r in rows)
    assert grouped < single / 3 and all(float(r[1]) > 0 for r in rows)
    assert "### mixed decode · tiny · cpu · float32" in results.read_text()


def test_bench_worker_clips_contexts_to_the_model_limit(tmp_path):
    """With ``--no-write`` the results file is left alone. A decode context past ``max_position_embeddings`` (tiny: 8192) is one no worker serves
    (worker/engine.py caps requests there, and the runner's CUDA-graph tables end there): the bench
    runs the longest servable one instead and says so."""
    results = tmp_path / "RESULTS.md"
    out = subprocess.run([sys.executable, "bench/worker/worker.py", "--quick", "--no-write", "--batch", "1",
                          "--context", "100", "--context", "9000", "--results", str(results)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "% of roofline" in out.stdout and not results.exists()
    ctx = re.findall(r"^\| decode \| 1 \| [\d,]+ \| [\d,]+ \| [\d.]+% \| \w+ \| (\d+) \|", out.stdout, re.M)
    limit = 8192 - 2 * 4 - 2  # --quick: 4 decode steps, each context also runs a warm-up past it
    assert ctx == ["100", str(limit)]
    assert f"contexts 9000 clipped to {limit}" in out.stdout


def test_bench_worker_sampling_table():
    out = subprocess.run([sys.executable, "bench/worker/worker.py", "--sampling", "--vocab", "1000", "--batch", "1",
                          "--batch", "4", "--sampling-repeats", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", out.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "4"] and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
