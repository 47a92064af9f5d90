#!/usr/bin/env python3
"""Routing quality on a real trace: Mooncake-format replay through the fleet and coordinator.

`--engine sim` workers (aggregated: generation servers only, so routing is the one variable) with
a finite KV pool and the H200 `1b` latency model (bench/routing/_trace.py), one external coordinator
process and one fleet process per policy; the trace is replayed open-loop at its own arrival
times divided by `--compress`, streaming, and every number comes from what the workers reported
(`usage.prompt_tokens_details.cached_tokens`) and what the client saw (first token, last token).

Policies: round_robin, load_balancing (requests; tokens), kv_cache_aware (defaults and each
`--kv-grid` setting), conversation (implicit sessions), and `oracle` — outside the product: the
harness subscribes to every worker's KV events (its true cache) and knows every request's state
(its true load), places each request on the worker with the least queued prefill work including
its own uncached tokens, and sends it to that worker directly.

Scaling, all stated in the report: root sampling (`--sample K`: the requests whose first block
id is 0 mod K, whole prefix trees kept), `--tokens-per-block T` synthetic tokens per 512-token
trace block (per-token costs scaled by 512/T), `--dilation D` (every latency x D on the wall
clock; numbers are reported divided by D, so the 2-core host's own overhead counts D x less).

Usage: python bench/routing/routing.py [--trace FILE] [--workers 8,32] [--quick] [--no-write]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

import aiohttp  # noqa: E402
import yaml  # noqa: E402

from bench.routing import _trace as T  # noqa: E402
from bench._common import cpu_model, replace_section  # noqa: E402
from bench.routing import _conversations as C  # noqa: E402
from bench.routing import _routing_bound as RB  # noqa: E402
from bench.routing._routing_oracle import Oracle  # noqa: E402
from splitserve_testing import Proc, free_port, serves, wait_http  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
OUTDIR = ROOT / "bench" / "results"
PY = sys.executable
BLOCK = 16
KV_DEFAULTS: dict = {}
KV_GRID = [  # the search around the time cost's defaults, and the token cost it replaced
    {"uncached_weight": 1.0},
    {"uncached_weight": 3.0},
    {"hotspot_factor": None},
    {"cost": "tokens"},
    {"load_tokens_weight": 0.25, "hotspot_factor": 1.5, "hotspot_slack": 1.0},
]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def post(url: str, body: dict, timeout: float = 10.0) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


class WorkerGone(RuntimeError):
    """A sim worker of this run stopped serving: which one, its exit code and the end of its log."""


class Procs:
    """Child processes (splitserve_testing.Proc), each in its own session, stopped by pid; the
    sim workers also by the url each serves (`workers`), for saying which one failed and how."""

    def __init__(self, work: Path):
        self.work = work
        self.procs: list[Proc] = []
        self.workers: dict[str, Proc] = {}

    def spawn(self, name: str, argv: list[str]) -> Proc:
        p = Proc(name, argv, self.work / f"{name}.log")
        self.procs.append(p)
        return p

    def wait_http(self, url: str, p: Proc, timeout: float = 90) -> None:
        # served_by: the answer must come from `p`. The cells of --jobs pick their ports side by
        # side, each free when picked; a process of another cell that bound the same port first
        # answered /health in place of ours, which exited on EADDRINUSE, and this cell then used
        # the other cell's worker until that cell stopped it: "Connection refused" mid-cell (what
        # stopped two 32-worker cells of f900f66's judged run, by their timing; logs not kept).
        wait_http(url, timeout, p, served_by=p)

    def worker_report(self, url: str) -> str:
        """What became of the worker at `url`: its process, exit code and the end of its log."""
        p = self.workers.get(url)
        if p is None:
            return f"no worker process of this run was started for {url}"
        rc = p.returncode
        if rc is None:
            port = int(url.rsplit(":", 1)[1])
            state = f"still runs, {'listening' if serves(p, port) else 'not listening'} on its port"
        else:
            state = f"exited with code {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 else "")
        return (f"sim worker {p.name} at {url} (pid {p.pid}) {state}; the end of its log "
                f"({p.log_path}):\n{p.tail(20)}")

    def check_workers(self, urls: list[str], when: str) -> None:
        """Raise WorkerGone naming every worker of `urls` whose process has exited."""
        gone = [u for u in urls if u in self.workers and not self.workers[u].alive()]
        if gone:
            raise WorkerGone(f"{len(gone)} of {len(urls)} sim workers exited {when}:\n"
                             + "\n".join(self.worker_report(u) for u in gone))

    @contextlib.contextmanager
    def calling(self, url: str, what: str):
        """A call to the worker at `url`: a failure to reach it (refused, reset, timed out) is
        raised as WorkerGone with what became of its process."""
        try:
            yield
        except OSError as e:    # urllib's URLError and the socket errors are OSErrors
            raise WorkerGone(f"{what} {url} failed ({e}); {self.worker_report(url)}") from e

    def stop(self, p: Proc) -> None:
        p.stop(15)
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p)


def start_workers(procs: Procs, n: int, num_blocks: int, args, model: str = "1b") -> list[str]:
    flags = T.sim_flags(args.tokens_per_block, args.dilation)

    def spawn(k: int, attempt: int) -> tuple[str, Proc]:
        port = free_port()
        argv = [PY, "-m", "splitserve_cli", "worker", "--engine", "sim", "--role", "both",
                "--model", model, "--host", "127.0.0.1", "--port", str(port),
                "--block-size", str(BLOCK), "--num-blocks", str(num_blocks),
                "--max-batch-size", str(args.max_batch_size), "--log-level", "WARNING", *flags]
        if args.no_reuse_worker and k == 0:
            argv += ["--sim-prefix-reuse", "off"]
        return f"http://127.0.0.1:{port}", procs.spawn(f"worker-{n}-{k}-{attempt}", argv)

    started = [spawn(k, 0) for k in range(n)]
    urls = []
    for k, (u, p) in enumerate(started):
        for attempt in range(1, 4):
            try:
                procs.wait_http(u + "/health", p)
                break
            except RuntimeError as e:
                # a port picked free can be taken by another worker's KV-event socket meanwhile
                if "Address already in use" not in str(e) or attempt == 3:
                    raise
                u, p = spawn(k, attempt)
        urls.append(u)
        procs.workers[u] = p
    return urls


def start_front(procs: Procs, work: Path, urls: list[str], policy: str, rargs: dict,
                model: str = "1b"):
    """An external coordinator and one fleet process for `policy` → (fleet url, coord url, procs).
    A port picked free and taken meanwhile (cells of `--jobs` start processes side by side) is
    tried again with new ports."""
    for attempt in range(1, 4):
        before = list(procs.procs)
        try:
            return _start_front(procs, work, urls, policy, rargs, model)
        except RuntimeError as e:
            for p in [p for p in procs.procs if p not in before]:
                procs.stop(p)
            if "Address already in use" not in str(e) or attempt == 3:
                raise


def _start_front(procs: Procs, work: Path, urls: list[str], policy: str, rargs: dict,
                 model: str = "1b"):
    doc = {"hostname": "127.0.0.1", "model": model, "request_timeout": 600,
           "generation_servers": {"urls": [u.removeprefix("http://") for u in urls],
                                  "router": {"type": policy, **rargs}},
           "routing": {"block_size": BLOCK}}
    cport, fport = free_port(), free_port()
    ccfg = work / f"coord-{cport}.yaml"
    # max_queue_delay_s: the coordinator sheds placements that waited behind a saturated event
    # loop; here a host running several cells at once would turn its own contention into errors
    # that say nothing about the policy
    ccfg.write_text(yaml.safe_dump(dict(doc, port=cport + 1,
                                        coordinator={"health_check_interval_s": 1.0,
                                                     "max_queue_delay_s": 2.0})))
    coord = procs.spawn(f"coord-{policy}-{cport}", [PY, "-m", "splitserve_cli", "coordinator",
                                                    "-c", str(ccfg), "--host", "127.0.0.1",
                                                    "--port", str(cport)])
    curl = f"http://127.0.0.1:{cport}"
    procs.wait_http(curl + "/health", coord)
    fcfg = work / f"fleet-{fport}.yaml"
    fcfg.write_text(yaml.safe_dump(dict(doc, port=fport, fleet={"max_body_bytes": 16 << 20,
                                                                "route_header": "full"})))
    fleet = procs.spawn(f"fleet-{policy}-{fport}", [PY, "-m", "splitserve_cli", "serve", "-c",
                                                    str(fcfg), "--coordinator-url", curl])
    furl = f"http://127.0.0.1:{fport}"
    procs.wait_http(furl + "/health", fleet)
    return furl, curl, (fleet, coord)


async def _one(session, url: str, r: T.Req, ids: list[int], at: float, oracle: Oracle | None,
               res: T.Result, model: str) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, at - loop.time()))
    body = {"model": model, "prompt": ids, "max_tokens": r.output_length, "stream": True,
            "stream_options": {"include_usage": True}}
    target = url
    if oracle is not None:
        res.server, res.matched_tokens = oracle.place(res.i, ids)
        target = res.server
    res.t_send = time.perf_counter()
    try:
        async with session.post(target + "/v1/completions", json=body) as resp:
            res.status = resp.status
            route = resp.headers.get("x-splitserve-route")
            if route:
                g = json.loads(route).get("generation") or {}
                res.server, res.matched_tokens = g.get("server"), g.get("matched_tokens", 0)
                rows = [c for c in g.get("candidates") or () if "matched_tokens" in c]
                if rows:    # the deepest match, and why it was not chosen (--work's dump)
                    best = max(rows, key=lambda c: c["matched_tokens"])
                    # reason: says whether the pick was the (implicit) session's server
                    res.extra = {"best_match": best["matched_tokens"], "best_why": best.get("why"),
                                 "hot": g.get("hot"), "reason": g.get("reason")}
            if resp.status != 200:
                res.error = (await resp.read())[:200].decode(errors="replace")
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = json.loads(line[6:])
                if ev.get("error"):
                    res.error = str(ev["error"])[:200]
                if ev.get("choices") and res.t_first is None:
                    res.t_first = time.perf_counter()
                    if oracle is not None:
                        oracle.first_token(res.i)
                u = ev.get("usage")
                if u:
                    res.completion_tokens = u.get("completion_tokens", 0)
                    res.prompt_tokens = u.get("prompt_tokens", 0)
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            res.t_end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        if oracle is not None:
            oracle.done(res.i)


async def replay(url: str, reqs: list[T.Req], tokens: T.Tokens, args,
                 oracle: Oracle | None = None, model: str = "1b") -> list[T.Result]:
    prompts = [tokens.prompt(r) for r in reqs]
    results = [T.Result(i=k) for k in range(len(reqs))]
    # keep-alive under the fleet's own (server_keep_alive_timeout, 10 s): aiohttp's 15 s default
    # reused connections the fleet had just closed ('Server disconnected' on a conversation's
    # next turn after a think time, one request in ~2,000)
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = asyncio.get_running_loop().time() + 0.5
        scale = args.dilation / args.compress
        await asyncio.gather(*(_one(s, url, r, ids, t0 + r.t_s * scale, oracle, res, model)
                               for r, ids, res in zip(reqs, prompts, results)))
    return results


def worker_state(urls: list[str], procs: Procs) -> dict:
    """Requests running and blocks pinned/used on every worker (all must be 0 when idle)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {"running": 0, "pinned": 0, "used": 0}
    for u in urls:
        with procs.calling(u, "GET /metrics of"):
            text = get(u + "/metrics").decode()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name == "splitserve_worker_num_requests_running":
                    out["running"] += int(smp.value)
                elif smp.name == "splitserve_worker_kv_blocks" and smp.labels.get("state") in ("pinned", "used"):
                    out[smp.labels["state"]] += int(smp.value)
    return out


