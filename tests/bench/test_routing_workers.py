"""bench/routing/routing.py's sim workers, real processes on loopback: a worker port that another
run's process took first is not mistaken for this run's worker, and a worker that stopped is
reported by name, exit code and log instead of a bare "Connection refused".

The judged run at f900f66 (`--jobs 8`, 8 cells side by side) lost two 32-worker cells to the first:
a cell's worker picked a port that another cell's worker bound first, the other worker answered
/health in its place, the cell used it until the other cell finished and stopped it, and the next
GET /metrics was refused."""
from __future__ import annotations

import argparse
import signal

import pytest

from bench.routing import routing as R
from splitserve_testing import serves

ARGS = argparse.Namespace(tokens_per_block=16, dilation=1.0, max_batch_size=8, no_reuse_worker=False)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_worker_port_taken_by_another_run_gets_a_new_port_and_a_dead_worker_is_named(tmp_path,
                                                                                      monkeypatch):
    (tmp_path / "other").mkdir()
    (tmp_path / "ours").mkdir()
    other, ours = R.Procs(tmp_path / "other"), R.Procs(tmp_path / "ours")
    try:
        [taken] = R.start_workers(other, 1, 64, ARGS)   # another cell's worker, serving
        # our cell picked the same port before the other cell's worker bound it
        picks = iter([_port(taken)])
        real = R.free_port
        monkeypatch.setattr(R, "free_port", lambda: next(picks, None) or real())
        urls = R.start_workers(ours, 2, 64, ARGS)
        assert taken not in urls
        for u in urls:
            assert serves(ours.workers[u], _port(u)), (u, ours.worker_report(u))
        first = next(p for p in ours.procs if p.name == "worker-2-0-0")
        assert first.returncode == 2 and "Address already in use" in first.log()
        assert R.worker_state(urls, ours) == {"running": 0, "pinned": 0, "used": 0}

        # a worker that stops is named, with its exit code and log
        victim = ours.workers[urls[1]]
        victim.kill(signal.SIGKILL)
        victim.p.wait(10)
        with pytest.raises(R.WorkerGone) as e:
            R.worker_state(urls, ours)
        msg = str(e.value)
        assert f"GET /metrics of {urls[1]} failed" in msg and "Connection refused" in msg
        assert f"sim worker {victim.name} at {urls[1]} (pid {victim.pid}) exited with code -9 (SIGKILL)" in msg
        assert "splitserve worker ready at" in msg      # the end of its log
        with pytest.raises(R.WorkerGone, match=rf"1 of 2 sim workers exited while x was replayed:\n"
                                               rf"sim worker {victim.name} at {urls[1]}"):
            ours.check_workers(urls, "while x was replayed")
        with pytest.raises(R.WorkerGone, match="POST /reset_prefix_cache to"):
            R.reset_workers(urls, ours)
    finally:
        ours.stop_all()
        other.stop_all()
