#!/usr/bin/env python3
"""Fleet benchmark: router CPU per request and req/s, next to nginx, sglang-router and vllm-router.

Three parts, all against mock backends (nginx `return 200`), so the router in the middle is what
is measured:

1. **scaling** — one table, one run: nginx (reverse proxy, round robin) and vllm-router (round robin,
   `--vllm-router CMD`) next to splitserve aggregated `round_robin`, two-leg `round_robin` and two-leg
   `kv_cache_aware` (tokenize + block keys + one placement of both legs + two lease ends per
   request, over the coordinator channel) at every `--num-workers` size; wrk `--wrk-threads` x
   `--conns`; req/s, CPU µs per request split into fleet processes and coordinator, p50/p99, errors.
2. **peers** (optional, `--peers`) — the shared peer harness (`../shared/bench/peers/bench_routers.sh`) in one run:
   nginx, sglang-router and vllm-router (round robin) and splitserve (`EXTRA_ROUTER_CMD`: aggregated
   `round_robin`, generation servers only) against the same JSON and SSE backends.
   The two-leg paths use mock context backends (answers with `disaggregated_params` and 250
   `prompt_token_ids`) and mock generation backends.
3. **stream latency** — p50 added latency of a streaming request at one connection: wrk -c1 on an SSE
   backend directly and through the fleet.

Usage: `python bench/fleet/fleet.py [--quick] [--no-write] [--num-workers 1,2,4,8] [--wrk-threads 4]
[--conns 256] [--vllm-router CMD] [--peers]`. Needs wrk and nginx (see the peers' setup.sh;
`--peers-venv` points at its venv). Results are printed and written as the "## fleet" section of
bench/RESULTS.md (unless --no-write; `--json-out FILE` saves the raw rows).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

from bench._common import pinned  # noqa: E402
from splitserve_testing import Proc, free_port, free_port_pair, wait_http  # noqa: E402
from splitserve_testing.proctable import cpu_ticks, group_members, splitserve_role  # noqa: E402
PEERS = (ROOT / ".." / "shared" / "bench" / "peers").resolve()
RESULTS = ROOT / "bench" / "RESULTS.md"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT_IDS = list(range(1000, 1250))
BODY = {"model": "m", "prompt": "hello world " * 80, "max_tokens": 16}
# The same ~1000-character prompt the peer harness sends (wrk_single.lua).


# --------------------------------------------------------------------------- processes

class Group(Proc):
    """A process started in its own session; stopped (and CPU-accounted) as a process group."""

    def __init__(self, argv, log: Path, env=None, cwd=None):
        # env None: splitserve_testing.clean_env() (no SPLITSERVE_* overrides reach a child)
        super().__init__(log.stem, argv, log, env, cwd=cwd, group=True, append=False)

    def members(self):
        """(pid, /proc/<pid>/stat fields after the command name) of every process of the group."""
        return group_members(self.p.pid)

    def ticks(self) -> int:
        return sum(cpu_ticks(f) for _, f in self.members())

    def ticks_split(self) -> dict[str, int]:
        """CPU ticks of the group by part: the coordinator process, everything else ("fleet"); and
        "sys", the kernel-mode ticks of both."""
        out = {"fleet": 0, "coordinator": 0, "sys": 0}
        for pid, fields in self.members():
            out["sys"] += int(fields[12])     # stime: the kernel's share, counted in the two parts too
            out["coordinator" if splitserve_role(pid) == "coordinator" else "fleet"] += cpu_ticks(fields)
        return out

    def stop(self, grace: float = 20.0):
        return super().stop(grace)


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


def mock_backends(work: Path, workers: int = 1, cpus: str | None = None) -> tuple[Group, dict[str, list[str]]]:
    """nginx with context (JSON), generation (JSON) and SSE servers, two of each, on `workers`
    worker processes (on a many-core host one worker would be the ceiling being measured), on the
    CPUs `cpus` (None: anywhere)."""
    taken: set[int] = set()

    def fresh() -> int:       # free_port() may hand back a port it just returned: keep them distinct
        while (p := free_port()) in taken:
            pass
        taken.add(p)
        return p

    ports = {k: [fresh(), fresh()] for k in ("ctx", "gen", "sse")}
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
    conf = f"""worker_processes {workers}; daemon off; pid {d}/nginx.pid; error_log {d}/error.log warn;