def reset_workers(urls: list[str], procs: Procs) -> None:
    for u in urls:
        with procs.calling(u, "POST /reset_prefix_cache to"):
            post(u + "/reset_prefix_cache", {"reason": "bench"})


def run_policy(procs: Procs, work: Path, urls: list[str], name: str, policy: str, rargs: dict,
               reqs, tokens, args) -> dict:
    reset_workers(urls, procs)
    t = time.time()
    if policy == "oracle":
        oracle = Oracle(urls, BLOCK, rargs.get("cache_weight", args.oracle_cache_weight),
                        T.sim_model(args.tokens_per_block, args.dilation),
                        args.blocks_per_worker * BLOCK)
        asyncio.run(_with_oracle(oracle, reqs, tokens, args))
        results, diag, leases = oracle.results, None, {"context": 0, "generation": 0}
        lease_stats = None
    else:
        furl, curl, front = start_front(procs, work, urls, policy, rargs)
        results = asyncio.run(replay(furl, reqs, tokens, args))
        time.sleep(1.2)   # one diagnostics check period
        ci = json.loads(get(curl + "/cluster_info"))
        leases = ci["leases"]["in_flight"]
        lease_stats = {k: ci["leases"].get(k) for k in ("first_tokens_total",
                                                         "prefill_timeouts_total")}
        diag = {s["url"]: s.get("routing_prediction") for s in ci["servers"]["generation"]}
        for p in front:
            procs.stop(p)
    # a worker that died mid-replay shows as errors in the row; the cell stops here instead, saying which
    procs.check_workers(urls, f"while {name} was replayed")
    s = T.summarize(results, urls, args.dilation)
    s.update(tree_moves(reqs, results))
    if args.work:   # per request, for a look at where each prefix tree went
        tag = "".join(c if c.isalnum() or c in "_." else "-" for c in name)[:80].strip("-")
        with open(Path(args.work) / f"requests-{tag}-{len(urls)}-{args.compress:g}.jsonl", "w") as f:
            for q, r in zip(reqs, results):
                f.write(json.dumps({"i": q.i, "t": q.t_s, "root": q.session if q.session is not None else (q.hash_ids or [None])[0],
                                    "n": r.prompt_tokens, "server": r.server, "predicted": r.matched_tokens,
                                    "cached": r.cached_tokens, "ttft": (r.t_first - r.t_send) / args.dilation
                                    if r.t_first else None, **r.extra}) + "\n")
    s.update(name=name, policy=policy, args=rargs, wall_s=round(time.time() - t, 1),
             leases_in_flight=leases, workers_after=worker_state(urls, procs), coordinator_prediction=diag,
             coordinator_leases=lease_stats)
    print(f"  {name:<34} hit {s['hit_ratio']:.3f}  TTFT p50 {s['ttft_p50_ms']:8.1f} ms  "
          f"p99 {s['ttft_p99_ms']:9.1f}  TPOT p50 {s['tpot_p50_ms']:6.2f} p99 {s['tpot_p99_ms']:6.2f}"
          f"  hotspot {s['hotspot']:.2f}  moves {s['moves']:.2f}  err {s['errors']}  ({s['wall_s']} s)",
          flush=True)
    return s


