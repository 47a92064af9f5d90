#!/usr/bin/env python3
"""Fleet benchmark: router CPU per request and req/s, next to nginx, sglang-router and vllm-router.

Three parts, all against mock backends (nginx `return 200`), so the router in the middle is what
is measured:

1. **peers** — the shared peer harness (`../shared/bench/peers/bench_routers.sh`) in one run:
   nginx, sglang-router and vllm-router (round robin) and splitserve (`EXTRA_ROUTER_CMD`: aggregated
   `round_robin`, generation servers only) against the same JSON and SSE backends.
2. **two-leg** — splitserve's disaggregated path on mock context backends (answers with
   `disaggregated_params` and 250 `prompt_token_ids`) and mock generation backends: `round_robin`
   and `kv_cache_aware` (tokenize + block keys + one `/select_pair` + two `/finish` per request),
   CPU of every fleet process plus the coordinator, per request, compared with aggregated
   round robin measured in the same run.
3. **stream latency** — p50 added latency of a streaming request at one connection: wrk -c1 on an SSE
   backend directly and through the fleet.

Usage: `python bench/fleet.py [--quick] [--no-write] [--num-workers 1,2] [--skip-peers]`.
Needs wrk and nginx (see the peers' setup.sh; `--peers-venv` points at its venv). Results are printed
and appended as a "## fleet" section to bench/RESULTS.md (unless --no-write).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = (ROOT / ".." / "shared" / "bench" / "peers").resolve()
RESULTS = ROOT / "bench" / "RESULTS.md"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT_IDS = list(range(1000, 1250))
BODY = {"model": "m", "prompt": "hello world " * 80, "max_tokens": 16}
# The same ~1000-character prompt the peer harness sends (wrk_single.lua).


# --------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_pair() -> int:
    for _ in range(100):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p - 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port pair")


class Group:
    """A process started in its own session; stopped (and CPU-accounted) as a process group."""

    def __init__(self, argv, log: Path, env=None, cwd=None):
        self.log = log
        self._f = open(log, "wb")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                  start_new_session=True)

    def ticks(self) -> int:
        total = 0
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.p.pid:       # pgrp
                total += int(fields[11]) + int(fields[12])
        return total

    def stop(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
            except ProcessLookupError:
                pass
        self._f.close()


def wait_http(url: str, body: dict | None, timeout: float = 60, proc: Group | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.p.poll() is not None:
            raise RuntimeError(f"{proc.log.name} exited: {proc.log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s")


# --------------------------------------------------------------------------- mock backends

def _ctx_json(kind: str) -> str:
    dp = {"request_type": "context_only", "ctx_request_id": 42, "first_gen_tokens": [7],
          "encoded_opaque_state": "AAAA", "ctx_info_endpoint": None}
    usage = {"prompt_tokens": 250, "completion_tokens": 1, "total_tokens": 251,
             "prompt_tokens_details": {"cached_tokens": 0}}
    choice = {"index": 0, "finish_reason": "length", "disaggregated_params": dp}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": ""}
        obj = {"id": "chatcmpl-ctx", "object": "chat.completion"}
    else:
        choice["text"] = ""
        obj = {"id": "cmpl-ctx", "object": "text_completion"}
    obj.update({"created": 1700000000, "model": "m", "prompt_token_ids": PROMPT_IDS, "choices": [choice],
                "usage": usage})
    return json.dumps(obj, separators=(",", ":"))


def _gen_json() -> str:
    return json.dumps({"id": "cmpl-gen", "object": "text_completion", "created": 1700000000, "model": "m",
                       "choices": [{"index": 0, "text": " mock completion", "logprobs": None,
                                    "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 250, "completion_tokens": 16, "total_tokens": 266,
                                 "prompt_tokens_details": {"cached_tokens": 0}}}, separators=(",", ":"))


def _sse() -> str:
    ev = []
    for i in range(1, 5):
        ev.append("data: " + json.dumps({"id": "chatcmpl-m", "object": "chat.completion.chunk", "created": 1,
                                         "model": "m", "choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                                                    "finish_reason": None}]},
                                        separators=(",", ":")) + "\\n\\n")
    ev.append("data: " + json.dumps({"id": "chatcmpl-m", "object": "chat.completion.chunk", "created": 1,
                                     "model": "m", "choices": [{"index": 0, "delta": {},
                                                                "finish_reason": "length"}]},
                                    separators=(",", ":")) + "\\n\\n")
    ev.append("data: " + json.dumps({"id": "chatcmpl-m", "object": "chat.completion.chunk", "created": 1,
                                     "model": "m", "choices": [],
                                     "usage": {"prompt_tokens": 250, "completion_tokens": 5, "total_tokens": 255,
                                               "prompt_tokens_details": {"cached_tokens": 0}}},
                                    separators=(",", ":")) + "\\n\\n")
    return "".join(ev) + "data: [DONE]\\n\\n"


def mock_backends(work: Path) -> tuple[Group, dict[str, list[str]]]:
    """nginx with context (JSON), generation (JSON) and SSE servers, two of each."""
    ports = {k: [free_port(), free_port()] for k in ("ctx", "gen", "sse")}
    d = work / "nginx"
    d.mkdir(parents=True, exist_ok=True)
    servers = []
    for p in ports["ctx"]:
        servers.append(f"""
  server {{ listen 127.0.0.1:{p} reuseport backlog=4096; default_type application/json;
    location = /health {{ return 200 '{{"status":"ok"}}'; }}
    location = /v1/completions {{ return 200 '{_ctx_json("completion")}'; }}
    location = /v1/chat/completions {{ return 200 '{_ctx_json("chat")}'; }}
    location = /v1/abort {{ return 200 '{{"aborted":false}}'; }}
    location / {{ return 200 '{{"mock":true}}'; }} }}""")
    for p in ports["gen"]:
        servers.append(f"""
  server {{ listen 127.0.0.1:{p} reuseport backlog=4096; default_type application/json;
    location = /health {{ return 200 '{{"status":"ok"}}'; }}
    location = /v1/completions {{ return 200 '{_gen_json()}'; }}
    location = /v1/abort {{ return 200 '{{"aborted":false}}'; }}
    location / {{ return 200 '{{"mock":true}}'; }} }}""")
    for p in ports["sse"]:
        servers.append(f"""
  server {{ listen 127.0.0.1:{p} reuseport backlog=4096; default_type application/json;
    location = /health {{ return 200 '{{"status":"ok"}}'; }}
    location = /v1/chat/completions {{ default_type text/event-stream; add_header Cache-Control no-cache;
      return 200 '{_sse()}'; }}
    location / {{ return 200 '{{"mock":true}}'; }} }}""")
    conf = f"""worker_processes 1; daemon off; pid {d}/nginx.pid; error_log {d}/error.log warn;
