"""Real processes on loopback for the fleet tests: sim workers, coordinators, fleets.

Every process runs in its own session and is stopped by its own pid at teardown; ports come from the
OS. `SPLITSERVE_*` variables of the test environment are not passed on (they would override flags).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]


# A coordinator sheds placements (503 to the client) once its event loop runs late by
# `max_queue_delay_s`; on a loaded CI box that can happen to any test. Tests that are not about
# overload but need every request served raise the bound.
NO_SHEDDING = {"max_queue_delay_s": 30.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p-1 free too (the implicit coordinator listens on port - 1)."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p - 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")
           and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def http(method: str, url: str, body=None, headers=None, timeout: float = 10.0):
    """→ (status, headers, bytes). Never raises on HTTP errors."""
    data = None
    h = dict(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    found = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    return total if found else 0.0


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None):
        self.name, self.argv, self.log_path = name, argv, log
        self.env = env or clean_env()
        self.p: subprocess.Popen | None = None
        self.start()

    def start(self):
        self._log = open(self.log_path, "ab")
        self.p = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                  cwd=str(ROOT), start_new_session=True)

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.p.poll() is None:
            try:
                os.kill(self.p.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.p.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                # Our child may have children of its own (the launcher's fleet): end the whole session.
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(5)
        self._log.close()
        return self.p.returncode


def wait_for(pred, timeout: float, what: str, proc: Proc | None = None, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - polling: keep the last error for the message
            last = e
        if proc is not None and not proc.alive():
            raise AssertionError(f"{proc.name} exited ({proc.p.returncode}) while waiting for {what}:\n{proc.log()[-3000:]}")
        time.sleep(interval)
    tail = proc.log()[-3000:] if proc is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last})\n{tail}")


def healthy(url: str) -> bool:
    st, _, _ = http("GET", url + "/health", timeout=2)
    return st == 200


class Cluster:
    """Processes started by one test (or module); all stopped at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[Proc] = []

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> Proc:
        p = Proc(name, argv, self.tmp / f"{name}.log", env)
        self.procs.append(p)
        return p

    def worker(self, role: str, *, engine: str = "sim", name: str | None = None, port: int | None = None,
               extra: tuple = (), wait: bool = True) -> tuple[Proc, str]:
        port = port or free_port()
        argv = [PY, "-m", "splitserve_cli", "worker", "--role", role, "--engine", engine, "--model", "tiny",
                "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *map(str, extra)]
        p = self.spawn(name or f"{role}-{port}", argv)
        url = f"http://127.0.0.1:{port}"
        if wait:
            wait_for(lambda: healthy(url), 60, f"worker {url}", p)
        return p, url

    def coordinator(self, cfg: Path, port: int, *, uds: str | None = None, name: str = "coordinator") -> Proc:
        argv = [PY, "-m", "splitserve_cli", "coordinator", "-c", str(cfg), "--host", "127.0.0.1",
                "--port", str(port)]
        if uds:
            argv += ["--uds", uds]
        return self.spawn(name, argv)

    def fleet(self, cfg: Path, *args, name: str = "fleet", env: dict | None = None) -> Proc:
        argv = [PY, "-m", "splitserve_cli", "serve", "-c", str(cfg), *map(str, args)]
        return self.spawn(name, argv, env)

    def config(self, name: str = "cluster.yaml", **doc) -> Path:
        doc.setdefault("hostname", "127.0.0.1")
        doc.setdefault("model", "tiny")
        p = self.tmp / name
        p.write_text(yaml.safe_dump(doc))
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fleet"))
    yield c
    c.stop()


def group(urls, policy="round_robin", **router_args):
    return {"urls": [u.replace("http://", "") for u in urls], "router": {"type": policy, **router_args}}