def tree_moves(reqs, results) -> dict:
    """How often a prefix tree's (a conversation's) next request left the server of its previous one (`moves`: the
    share of the requests that follow an earlier one of their tree), and the mean number of servers
    a tree used (`servers_per_tree`, over trees of 2 requests or more): what a policy's cache
    affinity does, apart from how the caches then fared."""
    last: dict = {}
    used: dict = {}
    count: dict = {}
    follow = moved = 0
    for q, r in sorted(zip(reqs, results), key=lambda x: x[0].t_s):
        if not q.hash_ids or r.server is None:
            continue
        root = q.hash_ids[0] if q.session is None else ("s", q.session)
        if root in last:
            follow += 1
            moved += last[root] != r.server
        last[root] = r.server
        used.setdefault(root, set()).add(r.server)
        count[root] = count.get(root, 0) + 1
    trees = [len(v) for k, v in used.items() if count[k] > 1]
    return {"moves": moved / follow if follow else 0.0,
            "servers_per_tree": sum(trees) / len(trees) if trees else 0.0}


async def _with_oracle(oracle: Oracle, reqs, tokens, args) -> None:
    await oracle.start()
    try:
        oracle.results = await replay("", reqs, tokens, args, oracle=oracle)
    finally:
        await oracle.stop()


def policies(args) -> list[tuple[str, str, dict]]:
    out = [("round_robin", "round_robin", {}),
           ("load_balancing (requests)", "load_balancing", {}),
           ("load_balancing (tokens)", "load_balancing", {"use_tokens": True}),
           ("kv_cache_aware (defaults)", "kv_cache_aware", dict(KV_DEFAULTS))]
    if not args.quick:
        grid = json.loads(args.kv_grid) if args.kv_grid else KV_GRID
        out += [(f"kv_cache_aware {json.dumps(g, separators=(',', ':'))}", "kv_cache_aware", g)
                for g in grid]
    out += [("conversation", "conversation", {}), ("oracle (outside the product)", "oracle", {})]
    if args.policies:   # types or row names, ';'-separated (row names hold commas)
        keep = set(args.policies.split(";" if ";" in args.policies else ","))
        out = [p for p in out if p[1] in keep or p[0] in keep]
    return out


