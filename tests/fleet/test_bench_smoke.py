"""Smoke test of bench/fleet/fleet.py: a one-second run of the splitserve paths against nginx mocks."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT, clean_env


@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("nginx") is None,
                    reason="wrk and nginx are not installed (apt-get install wrk nginx)")
def test_bench_fleet_smoke():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet" / "fleet.py"), "--no-write", "--num-workers", "1,2",
                        "--duration", "1s", "--warmup", "1s"], capture_output=True, text=True, timeout=240,
                       cwd=str(ROOT), env=clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "## fleet" in out and "### Scaling" in out
    for path in ("nginx proxy", "aggregated round_robin", "two-leg round_robin", "two-leg kv_cache_aware"):
        line = next(l for l in out.splitlines() if l.startswith(f"| {path} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2].replace(",", "")) > 0, line    # req/s
        assert cells[-1] == "0", line                         # no errors
    assert "added p50" in out
    # the header names the run's interpreter speed (bench/_common.py python_speed), start and end
    import re
    m = re.search(r"Interpreter speed probe \(.*?\): ([0-9.]+) µs at the start, ([0-9.]+) µs at the end", out)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out[:3000]


@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("nginx") is None,
                    reason="wrk and nginx are not installed (apt-get install wrk nginx)")
def test_bench_fleet_wait_smoke():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet" / "fleet_wait.py"), "--num-workers", "2",
                        "--wrk-threads", "1", "--conns", "16", "--backend-workers", "1", "--seconds", "1"],
                       capture_output=True, text=True, timeout=240, cwd=str(ROOT), env=clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    rows = [l for l in out.splitlines() if l.startswith("| fleet-") or l.startswith("| coordinator |")]
    assert len(rows) == 3, out               # the coordinator and both fleet processes did work
    assert sum(int(l.split("|")[3]) for l in rows) == 16, out    # every client connection found
    assert 'call="select_pair"' in out and 'role="generation"' in out and "batches per request" in out


def test_bench_fleet_metrics_smoke():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet" / "fleet_metrics.py"), "--rounds", "1", "--n", "500"],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT), env=clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "prometheus_client  (MmapedValue): median" in r.stdout
    assert "lean               (LeanMmapedValue): median" in r.stdout
    assert "lean / prometheus_client:" in r.stdout


@pytest.mark.parametrize("policy", ["kv_cache_aware", "round_robin"])
def test_bench_fleet_instructions_request_path(policy, tmp_path):
    """bench/fleet/fleet_instructions.py's counted code path, without valgrind: its stubbed two-leg
    request must answer 200 (the child exits non-zero otherwise) and repeat without suspending."""
    env = {**clean_env(), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet" / "fleet_instructions.py"), "--child", str(ROOT),
                        policy, "20"], capture_output=True, text=True, timeout=120, cwd=str(ROOT), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
