"""The process/port harness tests and benchmarks share (splitserve_testing/): real child processes,
real sockets."""
from __future__ import annotations

import signal
import socket
import sys
import time

import pytest

from splitserve_testing import Proc, free_port_pair, free_ports, serves, stop_all, wait_for, wait_http
from splitserve_testing.proctable import alive, children, group_members

PY = sys.executable
# A parent that starts a child of its own (like a fleet launcher), prints both pids, and lives on;
# with `stubborn` both ignore SIGTERM.
TREE = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\\n"
                          "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                          "time.sleep(600)", sys.argv[1]])
print(os.getpid(), child.pid, flush=True)
time.sleep(600)
"""


def _pids(p: Proc) -> tuple[int, int]:
    line = wait_for(lambda: [x for x in p.log().splitlines() if x and x[0].isdigit()], 20, "pids", p)[0]
    a, b = map(int, line.split())
    return a, b


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_group_stop_ends_the_whole_tree(tmp_path):
    p = Proc("tree", [PY, "-c", TREE, "polite"], tmp_path / "tree.log", group=True, header=True)
    leader, child = _pids(p)
    assert leader == p.pid and children(leader) == [child]
    assert {pid for pid, _ in group_members(p.pid)} == {leader, child}
    assert p.stop(grace=10) == -signal.SIGTERM and not p.escalated
    assert _gone(child)
    assert p.log().startswith(f"$ {PY} -c ")


def test_pid_stop_escalates_to_the_group_after_the_grace_period(tmp_path):
    p = Proc("stubborn", [PY, "-c", TREE, "stubborn"], tmp_path / "s.log")
    leader, child = _pids(p)
    t0 = time.monotonic()
    assert p.stop(grace=0.5) == -signal.SIGKILL and p.escalated
    assert time.monotonic() - t0 < 5
    assert _gone(leader) and _gone(child)


def test_stop_all_terminates_together_and_reports_who_needed_sigkill(tmp_path):
    polite = Proc("polite", [PY, "-c", "import time; time.sleep(600)"], tmp_path / "p.log")
    stubborn = Proc("stubborn", [PY, "-c", TREE, "stubborn"], tmp_path / "s.log")
    _pids(stubborn)
    codes = stop_all([polite, stubborn], grace=0.5)
    assert codes == {"polite": -signal.SIGTERM, "stubborn": None}


def test_wait_for_fails_with_the_log_of_a_child_that_died(tmp_path):
    p = Proc("dies", [PY, "-c", "import sys; print('cannot bind', flush=True); sys.exit(3)"],
             tmp_path / "d.log")
    with pytest.raises(RuntimeError) as e:
        wait_http("http://127.0.0.1:1/health", 20, p)
    assert "dies exited (3)" in str(e.value) and "cannot bind" in str(e.value)
    p.stop()


def test_wait_http_returns_once_the_child_serves(tmp_path):
    port = free_ports(1)
    p = Proc("http", [PY, "-m", "http.server", "--bind", "127.0.0.1", str(port)], tmp_path / "h.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/", 20, p)
    finally:
        p.stop()


def test_wait_http_served_by_refuses_another_process_answering_on_the_port(tmp_path):
    """Two runs side by side picked the same free port and the other one's server bound it first:
    its answer passes for our child under a plain wait_http, while our child fails to bind and
    exits. With served_by that exit is the failure, with the child's log."""
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}/"
    server = [PY, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    other = Proc("other", server, tmp_path / "o.log")
    ours = None
    try:
        wait_http(url, 20, other, served_by=other)      # the other run's server, which does serve
        assert serves(other, port)
        ours = Proc("ours", server, tmp_path / "ours.log")
        wait_http(url, 20, ours)                         # the hazard: answered, by `other`
        with pytest.raises(RuntimeError) as e:
            wait_http(url, 20, ours, served_by=ours)
        assert "ours exited (1)" in str(e.value) and "Address already in use" in str(e.value)
        assert not serves(ours, port)
    finally:
        for p in (ours, other):
            if p is not None:
                p.stop()


def test_wait_for_times_out_with_the_last_error():
    def boom():
        raise OSError("refused")
    with pytest.raises(AssertionError, match=r"timed out after 0.2s waiting for x \(last error: refused\)"):
        wait_for(boom, 0.2, "x")


def test_free_ports_are_consecutive_and_bindable():
    base = free_ports(3)
    socks = []
    try:
        for i in range(3):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", base + i))
    finally:
        for s in socks:
            s.close()
    p = free_port_pair()
    for port in (p - 1, p):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