# Arrival compression at 8 workers per trace and offered load (scaled by workers/8 with
# --per-worker-load): "light" keeps round robin's TTFT p50 under ~1 s, "heavy" is near saturation
# (queues grow under round robin, while a router that reuses caches still keeps up).
LOADS = {"synthetic": {"light": 100.0, "heavy": 160.0},
         "conversations": {"light": 40.0, "heavy": 60.0}}
# KV capacity of the cluster as a share of each trace's working set (--kv-ratio overrides). The
# conversations' working set is small for their concurrency (every running request pins its
# whole history), so half of it would leave no room to cache anything.
KV_RATIO = {"synthetic": 0.5, "conversations": 1.0}


def run_size(n: int, args, trace: str, reqs, tokens, work: Path, loads: list[str]) -> list[dict]:
    """Every load of one trace on one cluster of `n` workers (started once; caches reset per
    policy) → one run record per load."""
    dil = args.dilation * n / 8 if args.per_worker_load else args.dilation
    ws = T.working_set_blocks(reqs, args.tokens_per_block, BLOCK)
    # at least twice the longest prompt, so every request fits a worker's pool
    longest = max(len(tokens.prompt(r)) for r in reqs) // BLOCK + 1
    kv_ratio = args.kv_ratio if args.kv_ratio is not None else KV_RATIO[trace]
    per_worker = max(2 * longest, int(ws * kv_ratio / n))
    bound = RB.affinity_bound(reqs, n, per_worker, args.tokens_per_block, BLOCK)
    runs = []
    procs = Procs(work)
    try:
        urls = start_workers(procs, n, per_worker, argparse.Namespace(**{**vars(args), "dilation": dil}))
        for load in loads:
            c = args.compress if args.compress is not None else LOADS[trace][load]
            a = argparse.Namespace(**{**vars(args), "dilation": dil, "blocks_per_worker": per_worker,
                                      "compress": c * n / 8 if args.per_worker_load else c})
            print(f"{trace} · {load} · {n} workers, {len(reqs)} requests, working set {ws} blocks, "
                  f"{per_worker} blocks per worker, compress {a.compress:g}, dilation {dil:g}; "
                  f"affinity bound {bound['hit_ratio']:.3f}", flush=True)
            rows = [run_policy(procs, work, urls, name, pol, ra, reqs, tokens, a)
                    for name, pol, ra in policies(args)]
            runs.append({"trace": trace, "load": load, "workers": n, "requests": len(reqs),
                         "working_set_blocks": ws, "kv_ratio_effective": per_worker * n / ws,
                         "compress": a.compress, "dilation": dil, "blocks_per_worker": per_worker,
                         "affinity_bound": bound, "rows": rows})
    finally:
        procs.stop_all()
    return runs


