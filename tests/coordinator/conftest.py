"""The coordinator's environment for tests: stand-in workers (aiohttp) and KV-event publishers
(pyzmq, vLLM framing). They are the environment, not the thing under test: the coordinator runs
for real, over real sockets and real ZMQ."""
from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from protocol import kv_replay
from router.block_keys import KEY_SCHEME, block_keys_list
from router.events import AllCleared, BlocksRemoved, BlocksStored, encode_vllm_batch
# Re-exported: the tests of this directory import it through here.
from splitserve_testing import free_ports  # noqa: F401

END = kv_replay.END_SEQ
ROOT = Path(__file__).resolve().parents[2]


async def start_sim_worker(coord_url: str, *extra: str, role: str = "both", port: int = 0,
                           num_blocks: int = 512):
    """The reference worker (`splitserve worker --engine sim`, a process) registered with the
    coordinator at `coord_url`; returns (process, its url) once it prints that it is ready."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "splitserve_cli", "worker", "--engine", "sim", "--model", "tiny",
        "--role", role, "--port", str(port), "--num-blocks", str(num_blocks),
        "--coordinator-url", coord_url, "--register-ttl", "3", "--sim-prefill-us-per-token", "1",
        "--sim-decode-us-per-step", "100", "--log-level", "WARNING", *extra,
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            if not line:
                raise AssertionError(f"worker exited: {(await proc.stderr.read()).decode()[-2000:]}")
            if line.startswith("splitserve worker ready at "):
                return proc, line.split()[4]
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


async def wait_for(pred, timeout: float = 10.0, interval: float = 0.01, what: str = "condition"):
    """Poll `pred()` until true; fail the test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


class FakeWorker:
    """A stand-in worker: `/health` (switchable), `/server_info` (editable), `/kv_snapshot`."""

    _ids = itertools.count()

    def __init__(self, role: str = "both", *, block_size: int = 16, key_scheme: str | None = KEY_SCHEME,
                 worker_id: str | None = None, kv_events: dict | None = None):
        self.healthy = True
        self.info_status = 200
        self.info = {"role": role, "model": "tiny", "engine": "sim", "block_size": block_size,
                     "worker_id": worker_id or f"w{next(self._ids)}", "max_batch_size": 64,
                     "max_num_tokens": 8192, "kv_events": kv_events}
        if key_scheme is not None:
            self.info["key_scheme"] = key_scheme
        self.snapshot: dict | None = None
        self.health_calls = 0
        self.info_calls = 0
        self.snapshot_calls = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _health(self, request):
        self.health_calls += 1
        return web.Response(text="ok" if self.healthy else "down", status=200 if self.healthy else 503)

    async def _server_info(self, request):
        self.info_calls += 1
        if self.info_status != 200:
            return web.Response(status=self.info_status, text="no")
        return web.json_response(self.info)

    async def _kv_snapshot(self, request):
        self.snapshot_calls += 1
        if self.snapshot is None:
            return web.Response(status=404)
        return web.Response(body=msgpack.packb(self.snapshot), content_type="application/msgpack")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/kv_snapshot", self._kv_snapshot)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def stored(tokens: list[int], hashes: list[int], parent: int | None = None, block_size: int = 16):
    return BlocksStored(engine_hashes=list(hashes), parent_engine_hash=parent, token_ids=list(tokens),
                        engine_block_size=block_size)


def removed(hashes: list[int]):
    return BlocksRemoved(engine_hashes=list(hashes))


def cleared():
    return AllCleared()


def legacy_payload(ts: float, events: list, dp_rank=0) -> bytes:
    """The same batch in vLLM <= 0.23's tagged-array event encoding (docs/reference/kv_events.md §2.2)."""
    out = []
    for ev in events:
        if isinstance(ev, BlocksStored):
            out.append(["BlockStored", list(ev.engine_hashes), ev.parent_engine_hash,
                        list(ev.token_ids), ev.engine_block_size, None, "GPU", None, None, 0])
        elif isinstance(ev, BlocksRemoved):
            out.append(["BlockRemoved", list(ev.engine_hashes), "GPU", 0])
        else:
            out.append(["AllBlocksCleared"])
    return msgpack.packb([ts, out, dp_rank])


