"""fleet/_mp_values.py: the lean multiprocess value writes exactly what prometheus_client's writes.

Two real processes run the same metric updates on the fleet's metrics in multiprocess mode, one
with prometheus_client's own MmapedValue and one with the lean value; the files each leaves are
merged by prometheus_client's MultiProcessCollector (what any fleet process's /metrics serves) and
must expose the same samples. The updates add enough label values to grow (and so remap) the
mmap'd file after samples were written, and fork a child that writes under its own pid.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, multiprocess

ROOT = Path(__file__).resolve().parents[2]

_UPDATES = r"""
import os, sys
if sys.argv[1] == "std":
    import fleet._mp_values as mv
    mv.install_lean_values = lambda: False
import fleet.metrics as M
from prometheus_client import values
print(type(values.ValueClass).__name__ if not isinstance(values.ValueClass, type) else values.ValueClass.__name__)
lat = M.LEG_LATENCY.labels("context")
M.LEG_REQUESTS.labels("context").inc()
for i in range(300):                       # ~300 samples of ~230 bytes: the counter file outgrows its first 64 KiB mapping
    M.EJECTIONS.labels("generation", f"http://10.0.0.{i}:8000").inc(i % 7 + 1)
    lat.observe(i / 1000.0)
    M.TTFT.labels("disaggregated").observe(i / 500.0)
M.LEG_REQUESTS.labels("context").inc(2.5)  # a sample written before the remap, updated after it
M.INFLIGHT.inc(); M.INFLIGHT.inc(); M.INFLIGHT.dec()
M.COORD_UP.set(1)
M.COORD_UP.set(0)
pid = os.fork()
if pid == 0:                               # the child writes to its own pid's files
    M.LEG_REQUESTS.labels("context").inc(10)
    M.INFLIGHT.inc()
    lat.observe(0.2)
    os._exit(0)
os.waitpid(pid, 0)
M.LEG_REQUESTS.labels("generation").inc()
"""


def _run(kind: str, d: Path) -> tuple[str, bytes]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d)}
    out = subprocess.run([sys.executable, "-c", _UPDATES, kind], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(d))
    return out.stdout.strip(), generate_latest(reg)


def test_lean_values_expose_the_same_samples_as_prometheus_client(tmp_path):
    (tmp_path / "std").mkdir()
    (tmp_path / "lean").mkdir()
    std_cls, std = _run("std", tmp_path / "std")
    lean_cls, lean = _run("lean", tmp_path / "lean")
    assert std_cls == "MmapedValue" and lean_cls == "LeanMmapedValue"
    assert len(list((tmp_path / "lean").glob("counter_*.db"))) == 2     # parent and forked child
    assert max(p.stat().st_size for p in (tmp_path / "lean").glob("counter_*.db")) > 1 << 16  # remapped
    text = lean.decode()
    assert 'splitserve_fleet_leg_requests_total{role="context"} 13.5' in text
    assert "splitserve_fleet_inflight_requests 2.0" in text
    assert "splitserve_fleet_coordinator_reachable 0.0" in text
    assert 'splitserve_fleet_leg_latency_seconds_count{role="context"} 301.0' in text
    # the collector's metric order follows file listing order: compare the samples, not the order
    assert sorted(lean.splitlines()) == sorted(std.splitlines())


def test_fleet_histogram_buckets_like_prometheus_client():
    """fleet.metrics._Histogram (bisection, cached children) against prometheus_client's own."""
    from prometheus_client import Histogram

    from fleet.metrics import _LAT_BUCKETS, _Histogram
    amounts = [0.0, -1.0, 0.0005, 0.00050001, 0.001, 0.003, 1.0, 119.9, 120.0, 121.0,
               float("inf"), float("-inf"), float("nan"), 1e-12, 60.0]
    regs = []
    for cls in (Histogram, _Histogram):
        reg = CollectorRegistry()
        h = cls("h_seconds", "h", ["mode"], buckets=_LAT_BUCKETS, registry=reg)
        for a in amounts:
            h.labels("disaggregated").observe(a)
            h.labels(mode="aggregated").observe(a * 2)
        # everything but the creation time stamps
        regs.append(b"\n".join(l for l in generate_latest(reg).splitlines() if b"_created" not in l))
    assert regs[0] == regs[1]
    assert b'h_seconds_bucket{le="0.0005",mode="disaggregated"} 5.0' in regs[1]