def load_trace(name: str, args, work: Path) -> tuple[list, dict]:
    """(requests, how they were made) of a named trace."""
    if name == "synthetic":
        reqs = T.load(args.trace, sample=args.sample, limit=args.limit)
        info = {"file": str(args.trace), "sample": args.sample}
    elif name == "conversations":
        spec = C.ConversationSpec(sessions=args.conv_sessions, seed=args.conv_seed)
        path = C.write(spec, work / "conversations.jsonl")
        reqs = T.load(path, limit=args.limit)
        info = {"generator": "bench/routing/_conversations.py", "spec": asdict(spec),
                **C.describe(C.generate(spec))}
    else:
        raise SystemExit(f"unknown trace {name!r}: expected synthetic or conversations")
    if args.max_output:
        for r in reqs:
            r.output_length = min(r.output_length, args.max_output)
    return reqs, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="synthetic,conversations",
                    help="synthetic (the Mooncake trace, --trace) and/or conversations (generated)")
    ap.add_argument("--trace", type=Path, default=T.DEFAULT_TRACE)
    ap.add_argument("--conv-sessions", type=int, default=C.ConversationSpec.sessions)
    ap.add_argument("--conv-seed", type=int, default=0)
    ap.add_argument("--workers", default="8,32", help="cluster sizes, comma-separated")
    ap.add_argument("--loads", default="light,heavy", help="offered loads (LOADS), comma-separated")
    ap.add_argument("--sample", type=int, default=8, help="synthetic: keep 1/K of the prefix trees")
    ap.add_argument("--per-worker-load", action=argparse.BooleanOptionalAction, default=True,
                    help="scale the compression and --dilation by workers/8 (same load per worker)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many requests")
    ap.add_argument("--compress", type=float, default=None,
                    help="arrival-time compression factor at 8 workers for every load (default: "
                         "LOADS per trace and load; see --per-worker-load)")
    ap.add_argument("--dilation", type=float, default=4.0,
                    help="wall time per model time (at 8 workers, see --per-worker-load)")
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--kv-ratio", type=float, default=None,
                    help="KV capacity of the whole cluster as a fraction of the working set "
                         "(default: KV_RATIO per trace)")
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=None,
                    help="cap every request's output length (CI smoke: fewer streamed chunks)")
    ap.add_argument("--policies", default=None, help="only these (policy types or row names)")
    ap.add_argument("--oracle-cache-weight", type=float, default=2.0,
                    help="oracle cost: (queued prefill + this x uncached tokens) x prefill time "
                         "+ decode pressure")
    ap.add_argument("--no-reuse-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="no kv_cache_aware search")
    ap.add_argument("--kv-grid", default=None,
                    help="the kv_cache_aware settings to try beside the defaults, a JSON list of "
                         "argument objects (default: KV_GRID)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=0,
                    help="run the (trace, workers, load) cells in this many parallel processes, "
                         "one JSON per cell into --json-dir (bench/routing/judged.sh)")
    ap.add_argument("--json-dir", type=Path, default=None, help="with --jobs: the cells' JSON and logs")
    ap.add_argument("--parent-command", default=None, help=argparse.SUPPRESS)   # a --jobs cell's
    ap.add_argument("--work", type=Path, default=None, help="keep the processes' logs here")
    ap.add_argument("--note", default=None, help="a paragraph for the report (with --from-json)")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None,
                    help="write the report from earlier --json runs (their runs concatenated)")
    args = ap.parse_args(argv)
    if args.from_json:
        parts = [json.loads(p.read_text()) for p in args.from_json]
        runs: dict[tuple, dict] = {}
        for part in parts:   # a later file's rows replace the same-named rows of that run
            for r in part["runs"]:
                have = runs.setdefault((r["trace"], r["workers"], r["load"]), r)
                if have is not r:
                    names = [x["name"] for x in have["rows"]]
                    for row in r["rows"]:
                        if row["name"] in names:
                            have["rows"][names.index(row["name"])] = row
                        else:
                            have["rows"].append(row)
        order = {"synthetic": 0, "conversations": 1, "light": 0, "heavy": 1}
        out = {"meta": parts[0]["meta"], "runs": [runs[k] for k in sorted(
            runs, key=lambda k: (order.get(k[0], 9), k[0], k[1], order.get(k[2], 9), k[2]))]}
        for part in parts[1:]:
            out["meta"]["traces"] = {**part["meta"].get("traces", {}), **out["meta"]["traces"]}
        # the cells of one --jobs run share its command: named once
        out["meta"]["command"] = " ; ".join(dict.fromkeys(p["meta"]["command"] for p in parts))
        if args.note:
            out["meta"]["note"] = args.note
        return _write(out, OUTDIR / "routing.json")
    sizes = [int(x) for x in args.workers.split(",")]
    loads = args.loads.split(",")
    if args.jobs:
        return run_cells(args, argv if argv is not None else sys.argv[1:], sizes, loads)
    tokens = T.Tokens(args.tokens_per_block)
    runs, traces = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        if args.work:
            tmp = str(args.work)
            args.work.mkdir(parents=True, exist_ok=True)
        try:
            for name in args.traces.split(","):
                reqs, traces[name] = load_trace(name, args, Path(tmp))
                for n in sizes:
                    runs += run_size(n, args, name, reqs, tokens, Path(tmp), loads)
        except WorkerGone as e:    # which worker, how it ended, its log: the traceback adds nothing
            print(f"bench/routing/routing.py: stopped: {e}", file=sys.stderr, flush=True)
            return 1
    meta = {"traces": traces, "dilation": args.dilation,
            "tokens_per_block": args.tokens_per_block,
            "kv_ratio": args.kv_ratio if args.kv_ratio is not None else KV_RATIO,
            "max_batch_size": args.max_batch_size, "latency_model": T.H200_1B,
            "oracle_cache_weight": args.oracle_cache_weight,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{cpu_model()}, {os.cpu_count()} CPUs ({platform.machine()})",
            "command": args.parent_command or
            "python bench/routing/routing.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = json.loads(json.dumps({"meta": meta, "runs": runs}, default=str))
    if args.json:
        args.json.write_text(json.dumps(out))
    if not args.no_write:
        return _write(out, OUTDIR / "routing.json")
    return 0


def run_cells(args, argv: list[str], sizes: list[int], loads: list[str]) -> int:
    """`--jobs N`: every (trace, workers, load) cell in a process of its own, N at a time, the
    largest clusters first (the longest cells); each writes `--json-dir`/cell-TRACE-N-LOAD.json
    and its log beside it. With `--no-write` that is all (`--from-json DIR/cell-*.json` makes the
    report later); else the report is written from the cells."""
    import subprocess
    if args.json_dir is None:
        raise SystemExit("--jobs needs --json-dir DIR (one JSON per cell goes there)")
    args.json_dir.mkdir(parents=True, exist_ok=True)
    # the cell's own arguments: this command's, less what picks cells or writes the report
    drop = {"--jobs": 1, "--json-dir": 1, "--json": 1, "--traces": 1, "--workers": 1, "--loads": 1,
            "--no-write": 0, "--work": 1, "--parent-command": 1}
    base, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = drop[name] if "=" not in a else 0
            continue
        base.append(a)
    cells = sorted(((t, n, ld) for t in args.traces.split(",") for n in sizes for ld in loads),
                   key=lambda c: (-c[1], c[0] != "conversations"))
    running: list = []
    done: list[tuple] = []
    t0 = time.time()
    while cells or running:
        while cells and len(running) < args.jobs:
            t, n, ld = cells.pop(0)
            stem = args.json_dir / f"cell-{t}-{n}-{ld}"
            cmd = [PY, str(Path(__file__).resolve()), *base, "--traces", t, "--workers", str(n),
                   "--loads", ld, "--no-write", "--json", f"{stem}.json",
                   "--parent-command", "python bench/routing/routing.py " + " ".join(argv)]
            if args.work:
                cmd += ["--work", str(args.work / stem.name)]
            log = open(f"{stem}.log", "w")
            running.append(((t, n, ld), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                        cwd=ROOT), log, time.time()))
            print(f"[{time.time() - t0:6.0f} s] start {t} · {n} workers · {ld}", flush=True)
        time.sleep(1.0)
        for item in list(running):
            cell, proc, log, started = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            done.append((cell, proc.returncode, time.time() - started))
            print(f"[{time.time() - t0:6.0f} s] done  {cell[0]} · {cell[1]} workers · {cell[2]}: "
                  f"exit {proc.returncode} after {time.time() - started:.0f} s", flush=True)
    failed = [c for c, rc, _ in done if rc != 0]
    files = sorted(args.json_dir.glob("cell-*.json"))
    for f in files:    # the headline of each cell, as the cell's log printed it
        print(f"--- {f.stem}")
        print("\n".join(ln for ln in Path(str(f)[:-5] + ".log").read_text().splitlines()
                        if ln.startswith(("  ", "synthetic", "conversations"))))
    if failed:
        print(f"FAILED cells (see their .log): {failed}", flush=True)
        for t, n, ld in failed:    # why, as each cell's log ends (a stopped worker's report, a traceback)
            log = (args.json_dir / f"cell-{t}-{n}-{ld}.log").read_text(errors="replace").splitlines()
            print(f"--- cell-{t}-{n}-{ld}.log ends with:\n" + "\n".join(log[-30:]), flush=True)
    if not args.no_write and files:
        main(["--from-json", *map(str, files)])
    return 1 if failed else 0


def _write(out: dict, path: Path) -> int:
    """bench/results/routing.json (without the TTFT samples), the PNG, the bench/RESULTS.md section."""
    from bench.routing._routing_report import plot, section
    OUTDIR.mkdir(exist_ok=True)
    slim = json.loads(json.dumps(out))
    for r in slim["runs"]:
        for row in r["rows"]:
            row.pop("ttft_ms_sorted", None)
    path.write_text(json.dumps(slim, indent=1))
    plot(out, OUTDIR / "routing.png")
    replace_section(RESULTS, section(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
