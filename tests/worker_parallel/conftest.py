"""Fixtures for multi-rank worker tests: in-process leaders (followers are real processes),
single-rank references, HTTP helpers, and /proc-based process inspection."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import aiohttp
import pytest

from splitserve_testing.proctable import alive, children  # noqa: F401 - re-exported to the tests here


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    # Two shared cores and several rank processes: intra-op threads only add contention.
    torch.set_num_threads(1)
    os.environ.setdefault("SPLITSERVE_CPU_THREADS", "1")
    # Followers inherit this: the tests' own per-rank functions (tests/worker_parallel/rank_fns.py).
    os.environ["SPLITSERVE_RANK_CALLABLE_PACKAGES"] = "tests.worker_parallel."


class Worker:
    """An in-process worker (engine [+ its KV connector] + HTTP server on 127.0.0.1:0)."""

    def __init__(self, server, url):
        self.server, self.url = server, url
        self.engine = server.engine
        self.link = server.engine.kv_connector

    async def close(self):
        await self.server.stop()
        if self.link is not None:
            await self.link.close()


async def _in_transient_thread(fn):
    """Run ``fn`` on a thread that exits right after (unlike an executor's pooled threads)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def body():
        try:
            r = fn()
        except BaseException as e:
            loop.call_soon_threadsafe(fut.set_exception, e)
        else:
            loop.call_soon_threadsafe(fut.set_result, r)

    t = threading.Thread(target=body, name="transient-launcher")
    t.start()
    out = await fut
    await asyncio.get_running_loop().run_in_executor(None, t.join)
    return out


async def start_worker(model="tiny", *, tp=1, pp=1, role="both", transfer=None, block_size=4,
                       num_blocks=96, max_num_tokens=64, pin_timeout=30.0, transfer_timeout=30.0,
                       hf_dir=None) -> Worker:
    """A single-rank (tp=pp=1) or multi-rank worker; ``transfer`` names an agent (tcp, shm) or None.
    Multi-rank workers are launched from a thread that then exits: the followers must not care
    which thread spawned them (PR_SET_PDEATHSIG is per thread)."""
    from worker.cli import build_kv_connector
    from worker.server import WorkerServer

    name = hf_dir or model
    link = None
    if transfer:  # bound, and its transceiver(s) built, by the engine's constructor
        ns = SimpleNamespace(transfer_agent=transfer, host="127.0.0.1", transfer_port=0, role=role,
                             pin_timeout=pin_timeout, transfer_timeout=transfer_timeout)
        link = build_kv_connector(ns, "tiny", None)
    if tp * pp > 1:
        from worker.parallel.engine import build_parallel_engine

        engine = await _in_transient_thread(lambda: build_parallel_engine(
            name, tp_size=tp, pp_size=pp, device="cpu", dtype="float32", num_blocks=num_blocks,
            block_size=block_size, max_num_tokens=max_num_tokens, pin_timeout_s=pin_timeout,
            kv_connector=link))
    else:
        from worker.engine import TorchEngine
        from worker.loader import load_model
        from worker.runner import ModelRunner

        m, tok, _ = load_model(name, device="cpu", dtype="float32")
        engine = TorchEngine(ModelRunner(m, num_blocks=num_blocks, block_size=block_size), tok,
                             max_num_tokens=max_num_tokens, pin_timeout_s=pin_timeout,
                             kv_connector=link)
    srv = WorkerServer(engine, model_name="tiny", role=role, host="127.0.0.1", port=0,
                       transfer_info=link.server_info() if link else None,
                       ctx_info_endpoint=link.endpoint if link else None)
    return Worker(srv, await srv.start())


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


async def complete(http, url, body):
    async with http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def wait_gone(pids, timeout=15.0) -> list[int]:
    """Wait until none of ``pids`` is alive; returns the survivors (empty on success)."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if alive(p)]
        if left:
            time.sleep(0.05)
    return left
