"""The load generator of bench/coordinator/coordinator.py: a small HTTP/1.1 keep-alive client on raw asyncio
transports (so the client core is not the bottleneck being measured), the closed-loop client
processes, and the open-loop drivers over HTTP and the fleet channel."""
from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

# the prompts (and their sizes) are bench/routing/placement.py's, which measures the same cluster in process
from bench.routing.placement import PROMPT_TOKENS, _prompts  # noqa: E402
from coordinator.gc_tuning import settle_heap  # noqa: E402

# ---------------------------------------------------------------------------- load generator

class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self):
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end])
        i = head.lower().find(b"content-length:")
        n = int(head[i + 15:head.index(b"\r\n", i)]) if i >= 0 else 0
        if len(self.buf) < end + 4 + n:
            return
        status = int(head[9:12])
        body = bytes(self.buf[end + 4:end + 4 + n])
        del self.buf[:end + 4 + n]
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result((status, body))

    def connection_lost(self, exc):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def request(self, raw: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.waiter


async def _connect(target: dict) -> _Conn:
    loop = asyncio.get_running_loop()
    if target["uds"]:
        _, proto = await loop.create_unix_connection(_Conn, target["uds"])
    else:
        _, proto = await loop.create_connection(_Conn, target["host"], target["port"])
    return proto


def _req(path: bytes, body: bytes, ctype: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: c\r\nContent-Type: " + ctype +
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Bodies:
    """Per-request bodies: a prompt's precomputed keys plus a fresh req_id."""

    def __init__(self, prompts: list[np.ndarray], json_mode: bool):
        self.json = json_mode
        self.ctype = b"application/json" if json_mode else b"application/msgpack"
        if json_mode:
            self.keys = [p.tolist() for p in prompts]
        else:
            self.keys = [p.astype("<u8").tobytes() for p in prompts]

    def select(self, rid: int, role: str) -> bytes:
        body = {"role": role, "req_id": rid,
                "routing_key": {"block_keys": self.keys[rid % len(self.keys)], "num_tokens": PROMPT_TOKENS}}
        return _req(b"/select", orjson.dumps(body) if self.json else msgpack.packb(body), self.ctype)

    def finish(self, rid: int, role: str) -> bytes:
        body = {"role": role, "req_id": rid, "success": True}
        return _req(b"/finish", orjson.dumps(body) if self.json else msgpack.packb(body), self.ctype)


async def _client_main(base: dict, pipe) -> None:
    """A persistent client process: build the prompts once, then run one closed-loop window per
    command from the parent (set up, report armed, wait for the shared start time, warm up until
    it, count the pairs completed in [start, start + seconds], report)."""
    from protocol.coord import NoServerAvailable
    prompts = _prompts(base["seed"], base["docs"], base["prompts"])
    bodies = {False: _Bodies(prompts, False), True: _Bodies(prompts, True)}
    loop = asyncio.get_running_loop()
    rid = base["rid0"]

    async def recv():
        return await loop.run_in_executor(None, pipe.recv)

    pipe.send("ready")
    while True:
        spec = await recv()
        if spec is None:
            return
        kind = spec["kind"]
        pairs = errors = 0
        cl = None
        ch = None
        if kind == "client":
            from coordinator.client import HttpCoordinatorClient
            cl = HttpCoordinatorClient(spec["url"], timeout_s=60, channel=False)
            conns = [None] * spec["conns"]
        elif kind == "channel":
            from coordinator.channel_client import ChannelClient
            ch = ChannelClient(spec["url"], timeout_s=60)
            assert await ch.connect(), "the coordinator did not offer its channel"
            conns = [None] * spec["inflight"]
            keys = bodies[False].keys
        else:
            b = bodies[spec["json"]]
            conns = [await _connect(spec["target"]) for _ in range(spec["conns"])]
        settle_heap()      # its own collections (30 ms full ones every ~0.3 s) stalled its connections
        pipe.send("armed")
        start_at = await recv()
        end_at = start_at + spec["seconds"]

        async def worker(c):
            nonlocal rid, pairs, errors
            while True:
                now = time.time()
                if now >= end_at:
                    return
                r = rid = rid + 1
                role = "context" if r & 1 else "generation"
                if ch is not None:
                    # the fleet's pattern: await the placement, queue the finish (no round trip)
                    try:
                        await ch.select(role, r, {"block_keys": keys[r % len(keys)],
                                                  "num_tokens": PROMPT_TOKENS})
                        ok = ch.finish(role, r)
                    except NoServerAvailable:       # CoordinatorOverloaded too: shed, no lease
                        ok = False
                elif cl is not None:
                    try:
                        await cl.select(role, r, {"block_keys": prompts[r % len(prompts)],
                                                  "num_tokens": PROMPT_TOKENS})
                        await cl.finish(role, r)
                        ok = True
                    except NoServerAvailable:       # shed (429) on a loaded box: no lease
                        ok = False
                else:
                    first = b.finish(r, role) if kind == "floor" else b.select(r, role)
                    st, _ = await c.request(first)
                    st2, _ = await c.request(b.finish(r, role))
                    ok = st == 200 and st2 == 200
                if now >= start_at and time.time() <= end_at:
                    pairs += 1
                    errors += not ok

        await asyncio.gather(*[worker(c) for c in conns])
        if ch is not None:
            await ch.close()
        elif cl is not None:
            await cl.close()
        else:
            for c in conns:
                c.transport.close()
        pipe.send({"pairs": pairs, "errors": errors})


def _client_proc(base: dict, pipe) -> None:
    import uvloop
    if base.get("cpu") is not None:
        os.sched_setaffinity(0, {base["cpu"]})
    try:
        uvloop.run(_client_main(base, pipe))
    except BaseException as exc:  # report, never hang the parent
        pipe.send({"error": f"{type(exc).__name__}: {exc}"})


class ClientPool:
    """`n` persistent client processes that run closed-loop windows on command."""

    def __init__(self, args, cpu: int | None):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.n = max(1, args.client_procs)
        self.conns = max(1, args.conns // self.n)
        self.procs = []
        for i in range(self.n):
            parent, child = ctx.Pipe()
            base = {"seed": args.seed, "docs": args.docs, "prompts": args.prompts,
                    "rid0": (1 << 40) + i * 10**12, "cpu": cpu}
            p = ctx.Process(target=_client_proc, args=(base, child), daemon=True)
            p.start()
            self.procs.append((p, parent))
        for _p, pipe in self.procs:
            self._expect(pipe, "ready", 120)

    @staticmethod
    def _expect(pipe, what: str | None, timeout: float):
        if not pipe.poll(timeout):
            raise RuntimeError(f"a client process did not report {what or 'its result'}")
        msg = pipe.recv()
        if isinstance(msg, dict) and "error" in msg:
            raise RuntimeError(f"client process failed: {msg['error']}")
        if what is not None and msg != what:
            raise RuntimeError(f"client process sent {msg!r}, expected {what!r}")
        return msg

    def window(self, kind: str, target: dict, seconds: float, *, url: str | None = None,
               json_body: bool = False, warmup: float = 0.3, inflight: int = 64) -> dict:
        spec = {"kind": kind, "target": target, "url": url, "json": json_body,
                "conns": self.conns, "seconds": seconds, "inflight": inflight}
        for _p, pipe in self.procs:
            pipe.send(spec)
        for _p, pipe in self.procs:
            self._expect(pipe, "armed", 60)
        start_at = time.time() + warmup
        for _p, pipe in self.procs:
            pipe.send(start_at)
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = _proc_cpu(target["pid"])
        time.sleep(seconds)
        cpu = _proc_cpu(target["pid"]) - cpu0
        pairs = errors = 0
        for _p, pipe in self.procs:
            r = self._expect(pipe, None, 120)
            pairs += r["pairs"]
            errors += r["errors"]
        return {"pairs": pairs, "errors": errors, "cpu_s": cpu, "seconds": seconds}

    def close(self) -> None:
        for p, pipe in self.procs:
            try:
                pipe.send(None)
            except OSError:
                pass
            p.join(10)
            if p.is_alive():
                p.kill()


def _total(windows: list[dict]) -> dict:
    secs = sum(w["seconds"] for w in windows)
    pairs = sum(w["pairs"] for w in windows)
    return {"pairs_per_s": pairs / secs, "errors": sum(w["errors"] for w in windows),
            "coord_cpu": sum(w["cpu_s"] for w in windows) / secs}


class _TimerFd:
    """A periodic kernel timer (Linux timerfd on CLOCK_MONOTONIC, the clock of `time.perf_counter`).

    The open loop's sends are paced by it instead of `asyncio.sleep`: uvloop rounds every delay to
    whole milliseconds (a 0.3 ms sleep fires at once, a 0.6 ms one after 1 ms) and the stdlib loop
    rounds epoll's timeout up to the next millisecond, so sends left up to ~1.2 ms late at p99 and
    that lateness was charged to the server's round trip. A timerfd start is 0.13 ms late at p99 on
    the 16-core host and 0.24-0.38 ms on the 2-core VM (bench/RESULTS.md, "coordinator · open-loop
    pacing and the load generator's own pauses"). Each read returns how many periods have elapsed,
    so a late wake-up still starts every due send with its own scheduled time.
    """

    def __init__(self, start: float, interval: float):
        if hasattr(os, "timerfd_create"):   # Python 3.13+
            self.fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC)
            os.timerfd_settime_ns(self.fd, flags=os.TFD_TIMER_ABSTIME, initial=int(start * 1e9),
                                  interval=int(interval * 1e9))
            return
        import ctypes

        class _Ts(ctypes.Structure):
            _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

        class _Its(ctypes.Structure):
            _fields_ = [("interval", _Ts), ("value", _Ts)]

        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.timerfd_create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        ns, iv = int(start * 1e9), int(interval * 1e9)
        spec = _Its(_Ts(iv // 10**9, iv % 10**9), _Ts(ns // 10**9, ns % 10**9))
        if libc.timerfd_settime(self.fd, 1, ctypes.byref(spec), None) != 0:   # 1 = TFD_TIMER_ABSTIME
            os.close(self.fd)
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def expirations(self) -> int:
        try:
            return int.from_bytes(os.read(self.fd, 8), sys.byteorder)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        os.close(self.fd)


async def _open_loop(one, rate: float, seconds: float, rid0: int) -> int:
    """Start `one(request_id, scheduled_time)` at exact intervals for `seconds` and wait for all;
    returns how many starts were more than 1 ms late."""
    # The load generator's own collections would be charged to the server's round trip: its heap
    # (prompts, the closed-loop phases' results) frozen and young collections rarer, as the
    # coordinator's and fleet's (coordinator/gc_tuning.py).
    settle_heap()
    loop = asyncio.get_running_loop()
    n = int(rate * seconds)
    interval = 1.0 / rate
    t0 = time.perf_counter() + 0.05
    tasks: set = set()
    timer = _TimerFd(t0, interval)
    started = 0
    late = 0
    all_started = loop.create_future()

    def due() -> None:
        nonlocal started, late
        k = min(timer.expirations(), n - started)
        now = time.perf_counter()
        for _ in range(k):
            t_sched = t0 + started * interval
            started += 1
            if now - t_sched > 0.001:
                late += 1
            t = loop.create_task(one(rid0 + started, t_sched))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if started >= n and not all_started.done():
            all_started.set_result(None)

    loop.add_reader(timer.fd, due)
    try:
        await all_started
    finally:
        loop.remove_reader(timer.fd)
        timer.close()
    if tasks:
        await asyncio.gather(*tasks)
    return late


async def open_loop(target: dict, bodies: _Bodies, rate: float, seconds: float, rid0: int) -> dict:
    """Selects at exact intervals (each followed by its finish on the same connection); RTT of
    the select measured from its scheduled send time, so queueing in the client counts too."""
    pool = [await _connect(target) for _ in range(128)]
    idle: asyncio.Queue = asyncio.Queue()
    for c in pool:
        idle.put_nowait(c)
    rtts: list[float] = []
    wire_rtts: list[float] = []
    errors = 0

    async def one(r: int, t_sched: float):
        nonlocal errors
        c = await idle.get()   # an overloaded server shows up as waiting here, counted in the RTT
        role = "context" if r & 1 else "generation"
        t_send = time.perf_counter()
        st, _ = await c.request(bodies.select(r, role))
        t_done = time.perf_counter()
        rtts.append(t_done - t_sched)
        wire_rtts.append(t_done - t_send)
        st2, _ = await c.request(bodies.finish(r, role))
        if st != 200 or st2 != 200:
            errors += 1
        idle.put_nowait(c)

    late = await _open_loop(one, rate, seconds, rid0)
    for c in pool:
        c.transport.close()
    a = np.asarray(rtts) * 1e3
    w = np.asarray(wire_rtts) * 1e3
    return {"rate": rate, "n": len(rtts), "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "wire_p50_ms": float(np.percentile(w, 50)),
            "wire_p99_ms": float(np.percentile(w, 99)), "errors": errors, "late_sends": late}


async def open_loop_channel(url: str, keys: list[bytes], rate: float, seconds: float, rid0: int) -> dict:
    """The same open loop through the fleet's channel client (`ChannelClient`): selects at exact
    intervals, each finish queued on return; RTT from the scheduled send time."""
    from coordinator.channel_client import ChannelClient
    ch = ChannelClient(url, timeout_s=30)
    assert await ch.connect(), "the coordinator did not offer its channel"
    rtts: list[float] = []
    wire_rtts: list[float] = []
    errors = 0

    async def one(r: int, t_sched: float):
        nonlocal errors
        role = "context" if r & 1 else "generation"
        t_send = time.perf_counter()
        try:
            await ch.select(role, r, {"block_keys": keys[r % len(keys)], "num_tokens": PROMPT_TOKENS})
        except Exception:
            errors += 1
            return
        t_done = time.perf_counter()
        rtts.append(t_done - t_sched)
        wire_rtts.append(t_done - t_send)
        ch.finish(role, r)

    late = await _open_loop(one, rate, seconds, rid0)
    await ch.close()
    a = np.asarray(rtts) * 1e3
    w = np.asarray(wire_rtts) * 1e3
    return {"rate": rate, "n": len(rtts), "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "wire_p50_ms": float(np.percentile(w, 50)),
            "wire_p99_ms": float(np.percentile(w, 99)), "errors": errors, "late_sends": late}


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0
