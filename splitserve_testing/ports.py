"""Free TCP ports for processes the tests and benchmarks start on loopback.

A port is found free by binding it and letting it go, so another process may take it before ours
binds it. Every port is picked below the kernel's ephemeral range, which the OS hands out for bind(0)
and for the source ports of outgoing connections.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"

_taken: set[int] = set()


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def free_port(host: str = HOST) -> int:
    """A port free on ``host`` right now, below the kernel's ephemeral range.

    Not bind(0): a port from the ephemeral range can be the source port the OS picks for a client
    that polls it before its server has bound it, and Linux then connects that socket to itself (TCP
    simultaneous open): the poller reads its own ``GET /health`` back as the answer's status line.
    """
    return free_ports(1, host)


def free_ports(n: int = 1, host: str = HOST) -> int:
    """The first of ``n`` consecutive ports free on ``host`` (each bound and released), below the
    ephemeral range and never handed out twice in this process."""
    lo = _ephemeral_low()
    rng = random.Random()
    for _ in range(400):
        base = rng.randrange(max(1024, lo - 12000), lo - n)
        if any(base + i in _taken for i in range(n)):
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, base + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _taken.update(range(base, base + n))
        return base
    raise RuntimeError(f"no {n} consecutive free ports on {host} below the ephemeral range")


def free_port_pair(host: str = HOST) -> int:
    """A free port ``p`` with ``p - 1`` free too (an implicit coordinator listens on port - 1)."""
    return free_ports(2, host) + 1