events {{ worker_connections 16384; }}
http {{ access_log off; client_body_temp_path {d}/cb; proxy_temp_path {d}/px; fastcgi_temp_path {d}/fc;
  uwsgi_temp_path {d}/uw; scgi_temp_path {d}/sc;
  keepalive_requests 1000000; keepalive_timeout 300s; client_body_buffer_size 64k;
{''.join(servers)}
}}
"""
    (d / "nginx.conf").write_text(conf)
    g = Group(["nginx", "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")], work / "nginx.log")
    urls = {k: [f"http://127.0.0.1:{p}" for p in v] for k, v in ports.items()}
    for u in urls["ctx"] + urls["gen"]:
        wait_http(u + "/v1/completions", BODY, 20, g)
    return g, urls


# --------------------------------------------------------------------------- fleet

def fleet_config(work: Path, name: str, port: int, gen: list[str], ctx: list[str], policy: str,
                 num_workers: int) -> Path:
    import yaml
    doc = {"hostname": "127.0.0.1", "port": port, "num_workers": num_workers,
           "generation_servers": {"urls": [u.split("//")[1] for u in gen], "router": {"type": policy}},
           "context_servers": {"urls": [u.split("//")[1] for u in ctx], "router": {"type": policy}},
           "log_level": "warning",
           # the mocks serve model "m"; routing keys use the byte-level preset tokenizer
           "tokenizer": "tiny"}
    if num_workers > 1:
        doc["coordinator"] = {"port": port - 1}
    p = work / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def start_fleet(work: Path, name: str, cfg: Path) -> Group:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    return Group([sys.executable, "-m", "splitserve_cli", "serve", "-c", str(cfg)], work / f"{name}.log",
                 env=env, cwd=str(ROOT))


def wrk(url: str, script: Path, conns: int, duration: str, threads: int = 1) -> dict:
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{conns}", f"-d{duration}", "--latency", "-s", str(script), url],
                         capture_output=True, text=True, timeout=600).stdout

    def ms(v: str) -> float:
        for unit, f in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
            if v.endswith(unit):
                return float(v[:-len(unit)]) * f
        return float(v)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    n = int(re.search(r"(\d+) requests in", out).group(1))
    p50 = ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    bad = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        bad += sum(int(x) for x in m.groups())
    return {"rps": rps, "n": n, "p50_ms": p50, "p99_ms": p99, "errors": bad, "raw": out}


def lua(work: Path, name: str, path: str, body: dict) -> Path:
    p = work / f"{name}.lua"
    p.write_text(f'wrk.method = "POST"\nwrk.path = "{path}"\nwrk.headers["Content-Type"] = "application/json"\n'
                 f"wrk.body = {json.dumps(json.dumps(body))}\n")
    return p


def measure(work: Path, name: str, cfg: Path, script: Path, path: str, body: dict, conns: int, duration: str,
            warm: str) -> dict:
    port = int(re.search(r"^port: (\d+)", cfg.read_text(), re.M).group(1))
    g = start_fleet(work, name, cfg)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + path, body, 90, g)
        wrk(url, script, conns, warm)
        t0, c0 = time.monotonic(), g.ticks()
        r = wrk(url, script, conns, duration)
        el, c1 = time.monotonic() - t0, g.ticks()
    finally:
        g.stop()
    cpu_s = (c1 - c0) / CLK_TCK
    r["cpu_pct"] = cpu_s / el * 100
    r["us_per_req"] = cpu_s / max(1, r["n"]) * 1e6
    r["name"] = name
    return r


# --------------------------------------------------------------------------- parts

def part_two_leg(work: Path, urls, nws: list[int], duration: str, warm: str) -> list[dict]:
    script = lua(work, "completions", "/v1/completions", BODY)
    rows = []
    for nw in nws:
        for name, ctx, policy in (("aggregated round_robin", [], "round_robin"),
                                  ("two-leg round_robin", urls["ctx"], "round_robin"),
                                  ("two-leg kv_cache_aware", urls["ctx"], "kv_cache_aware")):
            port = free_pair()
            tag = f"{name.replace(' ', '-')}-n{nw}"
            cfg = fleet_config(work, tag, port, urls["gen"], ctx, policy, nw)
            r = measure(work, tag, cfg, script, "/v1/completions", BODY, 64, duration, warm)
            r["config"], r["num_workers"] = name, nw
            rows.append(r)
            print(f"  {name:24s} n={nw}: {r['rps']:8.0f} req/s  {r['us_per_req']:6.0f} µs CPU/req  "
                  f"p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  errors {r['errors']}", flush=True)
    return rows


def part_stream(work: Path, urls, duration: str, warm: str) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 150}], "max_tokens": 16,
            "stream": True}
    script = lua(work, "sse", "/v1/chat/completions", body)
    direct = []
    for _ in range(2):
        direct.append(wrk(urls["sse"][0], script, 1, duration)["p50_ms"])
    port = free_pair()
    cfg = fleet_config(work, "sse-rr", port, urls["sse"], [], "round_robin", 1)
    r = measure(work, "sse-rr", cfg, script, "/v1/chat/completions", body, 1, duration, warm)
    d = min(direct)
    out = {"direct_p50_ms": d, "fleet_p50_ms": r["p50_ms"], "added_p50_ms": r["p50_ms"] - d,
           "fleet_us_per_req": r["us_per_req"]}
    print(f"  stream at 1 connection: direct p50 {d:.3f} ms, via fleet {r['p50_ms']:.3f} ms, added "
          f"{out['added_p50_ms']:.3f} ms", flush=True)
    return out


def part_peers(work: Path, args) -> tuple[str, Path | None]:
    venv = Path(args.peers_venv)
    if not (venv / "bin" / "python").exists():
        return f"(skipped: no peer venv at {venv}; run OUT_DIR={venv.parent} {PEERS}/setup.sh)", None
    out_dir = work / "peers"
    extra = (f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'bench' / 'fleet.py'))} --serve-extra "
             f"--port $ROUTER_PORT --workers \"$WORKER_URLS_CSV\" --num-workers {args.extra_workers}")
    env = dict(os.environ, OUT_DIR=str(out_dir), VENV=str(venv), EXTRA_ROUTER_CMD=extra,
               EXTRA_ROUTER_NAME=f"splitserve-rr-n{args.extra_workers}",
               CONFIGS=args.peer_configs, WORKLOADS=args.peer_workloads, REPS=str(args.reps),
               DURATION=args.duration, WARMUP=args.warmup)
    env = {k: v for k, v in env.items() if not k.startswith("SPLITSERVE_")}
    subprocess.run(["bash", str(PEERS / "bench_routers.sh")], env=env, cwd=str(PEERS), timeout=3600,
                   stdout=open(work / "peers.log", "w"), stderr=subprocess.STDOUT)
    mds = sorted(out_dir.glob("results-*.md"))
    if not mds:
        return f"(peer harness produced no report; see {work / 'peers.log'})", None
    tsvs = sorted((out_dir / "logs").glob("*/results.tsv"))
    return mds[-1].read_text(), (tsvs[-1] if tsvs else None)


def serve_extra(args) -> int:
    """EXTRA_ROUTER_CMD entry: splitserve aggregated round robin on the harness's backends."""
    work = Path(tempfile.mkdtemp(prefix="splitserve-bench-extra-"))
    gen = [u for u in args.workers.split(",") if u]
    port = args.port
    cfg = fleet_config(work, "extra", port, gen, [], "round_robin", args.num_workers)
    if args.num_workers > 1:
        import yaml
        doc = yaml.safe_load(cfg.read_text())
        doc["coordinator"] = {"port": free_port()}
        cfg.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    os.execve(sys.executable, [sys.executable, "-m", "splitserve_cli", "serve", "-c", str(cfg)],
              dict(env, PYTHONPATH=str(ROOT)))
    return 0


