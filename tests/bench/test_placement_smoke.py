"""`bench/routing/placement.py` runs end to end, against a baseline tree too (small sizes, same code paths)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_placement_bench_against_a_baseline_tree(tmp_path):
    out = tmp_path / "placement.json"
    # the tree itself as its own baseline: the subprocess path that imports another checkout
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "routing" / "placement.py"), "--baseline", str(ROOT),
                        "--rounds", "1", "--calls", "256", "--scenarios", "select,fleet-like pair",
                        "--json-out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    for tree in ("this tree", "baseline"):
        assert set(res[tree]) == {"select", "fleet-like pair", "_runs"}
        assert all(0 < res[tree][s] < 100_000 for s in ("select", "fleet-like pair"))
    assert "| select |" in r.stdout and "median of paired ratios" in r.stdout
