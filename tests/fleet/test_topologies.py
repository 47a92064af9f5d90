"""The three topologies (docs/design.md §2) with real processes, plus the launcher's guarantees.

- implicit coordinator + 2 fleet processes on one SO_REUSEPORT port: distinct snowflake identities,
  one aggregated /metrics view, a fleet process killed under load is restarted, SIGTERM drains;
- external coordinator shared by a 2-process fleet;
- coordinator unreachable at start: a clear message and a non-zero exit, fast.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from .conftest import free_port, free_port_pair, group, healthy, http, metric, wait_for


@pytest.fixture(scope="module")
def workers(module_cluster):
    (_, ctx), (_, gen) = module_cluster.workers(("context", {"name": "topo-ctx"}), ("generation", {"name": "topo-gen"}))
    return ctx, gen


def identity(url: str) -> tuple[int, int, int]:
    # Connection: close per call: the kernel spreads new connections over the port group.
    st, _, raw = http("GET", url + "/cluster_info", headers={"Connection": "close"})
    f = json.loads(raw)["fleet"]
    return f["pid"], f["node_id"], f["process_id"]


def fleet_pids(url: str, want: int, timeout: float = 20) -> dict[int, tuple[int, int]]:
    seen: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < deadline:
        pid, node, proc = identity(url)
        seen[pid] = (node, proc)
    return seen


class Load:
    """Background completions on fresh connections; counts outcomes."""

    def __init__(self, url: str, body: dict):
        self.url, self.body = url, body
        self.ok = 0
        self.failed: list = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                st, _, raw = http("POST", self.url + "/v1/completions", self.body,
                                  headers={"Connection": "close"}, timeout=20)
            except OSError as e:
                self.failed.append(repr(e))
                continue
            if st == 200:
                self.ok += 1
            else:
                self.failed.append((st, raw[:200]))

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(30)


def test_implicit_coordinator_two_processes(cluster, workers):
    ctx, gen = workers
    port = free_port_pair()
    cfg = cluster.config(port=port, num_workers=2, context_servers=group([ctx], "kv_cache_aware"),
                         generation_servers=group([gen], "kv_cache_aware"), fleet={"drain_timeout_s": 5})
    launcher = cluster.fleet(cfg, name="launcher")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "fleet of 2", launcher)
    ids = fleet_pids(url, 2)
    assert len(ids) == 2, f"expected 2 fleet processes behind the port, saw {ids}"
    assert len(set(ids.values())) == 2, f"identities must differ: {ids}"
    # the coordinator is on port - 1 (and serves the same cluster)
    st, _, raw = http("GET", f"http://127.0.0.1:{port - 1}/cluster_info")
    assert st == 200 and json.loads(raw)["identities"]["held"] >= 2
    # one /metrics view: requests served by either process are all counted by whichever answers
    n = 12
    for _ in range(n):
        st, _, _ = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "count me", "max_tokens": 1},
                        headers={"Connection": "close"})
        assert st == 200
    for _ in range(4):
        st, _, raw = http("GET", url + "/metrics", headers={"Connection": "close"})
        assert metric(raw.decode(), "splitserve_fleet_requests_total", endpoint="completion", status="200") >= n

    # a fleet process crashing under load is restarted; the port keeps serving
    body = {"model": "tiny", "prompt": "under load", "max_tokens": 2}
    victim = next(iter(ids))
    with Load(url, body) as load:
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(set(fleet_pids(url, 2, 5)) - {victim}) == 2, 60, "a restarted fleet process", launcher)
        before = load.ok
        time.sleep(1.0)
        after_restart = load.ok - before
    assert after_restart > 0
    # Only requests in flight on the killed process (or queued on its listener) may fail.
    assert len(load.failed) <= 8, load.failed[:5]
    assert "restarting" in launcher.log()

    # SIGTERM: drains and exits 0, children gone, port free
    launcher.kill(signal.SIGTERM)
    launcher.p.wait(30)
    assert launcher.p.returncode == 0, launcher.log()[-2000:]
    st = None
    try:
        st, _, _ = http("GET", url + "/health", timeout=1)
    except OSError:
        pass
    assert st is None, "something still answers on the fleet port after shutdown"


def test_external_coordinator(cluster, workers):
    ctx, gen = workers
    cport = free_port()
    ccfg = cluster.config("coord.yaml", port=cport + 1, context_servers=group([ctx], "kv_cache_aware"),
                          generation_servers=group([gen], "kv_cache_aware"))
    coord = cluster.coordinator(ccfg, cport)
    curl = f"http://127.0.0.1:{cport}"
    wait_for(lambda: http("GET", curl + "/health")[0] == 200, 60, "coordinator", coord)
    port = free_port()
    fcfg = cluster.config("fleet.yaml", port=port, context_servers=group([ctx], "kv_cache_aware"),
                          generation_servers=group([gen], "kv_cache_aware"))
    f = cluster.fleet(fcfg, "--num-workers", 2, "--coordinator-url", curl)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "fleet on the external coordinator", f)
    ids = fleet_pids(url, 2)
    assert len(ids) == 2
    st, _, raw = http("GET", url + "/cluster_info")
    assert json.loads(raw)["fleet"]["coordinator"] == curl
    st, h, raw = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "external", "max_tokens": 2})
    assert st == 200 and json.loads(h["x-splitserve-route"])["context"]["policy"] == "kv_cache_aware"
    # no coordinator was started on port - 1 by the fleet
    with pytest.raises(OSError):
        http("GET", f"http://127.0.0.1:{port - 1}/health", timeout=1)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_coordinator_unreachable_at_start_fails_fast(cluster, workers, num_workers):
    ctx, gen = workers
    dead = free_port()
    port = free_port()
    cfg = cluster.config(f"dead{num_workers}.yaml", port=port, server_start_timeout=2,
                         context_servers=group([ctx]), generation_servers=group([gen]))
    t0 = time.monotonic()
    f = cluster.fleet(cfg, "--num-workers", num_workers, "--coordinator-url", f"http://127.0.0.1:{dead}",
                      name=f"dead-{num_workers}")
    f.p.wait(30)
    took = time.monotonic() - t0
    assert f.p.returncode == 3, f.log()
    out = f.log()
    assert f"coordinator at http://127.0.0.1:{dead} not reachable after 2s" in out
    assert took < 15
    with pytest.raises(OSError):   # it never listened
        http("GET", f"http://127.0.0.1:{port}/health", timeout=1)


def test_single_process_topology_and_sigterm(cluster, workers):
    ctx, gen = workers
    port = free_port()
    cfg = cluster.config("single.yaml", port=port, context_servers=group([ctx]), generation_servers=group([gen]))
    f = cluster.fleet(cfg, name="single")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "single-process fleet", f)
    st, _, raw = http("GET", url + "/cluster_info")
    assert json.loads(raw)["fleet"]["coordinator"] == "in-process"
    f.kill(signal.SIGTERM)
    f.p.wait(30)
    assert f.p.returncode == 0


def test_implicit_coordinator_crash_is_restarted_without_failed_requests(cluster, workers):
    ctx, gen = workers
    port = free_port_pair()
    cfg = cluster.config("crash.yaml", port=port, num_workers=2, context_servers=group([ctx], "kv_cache_aware"),
                         generation_servers=group([gen], "kv_cache_aware"), fleet={"coordinator_timeout_s": 1})
    launcher = cluster.fleet(cfg, name="launcher-crash")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "fleet of 2", launcher)
    cport = port - 1

    def coordinator_pid():
        import subprocess as sp
        out = sp.run(["ss", "-ltnpH", f"sport = :{cport}"], capture_output=True, text=True).stdout
        return int(out.split("pid=")[1].split(",")[0])

    old = coordinator_pid()
    with Load(url, {"model": "tiny", "prompt": "through a coordinator crash", "max_tokens": 2}) as load:
        time.sleep(0.5)
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: coordinator_pid() != old, 30, "the launcher to restart the coordinator", launcher)
        wait_for(lambda: all(json.loads(http("GET", url + "/cluster_info", headers={"Connection": "close"})[2])
                             ["fleet"]["coordinator_reachable"] for _ in range(4)), 30,
                 "both fleet processes back on the coordinator", launcher)
        time.sleep(0.5)
    assert load.ok > 0 and load.failed == [], load.failed[:5]
    assert "coordinator (pid" in launcher.log() and "restarting" in launcher.log()
