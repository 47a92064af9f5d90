"""The processes of one configuration: a coordinator, the workers (pinned with
``CUDA_VISIBLE_DEVICES``) and a fleet using that coordinator, all through the shared harness
(splitserve_testing), plus the registry that stops every process the benchmark started."""
from __future__ import annotations

import contextlib
import json
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.transfer.disagg.common import HOST, BenchError
from splitserve_testing import Proc, clean_env, free_port, stop_all, wait_for


class Registry:
    """Every process this benchmark started; ``stop_all`` ends them. Each pid is also appended to
    ``<logdir>/pids`` (``pid name`` per line) so an operator or a test can check nothing outlived us."""

    def __init__(self, logdir: Path) -> None:
        self.procs: list[Proc] = []
        self.pid_file = logdir / "pids"
        self.pids: list[int] = []

    def note(self, pid: int, name: str) -> None:
        self.pids.append(pid)
        with open(self.pid_file, "a") as f:
            f.write(f"{pid} {name}\n")

    def start(self, name: str, argv: list[str], log: Path, env: dict) -> Proc:
        # group: SIGTERM reaches a fleet launcher's children too, and none outlives the stop
        p = Proc(name, argv, log, env, group=True, header=True)
        self.procs.append(p)
        self.note(p.p.pid, name)
        return p

    def stop(self, procs: list[Proc], grace: float = 10.0) -> None:
        """SIGTERM all of ``procs`` at once (workers drain in parallel), then reap each."""
        stop_all(procs, grace)
        for p in procs:
            with contextlib.suppress(ValueError):
                self.procs.remove(p)

    def stop_all(self, grace: float = 10.0) -> None:
        self.stop(list(self.procs), grace)


