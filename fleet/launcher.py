"""The multi-process launcher: an implicit coordinator plus N fleet processes on one port.

Topologies (docs/design.md §2): `num_workers > 1` without a coordinator URL starts the coordinator here
(TCP `port - 1` and a Unix socket) and N fleet processes sharing the public port through
SO_REUSEPORT; with a coordinator URL only the N fleet processes run. (One process without a URL is
not launched from here: `fleet.cli` runs it directly, coordinator in-process.)

Guarantees:
- fail fast: the coordinator (started here or external) is probed with bounded retries up to
  `server_start_timeout`; if it never answers the launcher exits non-zero with a clear message and
  starts no fleet process;
- a fleet process joins the port group only once it is ready (it binds after its start-up), and the
  launcher never binds a *listening* socket itself — for `port: 0` it reserves the port with a bound,
  non-listening socket that receives no connections and is closed once the children listen;
- a crashed fleet process (or coordinator) is restarted, with a backoff that grows on crash loops;
- SIGTERM / SIGINT are forwarded: fleet processes stop listening and drain in-flight requests
  (bounded by `fleet.drain_timeout_s`), then the coordinator stops; leftovers are killed after a grace
  period, so the launcher always exits.

The launcher is plain synchronous Python (no event loop, no aiohttp import): it only spawns, watches
and signals processes.
"""
from __future__ import annotations

import http.client
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

from . import affinity

log = logging.getLogger("splitserve.fleet.launcher")

EXIT_COORDINATOR_UNREACHABLE = 3


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def probe(url: str, path: str = "/cluster_info", timeout: float = 2.0) -> tuple[bool, str]:
    """One GET against the coordinator; → (answered 200, detail)."""
    try:
        if url.startswith("unix:"):
            sock_path = url[len("unix:"):].lstrip("/")
            conn = _UnixHTTPConnection("/" + sock_path, timeout)
        else:
            u = urlsplit(url)
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conn = cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=timeout)
        try:
            conn.request("GET", path, headers={"Accept": "application/json"})
            r = conn.getresponse()
            r.read()
            return r.status == 200, f"HTTP {r.status}"
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as e:
        return False, f"{type(e).__name__}: {e}"


