"""Real processes on loopback for the fleet tests: sim workers, coordinators, fleets.

Every process runs in its own session and is stopped by its own pid at teardown; ports come from the
OS. `SPLITSERVE_*` variables of the test environment are not passed on (they would override flags).
"""
from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

# Re-exported: the tests of this directory import the harness through here.
from splitserve_testing import ROOT, Proc, clean_env, free_port, free_port_pair, stop_all, wait_for  # noqa: F401

PY = sys.executable


# A coordinator sheds placements (503 to the client) once its event loop runs late by
# `max_queue_delay_s`; on a loaded CI box that can happen to any test. Tests that are not about
# overload but need every request served raise the bound.
NO_SHEDDING = {"max_queue_delay_s": 30.0}


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


def healthy(url: str) -> bool:
    st, _, _ = http("GET", url + "/health", timeout=2)
    return st == 200


def recv_until(s: socket.socket, marker: bytes, timeout: float, closed_early: str) -> bytes:
    """Read a raw client socket until `marker` has come (each read waits up to `timeout` s);
    → all bytes read. The peer closing first fails the test with `closed_early`."""
    s.settimeout(timeout)
    got = b""
    while marker not in got:
        chunk = s.recv(65536)
        assert chunk, closed_early
        got += chunk
    return got


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

    def workers(self, *specs: str | tuple[str, dict]) -> list[tuple[Proc, str]]:
        """Several workers started together, then each waited for: their start-ups (imports, mostly)
        overlap. A spec is a role or (role, `worker` keyword arguments)."""
        started = []
        for spec in specs:
            role, kw = (spec, {}) if isinstance(spec, str) else spec
            started.append(self.worker(role, **kw, wait=False))
        for p, url in started:
            wait_for(lambda url=url: healthy(url), 60, f"worker {url}", p)
        return started

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
        # the tests read the whole route receipt (its default, off, is for public clients)
        doc["fleet"] = {"route_header": "full", **(doc.get("fleet") or {})}
        p = self.tmp / name
        p.write_text(yaml.safe_dump(doc))
        return p

    def stop(self) -> None:
        # SIGTERM to every process first, then reap them, last started first: they drain in
        # parallel (one at a time, a cluster's teardown was the sum of its processes' shutdowns).
        stop_all(self.procs, grace=15.0)


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