events {{ worker_connections 16384; }}
http {{ access_log off; client_body_temp_path {d}/cb; proxy_temp_path {d}/px; fastcgi_temp_path {d}/fc;
  uwsgi_temp_path {d}/uw; scgi_temp_path {d}/sc;
  keepalive_requests 1000000; keepalive_timeout 300s; client_body_buffer_size 64k;
{''.join(servers)}
}}
"""
    (d / "nginx.conf").write_text(conf)
    g = Group(pinned(["nginx", "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")], cpus),
              work / "nginx.log")
    urls = {k: [f"http://127.0.0.1:{p}" for p in v] for k, v in ports.items()}
    for u in urls["ctx"] + urls["gen"]:
        wait_http(u + "/v1/completions", 20, g, body=BODY)
    return g, urls


# --------------------------------------------------------------------------- fleet

def fleet_config(work: Path, name: str, port: int, gen: list[str], ctx: list[str], policy: str,
                 num_workers: int, event_loop: str | None = None, cpu_affinity: str | None = None) -> Path:
    import yaml
    doc = {"hostname": "127.0.0.1", "port": port, "num_workers": num_workers,
           "generation_servers": {"urls": [u.split("//")[1] for u in gen], "router": {"type": policy}},
           "context_servers": {"urls": [u.split("//")[1] for u in ctx], "router": {"type": policy}},
           "log_level": "warning",
           # the mocks serve model "m"; routing keys use the byte-level preset tokenizer
           "tokenizer": "tiny"}
    if num_workers > 1:
        doc["coordinator"] = {"port": port - 1}
    fleet = {k: v for k, v in (("event_loop", event_loop), ("cpu_affinity", cpu_affinity)) if v}
    if fleet:
        doc["fleet"] = fleet
    p = work / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def start_fleet(work: Path, name: str, cfg: Path) -> Group:
    return Group([sys.executable, "-m", "splitserve_cli", "serve", "-c", str(cfg)], work / f"{name}.log",
                 cwd=str(ROOT))


def wrk(url: str, script: Path, conns: int, duration: str, threads: int = 1, cpus: str | None = None) -> dict:
    argv = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{duration}", "--latency", "-s", str(script), url]
    out = subprocess.run(pinned(argv, cpus), capture_output=True, text=True, timeout=600).stdout

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
            warm: str, threads: int = 1, cpus: str | None = None) -> dict:
    port = int(re.search(r"^port: (\d+)", cfg.read_text(), re.M).group(1))
    return measure_group(start_fleet(work, name, cfg), f"http://127.0.0.1:{port}", name, script, path, body,
                         conns, duration, warm, threads, cpus)


def measure_group(g: Group, url: str, name: str, script: Path, path: str, body: dict, conns: int,
                  duration: str, warm: str, threads: int = 1, cpus: str | None = None) -> dict:
    """wrk (on the CPUs `cpus`) against `url` served by the process group `g` (stopped afterwards);
    CPU of the group."""
    try:
        wait_http(url + path, 90, g, body=body)
        wrk(url, script, conns, warm, threads, cpus)
        # The warm-up's connections close with requests in flight; wrk's next run reuses their
        # client ports at once (tcp_tw_reuse on loopback) while the fleet still holds them open,
        # and the new SYNs wait ~1 s for retransmission (TcpExtPAWSOldAck): a ~1.2 s p99 at 256
        # connections, none after a 0.5 s pause (issue 13). Measure the steady state.
        time.sleep(1.0)
        t0, c0 = time.monotonic(), g.ticks_split()
        r = wrk(url, script, conns, duration, threads, cpus)
        el, c1 = time.monotonic() - t0, g.ticks_split()
    finally:
        g.stop()
    n = max(1, r["n"])
    cpu = {k: (c1[k] - c0[k]) / CLK_TCK for k in c0}
    sys_s = cpu.pop("sys")
    cpu_s = sum(cpu.values())
    r["sys_share"] = sys_s / cpu_s if cpu_s else 0.0
    r["cpu_pct"] = cpu_s / el * 100
    r["us_per_req"] = cpu_s / n * 1e6
    r["fleet_us"] = cpu["fleet"] / n * 1e6
    r["coord_us"] = cpu["coordinator"] / n * 1e6
    r["name"] = name
    return r


# --------------------------------------------------------------------------- parts

def _show(r: dict) -> None:
    split = (f" (fleet {r['fleet_us']:.0f} + coordinator {r['coord_us']:.0f})" if r.get("coord_us") else "")
    print(f"  {r['config']:24s} n={r['num_workers']}: {r['rps']:9.0f} req/s  {r['us_per_req']:6.0f} µs CPU/req"
          f"{split}  kernel {r['sys_share']:.0%}  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
          f"errors {r['errors']}", flush=True)


def nginx_proxy(work: Path, backends: list[str], workers: int, cpus: str | None = None) -> tuple[Group, str]:
    """nginx as a round-robin reverse proxy with upstream keep-alive (the peers' `nginx` config)."""
    port = free_port()
    d = work / "nginx-proxy"
    d.mkdir(parents=True, exist_ok=True)
    ups = "".join(f"    server {u.split('//')[1]};\n" for u in backends)
    (d / "nginx.conf").write_text(f"""worker_processes {workers}; daemon off; pid {d}/nginx.pid; error_log {d}/error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{ access_log off; client_body_temp_path {d}/cb; proxy_temp_path {d}/px; fastcgi_temp_path {d}/fc;
  uwsgi_temp_path {d}/uw; scgi_temp_path {d}/sc;
  keepalive_requests 1000000; keepalive_timeout 300s; client_body_buffer_size 64k;
  upstream backends {{
{ups}    keepalive 1024; keepalive_requests 1000000;
  }}
  server {{ listen 127.0.0.1:{port} reuseport backlog=4096;
    location / {{ proxy_pass http://backends; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}
}}
""")
    g = Group(pinned(["nginx", "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")], cpus),
              work / "nginx-proxy.log")
    return g, f"http://127.0.0.1:{port}"


