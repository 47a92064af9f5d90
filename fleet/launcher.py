"""The multi-process launcher: an implicit coordinator plus N fleet processes on one port.

Topologies (docs/design.md §2): `num_workers > 1` without a coordinator URL starts the coordinator here
(TCP `port - 1` and a Unix socket) and N fleet processes sharing the public port through
SO_REUSEPORT; with a coordinator URL only the N fleet processes run. (One process without a URL is
not launched from here: `fleet.cli` runs it directly, coordinator in-process.)

Guarantees:
- fail fast: the coordinator (started here or external) is probed with bounded retries up to
  `server_start_timeout`; if it never answers the launcher exits non-zero with a clear message and
  starts no fleet process;
- no merging with another cluster (issue 39): the public port must be free when the launcher starts
  (a bind without SO_REUSEPORT, which any listener on it refuses), and the launcher then holds it
  for its whole life with a bound, non-listening SO_REUSEPORT socket (it receives no connections),
  so a second cluster's check fails while this one runs; the coordinator it starts gets a cluster
  id minted here, and the launcher and every fleet process check that the coordinator which
  answers reports it (a foreign coordinator on a shared port or socket is an error, not a peer);
- a fleet process joins the port group only once it is ready (it binds after its start-up), and the
  launcher never binds a *listening* socket itself;
- a crashed fleet process (or coordinator) is restarted, with a backoff that grows on crash loops;
  a coordinator whose address is taken (exit EXIT_ADDRESS_IN_USE) is not: the launcher stops the
  cluster and exits non-zero, since no restart can succeed;
  a fleet process that exits unasked is announced to every coordinator at once (`POST
  /identity/release` with `end_leases`), which ends the leases of its requests: they died with it,
  and their load must not count until `leases.ttl_s` (docs/failover.md);
- SIGTERM / SIGINT are forwarded: fleet processes stop listening and drain in-flight requests
  (bounded by `fleet.drain_timeout_s`), then the coordinator stops; leftovers are killed after a grace
  period, so the launcher always exits.

The launcher is plain synchronous Python (no event loop, no aiohttp import): it only spawns, watches
and signals processes.
"""
from __future__ import annotations

import errno
import http.client
import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit

from . import affinity

log = logging.getLogger("splitserve.fleet.launcher")

EXIT_COORDINATOR_UNREACHABLE = 3
EXIT_ADDRESS_IN_USE = 4           # coordinator/cli.py: a listener's address is taken
EXIT_FOREIGN_COORDINATOR = 5      # fleet/server.py: the coordinator belongs to another cluster


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def holder_name(port: int, pid: int) -> str:
    """The name a fleet process leases its request-id identity under (fleet/server.py): what its
    launcher names it by when it announces the process gone."""
    return f"{socket.gethostname()}:{port}:{pid}"