class FakePublisher:
    """A KV-event publisher: PUB `[topic, seq_be8, payload]` and a ROUTER replay socket whose
    buffer the test controls (drop live sends, evict history, restart from seq 0)."""

    def __init__(self, ctx: zmq.asyncio.Context, *, topic: str = "kv-events", legacy: bool = False,
                 replay: bool = True, connect_to: str | None = None, port: int | None = None,
                 replay_port: int | None = None, dp_rank: int = 0):
        self.ctx = ctx
        self.topic = topic.encode()
        self.legacy = legacy
        self.dp_rank = dp_rank
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to:
            self.pub.connect(connect_to)
            self.endpoint = None
        else:
            if port is None:
                port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = None
        self.replay_endpoint = None
        self.replay_requests: list[int] = []
        self.replay_delay = 0.0
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            if replay_port is None:
                replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
            self._task = asyncio.get_running_loop().create_task(self._serve())
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.epoch: str | None = None      # sent as the batch's trailing element when set

    def kv_events(self, snapshot: bool = False) -> dict:
        d = {"publisher": self.endpoint, "replay": self.replay_endpoint,
             "topic": self.topic.decode(), "format": "vllm"}
        if snapshot:
            d["snapshot"] = "/kv_snapshot"
        return d

    def encode(self, events: list) -> bytes:
        if self.legacy:
            return legacy_payload(time.time(), events, self.dp_rank)
        return encode_vllm_batch(time.time(), events, self.dp_rank, self.epoch)

    async def send_raw(self, payload: bytes) -> int:
        """Send arbitrary payload bytes as the next live batch (not kept for replay)."""
        seq = self.seq
        self.seq += 1
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def publish(self, events: list, *, deliver: bool = True) -> int:
        """Buffer one batch for replay and (unless `deliver` is False: a drop) send it live."""
        seq = self.seq
        self.seq += 1
        payload = self.encode(events)
        self.buffer.append((seq, payload))
        if deliver:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def evict(self, keep_from: int) -> None:
        self.buffer = [(s, p) for s, p in self.buffer if s >= keep_from]

    def restart(self) -> None:
        self.seq = 0
        self.buffer = []

    async def _serve(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            ident, rest = frames[0], frames[1:]
            head = [ident] + ([b""] if rest and rest[0] == b"" else [])
            start = int.from_bytes(rest[-1], "big")
            self.replay_requests.append(start)
            if self.replay_delay:
                await asyncio.sleep(self.replay_delay)
            for s, p in list(self.buffer):
                if s >= start:
                    # vLLM 0.33 form: [topic, seq, payload]
                    await self.router.send_multipart(head + [self.topic, s.to_bytes(8, "big"), p])
            await self.router.send_multipart(head + [self.topic, END, b""])

    def close(self) -> None:
        if self.router is not None:
            self._task.cancel()
            self.router.close(0)
        self.pub.close(0)


def chain(tokens: list[int], block_size: int = 16, base: int = 1_000) -> list[int]:
    """Engine hashes for the full blocks of `tokens` (opaque ids, like vLLM's)."""
    return [base + i for i in range(len(tokens) // block_size)]


def keys_of(tokens: list[int], block_size: int = 16) -> list[int]:
    return block_keys_list(tokens, block_size)


@pytest.fixture
async def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def workers():
    made: list[FakeWorker] = []

    async def make(role: str = "both", **kw) -> FakeWorker:
        w = FakeWorker(role, **kw)
        await w.start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


def cfg(ctx_urls=(), gen_urls=(), *, ctx_router="kv_cache_aware", gen_router="kv_cache_aware",
        interval=0.05, threshold=2, ttl=300.0, minimal=None, extra=None, **coord) -> dict:
    """A cluster config dict with fast health checks."""
    d = {
        "context_servers": {"urls": list(ctx_urls), "router": {"type": ctx_router}},
        "generation_servers": {"urls": list(gen_urls), "router": {"type": gen_router}},
        "leases": {"ttl_s": ttl},
        "coordinator": {"health_check_interval_s": interval, "health_failure_threshold": threshold,
                        "server_info_timeout_s": 1.0, **coord},
    }
    if minimal is not None:
        d["disagg_cluster"] = {"cluster_uri": "http://127.0.0.1:1",
                               "minimal_instances": {"context_servers": minimal[0],
                                                     "generation_servers": minimal[1]},
                               "heartbeat_interval_sec": 0.1, "inactive_timeout_sec": 0.5}
    if extra:
        d.update(extra)
    return d


@pytest.fixture
async def coordinator():
    """`await coordinator(config_dict, serve=True, http="fast"|"aiohttp")` → (Coordinator,
    CoordinatorServer|None)."""
    from coordinator.listeners import CoordinatorServer
    from coordinator.service import Coordinator

    made = []

    async def make(config: dict, *, serve: bool = True, uds: str | None = None, http: str = "fast"):
        c = Coordinator(config)
        if serve:
            s = CoordinatorServer(c, host="127.0.0.1", port=0, uds_path=uds, http=http)
            await s.start()
            made.append(s)
            return c, s
        await c.start()
        made.append(c)
        return c, None

    yield make
    for m in reversed(made):
        await m.stop()
