"""CI smoke of bench/routing/routing.py: a few hundred Mooncake-trace requests on 4 sim workers through a
real fleet and coordinator, asserting behaviour only (no timings): kv_cache_aware's
worker-reported prefix-hit ratio above round_robin's, no errors, and every lease, running request
and pinned block back to zero afterwards."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.routing._trace import DEFAULT_TRACE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(),
                    reason=f"the Mooncake trace is read from {DEFAULT_TRACE} (outside the repository, "
                           "never copied into it), absent here")
def test_trace_replay_kv_aware_beats_round_robin(tmp_path):
    out = tmp_path / "routing.json"
    cmd = [sys.executable, "bench/routing/routing.py", "--workers", "4", "--sample", "8", "--limit", "240",
           "--max-output", "4", "--tokens-per-block", "16", "--compress", "300", "--dilation", "0.5",
           "--no-per-worker-load", "--policies", "round_robin,kv_cache_aware", "--quick",
           "--no-write", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = {r["policy"]: r for r in json.loads(out.read_text())["runs"][0]["rows"]}
    rr, kv = rows["round_robin"], rows["kv_cache_aware"]
    for r in (rr, kv):
        assert r["requests"] == 240 and r["errors"] == 0, r["error_samples"]
        assert r["leases_in_flight"] == {"context": 0, "generation": 0}
        assert r["workers_after"] == {"running": 0, "pinned": 0, "used": 0}
        assert r["prompt_tokens"] > 0
    assert kv["hit_ratio"] > rr["hit_ratio"] > 0, (kv["hit_ratio"], rr["hit_ratio"])
    # what the coordinator predicted is what the workers then reported, roughly
    kv_pred = sum(v["predicted_tokens"] for v in kv["coordinator_prediction"].values() if v)
    kv_act = sum(v["actual_cached_tokens"] for v in kv["coordinator_prediction"].values() if v)
    assert kv_pred > 0 and kv_act >= 0.5 * kv_pred
