"""Free TCP ports for processes the tests and benchmarks start on loopback.

A port is found free by binding it and letting it go, so another process may take it before ours
binds it; callers that cannot retry use ``free_port_below_ephemeral``.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A port the OS reports free on ``host`` right now (bind to port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int = 1, host: str = HOST) -> int:
    """The first of ``n`` consecutive ports free on ``host`` (each bound and released)."""
    for _ in range(200):
        s0 = socket.socket()
        s0.bind((host, 0))
        base = s0.getsockname()[1]
        socks = [s0]
        try:
            for i in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, base + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def free_port_pair(host: str = HOST) -> int:
    """A free port ``p`` with ``p - 1`` free too (an implicit coordinator listens on port - 1)."""
    return free_ports(2, host) + 1


_taken: set[int] = set()


def free_port_below_ephemeral(host: str = HOST) -> int:
    """A free port below the kernel's ephemeral range, never the same one twice in this process.

    Ports the OS hands out for bind(0) and outgoing connections (other tests, our own processes'
    clients) come from that range, so a port picked here is not grabbed between this check and the
    process binding it — for processes started all at once, with no retry on a lost port.
    """
    lo, _hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in _taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError(f"no free port on {host} found below the ephemeral range")