def probe(url: str, path: str = "/cluster_info", timeout: float = 2.0,
          body: bytes | None = None) -> tuple[bool, str, dict]:
    """One GET (or, with `body`, a JSON POST) against the coordinator; → (answered 200, detail,
    the JSON body or {})."""
    try:
        if url.startswith("unix:"):
            sock_path = url[len("unix:"):].lstrip("/")
            conn = _UnixHTTPConnection("/" + sock_path, timeout)
        else:
            u = urlsplit(url)
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conn = cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=timeout)
        try:
            if body is None:
                conn.request("GET", path, headers={"Accept": "application/json"})
            else:
                conn.request("POST", path, body=body, headers={"Accept": "application/json",
                                                              "Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
            try:
                body = json.loads(raw) if r.status == 200 else {}
            except ValueError:
                body = {}
            return r.status == 200, f"HTTP {r.status}", body if isinstance(body, dict) else {}
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as e:
        return False, f"{type(e).__name__}: {e}", {}


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket on `port` (0: a free one), after checking that
    nothing else is bound there: the check binds without SO_REUSEPORT, which every listener on the
    port refuses, SO_REUSEPORT groups included. OSError(EADDRINUSE) with a clear message if taken."""
    family, _, _, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                               flags=socket.AI_PASSIVE)[0]
    if port:
        with socket.socket(family, socket.SOCK_STREAM) as check:
            check.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT leftovers do not count
            try:
                check.bind(addr)
            except OSError as e:
                raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror} (another "
                                       f"process, perhaps another splitserve cluster, listens there; "
                                       f"stop it or pick another port)") from None
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    return s


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
        # Minted per run: the coordinator started here reports it, the fleet processes check it.
        self.cluster_id: str | None = None
        self.coordinator_urls: list[str] = []

    # ------------------------------------------------------------------ helpers
    def _on_signal(self, signum, frame) -> None:
        if not self.stopping:
            log.info("launcher: %s received, draining fleet processes", signal.Signals(signum).name)
        self.stopping = True

    def _wait_coordinator(self, urls: list[str], child: _Child | None) -> None:
        """Until one of `urls` (the coordinator, or any of its replicas) answers."""
        deadline = time.monotonic() + self.config.server_start_timeout
        attempts, detail = 0, ""
        delay = 0.1
        while True:
            attempts += 1
            for url in urls:
                ok, detail, body = probe(url, timeout=min(2.0, self.config.fleet.coordinator_timeout_s))
                if ok:
                    break
            else:
                url = " or ".join(urls)
            if ok and self.cluster_id is not None and body.get("cluster_id") != self.cluster_id:
                # Another cluster's coordinator holds the port: ours is about to fail to bind it.
                raise SystemExit(self._fail(
                    f"the coordinator answering at {url} belongs to another cluster (cluster_id "
                    f"{body.get('cluster_id')!r}, not {self.cluster_id!r}): another splitserve cluster "
                    f"uses this coordinator port; stop it or pick another port (coordinator.port)",
                    EXIT_ADDRESS_IN_USE))
            if ok:
                return
            if child is not None and not child.alive():
                rc = child.proc.returncode
                if rc == EXIT_ADDRESS_IN_USE:
                    raise SystemExit(self._fail(
                        f"the coordinator cannot listen: its port or socket is in use ({url}"
                        f"{' or ' + self.config.coordinator_uds_path if self.config.coordinator_uds_path else ''}); "
                        f"another splitserve cluster? stop it or pick another port", EXIT_ADDRESS_IN_USE))
                raise SystemExit(self._fail(f"the coordinator process exited with code {rc} "
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

    def _announce_gone(self, pid: int) -> None:
        """A fleet process died: every coordinator (replica) ends its leases now (a background
        thread: the supervision loop does not wait for the answers)."""
        holder = holder_name(self.port, pid)
        body = json.dumps({"holder": holder, "end_leases": True}).encode()

        def send() -> None:
            for url in self.coordinator_urls:
                ok, detail, _ = probe(url, "/identity/release", timeout=1.0, body=body)
                if not ok:
                    log.warning("launcher: could not announce %s gone to %s: %s", holder, url, detail)
        threading.Thread(target=send, name="announce-gone", daemon=True).start()

    def _fail(self, msg: str, code: int = EXIT_COORDINATOR_UNREACHABLE) -> int:
        log.error("%s", msg)
        print(f"splitserve serve: error: {msg}", file=sys.stderr, flush=True)
        self._shutdown()
        return code

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
        coordinator_cpu, fleet_cpus = affinity.plan(self.cpus, self.n,
                                                     cfg.topology != "external_coordinator")
        if self.cpus:
            log.info("launcher: fleet.cpu_affinity %s: coordinator on CPU %s, fleet processes on %s",
                     cfg.fleet.cpu_affinity, coordinator_cpu, fleet_cpus)
        try:
            self._reservation = reserve_port(cfg.effective_bind_host, cfg.port)
        except OSError as e:
            return self._fail(str(e.strerror or e), EXIT_ADDRESS_IN_USE)
        self.port = self._reservation.getsockname()[1]
        try:
            if cfg.coordinator.replicas:
                fleet_url = None      # each fleet process reads the replica list from the config
                self.coordinator_urls = list(cfg.coordinator.replicas)
                self._wait_coordinator(self.coordinator_urls, None)
            elif cfg.disagg_coordinator_url:
                fleet_url = cfg.disagg_coordinator_url
                self.coordinator_urls = [fleet_url]
                self._wait_coordinator([fleet_url], None)
            else:
                fleet_url, tcp_url = self._coordinator_urls()
                cport = cfg.coordinator_port
                self.cluster_id = secrets.token_hex(8)
                argv = [self.python, "-m", "splitserve_cli", "coordinator", *self._config_args(),
                        "--host", cfg.coordinator.host, "--port", str(cport),
                        "--cluster-id", self.cluster_id]
                uds = cfg.coordinator_uds_path
                if uds:
                    argv += ["--uds", uds]   # the coordinator replaces a stale socket file, never a live one
                self.coordinator = _Child("coordinator", argv, env, cpu=coordinator_cpu)
                self.coordinator.start()
                log.info("launcher: coordinator pid %d on %s%s", self.coordinator.proc.pid, tcp_url,
                         f" and unix://{uds}" if uds else "")
                self.coordinator_urls = [tcp_url]
                self._wait_coordinator([tcp_url], self.coordinator)
        except SystemExit as e:
            return int(e.code or EXIT_COORDINATOR_UNREACHABLE)
        self.metrics_dir = tempfile.mkdtemp(prefix="splitserve-fleet-metrics-")
        fenv = dict(env)
        fenv["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        port = self.port
        ident = ["--cluster-id", self.cluster_id] if self.cluster_id else []
        for i in range(self.n):
            argv = [self.python, "-m", "fleet.cli", *self.child_argv, "--port", str(port),
                    *(("--coordinator-url", fleet_url) if fleet_url else ()), "--child-index", str(i),
                    *ident]
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
                    if rc == EXIT_FOREIGN_COORDINATOR:
                        msg = (f"{c.name} reached another cluster's coordinator (its cluster id is not "
                               f"{self.cluster_id!r}); another splitserve cluster took this cluster's "
                               f"coordinator port or socket; stopping")
                        log.error("launcher: %s", msg)
                        print(f"splitserve serve: error: {msg}", file=sys.stderr, flush=True)
                        return EXIT_FOREIGN_COORDINATOR
                    if now - c.started_at > 30:
                        c.backoff = 0.5   # it ran fine for a while: not a crash loop
                    log.warning("launcher: %s (pid %d) exited with code %s; restarting in %.1fs",
                                c.name, c.proc.pid, rc, c.backoff)
                    self._announce_gone(c.proc.pid)
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
                if co.proc.returncode == EXIT_ADDRESS_IN_USE:
                    # Its port or socket was taken while it was down: no restart can bind it.
                    msg = (f"the coordinator (pid {co.proc.pid}) cannot listen again: its port or "
                           f"socket is taken by another process; not restarting it, stopping the cluster")
                    log.error("launcher: %s", msg)
                    print(f"splitserve serve: error: {msg}", file=sys.stderr, flush=True)
                    return EXIT_ADDRESS_IN_USE
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
