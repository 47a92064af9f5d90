"""The floor under the control plane on this machine: what one wake-up costs a Python thread.

Ping-pong, median µs per one-way hop (half a round trip), each blocking on its own side:
- *thread → thread*: two threads of one process handing a token through `threading.Event`s
  (what a hand-off to the listener or the transfer thread costs);
- *process → process, socket*: two processes over a connected TCP pair on loopback, each
  blocked in `recv` (what a control-lane message costs, Python at both ends);
- *process → process, ZeroMQ*: the same over a DEALER/ROUTER pair, each blocked in `poll`
  (what a ZeroMQ control message costs: its I/O threads wake too).

Usage: `python bench/transfer/wakeup_probe.py [--n 3000]`
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


def _socket(n: int) -> float:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    p = mp.get_context("spawn").Process(target=_echo_socket, args=(ls.getsockname()[1], n))
    p.start()
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.sendall(b"x" * 8)
        c.recv(16)
        ts.append(time.perf_counter() - t0)
    p.join()
    return statistics.median(ts[n // 10:]) / 2


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
    args = p.parse_args(argv)
    print(f"one-way hop, median µs: thread → thread {_threads(args.n) * 1e6:.0f}; "
          f"process → process over a socket {_socket(args.n) * 1e6:.0f}; "
          f"over ZeroMQ {_zmq(args.n) * 1e6:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