def http_call(url: str, timeout: float = 3.0, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


def _child_env(gpu: str | None) -> dict:
    env = clean_env(PYTHONUNBUFFERED=1)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


class _NotYet(Exception):
    """A readiness poll's state so far (the last one is in the timeout message)."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str                       # context | generation | both
    gpu: str | None                 # CUDA_VISIBLE_DEVICES value; None = inherit (cpu runs)
    extra: tuple[str, ...] = ()


@dataclass
class RunningWorker:
    spec: WorkerSpec
    url: str
    proc: Proc


class Cluster:
    """A coordinator, the workers (static ``urls`` in the cluster YAML) and a fleet using that
    coordinator, on loopback ports picked by the OS. ``start`` returns once the fleet serves a probe."""

    def __init__(self, name: str, args, reg: Registry, logdir: Path, workers: list[WorkerSpec],
                 ctx_router: str | None, gen_router: str, schedule_style: str | None = None):
        self.name, self.args, self.reg, self.logdir = name, args, reg, logdir
        self.schedule_style = schedule_style   # None: the fleet's default (context_first)
        self.specs, self.ctx_router, self.gen_router = workers, ctx_router, gen_router
        self.workers: list[RunningWorker] = []
        self.procs: list[Proc] = []
        self.url = ""
        self.model = ""

    def _worker_argv(self, spec: WorkerSpec, port: int) -> list[str]:
        a = self.args
        extra = list(spec.extra)
        head = [sys.executable, "-m", "splitserve_cli", "worker"]
        argv = [*head, "--role", spec.role, "--engine", "torch",
                "--model", a.model, "--device", a.device, "--host", HOST, "--port", str(port),
                "--num-blocks", str(a.num_blocks), "--transfer-agent", a.transfer_agent,
                "--drain-timeout", "2", "--log-level", a.log_level.upper()]
        if a.dtype:
            argv += ["--dtype", a.dtype]
        return argv + list(a.worker_arg) + extra

    def start(self, timeout: float) -> None:
        a = self.args
        cport, fport = free_port(), free_port()
        for spec in self.specs:
            port = free_port()
            p = self.reg.start(f"{self.name}/{spec.name}", self._worker_argv(spec, port),
                               self.logdir / f"{self.name}-{spec.name}.log", _child_env(spec.gpu))
            self.procs.append(p)
            self.workers.append(RunningWorker(spec, f"http://{HOST}:{port}", p))
        ctx = [w.url for w in self.workers if w.spec.role == "context"]
        gen = [w.url for w in self.workers if w.spec.role in ("generation", "both")]
        # `model` names the tokenizer the fleet computes KV-aware routing keys with (the fleet starts
        # before the workers answer /server_info).
        cfg = {"hostname": HOST, "port": fport, "num_workers": a.fleet_workers, "model": a.model,
               "server_start_timeout": timeout, "request_timeout": a.request_timeout,
               "log_level": a.log_level.lower(),
               "coordinator": {"host": HOST, "port": cport, "uds": False, "health_check_interval_s": 0.5},
               "fleet": {"route_header": "full"},   # the client reads each answer's placement
               "context_servers": {"urls": [u.split("//", 1)[1] for u in ctx],
                                   "router": {"type": self.ctx_router or "round_robin"}},
               "generation_servers": {"urls": [u.split("//", 1)[1] for u in gen],
                                      "router": {"type": self.gen_router}}}
        if self.schedule_style:
            cfg["schedule_style"] = self.schedule_style
        cfg_path = self.logdir / f"{self.name}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = _child_env(None)
        env["CUDA_VISIBLE_DEVICES"] = ""   # neither the coordinator nor the fleet touch a GPU
        # Everything starts at once: the fleet probes the coordinator with retries, and the coordinator
        # health-checks the workers until they answer.
        self.procs.append(self.reg.start(
            f"{self.name}/coordinator", [sys.executable, "-m", "splitserve_cli", "coordinator", "-c", str(cfg_path),
                                         "--port", str(cport), "--no-uds"],
            self.logdir / f"{self.name}-coordinator.log", env))
        self.procs.append(self.reg.start(
            f"{self.name}/fleet", [sys.executable, "-m", "splitserve_cli", "serve", "-c", str(cfg_path),
                                   "--coordinator-url", f"http://{HOST}:{cport}"],
            self.logdir / f"{self.name}-fleet.log", env))
        self.url = f"http://{HOST}:{fport}"
        deadline = time.monotonic() + timeout
        pending = [w.url + "/health" for w in self.workers]

        def workers_up() -> bool:
            pending[:] = [u for u in pending if http_call(u)[0] != 200]
            if pending:
                raise _NotYet(f"not answering: {', '.join(pending)}")
            return True
        self._until("the workers' /health", workers_up, deadline, 0.3)
        # The coordinator admits a server after its own health probe; until then the fleet would
        # serve the probe below by a fallback (e.g. aggregated on the generation server).
        want = {"context": set(ctx), "generation": set(gen)}
        cinfo = f"http://{HOST}:{cport}/cluster_info"

        def admitted() -> bool:
            status, body = http_call(cinfo)
            lists = json.loads(body).get("server_lists", {}) if status == 200 else {}
            if not all(want[r] <= set(lists.get(r, [])) for r in want):
                raise _NotYet(f"healthy: {lists}")
            return True
        self._until("the coordinator to admit every worker", admitted, deadline, 0.2)
        status, body = http_call(self.workers[0].url + "/v1/models")
        self.model = json.loads(body)["data"][0]["id"] if status == 200 else a.model
        probe = {"model": self.model, "prompt": "probe", "max_tokens": 2, "ignore_eos": True}

        def answers() -> bool:
            status, _ = http_call(self.url + "/v1/completions", timeout=max(5.0, a.request_timeout), body=probe)
            if status != 200:
                raise _NotYet(f"last HTTP status {status}")
            return True
        self._until(f"the fleet at {self.url} to answer a completion", answers, deadline, 0.2)

    def _until(self, what: str, pred, deadline: float, interval: float) -> None:
        """Poll ``pred`` until it returns true; BenchError at ``deadline`` (with the state ``pred`` last
        raised as ``_NotYet``) or as soon as one of the cluster's processes exits (with its log)."""
        wait_for(pred, max(interval, deadline - time.monotonic()), f"{self.name}: {what} (logs in {self.logdir})",
                 self.procs, interval, BenchError)

    def stop(self) -> None:
        self.reg.stop(self.procs, grace=10.0)
        self.procs = []

    def transfer_info(self) -> dict:
        """The first context worker's ``transfer`` field of ``/server_info`` ({} if none)."""
        for w in self.workers:
            if w.spec.role == "context":
                st, body = http_call(w.url + "/server_info")
                return (json.loads(body).get("transfer") or {}) if st == 200 else {}
        return {}

    def route_mode(self) -> str | None:
        """The placement mode of one short non-streaming request (``disaggregated``, ``no_kv_transfer``…)."""
        req = urllib.request.Request(
            self.url + "/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": self.model, "prompt": "which way?", "max_tokens": 2,
                             "ignore_eos": True}).encode())
        try:
            with urllib.request.urlopen(req, timeout=self.args.request_timeout) as r:
                route = r.headers.get("x-splitserve-route")
        except (OSError, ValueError) as e:
            raise BenchError(f"{self.name}: probe request failed: {e}") from None
        return json.loads(route).get("mode") if route else None

    def worker_metrics(self) -> dict[str, dict[str, float]]:
        return {w.spec.name: parse_metrics(http_call(w.url + "/metrics")[1].decode(errors="replace"))
                for w in self.workers}


_METRIC_KEEP = re.compile(r"transfer|kv_recv|kv_send|preemption|prefix_cache_hit|prefill_tokens_total|"
                          r"decode_tokens_total|generation_tokens_total")


def parse_metrics(text: str) -> dict[str, float]:
    """The worker's counters and histogram sums/counts this benchmark reports (Prometheus text)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if not _METRIC_KEEP.search(name) or "_bucket" in name or name.endswith("_created"):
            continue
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    return {w: {k: round(v - before.get(w, {}).get(k, 0.0), 6) for k, v in m.items()
                if v != before.get(w, {}).get(k, 0.0)}
            for w, m in after.items()}
