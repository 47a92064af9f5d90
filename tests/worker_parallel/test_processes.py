"""Process lifecycle of multi-rank workers: clean SIGTERM, no orphan after the leader is killed,
a dead follower fails the worker (health 503, requests error, exit status 1).

The `splitserve worker` processes are started together by one module fixture (their followers'
torch imports overlap) while the in-process test runs; each test then waits for its own.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from tests.worker_parallel.conftest import alive, children, complete, start_worker, wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
URL_RE = re.compile(rb"ready at (http://\S+)")


class Leader:
    """A `splitserve worker --tp-size/--pp-size` process whose output is collected on a thread."""

    def __init__(self, *flags: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", SPLITSERVE_CPU_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve_cli", "worker", "--port", "0", "--model", "tiny",
             "--engine", "torch", "--device", "cpu", "--num-blocks", "32", "--block-size", "4",
             "--transfer-agent", "tcp", "--drain-timeout", "5", "--log-level", "WARNING", *flags],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.output = bytearray()
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output += line
            m = URL_RE.search(line)
            if m:
                self.url = m.group(1).decode()
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout=90.0) -> str:
        assert self._ready.wait(timeout), f"not ready in {timeout}s: {self.text}"
        assert self.url, f"exited {self.proc.poll()} before ready: {self.text}"
        return self.url

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def followers(self) -> list[int]:
        return children(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def leaders():
    ls = {"term": Leader("--tp-size", "2"), "kill": Leader("--pp-size", "2"),
          "crash": Leader("--tp-size", "2")}
    yield ls
    for leader in ls.values():
        pids = leader.followers()
        leader.kill()
        wait_gone(pids, timeout=10)


async def test_in_process_follower_death_fails_requests_and_health(leaders):
    w = await start_worker(tp=2, num_blocks=300)
    try:
        eng, group = w.engine, w.engine.rank_group
        follower = group.pids()[1]
        await asyncio.sleep(0.3)  # the launching thread has exited: the follower must live on
        assert alive(follower) and eng.alive
        from worker.engine import EngineRequest, SamplingParams

        req = EngineRequest(request_id="long", prompt_token_ids=list(range(60, 90)),
                            sampling=SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        stream = await eng.submit(req)
        first = await stream.__anext__()
        assert first.error is None and first.token_ids
        os.kill(follower, signal.SIGKILL)
        t0 = time.monotonic()
        last = first
        async for ev in stream:
            last = ev
        assert last.finish_reason == "error", last
        assert "rank 1" in last.error and "SIGKILL" in last.error, last.error
        assert time.monotonic() - t0 < 5
        assert not eng.alive and eng.exit_code == 1 and "rank 1" in eng.failure
        async with aiohttp.ClientSession() as http:
            async with http.get(w.url + "/health") as r:
                assert r.status == 503
            st, body = await complete(http, w.url, {"prompt": "x", "max_tokens": 2})
            assert st == 503, body
            assert "lost a rank" in body["error"]["message"]
    finally:
        await asyncio.wait_for(w.close(), 30)
    assert not alive(follower)


def _health(url) -> int:
    import urllib.request

    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return r.status


def test_sigterm_drains_and_stops_every_rank(leaders):
    leader = leaders["term"]
    url = leader.wait_ready()
    assert _health(url) == 200
    followers = leader.followers()
    assert len(followers) == 1
    leader.proc.send_signal(signal.SIGTERM)
    assert leader.proc.wait(30) == 0, leader.text
    assert wait_gone(followers, timeout=10) == [], "follower outlived its leader"


def test_sigkill_of_the_leader_leaves_no_orphan(leaders):
    leader = leaders["kill"]
    leader.wait_ready()
    followers = leader.followers()
    assert len(followers) == 1 and all(alive(p) for p in followers)
    leader.kill()
    assert wait_gone(followers, timeout=10) == [], "follower survived SIGKILL of its leader"


def test_follower_crash_exits_the_leader_nonzero(leaders):
    leader = leaders["crash"]
    url = leader.wait_ready()
    assert _health(url) == 200
    (follower,) = leader.followers()
    os.kill(follower, signal.SIGKILL)
    t0 = time.monotonic()
    assert leader.proc.wait(20) == 1, leader.text
    assert time.monotonic() - t0 < 10
    assert "rank 1" in leader.text and "SIGKILL" in leader.text, leader.text
    assert wait_gone([follower], timeout=5) == []
