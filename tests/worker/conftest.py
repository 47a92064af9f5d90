"""Fixtures for the worker tests: in-process engines and servers on real sockets, and helpers to
start real `splitserve worker` processes."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from protocol.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
URL_RE = re.compile(rb"ready at (http://\S+)")


@pytest.fixture
def byte_tok():
    return ByteTokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    import torch

    # Two shared cores: torch's thread pool only adds contention for a model this small.
    torch.set_num_threads(1)
    from worker.presets import build_preset

    return build_preset("tiny")


@pytest.fixture
async def engines(tiny_model):
    """TorchEngines on the tiny preset, started on demand (``await engines(**kw)``); each is stopped
    afterwards with its block pool's invariants checked and every block back."""
    made = []

    async def make(**kw):
        e = make_torch_engine(tiny_model, **kw)
        await e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        await e.stop()
        e.pool.check_invariants()
        assert e.pool.num_used == 0, f"{e.pool.num_used} blocks leaked"


def prompt(n, salt=0):
    """A BOS then ``n - 1`` byte-range ids, distinct per ``salt`` (prompts for the tiny preset)."""
    return [256] + [(i * 31 + salt * 17) % 200 + 40 for i in range(n - 1)]


def make_torch_engine(model, tokenizer=None, *, num_blocks=128, block_size=8, **kw):
    from protocol.tokenizer import ByteTokenizer
    from worker.engine import TorchEngine
    from worker.runner import ModelRunner

    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size)
    return TorchEngine(runner, tokenizer or ByteTokenizer(vocab_size=model.config.vocab_size), **kw)


def make_sim_engine(*, num_blocks=256, block_size=4, prefill_us=0.0, decode_us=0.0, **kw):
    from worker.sim import SimEngine

    return SimEngine(ByteTokenizer(), num_blocks=num_blocks, block_size=block_size,
                     prefill_us_per_token=prefill_us, decode_us_per_step=decode_us, **kw)


async def start_server(engine, *, role="both", model_name="tiny", **kw):
    """A WorkerServer on 127.0.0.1:0 with a real ZMQ publisher; returns (server, url)."""
    from worker.kv_events import KvEventPublisher
    from worker.server import WorkerServer

    pub = KvEventPublisher(host="127.0.0.1")
    srv = WorkerServer(engine, model_name=model_name, role=role, host="127.0.0.1", port=0,
                       publisher=pub, **kw)
    url = await srv.start()
    return srv, url


async def metric(session, url, name, labels=None) -> float:
    """One sample of a worker's /metrics."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    want = "splitserve_worker_" + name
    if labels:
        want += "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"metric {want} not in /metrics:\n{text}")


async def wait_for(pred, timeout=10.0, interval=0.02):
    """Await until the (sync or async) predicate is truthy; fail with its last value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value {last!r})")


def spawn_worker(*args, env=None, timeout=60.0):
    """Start `splitserve worker ...` and wait for its ready line; returns (proc, url)."""
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "splitserve_cli", "worker", "--port", "0",
                             *args], cwd=REPO, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise AssertionError(f"worker exited {proc.returncode}: {buf.decode(errors='replace')}")
            continue
        buf += line
        m = URL_RE.search(line)
        if m:
            # Keep draining the pipe so a chatty worker never blocks on a full buffer.
            proc.output = bytearray(buf)
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return proc, m.group(1).decode()
    proc.kill()
    raise AssertionError(f"worker not ready within {timeout}s: {buf.decode(errors='replace')}")


def _drain(proc):
    for line in proc.stdout:
        proc.output += line


def stop_worker(proc, timeout=20.0) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s