def peer_rows(tsv: Path | None) -> list[dict]:
    if tsv is None:
        return []
    import csv
    rows = list(csv.DictReader(open(tsv), delimiter="\t"))
    out = {}
    for r in rows:
        k = (r["config"], r["workload"])
        try:
            us = float(r["router_cpu_pct"]) / 100 * 1e6 / float(r["rps"])
        except (ValueError, ZeroDivisionError):
            us = None
        out.setdefault(k, []).append((float(r["rps"]), us, float(r["p50_ms"]), float(r["p99_ms"])))
    res = []
    for (c, w), v in out.items():
        us = [x[1] for x in v if x[1] is not None]
        res.append({"config": c, "workload": w, "rps": sum(x[0] for x in v) / len(v),
                    "us": sum(us) / len(us) if us else None, "p50": sum(x[2] for x in v) / len(v),
                    "p99": sum(x[3] for x in v) / len(v)})
    return res


def report(args, peers_md: str, prow: list[dict], two: list[dict], stream: dict | None) -> str:
    box = f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), Python {platform.python_version()}"
    lines = ["## fleet", "", f"`python bench/fleet.py{' --quick' if args.quick else ''}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{box}; wrk 1 thread, 64 connections, {args.duration} per point; mock backends are nginx `return 200`. "
             "CPU µs/req = CPU time of the router's whole process group (all fleet processes and, for "
             "splitserve, its coordinator) divided by requests served. This box is shared and has 2 cores, so "
             "req/s moves with whatever else runs; µs/req is the stable number.", ""]
    if prow:
        lines += ["### Peers, same run (aggregated round robin, peer harness `bench_routers.sh`)", "",
                  "| router | workload | req/s | router CPU µs/req | p50 ms | p99 ms |", "|---|---|---:|---:|---:|---:|"]
        for r in sorted(prow, key=lambda r: (r["workload"], r["config"])):
            us = f"{r['us']:.0f}" if r["us"] is not None else "-"
            lines.append(f"| {r['config']} | {r['workload']} | {r['rps']:.0f} | {us} | {r['p50']:.2f} | {r['p99']:.2f} |")
        lines.append("")
    elif peers_md.startswith("("):
        lines += [f"Peers: {peers_md}", ""]
    if two:
        base = {r["num_workers"]: r["us_per_req"] for r in two if r["config"] == "aggregated round_robin"}
        lines += ["### splitserve paths (same mock backends, one run)", "",
                  "| path | fleet processes | req/s | CPU µs/req | × aggregated rr | p50 ms | p99 ms | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in two:
            x = r["us_per_req"] / base[r["num_workers"]] if base.get(r["num_workers"]) else 0
            lines.append(f"| {r['config']} | {r['num_workers']} | {r['rps']:.0f} | {r['us_per_req']:.0f} | {x:.2f} | "
                         f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
        lines.append("")
    if stream:
        lines += ["### Streaming added latency, one connection", "",
                  f"SSE chat completion (4 token events + usage): direct to the backend p50 "
                  f"{stream['direct_p50_ms']:.3f} ms, through the fleet p50 {stream['fleet_p50_ms']:.3f} ms → "
                  f"**added p50 {stream['added_p50_ms']:.3f} ms** (target ≤ 2 ms).", ""]
    lines += ["Targets (issue 5): round_robin ≤ 300 µs fleet CPU per request; two-leg kv_cache_aware ≤ 2.5× "
              "round_robin including the coordinator; streaming p50 added latency ≤ 2 ms.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs, one rep, fewer peer configs")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to bench/RESULTS.md")
    ap.add_argument("--skip-peers", action="store_true", help="skip the peer harness part")
    ap.add_argument("--num-workers", default="1", help="fleet sizes for the splitserve paths, e.g. 1,2,4")
    ap.add_argument("--extra-workers", type=int, default=1, help="fleet size in the peer run")
    ap.add_argument("--peers-venv", default=str(ROOT / ".bench_out" / "venv"))
    ap.add_argument("--duration", default=None)
    ap.add_argument("--warmup", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--peer-configs", default=None)
    ap.add_argument("--peer-workloads", default=None)
    # internal: the peer harness's EXTRA_ROUTER_CMD
    ap.add_argument("--serve-extra", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--workers", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_extra:
        args.num_workers = int(args.num_workers)
        return serve_extra(args)
    args.duration = args.duration or ("4s" if args.quick else "10s")
    args.warmup = args.warmup or ("1s" if args.quick else "2s")
    args.reps = args.reps or (1 if args.quick else 2)
    args.peer_configs = args.peer_configs or ("nginx sgl-rr vllm-rr extra" if args.quick
                                              else "direct nginx sgl-rr sgl-ca vllm-rr vllm-ca aio-1 extra")
    args.peer_workloads = args.peer_workloads or ("single sse" if args.quick else "single prefix sse")
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            print(f"bench/fleet.py: {tool} is not installed (apt-get install wrk nginx; see {PEERS}/setup.sh)",
                  file=sys.stderr)
            return 1
    work = Path(tempfile.mkdtemp(prefix="splitserve-bench-fleet-"))
    print(f"bench/fleet.py: work dir {work}", flush=True)
    peers_md, tsv = ("(skipped: --skip-peers)", None)
    if not args.skip_peers:
        print("peers (shared harness, same run) ...", flush=True)
        peers_md, tsv = part_peers(work, args)
    prow = peer_rows(tsv)
    for r in prow:
        print(f"  {r['config']:18s} {r['workload']:7s} {r['rps']:8.0f} req/s  "
              f"{(r['us'] or 0):6.0f} µs CPU/req  p50 {r['p50']:.2f} ms", flush=True)
    nginx, urls = mock_backends(work)
    try:
        print("splitserve paths ...", flush=True)
        two = part_two_leg(work, urls, [int(x) for x in args.num_workers.split(",")], args.duration, args.warmup)
        print("streaming latency ...", flush=True)
        stream = part_stream(work, urls, args.duration, args.warmup)
    finally:
        nginx.stop()
    md = report(args, peers_md, prow, two, stream)
    print("\n" + md)
    if not args.no_write:
        prev = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
        RESULTS.write_text(prev.rstrip("\n") + "\n\n" + md + "\n")
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
