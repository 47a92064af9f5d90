"""What every part of the disaggregation benchmark shares: its error type, the host, progress lines."""
from __future__ import annotations

import time

HOST = "127.0.0.1"


class BenchError(RuntimeError):
    """The benchmark cannot go on (a process died, a cluster never became ready, bad flags)."""


_T0 = time.monotonic()


def say(label: str, msg: str) -> None:
    """One progress line, stamped with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _T0:6.1f}s {label}] {msg}", flush=True)