class _Child:
    def __init__(self, name: str, argv: list[str], env: dict, index: int | None = None,
                 cpu: int | None = None):
        self.name = name
        self.cpu = cpu
        self.argv = argv
        self.env = env
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.ready_r: int | None = None
        self.ready = False
        self.started_at = 0.0
        self.restarts = 0
        self.backoff = 0.5
        self.next_start = 0.0

    def start(self) -> None:
        pass_fds = ()
        argv = list(self.argv)
        if self.index is not None:
            r, w = os.pipe()
            self.ready_r = r
            argv += ["--ready-fd", str(w)]
            pass_fds = (w,)
        # Same process group as the launcher, so process-group accounting and killpg cover the whole fleet.
        # Fleet processes ignore SIGINT (a terminal's Ctrl-C reaches the whole group): the launcher turns
        # it into an ordered SIGTERM drain.
        self.proc = subprocess.Popen(argv, env=self.env, pass_fds=pass_fds)
        affinity.pin(self.proc.pid, self.cpu)   # a restart lands on the same CPU
        if self.index is not None:
            os.close(pass_fds[0])
        self.ready = self.index is None
        self.started_at = time.monotonic()

    def poll_ready(self) -> None:
        if self.ready or self.ready_r is None:
            return
        r, _, _ = select.select([self.ready_r], [], [], 0)
        if r:
            data = os.read(self.ready_r, 64)
            if data:
                self.ready = True
            os.close(self.ready_r)
            self.ready_r = None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Launcher:
    def __init__(self, config, child_argv: list[str], *, python: str = sys.executable,
                 cpus: list[int] | None = None):
        """`child_argv`: the `splitserve serve` flags to repeat for each fleet process; `cpus`: those
        to pin the processes to in turn (fleet/affinity.py; None = no pinning)."""
        self.config = config
        self.cpus = cpus
        self.child_argv = child_argv
        self.python = python
        self.n = config.num_workers
        self.stopping = False
        self.coordinator: _Child | None = None
        self.fleet: list[_Child] = []
        self.metrics_dir: str | None = None
        self._reservation: socket.socket | None = None

    # ------------------------------------------------------------------ helpers
    def _on_signal(self, signum, frame) -> None:
        if not self.stopping:
            log.info("launcher: %s received, draining fleet processes", signal.Signals(signum).name)
        self.stopping = True

    def _wait_coordinator(self, url: str, child: _Child | None) -> None:
        deadline = time.monotonic() + self.config.server_start_timeout
        attempts, detail = 0, ""
        delay = 0.1
        while True:
            attempts += 1
            ok, detail = probe(url, timeout=min(2.0, self.config.fleet.coordinator_timeout_s))
            if ok:
                return
            if child is not None and not child.alive():
                raise SystemExit(self._fail(f"the coordinator process exited with code {child.proc.returncode} "
                                            f"before answering at {url}"))
            if self.stopping:
                raise SystemExit(self._fail("stopped while waiting for the coordinator"))
            if time.monotonic() >= deadline:
                raise SystemExit(self._fail(
                    f"coordinator at {url} not reachable after {self.config.server_start_timeout:g}s "
                    f"({attempts} attempts, last error: {detail}); is it running? "
                    f"(server_start_timeout bounds the wait)"))
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _fail(self, msg: str) -> int:
        log.error("%s", msg)
        print(f"splitserve serve: error: {msg}", file=sys.stderr, flush=True)
        self._shutdown()
        return EXIT_COORDINATOR_UNREACHABLE

    def _coordinator_urls(self) -> tuple[str, str]:
        """(URL the fleet processes use, URL the launcher probes)."""
        cfg = self.config
        tcp = cfg.coordinator_url
        uds = cfg.coordinator_uds_path
        return (f"unix://{uds}" if uds else tcp), tcp

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        cfg = self.config
        env = dict(os.environ)
        coordinator_cpu, fleet_cpus = affinity.plan(self.cpus, self.n, not cfg.disagg_coordinator_url)
        if self.cpus:
            log.info("launcher: fleet.cpu_affinity %s: coordinator on CPU %s, fleet processes on %s",
                     cfg.fleet.cpu_affinity, coordinator_cpu, fleet_cpus)
        try:
            if cfg.disagg_coordinator_url:
                fleet_url = cfg.disagg_coordinator_url
                self._wait_coordinator(fleet_url, None)
            else:
                fleet_url, tcp_url = self._coordinator_urls()
                cport = cfg.coordinator_port
                argv = [self.python, "-m", "splitserve_cli", "coordinator", *self._config_args(),
                        "--host", cfg.coordinator.host, "--port", str(cport)]
                uds = cfg.coordinator_uds_path
                if uds:
                    argv += ["--uds", uds]   # the coordinator replaces a stale socket file, never a live one
                self.coordinator = _Child("coordinator", argv, env, cpu=coordinator_cpu)
                self.coordinator.start()
                log.info("launcher: coordinator pid %d on %s%s", self.coordinator.proc.pid, tcp_url,
                         f" and unix://{uds}" if uds else "")
                self._wait_coordinator(tcp_url, self.coordinator)
        except SystemExit as e:
            return int(e.code or EXIT_COORDINATOR_UNREACHABLE)
        self.metrics_dir = tempfile.mkdtemp(prefix="splitserve-fleet-metrics-")
        fenv = dict(env)
        fenv["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        port = cfg.port
        if port == 0:
            # Reserve a port with a bound, never-listening socket (it gets no connections).
            self._reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self._reservation.bind((cfg.effective_bind_host, 0))
            port = self._reservation.getsockname()[1]
        self.port = port
        for i in range(self.n):
            argv = [self.python, "-m", "fleet.cli", *self.child_argv, "--port", str(port),
                    "--coordinator-url", fleet_url, "--child-index", str(i)]
            self.fleet.append(_Child(f"fleet-{i}", argv, fenv, index=i, cpu=fleet_cpus[i]))
        for c in self.fleet:
            c.start()
        rc = self._supervise()
        self._shutdown()
        return rc

    def _config_args(self) -> list[str]:
        out = []
        it = iter(self.child_argv)
        for a in it:
            if a in ("-c", "--config"):
                out += [a, next(it)]
            elif a.startswith("--config="):
                out.append(a)
            elif a in ("--log-level",):
                out += [a, next(it)]
        return out

    def _supervise(self) -> int:
        cfg = self.config
        announced = False
        start_deadline = time.monotonic() + cfg.server_start_timeout + 10
        while not self.stopping:
            now = time.monotonic()
            for c in self.fleet:
                c.poll_ready()
                if c.proc is not None and c.proc.poll() is not None:
                    rc = c.proc.returncode
                    if self.metrics_dir:
                        # Its live gauges (in-flight) must not linger in the aggregated /metrics.
                        from prometheus_client import multiprocess
                        multiprocess.mark_process_dead(c.proc.pid, self.metrics_dir)
                    if not announced and rc == EXIT_COORDINATOR_UNREACHABLE:
                        log.error("launcher: %s could not reach the coordinator at start-up; giving up", c.name)
                        return EXIT_COORDINATOR_UNREACHABLE
                    if now - c.started_at > 30:
                        c.backoff = 0.5   # it ran fine for a while: not a crash loop
                    log.warning("launcher: %s (pid %d) exited with code %s; restarting in %.1fs",
                                c.name, c.proc.pid, rc, c.backoff)
                    c.proc = None
                    c.ready = False
                    c.next_start = now + c.backoff
                    c.backoff = min(c.backoff * 2, 10.0)
                if c.proc is None and now >= c.next_start:
                    c.restarts += 1
                    c.start()
            co = self.coordinator
            if co is not None and co.proc is not None and co.proc.poll() is not None:
                # The fleet keeps serving from its last-known server list meanwhile.
                if now - co.started_at > 30:
                    co.backoff = 0.5
                log.warning("launcher: coordinator (pid %d) exited with code %s; restarting in %.1fs",
                            co.proc.pid, co.proc.returncode, co.backoff)
                co.proc = None
                co.next_start = now + co.backoff
                co.backoff = min(co.backoff * 2, 10.0)
            if co is not None and co.proc is None and now >= co.next_start and not self.stopping:
                co.restarts += 1
                co.start()
            if not announced and all(c.ready for c in self.fleet):
                announced = True
                if self._reservation is not None:
                    self._reservation.close()
                    self._reservation = None
                log.info("launcher: %d fleet processes listening on %s:%d", self.n,
                         cfg.effective_bind_host, self.port)
                print(f"splitserve: fleet of {self.n} processes ready on http://{cfg.hostname}:{self.port}",
                      flush=True)
            if not announced and now > start_deadline:
                log.error("launcher: fleet processes not ready after %.0fs", cfg.server_start_timeout + 10)
                return 1
            time.sleep(0.1)
        return 0

    def _shutdown(self) -> None:
        grace = self.config.fleet.drain_timeout_s + 10
        for c in self.fleet:
            c.signal(signal.SIGTERM)
        self._reap(self.fleet, grace)
        if self.coordinator is not None:
            self.coordinator.signal(signal.SIGTERM)
            self._reap([self.coordinator], 10)
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None

    @staticmethod
    def _reap(children: list[_Child], grace: float) -> None:
        deadline = time.monotonic() + grace
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("launcher: %s (pid %d) did not stop in time; killing it", c.name, c.proc.pid)
                c.signal(signal.SIGKILL)
                c.proc.wait()
            if c.ready_r is not None:
                os.close(c.ready_r)
                c.ready_r = None