def vllm_router(work: Path, cmd: str, backends: list[str], cpus: str | None = None) -> tuple[Group, str]:
    """vllm-router, round robin, over the same backends (`cmd` launches it: e.g. `vllm-router`
    or `python3 .device-carry/vr/vr_launch.py`)."""
    port = free_port()
    argv = [*shlex.split(cmd), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends,
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warning"]
    return Group(pinned(argv, cpus), work / "vllm-router.log"), f"http://127.0.0.1:{port}"


def part_scaling(work: Path, urls, args) -> list[dict]:
    """Peers and splitserve at every fleet size, same backends, same wrk load, one run."""
    script = lua(work, "completions", "/v1/completions", BODY)
    nws = [int(x) for x in args.num_workers.split(",")]
    load = dict(conns=args.conns, duration=args.duration, warm=args.warmup, threads=args.wrk_threads,
                cpus=args.load_cpus)
    rows = []
    rc = args.router_cpus
    peers = [("nginx proxy", lambda: nginx_proxy(work, urls["gen"], args.nginx_workers, rc))] if args.nginx_workers else []
    if args.vllm_router:
        peers.append(("vllm-router round_robin", lambda: vllm_router(work, args.vllm_router, urls["gen"], rc)))
    for name, start in peers:
        try:
            g, url = start()
            r = measure_group(g, url, name, script, "/v1/completions", BODY, **load)
        except (RuntimeError, OSError) as e:
            print(f"  {name}: skipped ({e})", flush=True)
            continue
        r["config"], r["num_workers"], r["coord_us"] = name, args.nginx_workers if name.startswith("nginx") else "-", None
        rows.append(r)
        _show(r)
    paths = [p for p in (("aggregated round_robin", [], "round_robin"),
                         ("two-leg round_robin", urls["ctx"], "round_robin"),
                         ("two-leg kv_cache_aware", urls["ctx"], "kv_cache_aware"))
             if args.paths is None or p[0].split()[0] + "-" + p[2] in args.paths.split(",")]
    for nw in nws:
        for name, ctx, policy in paths:
            tag = f"{name.replace(' ', '-')}-n{nw}"
            for attempt in range(3):
                # free_port_pair() only probes: on a shared host another process may take the port first
                cfg = fleet_config(work, tag, free_port_pair(), urls["gen"], ctx, policy, nw,
                                   args.event_loop, rc)
                try:
                    r = measure(work, tag, cfg, script, "/v1/completions", BODY, **load)
                    break
                except RuntimeError as e:
                    if "Address already in use" not in str(e) or attempt == 2:
                        raise
                    print(f"  {tag}: port taken meanwhile, retrying on another", flush=True)
            r["config"], r["num_workers"] = name, nw
            if nw == 1:
                r["coord_us"] = None     # in-process coordinator: its CPU is the fleet process's
            rows.append(r)
            _show(r)
    return rows


def part_stream(work: Path, urls, duration: str, warm: str) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 150}], "max_tokens": 16,
            "stream": True}
    script = lua(work, "sse", "/v1/chat/completions", body)
    direct = []
    for _ in range(2):
        direct.append(wrk(urls["sse"][0], script, 1, duration)["p50_ms"])
    port = free_port_pair()
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
    extra = (f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'bench' / 'fleet' / 'fleet.py'))} --serve-extra "
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


