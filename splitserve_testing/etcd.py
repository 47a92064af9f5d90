"""A real etcd on loopback for the tests (Debian's `etcd-server`: `apt-get install etcd-server`,
which .ci/run does). `EtcdServer.start_in(tmp_path)` runs one member on two free ports with its data in
`tmp_path`; `stop()` / `start()` again restart it on the same ports and data (an outage);
`ETCD_MISSING` is the reason to skip with when the binary is not installed.
"""
from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from splitserve_testing.ports import free_ports
from splitserve_testing.process import Proc

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
ETCD_MISSING = None if ETCD else \
    "etcd is not installed (Debian: apt-get install etcd-server; .ci/run installs it)"


class EtcdServer:
    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.client_port = free_ports(2)
        self.peer_port = self.client_port + 1
        self.proc: Proc | None = None

    @property
    def uri(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @classmethod
    def start_in(cls, data_dir: Path, timeout: float = 30.0) -> "EtcdServer":
        s = cls(data_dir)
        s.start(timeout)
        return s

    def start(self, timeout: float = 30.0) -> None:
        if ETCD is None:
            raise RuntimeError(ETCD_MISSING)
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = Proc("etcd", [ETCD, "--name", "t", "--data-dir", self.data_dir / "data",
                                  "--listen-client-urls", client, "--advertise-client-urls", client,
                                  "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                  "--initial-cluster", f"t={peer}", "--log-level", "warn"],
                         self.data_dir / "etcd.log", cwd=None)
        deadline = time.monotonic() + timeout
        while True:
            if not self.proc.alive():
                raise RuntimeError(f"etcd exited: {self.proc.tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.client_port), 0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd not listening after {timeout}s: {self.proc.tail()}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace=10)
            self.proc = None
