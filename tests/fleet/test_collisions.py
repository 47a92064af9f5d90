"""Two clusters on one port or coordinator socket fail fast instead of merging (issue 39, item 1).

Before: a second `splitserve serve` with the same config (num_workers 2) had its coordinator fail to
bind (restarted forever with backoff) while its launcher's probe was answered by the *first*
cluster's coordinator; its fleet processes joined the first cluster's SO_REUSEPORT group and
coordinator socket and it announced "ready". Real launchers, coordinators and fleet processes on
loopback.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import pytest

from splitserve_testing import free_port_pair

from .conftest import PY, clean_env, group, http, wait_for


@pytest.fixture(scope="module")
def w(module_cluster):
    """The one generation worker the clusters of this module point at: only its url matters here
    (no test stops it), so one start-up serves them all."""
    return module_cluster.worker("generation", name="collisions-gen")[1]


def _config(cluster, name, port, worker_url, **extra):
    return cluster.config(name, port=port, num_workers=2, server_start_timeout=20,
                          generation_servers=group([worker_url]), **extra)


def _start_first(cluster, worker_url, port, **extra):
    cfg = _config(cluster, "a.yaml", port, worker_url, **extra)
    a = cluster.fleet(cfg, name="cluster-a")
    wait_for(lambda: "processes ready on" in a.log(), 60, "cluster A ready", a)
    return a


def _wait_exit(p, timeout=40.0) -> int:
    wait_for(lambda: not p.alive(), timeout, f"{p.name} to exit", None)
    return p.returncode


def _cluster_a_intact(port: int, cid: str) -> None:
    st, _, body = http("GET", f"http://127.0.0.1:{port}/cluster_info")
    assert st == 200
    assert json.loads(body)["cluster_id"] == cid


def test_second_cluster_on_a_taken_port_exits_nonzero(cluster, w):
    port = free_port_pair()
    a = _start_first(cluster, w, port)
    # The README's config a second time: same port, same coordinator port and socket.
    b = cluster.fleet(_config(cluster, "b.yaml", port, w), name="cluster-b")
    rc = _wait_exit(b)
    assert rc not in (0, None), b.log()
    assert "Address already in use" in b.log() and f":{port}" in b.log(), b.log()
    assert "processes ready" not in b.log()
    assert a.alive()
    st, _, body = http("GET", f"http://127.0.0.1:{port - 1}/version")
    cid = json.loads(body)["cluster_id"]
    assert re.fullmatch(r"[0-9a-f]{16}", cid)
    for _ in range(8):   # every fleet process on the port is the first cluster's
        _cluster_a_intact(port, cid)


def test_second_cluster_on_a_taken_coordinator_port_exits_nonzero(cluster, w):
    """Another public port, but the coordinator's port (and so its socket) is the first cluster's."""
    port = free_port_pair()
    a = _start_first(cluster, w, port)
    other = free_port_pair()
    b = cluster.fleet(_config(cluster, "b.yaml", other, w, coordinator={"port": port - 1}),
                      name="cluster-b")
    rc = _wait_exit(b)
    assert rc == 4, b.log()
    log = b.log()
    assert "another cluster" in log or "in use" in log, log
    assert "processes ready" not in log
    # It started no fleet process on its own port, and the first cluster still serves.
    with socket.socket() as s:
        s.bind(("127.0.0.1", other))
    assert a.alive()


def test_coordinator_socket_taken_exits_nonzero(cluster, tmp_path, w):
    """The coordinator's Unix socket is live (another cluster's); its TCP port is free."""
    port = free_port_pair()
    sock = str(tmp_path / "coord.sock")
    _start_first(cluster, w, port, coordinator={"uds_path": sock})
    other = free_port_pair()
    b = cluster.fleet(_config(cluster, "b.yaml", other, w, coordinator={"uds_path": sock}),
                      name="cluster-b")
    assert _wait_exit(b) == 4, b.log()
    assert "in use" in b.log()


def test_launcher_stops_restarting_a_coordinator_whose_port_was_taken(cluster, w):
    port = free_port_pair()
    a = _start_first(cluster, w, port)
    m = re.search(r"launcher: coordinator pid (\d+)", a.log())
    assert m, a.log()
    thief = socket.socket()
    thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        os.kill(int(m.group(1)), signal.SIGKILL)
        # Take its port while it is down (the launcher restarts it after a 0.5 s backoff).
        deadline = time.monotonic() + 5
        while True:
            try:
                thief.bind(("127.0.0.1", port - 1))
                break
            except OSError:
                assert time.monotonic() < deadline, "the coordinator's port never came free"
                time.sleep(0.01)
        thief.listen(1)
        rc = _wait_exit(a, 30)
        assert rc == 4, a.log()
        assert "not restarting" in a.log()
        assert len(re.findall(r"launcher: coordinator \(pid \d+\) exited", a.log())) == 1, a.log()
    finally:
        thief.close()


def test_fleet_process_refuses_a_foreign_coordinator(cluster, w):
    """A fleet process told its cluster id exits (5) when the coordinator reports another one."""
    port = free_port_pair()
    cfg = _config(cluster, "a.yaml", port, w)
    cluster.coordinator(cfg, port - 1)
    wait_for(lambda: http("GET", f"http://127.0.0.1:{port - 1}/version")[0] == 200, 30, "coordinator")
    p = cluster.spawn("fleet-child", [PY, "-m", "fleet.cli", "-c", str(cfg), "--port", str(port),
                                      "--coordinator-url", f"http://127.0.0.1:{port - 1}",
                                      "--child-index", "0", "--cluster-id", "0123456789abcdef"],
                      clean_env())
    assert _wait_exit(p) == 5, p.log()
    assert "belongs to another cluster" in p.log()
    with socket.socket() as s:    # it never listened
        s.bind(("127.0.0.1", port))


def test_one_process_cluster_with_a_taken_registration_port_exits_nonzero(cluster):
    """num_workers 1 with dynamic membership: the in-process coordinator serves its API on
    port - 1; when another cluster holds it, the second exits non-zero with the reason."""
    port = free_port_pair()
    doc = dict(port=port, num_workers=1, server_start_timeout=20,
               disagg_cluster={"cluster_uri": f"http://127.0.0.1:{port - 1}"})
    a = cluster.fleet(cluster.config("a.yaml", **doc), name="one-a")
    wait_for(lambda: http("GET", f"http://127.0.0.1:{port - 1}/version", timeout=2)[0] == 200, 60, "A", a)
    b = cluster.fleet(cluster.config("b.yaml", **{**doc, "port": free_port_pair(),
                                                  "coordinator": {"port": port - 1}}), name="one-b")
    assert _wait_exit(b) == 1, b.log()
    assert "cannot start the in-process coordinator" in b.log() and "in use" in b.log()
    assert "Traceback" not in b.log() and a.alive()
