#!/usr/bin/env python3
"""Benchmark of the coordinator's hot path: /select + /finish over UDS and TCP.

Setup: 32 stand-in workers (one helper process: /health, /server_info, a ZMQ publisher and a
/kv_snapshot holding their cached prompt prefixes), `kv_cache_aware` on both roles, and the real
`splitserve coordinator` process pinned to one core. Clients run on the other core with
pre-computed routing keys (4k-token prompts, 256 block keys, sent as binary u64).

Phases (same run, same coordinator; phases 1-4 interleave in rounds so that each meets the same
mix of KV-index states, which keep changing as routed blocks are added):
1. closed loop, msgpack over UDS: select+finish pairs per second;
2. closed loop, msgpack over TCP;
3. closed loop, JSON over TCP with keys as a JSON list (upstream's shape) → ratio vs 1;
4. closed loop through `HttpCoordinatorClient` (aiohttp) over UDS, for reference;
5. the HTTP floor: two /finish of no lease per "pair" (the server's own per-request cost);
6. open loop at a fixed offered rate (2,000 selects/s, each followed by its finish) over UDS:
   select round-trip p50/p99 from each send's scheduled time, the sends paced by a kernel timer
   (timerfd: `asyncio.sleep` pacing started them up to ~1.2 ms late, bench/fleet/pacing.py);
7. the same closed loop and floor against the coordinator run with `--http aiohttp`;
8. with `--baseline DIR`: fresh coordinators of this tree and of DIR started together (same core,
   cluster and prompts), channel windows alternating between the two, then the open loop on each.

The load generator is a small HTTP/1.1 keep-alive client on raw asyncio transports so that the
client core is not the bottleneck being measured. Prints a table and (unless --no-write)
replaces the "## coordinator" section of bench/RESULTS.md.

    python bench/coordinator/coordinator.py            # full run (~1 minute)
    python bench/coordinator/coordinator.py --quick    # smoke run (seconds), same code paths
    python bench/coordinator/coordinator.py --baseline DIR   # also this tree's coordinator vs DIR's, alternating
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

from bench._common import replace_subsection  # noqa: E402

from bench.coordinator.coordinator_load import (ClientPool, _Bodies, _prompts, _total, open_loop,  # noqa: E402
                                    open_loop_channel)
from bench.routing.placement import BLOCK, PROMPT_TOKENS  # noqa: E402
from router.block_keys import block_keys  # noqa: E402

# Issue 13: on the fleet's channel, ≥ 15,000 select+finish pairs/s at 100% of one coordinator core
# and an open-loop p99 ≤ 2 ms at 2,000 selects/s; the HTTP rows are kept for comparison.
TARGETS = {"pairs_per_s": 15000.0, "p99_ms": 2.0}


# ---------------------------------------------------------------------------- stand-in workers

def _workers_main(n: int, seed: int, docs: int, port_file: str) -> None:
    """Helper process: n tiny workers; each caches a few documents' 3k-token prefixes."""
    import uvloop
    import zmq
    from aiohttp import web

    async def main():
        rng = np.random.default_rng(seed)
        doc_tokens = [rng.integers(0, 50_000, PROMPT_TOKENS).tolist() for _ in range(docs)]
        doc_keys = [block_keys(t, BLOCK).tolist() for t in doc_tokens]
        ctx = zmq.Context()
        urls = []
        runners = []
        pubs = []   # kept referenced: a collected PUB socket closes and its port stops listening
        for i in range(n):
            pub = ctx.socket(zmq.PUB)
            pubs.append(pub)
            pport = pub.bind_to_random_port("tcp://127.0.0.1")
            resident = []
            for d in range(i % docs, docs, max(1, n // 2)):   # each doc on ~2 servers
                resident += doc_keys[d][:192]
            info = {"role": "both", "model": "bench", "engine": "sim", "block_size": BLOCK,
                    "key_scheme": "xxh3_chain_v1", "worker_id": f"bench-{i}", "max_batch_size": 256,
                    "max_num_tokens": 16384,
                    "kv_events": {"publisher": f"tcp://127.0.0.1:{pport}", "replay": None,
                                  "topic": "kv-events", "snapshot": "/kv_snapshot", "format": "vllm"}}
            snap = msgpack.packb({"seq": -1, "block_size": BLOCK, "key_scheme": "xxh3_chain_v1",
                                  "block_keys": resident})

            def handlers(info=info, snap=snap):
                async def health(_r):
                    return web.Response(text="ok")

                async def server_info(_r):
                    return web.json_response(info)

                async def kv_snapshot(_r):
                    return web.Response(body=snap, content_type="application/msgpack")
                return health, server_info, kv_snapshot
            h, si, ks = handlers()
            app = web.Application()
            app.router.add_get("/health", h)
            app.router.add_get("/server_info", si)
            app.router.add_get("/kv_snapshot", ks)
            r = web.AppRunner(app, access_log=None)
            await r.setup()
            site = web.TCPSite(r, "127.0.0.1", 0)
            await site.start()
            runners.append(r)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        Path(port_file).write_text(json.dumps(urls))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        for r in runners:
            await r.cleanup()
        ctx.destroy(0)

    uvloop.run(main())


def inproc_cost(args, n: int = 8192, batch: int = 64) -> dict:
    """The coordinator's own CPU per select+finish (and per select_pair + both finishes), without
    sockets or other processes: the same 32 servers, indexes and prompts, channel frames decoded,
    answered and encoded by `ChannelServer.run_batch` in this process (bench/routing/placement.py)."""
    from bench.routing import placement
    return {"us_per_pair": placement.measure("select", n, batch), "pairs": n // batch * batch,
            "batch": batch, "us_per_select_pair": placement.measure("select_pair", n, batch)}


# ---------------------------------------------------------------------------- orchestration

def _pin(cpu: int | None):
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def _cluster_ready(url: str, n: int) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/cluster_info", timeout=2) as r:
            ci = json.load(r)
    except OSError:
        return False
    rows = ci["servers"]["context"]
    return ci["is_ready"] and len(rows) == n and all(
        r["healthy"] and r["kv_ready"] and r["kv_index_blocks"] > 0 for r in rows)


def _start_coordinator(conf: Path, uds: str, http: str, env: dict, cpu: int | None, servers: int,
                       root: Path = ROOT):
    """`root`: the checkout whose coordinator runs (another one for `--baseline`)."""
    if root != ROOT:
        env = {**env, "PYTHONPATH": os.pathsep.join(
            p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "splitserve_cli", "coordinator", "-c", str(conf),
                             "--port", "0", "--uds", uds, "--http", http], env=env, cwd=root, text=True,
                            stdout=subprocess.PIPE, preexec_fn=_pin(cpu))
    line = proc.stdout.readline().strip()
    if not line.startswith("splitserve coordinator listening on "):
        proc.kill()
        raise RuntimeError(f"coordinator did not start: {line!r}")
    tcp_url = line.split("listening on ", 1)[1].split(" and ")[0]
    deadline = time.monotonic() + 60
    while not _cluster_ready(tcp_url, servers):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("cluster did not become ready with loaded KV indexes")
        time.sleep(0.1)
    host, port = tcp_url.rsplit("//", 1)[1].rsplit(":", 1)
    return proc, {"uds": uds, "pid": proc.pid}, {"uds": None, "host": host, "port": int(port), "pid": proc.pid}


def _stop(p) -> None:
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _ab(args, pool, conf: Path, env: dict, cpu, tmp: Path, bodies) -> dict:
    """A fresh coordinator of this tree against one of `--baseline`, both started together on the
    same core and cluster (so their speculative entries age alike): channel windows alternating
    between the two, round by round (the box's noise shared), then the open loop on each; CPU µs
    per pair per window."""
    import uvloop
    uds = str(tmp / "coord-ab.sock")
    base_uds = str(tmp / "coord-baseline.sock")
    this, uds_t, _ = _start_coordinator(conf, uds, "fast", env, cpu, args.servers)
    base = None
    try:
        base, base_t, _ = _start_coordinator(conf, base_uds, "fast", env, cpu, args.servers,
                                             root=Path(args.baseline).resolve())
        for t in (uds_t, base_t):       # fill both indexes with routed blocks first
            pool.window("select", t, min(2.0, args.seconds / 2))
        trees = {"this tree": (uds_t, "unix://" + uds), "baseline": (base_t, "unix://" + base_uds)}
        wins: dict[str, list] = {t: [] for t in trees}
        for r in range(args.rounds):
            for t in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                target, url = trees[t]
                wins[t].append(pool.window("channel", target, args.seconds / args.rounds, url=url))
        out = {"rounds": args.rounds, "baseline_dir": str(args.baseline)}
        for t, ws in wins.items():
            us = [w["cpu_s"] / w["pairs"] * 1e6 for w in ws if w["pairs"]]
            out[t] = {**_total(ws), "us_per_pair": [round(u, 1) for u in us],
                      "median_us": float(np.median(us)) if us else float("nan")}
        for t, (_target, url) in trees.items():
            out[t]["open"] = uvloop.run(open_loop_channel(url, bodies.keys, args.rate,
                                                          args.rate_seconds, (1 << 52) + (t == "baseline")
                                                          * (1 << 48)))
        return out
    finally:
        _stop(base)
        _stop(this)


def bench_env() -> dict:
    """ROOT first, and whatever PYTHONPATH the caller set (staged wheels on the GPU host) after it."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                        if p)}


def start_workers(n: int, docs: int, env: dict, cpu: int | None, tmp: Path):
    """(process, urls): the helper process serving ``n`` stand-in workers, once they listen."""
    port_file = tmp / "workers.json"
    helper = subprocess.Popen([sys.executable, __file__, "--_workers", str(n), "--_docs", str(docs),
                               "--_port-file", str(port_file)], env=env, cwd=ROOT, preexec_fn=_pin(cpu))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if helper.poll() is not None or time.monotonic() > deadline:
            _stop(helper)
            raise RuntimeError("stand-in workers did not start")
        time.sleep(0.05)
    return helper, json.loads(port_file.read_text())


def cluster_conf(tmp: Path, urls: list[str], router: dict) -> Path:
    """The coordinator's config: every stand-in worker in both roles under ``router``."""
    conf = tmp / "cluster.yaml"
    conf.write_text(json.dumps({
        "context_servers": {"urls": urls, "router": router},
        "generation_servers": {"urls": urls, "router": router},
        "leases": {"ttl_s": 60.0},
        "log_level": "warning",
    }))
    return conf


def run(args) -> dict:
    import uvloop

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    coord_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    tmp = Path(tempfile.mkdtemp(prefix="splitserve-bench-coord-"))
    env = bench_env()
    helper, urls = start_workers(args.servers, args.docs, env, client_cpu, tmp)
    coord = None
    try:
        conf = cluster_conf(tmp, urls, {"type": "kv_cache_aware"})
        if client_cpu is not None:
            os.sched_setaffinity(0, {client_cpu})
        res: dict = {}
        pool = ClientPool(args, client_cpu)
        try:
            uds = str(tmp / "coord.sock")
            coord, uds_t, tcp_t = _start_coordinator(conf, uds, "fast", env, coord_cpu, args.servers)
            # Phases interleave in rounds: the KV index keeps filling with routed blocks as the
            # run goes on, so back-to-back phases would each meet a different index.
            phases = {"channel_uds": ("channel", uds_t, "unix://" + uds, False),
                      "uds_msgpack": ("select", uds_t, None, False),
                      "tcp_msgpack": ("select", tcp_t, None, False),
                      "tcp_json": ("select", tcp_t, None, True),
                      "client_uds": ("client", uds_t, "unix://" + uds, False)}
            wins: dict[str, list] = {k: [] for k in phases}
            pool.window("select", uds_t, min(2.0, args.seconds / 2))       # fill the index first
            for _ in range(args.rounds):
                for name, (kind, target, url, js) in phases.items():
                    wins[name].append(pool.window(kind, target, args.seconds / args.rounds,
                                                  url=url, json_body=js))
            for name in phases:
                res[name] = _total(wins[name])
            res["floor_uds"] = _total([pool.window("floor", uds_t, args.seconds / 2)])
            mp_bodies = _Bodies(_prompts(args.seed, args.docs, args.prompts), False)
            res["open_uds"] = uvloop.run(open_loop(uds_t, mp_bodies, args.rate, args.rate_seconds,
                                                   1 << 50))
            res["open_channel"] = uvloop.run(open_loop_channel("unix://" + uds, mp_bodies.keys,
                                                               args.rate, args.rate_seconds, 1 << 51))
            _stop(coord)
            if args.baseline:
                res["ab"] = _ab(args, pool, conf, env, coord_cpu, tmp, mp_bodies)
            if not args.skip_aiohttp:
                uds2 = str(tmp / "coord-aiohttp.sock")
                coord, uds_t, _ = _start_coordinator(conf, uds2, "aiohttp", env, coord_cpu,
                                                     args.servers)
                pool.window("select", uds_t, min(2.0, args.seconds / 2))
                res["aiohttp_uds"] = _total([pool.window("select", uds_t, args.seconds)])
                res["aiohttp_floor"] = _total([pool.window("floor", uds_t, args.seconds / 2)])
                _stop(coord)
        finally:
            pool.close()

        res["inproc"] = inproc_cost(args)
        res["setup"] = {"servers": args.servers, "prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK,
                        "conns": args.conns, "client_procs": args.client_procs, "rounds": args.rounds,
                        "seconds": args.seconds, "coord_cpu": coord_cpu,
                        "client_cpu": client_cpu, "cpus": len(cpus), "load": os.getloadavg()}
        return res
    finally:
        _stop(coord)
        _stop(helper)


def render(res: dict, quick: bool) -> list[str]:
    s = res["setup"]
    u, t, j, cl, o = (res["uds_msgpack"], res["tcp_msgpack"], res["tcp_json"], res["client_uds"],
                      res["open_uds"])
    ch, oc = res["channel_uds"], res["open_channel"]
    ratio = u["pairs_per_s"] / j["pairs_per_s"] if j["pairs_per_s"] else float("nan")

    def cpu_us(r):
        return r["coord_cpu"] / r["pairs_per_s"] * 1e6 if r["pairs_per_s"] else float("nan")
    cpu_ratio = cpu_us(j) / cpu_us(u)
    pin = (f"coordinator pinned to CPU {s['coord_cpu']}, clients + stand-in workers on CPU {s['client_cpu']}"
           if s["coord_cpu"] is not None else "no CPU pinning (fewer than 2 CPUs)")
    ch_core = 1e6 / cpu_us(ch) if ch["pairs_per_s"] else 0.0
    ok_pairs = "✅" if ch_core >= TARGETS["pairs_per_s"] else "❌"
    ok_p99 = "✅" if oc["p99_ms"] <= TARGETS["p99_ms"] else "❌"
    lines = [
        "## coordinator",
        "",
        f"`python bench/coordinator/coordinator.py{' --quick' if quick else ''}` — "
        f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"{s['cpus']} CPUs, Python {platform.python_version()}; {pin}; load average at the end "
        f"{s['load'][0]:.1f} (the box is shared: compare CPU µs per pair across runs).",
        f"{s['servers']} servers, `kv_cache_aware` on both roles, {s['prompt_tokens']}-token prompts "
        f"({s['prompt_tokens'] // s['block_size']} block keys, precomputed by the client), stand-in "
        "workers whose KV indexes were loaded from `/kv_snapshot`; "
        f"{s['conns']} closed-loop connections over {s['client_procs']} client processes, "
        f"{s['seconds']:g}s per phase in {s['rounds']} interleaved rounds.",
        "",
        "| phase | select+finish pairs/s | coordinator CPU | CPU µs per pair | errors |",
        "|---|---|---|---|---|",
        *(f"| {label} | {r['pairs_per_s']:,.0f} | {r['coord_cpu']:.0%} | "
          f"{r['coord_cpu'] / r['pairs_per_s'] * 1e6 if r['pairs_per_s'] else float('nan'):,.0f} | {r['errors']} |"
          for label, r in (("**fleet channel over UDS** (`ChannelClient`, 64 in flight per client "
                            "process, finishes queued)", ch),
                           ("msgpack over UDS (raw HTTP/1.1 client)", u), ("msgpack over TCP", t),
                           ("JSON over TCP, keys as a JSON list (upstream's shape)", j),
                           ("`HttpCoordinatorClient(channel=False)` (aiohttp) over UDS", cl),
                           ("HTTP floor: two `/finish` of no lease, UDS", res["floor_uds"]),
                           *((("same, msgpack over UDS, `--http aiohttp` server", res["aiohttp_uds"]),
                              ("same, HTTP floor, `--http aiohttp` server", res["aiohttp_floor"]))
                             if "aiohttp_uds" in res else ()))),
        "",
        f"msgpack/UDS vs JSON/TCP: **{ratio:.2f}×** the pairs per second, **{cpu_ratio:.2f}×** less "
        f"coordinator CPU per pair (the ratio that survives a shared box); at 100% of one core "
        f"that is {1e6 / cpu_us(u):,.0f} vs {1e6 / cpu_us(j):,.0f} pairs/s.",
        "",
        f"Fleet channel vs HTTP msgpack/UDS: **{cpu_us(u) / cpu_us(ch):.2f}×** less coordinator CPU per "
        f"pair; at 100% of one core the channel is {ch_core:,.0f} pairs/s.",
        "",
        f"In-process, no sockets (`ChannelServer.run_batch` on the same 32 servers and indexes, "
        f"batches of {res['inproc']['batch']}, {res['inproc']['pairs']:,} pairs, CPU time of one thread): "
        f"**{res['inproc']['us_per_pair']:.1f} CPU µs per select+finish** = "
        f"{1e6 / res['inproc']['us_per_pair']:,.0f} pairs/s per core — the placement itself, what "
        "the channel leaves of the per-call cost; one `select_pair` with both finishes (a two-leg "
        f"request): **{res['inproc']['us_per_select_pair']:.1f} CPU µs**. Against another tree: "
        "`python bench/routing/placement.py --baseline DIR`.",
        "",
        f"Open loop over the fleet channel (UDS) at {oc['rate']:,.0f} selects/s, {oc['n']:,} selects, "
        f"finish queued on each answer: select round trip p50 **{oc['p50_ms']:.3f} ms**, p90 "
        f"{oc['p90_ms']:.3f} ms, p99 **{oc['p99_ms']:.3f} ms**, max {oc['max_ms']:.2f} ms from each "
        f"select's scheduled send time ({oc['errors']} errors, {oc['late_sends']} sends >1 ms late); from the "
        f"call into the channel client (the client's own late starts left out): p50 "
        f"{oc['wire_p50_ms']:.3f} ms, p99 {oc['wire_p99_ms']:.3f} ms.",
        "",
        f"Open loop over HTTP/UDS at {o['rate']:,.0f} selects/s (each followed by its finish), {o['n']:,} selects: "
        f"select round trip p50 **{o['p50_ms']:.3f} ms**, p90 {o['p90_ms']:.3f} ms, "
        f"p99 **{o['p99_ms']:.3f} ms**, max {o['max_ms']:.2f} ms, measured from each select's "
        f"scheduled send time ({o['errors']} errors, {o['late_sends']} sends >1 ms late); from the "
        f"actual send: p50 {o['wire_p50_ms']:.3f} ms, p99 {o['wire_p99_ms']:.3f} ms.",
        "",
        *(_render_ab(res["ab"]) if "ab" in res else ()),
        "| target | measured | |",
        "|---|---|---|",
        f"| ≥ {TARGETS['pairs_per_s']:,.0f} pairs/s at 100% of one core (channel) | {ch_core:,.0f} "
        f"({cpu_us(ch):.1f} CPU µs per pair) | {ok_pairs} |",
        f"| p99 ≤ {TARGETS['p99_ms']:g} ms at {oc['rate']:,.0f}/s (channel, open loop) | {oc['p99_ms']:.3f} ms | {ok_p99} |",
    ]
    return lines


def _render_ab(ab: dict) -> list[str]:
    t, b = ab["this tree"], ab["baseline"]
    lines = [f"Against `--baseline {ab['baseline_dir']}` (fresh coordinators of both trees started "
             f"together on the same core and cluster, channel windows alternating over {ab['rounds']} "
             "rounds; CPU µs per pair per window):",
             "",
             "| tree | channel pairs/s | CPU µs per pair (median) | windows | open loop p50 / p99 ms |",
             "|---|---:|---:|---|---:|"]
    for name, r in (("this tree", t), ("baseline", b)):
        o = r["open"]
        lines.append(f"| {name} | {r['pairs_per_s']:,.0f} | {r['median_us']:.1f} | "
                     f"{', '.join(f'{u:.0f}' for u in r['us_per_pair'])} | "
                     f"{o['p50_ms']:.3f} / {o['p99_ms']:.3f} ({o['errors']} errors) |")
    lines += ["", f"Baseline / this tree, CPU µs per pair: **{b['median_us'] / t['median_us']:.2f}×**.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short phases: a smoke run in seconds")
    ap.add_argument("--no-write", action="store_true", help="do not touch bench/RESULTS.md")
    ap.add_argument("--servers", type=int, default=32)
    ap.add_argument("--docs", type=int, default=64, help="distinct shared prompt prefixes")
    ap.add_argument("--prompts", type=int, default=512, help="distinct precomputed prompts")
    ap.add_argument("--conns", type=int, default=16, help="closed-loop connections (in total)")
    ap.add_argument("--client-procs", type=int, default=2,
                    help="client processes sharing the closed-loop connections")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved rounds of the closed-loop phases (default 4, quick 1)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per closed-loop phase")
    ap.add_argument("--rate", type=float, default=2000.0, help="open-loop selects per second")
    ap.add_argument("--rate-seconds", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-aiohttp", action="store_true",
                    help="skip the comparison run against the aiohttp-served coordinator")
    ap.add_argument("--baseline", default=None,
                    help="another checkout's root: its coordinator against this tree's, channel "
                         "windows alternating (e.g. `git archive REV | tar -x -C DIR`)")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--_workers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_docs", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--_port-file", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._workers:
        _workers_main(a._workers, a.seed, a._docs, a._port_file)
        return 0
    a.rounds = a.rounds or (1 if a.quick else 4)
    if a.quick:
        a.seconds = a.seconds or 1.0
        a.rate_seconds = a.rate_seconds or 1.0
        a.prompts = min(a.prompts, 64)
    else:
        a.seconds = a.seconds or 8.0
        a.rate_seconds = a.rate_seconds or 10.0
    t0 = time.perf_counter()
    res = run(a)
    lines = render(res, a.quick)
    print("\n".join(lines))
    print(f"\n(total {time.perf_counter() - t0:.1f}s)")
    if not a.no_write:
        # its own subsection per machine size: the section also holds other runs' subsections
        title = f"### coordinator · {res['setup']['cpus']} cores · latest `bench/coordinator/coordinator.py` run"
        replace_subsection(a.results, "coordinator", title, "\n".join(lines[2:]))
        print(f"wrote '{title}' in the coordinator section of {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
