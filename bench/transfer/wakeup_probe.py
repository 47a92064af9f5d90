"""The floor under the control plane on this machine: what one wake-up costs a Python thread.

Ping-pong, median µs per one-way hop (half a round trip), each blocking on its own side:
- *thread → thread*: two threads of one process handing a token through `threading.Event`s
  (what a hand-off to the listener or the transfer thread costs);
- *process → process, socket*: two processes over a connected TCP pair on loopback, each
  blocked in `recv` (what a control-lane message costs, Python at both ends);
- *process → process, ZeroMQ*: the same over a DEALER/ROUTER pair, each blocked in `poll`
  (what a ZeroMQ control message costs: its I/O threads wake too);
- *socket after an idle wait*: the socket ping-pong with `--gap-ms` of sleep before each message,
  as the control plane sees it (a receive arrives at a listener that slept, not in a tight loop);
- *cold Python*: a few calls of the kind the control path makes (numpy on a handful of block ids,
  a msgpack encode) timed in a loop and right after a `--gap-ms` sleep: how much slower code runs
  on a thread that just woke (cold caches, a core that slept), which is most of the round trip
  on the 2-core box (docs/kv-transfer.md, "Completion and wake-ups").

Usage: `python bench/transfer/wakeup_probe.py [--n 3000] [--gap-ms 2]`
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import threading
import time


def _threads(n: int) -> float:
    a, b = threading.Event(), threading.Event()

    def peer():
        for _ in range(n):
            a.wait()
            a.clear()
            b.set()
    t = threading.Thread(target=peer, daemon=True)
    t.start()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        a.set()
        b.wait()
        b.clear()
        ts.append(time.perf_counter() - t0)
    t.join()
    return statistics.median(ts[n // 10:]) / 2


def _echo_socket(port: int, n: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(n):
        s.sendall(s.recv(16))


def _socket(n: int, gap_s: float = 0.0) -> float:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    p = mp.get_context("spawn").Process(target=_echo_socket, args=(ls.getsockname()[1], n))
    p.start()
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ts = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        c.sendall(b"x" * 8)
        c.recv(16)
        ts.append(time.perf_counter() - t0)
    p.join()
    return statistics.median(ts[n // 10:]) / 2


def _cold_python(n: int, gap_s: float) -> tuple[float, float]:
    """Median µs of a few control-path-like calls: in a loop, and each right after a sleep."""
    import msgspec
    import numpy as np

    ids = [3, 4, 5, 6]
    msg = {"t": "result", "req": 7, "from": "inst/0", "status": "ok", "error": None,
           "slices": [0, 0], "span": [0, 16], "last": True, "meta": None}

    def work():
        a = np.asarray(ids, dtype=np.int64)
        a.max()
        a.tobytes()
        msgspec.msgpack.encode(msg)

    out = []
    for gap in (0.0, gap_s):
        ts = []
        for _ in range(n):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            work()
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts[n // 10:]) * 1e6)
    return out[0], out[1]


def _echo_zmq(ep: str, n: int) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(ep)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    s.send(b"hello")
    for _ in range(n):
        poller.poll()
        s.send(s.recv())
    s.close(0)
    ctx.term()


def _zmq(n: int) -> float:
    import zmq

    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    p = mp.get_context("spawn").Process(target=_echo_zmq, args=(f"tcp://127.0.0.1:{port}", n))
    p.start()
    ident, _ = r.recv_multipart()
    poller = zmq.Poller()
    poller.register(r, zmq.POLLIN)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.send_multipart([ident, b"x" * 8])
        poller.poll()
        r.recv_multipart()
        ts.append(time.perf_counter() - t0)
    p.join()
    r.close(0)
    ctx.term()
    return statistics.median(ts[n // 10:]) / 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--gap-ms", type=float, default=2.0,
                   help="sleep before each idle-wait sample (ms)")
    args = p.parse_args(argv)
    print(f"one-way hop, median µs: thread → thread {_threads(args.n) * 1e6:.0f}; "
          f"process → process over a socket {_socket(args.n) * 1e6:.0f}; "
          f"over ZeroMQ {_zmq(args.n) * 1e6:.0f}", flush=True)
    gap = args.gap_ms / 1e3
    k = min(args.n, 500)
    warm, cold = _cold_python(k, gap)
    print(f"after {args.gap_ms:g} ms idle, median µs: socket one-way hop "
          f"{_socket(k, gap) * 1e6:.0f}; control-path-like Python {cold:.1f} "
          f"(in a loop {warm:.1f}: {cold / warm:.1f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