def scaling_md(args, rows: list[dict]) -> str:
    """The scaling table: peers first, then every splitserve path at every fleet size."""
    base = {r["num_workers"]: r["rps"] for r in rows if r["config"] == "two-leg kv_cache_aware"}
    rr1 = {r["num_workers"]: r["rps"] for r in rows if r["config"] == "aggregated round_robin"}
    out = ["| config | fleet processes | req/s | × 1 process | CPU µs/req | fleet µs/req | coordinator µs/req "
           "| kernel share | p50 ms | p99 ms | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = base if r["config"] == "two-leg kv_cache_aware" else rr1 if r["config"] == "aggregated round_robin" else {}
        x = f"{r['rps'] / ref[1]:.2f}" if ref.get(1) and r["num_workers"] != 1 else "-"
        coord = f"{r['coord_us']:.0f}" if r.get("coord_us") is not None else "-"
        fleet = f"{r['fleet_us']:.0f}" if r.get("coord_us") is not None else "-"
        out.append(f"| {r['config']} | {r['num_workers']} | {r['rps']:,.0f} | {x} | {r['us_per_req']:.0f} | {fleet} | "
                   f"{coord} | {r['sys_share']:.0%} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
    return "\n".join(out)


def header(args) -> str:
    cores = os.cpu_count()
    from bench._common import cpu_model
    cpu = cpu_model()
    load = os.getloadavg()[0]
    return (f"`python bench/fleet/fleet.py {shlex.join(args.argv)}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{cores} cores ({cpu}), Python {platform.python_version()}, load average {load:.1f} at the end; "
            f"wrk {args.wrk_threads} thread(s) × {args.conns} connections, {args.duration} per point after "
            f"{args.warmup} warm-up and a 1 s pause; mock backends are nginx `return 200` ({args.backend_workers} worker "
            "process(es)). CPU µs/req = CPU time of the router's whole process group divided by requests "
            "served; for splitserve split into its fleet processes and its coordinator process (one "
            "process: the coordinator runs inside it); kernel share = the part of that CPU time spent in "
            "the kernel (stime). `× 1 process` = req/s over the same path's one-process req/s."
            f" Interpreter speed probe (bench/_common.py `python_speed`, lower is faster): "
            f"{args.speed[0]:.1f} µs at the start, {args.speed[1]:.1f} µs at the end." + (f" Routers under test on CPUs {args.router_cpus} (splitserve: "
            "`fleet.cpu_affinity`, one CPU per process), wrk and the mock backends on CPUs "
            f"{args.load_cpus}." if args.router_cpus or args.load_cpus else ""))


def report(args, peers_md: str, prow: list[dict], rows: list[dict], stream: dict | None) -> list[tuple[str, str]]:
    """[(subsection title, body)] for the "## fleet" section of bench/RESULTS.md."""
    subs = []
    cores = os.cpu_count()
    if rows:
        subs.append((f"### Scaling · {cores} cores · wrk {args.wrk_threads}×{args.conns}",
                     header(args) + "\n\n" + scaling_md(args, rows) + "\n\nTargets (issue 13, 16 cores): two-leg "
                     "kv_cache_aware at 8 processes ≥ 5× one process and ≥ 25,000 req/s, p99 ≤ 50 ms, zero errors, "
                     "coordinator ≤ 40 µs per request; round_robin at 8 processes ≥ 7× one process."))
    if prow:
        lines = ["| router | workload | req/s | router CPU µs/req | p50 ms | p99 ms |", "|---|---|---:|---:|---:|---:|"]
        for r in sorted(prow, key=lambda r: (r["workload"], r["config"])):
            us = f"{r['us']:.0f}" if r["us"] is not None else "-"
            lines.append(f"| {r['config']} | {r['workload']} | {r['rps']:.0f} | {us} | {r['p50']:.2f} | {r['p99']:.2f} |")
        subs.append(("### Peers, same run (aggregated round robin, peer harness `bench_routers.sh`)",
                     "\n".join(lines)))
    if stream:
        subs.append(("### Streaming added latency, one connection",
                     f"SSE chat completion (4 token events + usage): direct to the backend p50 "
                     f"{stream['direct_p50_ms']:.3f} ms, through the fleet p50 {stream['fleet_p50_ms']:.3f} ms → "
                     f"**added p50 {stream['added_p50_ms']:.3f} ms** (target ≤ 2 ms)."))
    return subs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs, one rep, fewer peer configs")
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch bench/RESULTS.md")
    ap.add_argument("--peers", action="store_true", help="also run the shared peer harness (bench_routers.sh)")
    ap.add_argument("--skip-peers", action="store_true", help=argparse.SUPPRESS)   # the default now
    ap.add_argument("--skip-stream", action="store_true", help="skip the one-connection streaming latency part")
    ap.add_argument("--num-workers", default="1", help="fleet sizes for the splitserve paths, e.g. 1,2,4,8")
    ap.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (-t)")
    ap.add_argument("--conns", type=int, default=64, help="wrk connections (-c)")
    ap.add_argument("--nginx-workers", type=int, default=4,
                    help="worker processes of the nginx proxy peer (0: no nginx peer)")
    ap.add_argument("--event-loop", choices=("asyncio", "uvloop"), default=None,
                    help="fleet.event_loop of the splitserve fleets (default: the config's default)")
    ap.add_argument("--router-cpus", default=None,
                    help="CPU list (e.g. 0-9) for the routers under test: the peers run on these CPUs, the "
                         "splitserve fleets get fleet.cpu_affinity = this list (one CPU per process)")
    ap.add_argument("--load-cpus", default=None,
                    help="CPU list (e.g. 10-15) for wrk and the mock backends (default: anywhere)")
    ap.add_argument("--paths", default=None,
                    help="splitserve paths to run (default all): aggregated-round_robin, "
                         "two-leg-round_robin, two-leg-kv_cache_aware, comma-separated")
    ap.add_argument("--backend-workers", type=int, default=1, help="worker processes of the mock backends")
    ap.add_argument("--vllm-router", default=None,
                    help="command that starts vllm-router (e.g. 'vllm-router' or 'python3 DIR/vr/vr_launch.py'); "
                         "default: vllm-router when it is on PATH")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the raw rows as JSON here")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="results file whose '## fleet' section gets the subsections (default bench/RESULTS.md)")
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
    args.argv = sys.argv[1:]
    if args.serve_extra:
        args.num_workers = int(args.num_workers)
        return serve_extra(args)
    args.duration = args.duration or ("4s" if args.quick else "10s")
    args.warmup = args.warmup or ("1s" if args.quick else "2s")
    args.reps = args.reps or (1 if args.quick else 2)
    args.peer_configs = args.peer_configs or ("nginx sgl-rr vllm-rr extra" if args.quick
                                              else "direct nginx sgl-rr sgl-ca vllm-rr vllm-ca aio-1 extra")
    args.peer_workloads = args.peer_workloads or ("single sse" if args.quick else "single prefix sse")
    if args.vllm_router is None and shutil.which("vllm-router"):
        args.vllm_router = "vllm-router"
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            print(f"bench/fleet/fleet.py: {tool} is not installed (apt-get install wrk nginx; see {PEERS}/setup.sh)",
                  file=sys.stderr)
            return 1
    work = Path(tempfile.mkdtemp(prefix="splitserve-bench-fleet-"))
    print(f"bench/fleet/fleet.py: work dir {work}", flush=True)
    from bench._common import python_speed
    speed0 = python_speed()
    print(f"interpreter speed probe: {speed0:.1f} µs (bench/_common.py python_speed)", flush=True)
    peers_md, tsv = ("(not run: pass --peers)", None)
    if args.peers and not args.skip_peers:
        print("peers (shared harness, same run) ...", flush=True)
        peers_md, tsv = part_peers(work, args)
    prow = peer_rows(tsv)
    for r in prow:
        print(f"  {r['config']:18s} {r['workload']:7s} {r['rps']:8.0f} req/s  "
              f"{(r['us'] or 0):6.0f} µs CPU/req  p50 {r['p50']:.2f} ms", flush=True)
    nginx, urls = mock_backends(work, args.backend_workers, args.load_cpus)
    stream = None
    try:
        print(f"scaling: wrk -t{args.wrk_threads} -c{args.conns}, fleet sizes {args.num_workers} ...", flush=True)
        rows = part_scaling(work, urls, args)
        if not args.skip_stream:
            print("streaming latency ...", flush=True)
            stream = part_stream(work, urls, args.duration, args.warmup)
    finally:
        nginx.stop()
    args.speed = (speed0, python_speed())
    print(f"interpreter speed probe at the end: {args.speed[1]:.1f} µs", flush=True)
    subs = report(args, peers_md, prow, rows, stream)
    print("\n## fleet\n")
    for title, body in subs:
        print(title + "\n\n" + body + "\n")
    if args.json_out:
        args.json_out.write_text(json.dumps({"argv": args.argv, "cores": os.cpu_count(),
                                             "python_speed_us": list(args.speed),
                                             "rows": [{k: v for k, v in r.items() if k != "raw"} for r in rows],
                                             "stream": stream}, indent=1))
    if not args.no_write:
        from bench._common import replace_subsection
        for title, body in subs:
            replace_subsection(args.results, "fleet", title, body)
        print(f"wrote the fleet section of {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
