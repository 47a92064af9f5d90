#!/usr/bin/env python3
"""Failover benchmark (issue 38): what a process death costs the routing, under kv_cache_aware load.

A real cluster on loopback: sim workers (generation servers only, so every request's prediction
and its worker's actual prefix hit are one pair), a fleet of `--fleet` processes (the launcher),
and the coordinator(s). A closed-loop client (`--conns` connections) sends completions whose
prompts share `--prefixes` long prefixes (multi-turn-like reuse), and records per request: send
and end time, status, the placement policy and predicted matched tokens (`x-splitserve-route`),
and the worker's `usage.prompt_tokens_details.cached_tokens`. A sampler reads the serving
coordinator's in-flight leases every 100 ms beside the client's own in-flight count.

Scenarios, each on a fresh cluster:
- `replicas`: two coordinator replicas (docs/failover.md); kill -9 the serving one.
- `single`: today's one coordinator; kill -9 it and start it again at once (the baseline).
- `worker`: two replicas; kill -9 a generation worker and start it again on the same ports.
- `fleet`: two replicas; kill -9 one fleet process (its launcher restarts it).

Reported per coordinator kill: failed client requests after the kill, the takeover time between
two bounds (from the kill to the send, and to the end, of the first request after it that a
coordinator placed; the end includes that request's own service time), placements made blind
after the kill (`local_fallback`), predicted/actual cached tokens of the first `--first`
delegated placements after the kill vs the last ones before it, and coordinator leases - client
in-flight before the kill vs 1-2 s after takeover. Worker restart: time until the
coordinator saw the new process, placements on it after that whose prediction exceeded its actual
cache by more than a block ("credited to the old cache"), failed requests. Fleet kill: how many
leases the dead process held and how long after the kill the coordinator had ended them (its
`leases.ended_by_announcement_total`), and whether any were left 2 s after it.

Usage: `python bench/fleet/failover.py [--fleet 2] [--workers 2] [--conns 16]
[--scenarios replicas,single,worker,fleet] [--no-write]`; on the 16-core host:
`python bench/fleet/failover.py --fleet 8 --workers 4 --conns 64`. Results are printed and
written as the "## failover" section of bench/RESULTS.md (unless --no-write).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

import yaml  # noqa: E402

from bench._common import cpu_model, replace_subsection  # noqa: E402
from splitserve_testing import Proc, free_port, wait_for, wait_http  # noqa: E402

PY = sys.executable
RESULTS = ROOT / "bench" / "RESULTS.md"
BLOCK = 16


def get_json(url: str, timeout: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Cluster:
    def __init__(self, work: Path, workers: int, fleet: int, replicas: int, sim_decode_us: int):
        self.work, self.procs = work, []
        self.wports = []
        self.workers = []
        for i in range(workers):
            p, e, r = free_port(), free_port(), free_port()
            argv = [PY, "-m", "splitserve_cli", "worker", "--role", "generation", "--engine", "sim",
                    "--model", "tiny", "--host", "127.0.0.1", "--port", str(p), "--device", "cpu",
                    "--kv-events-port", str(e), "--kv-replay-port", str(r),
                    "--sim-decode-us-per-step", str(sim_decode_us)]
            self.workers.append(self.spawn(f"gen-{i}", argv))
            self.wports.append(p)
        self.gen = [f"http://127.0.0.1:{p}" for p in self.wports]
        for u, w in zip(self.gen, self.workers):
            wait_http(u + "/health", 60, w)
        cports = [free_port() for _ in range(replicas)]
        self.curls = [f"http://127.0.0.1:{p}" for p in cports]
        servers = {"generation_servers": {"urls": [u[len("http://"):] for u in self.gen],
                                          "router": {"type": "kv_cache_aware"}},
                   "hostname": "127.0.0.1", "model": "tiny"}
        self.coord_cfgs = []
        self.coords = []
        for i, p in enumerate(cports):
            doc = dict(servers, port=p + 1)
            if replicas > 1:
                doc["coordinator"] = {"replicas": self.curls, "replica_index": i}
            cfg = self.write(f"coord{i}.yaml", doc)
            self.coord_cfgs.append((cfg, p))
            self.coords.append(self.coordinator(i))
        for u, c in zip(self.curls, self.coords):
            wait_http(u + "/health", 60, c)
        if replicas > 1:
            wait_for(lambda: not any(get_json(u + "/replica")["serving"] for u in self.curls[1:]),
                     15, "the standby to defer", self.coords)
        self.port = free_port()
        fdoc = dict(servers, port=self.port, num_workers=fleet,
                    fleet={"coordinator_timeout_s": 2, "route_header": "full"})
        if replicas > 1:
            fdoc["coordinator"] = {"replicas": self.curls}
        else:
            fdoc["disagg_coordinator_url"] = self.curls[0]
        fcfg = self.write("fleet.yaml", fdoc)
        self.launcher = self.spawn("fleet", [PY, "-m", "splitserve_cli", "serve", "-c", str(fcfg)])
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/health", 120, self.launcher)

    def write(self, name: str, doc: dict) -> Path:
        p = self.work / name
        p.write_text(yaml.safe_dump(doc))
        return p

    def spawn(self, name: str, argv: list) -> Proc:
        p = Proc(name, argv, self.work / f"{name}.log")
        self.procs.append(p)
        return p

    def coordinator(self, i: int, name: str | None = None) -> Proc:
        cfg, port = self.coord_cfgs[i]
        return self.spawn(name or f"coordinator-{i}", [PY, "-m", "splitserve_cli", "coordinator", "-c",
                                                       str(cfg), "--host", "127.0.0.1", "--port", str(port)])

    def fleet_children(self) -> list[int]:
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == self.launcher.p.pid:
                            out.append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
        return sorted(out)

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception:
                pass


class Load:
    """Closed-loop completions on `conns` connections, in a thread with its own event loop."""

    def __init__(self, url: str, conns: int, prefixes: int, seed: int = 1):
        self.url, self.conns = url, conns
        rng = random.Random(seed)
        words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
        self.prefixes = [" ".join(rng.choice(words) + str(rng.randrange(10**6)) for _ in range(120))
                         for _ in range(prefixes)]
        self.rows: list[tuple] = []    # (sent, end, status, policy, server, predicted, actual)
        self.inflight = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _one(self, session, rng) -> None:
        import aiohttp
        # answers of 4-200 tokens (~10-400 ms at the sim's 2 ms steps): the requests in flight at a
        # kill outlive it, so a coordinator that lost their leases counts too little for a while
        body = {"model": "tiny", "max_tokens": rng.randrange(4, 200),
                "prompt": rng.choice(self.prefixes) + f" question {rng.randrange(10**9)}"}
        t = time.monotonic()
        self.inflight += 1
        try:
            async with session.post(self.url + "/v1/completions", json=body) as r:
                raw = await r.read()
                st, route = r.status, r.headers.get("x-splitserve-route")
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            self.rows.append((t, time.monotonic(), 0, type(e).__name__, None, 0, 0))
            return
        finally:
            self.inflight -= 1
        pol = srv = None
        pred = act = 0
        if st == 200:
            g = json.loads(route)["generation"] if route else {}
            pol, srv = g.get("policy"), g.get("server")
            pred = int(g.get("matched_tokens") or 0)
            act = int(json.loads(raw).get("usage", {}).get("prompt_tokens_details", {})
                      .get("cached_tokens") or 0)
        self.rows.append((t, time.monotonic(), st, pol, srv, pred, act))

    async def _main(self) -> None:
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async def loop(i):
                rng = random.Random(i)
                while not self._stop.is_set():
                    await self._one(s, rng)
            await asyncio.gather(*(loop(i) for i in range(self.conns)))

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(60)


class Sampler:
    """Every 100 ms: (time, the coordinator's in-flight generation leases, the client's in-flight)."""

    def __init__(self, load: Load, curls: list[str]):
        self.load, self.curls = load, curls
        self.rows: list[tuple[float, str, int, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for u in self.curls:
                try:
                    ci = get_json(u + "/cluster_info", 0.5)
                    rep = get_json(u + "/replica", 0.5) if len(self.curls) > 1 else {"serving": True}
                except (OSError, ValueError):
                    continue
                if rep.get("serving"):
                    self.rows.append((time.monotonic(), u, ci["leases"]["in_flight"]["generation"],
                                      self.load.inflight))
            time.sleep(0.1)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)


def _ratio(rows) -> float | None:
    a = sum(r[6] for r in rows)
    return round(sum(r[5] for r in rows) / a, 3) if a else None


def _err(samples) -> float | None:
    return round(sum(abs(c - i) for _, _, c, i in samples) / len(samples), 2) if samples else None


def _bias(samples) -> float | None:
    return round(sum(c - i for _, _, c, i in samples) / len(samples), 2) if samples else None


def coordinator_kill(args, work: Path, replicas: int) -> dict:
    cl = Cluster(work, args.workers, args.fleet, replicas, args.sim_decode_us)
    try:
        with Load(cl.url, args.conns, args.prefixes) as load, Sampler(load, cl.curls) as smp:
            time.sleep(args.warm)
            cl.coords[0].kill(signal.SIGKILL)
            killed = time.monotonic()
            cl.coords[0].p.wait(10)
            if replicas == 1:       # today's recovery: the coordinator is started again
                cl.coords[0] = cl.coordinator(0, name="coordinator-0-restarted")
            time.sleep(args.after)
        rows = load.rows
        before = [r for r in rows if r[1] < killed and r[2] == 200 and r[3] == "kv_cache_aware"]
        after = [r for r in rows if r[0] >= killed]
        delegated = sorted((r for r in after if r[2] == 200 and r[3] == "kv_cache_aware"),
                           key=lambda r: r[1])
        first_end = delegated[0][1] - killed if delegated else None
        # a lower bound: the first request sent after the kill that a coordinator placed
        sent = [r for r in after if r[2] == 200 and r[3] == "kv_cache_aware"]
        first_sent = min(r[0] for r in sent) - killed if sent else None
        pre = [s for s in smp.rows if s[0] < killed - 0.2]
        t_back = delegated[0][1] if delegated else killed
        post = [s for s in smp.rows if t_back + 1.0 <= s[0] <= t_back + 2.0]
        return {"scenario": "replicas (kill -9 the serving one)" if replicas > 1
                else "single coordinator (kill -9, restarted)",
                "requests": len(rows), "failed_after_kill": sum(1 for r in after if r[2] != 200),
                "takeover_s": round(first_end, 3) if first_end is not None else None,
                "takeover_low_s": round(first_sent, 3) if first_sent is not None else None,
                "blind_after_kill": sum(1 for r in after if r[3] == "local_fallback"),
                "accuracy_before": _ratio(before[-args.first:]),
                "accuracy_after": _ratio(delegated[:args.first]),
                "lease_err_before": _err(pre[-20:]), "lease_err_after": _err(post),
                "lease_bias_before": _bias(pre[-20:]), "lease_bias_after": _bias(post),
                "client_inflight": round(sum(s[3] for s in pre[-20:]) / max(1, len(pre[-20:])), 1)}
    finally:
        cl.stop()


def worker_restart(args, work: Path) -> dict:
    cl = Cluster(work, args.workers, args.fleet, 2, args.sim_decode_us)
    try:
        victim = cl.gen[0]

        def epoch():
            for u in cl.curls:
                try:
                    if get_json(u + "/replica", 0.5).get("serving"):
                        ci = get_json(u + "/cluster_info", 0.5)
                        s = next(s for s in ci["servers"]["generation"] if s["url"] == victim)
                        return (s.get("kv_events") or {}).get("epoch")
                except (OSError, ValueError, StopIteration):
                    pass
            return None
        with Load(cl.url, args.conns, args.prefixes) as load:
            time.sleep(args.warm)
            old = epoch()
            cl.workers[0].kill(signal.SIGKILL)
            killed = time.monotonic()
            cl.workers[0].p.wait(10)
            cl.workers[0].start()
            restarted = time.monotonic()
            wait_http(victim + "/health", 60, cl.workers[0])
            ready = time.monotonic()
            wait_for(lambda: epoch() not in (None, old), 60, "the coordinator to see the new process")
            visible = time.monotonic()
            # A cache still credited to it would draw placements to it (predicted > actual): the
            # warm worker holds every prefix, so a correctly fenced one gets few or none.
            time.sleep(args.after)
        rows = load.rows
        noise = [r for r in rows if r[1] < killed and r[2] == 200 and r[5] - r[6] > BLOCK]
        on_new = [r for r in rows if r[0] >= visible and r[2] == 200 and r[4] == victim]
        stale = [r for r in on_new if r[5] - r[6] > BLOCK]
        return {"scenario": "worker restart (kill -9, same ports)", "requests": len(rows),
                "failed_after_kill": sum(1 for r in rows if r[0] >= killed and r[2] != 200),
                "started_to_ready_s": round(ready - restarted, 3),
                "visible_after_ready_s": round(visible - ready, 3),
                "placements_on_restarted": len(on_new), "credited_to_old_cache": len(stale),
                "overpredicted_before_kill": len(noise),
                "placements_before_kill": sum(1 for r in rows if r[1] < killed and r[2] == 200)}
    finally:
        cl.stop()


def fleet_kill(args, work: Path) -> dict:
    cl = Cluster(work, args.workers, max(2, args.fleet), 2, args.sim_decode_us)

    def ended() -> int:
        for u in cl.curls:
            try:
                if get_json(u + "/replica", 0.5).get("serving"):
                    return get_json(u + "/cluster_info", 0.5)["leases"]["ended_by_announcement_total"]
            except (OSError, ValueError, KeyError):
                pass
        return -1
    try:
        with Load(cl.url, args.conns, args.prefixes) as load:
            time.sleep(args.warm)
            for victim in cl.fleet_children():      # one that holds requests (SO_REUSEPORT)
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                try:
                    wait_for(lambda: ended() > 0, 5, "the dead process's leases to end")
                    break
                except AssertionError:
                    continue
            released = time.monotonic()
            n = ended()
            time.sleep(args.after)
        return {"scenario": "fleet process kill -9", "requests": len(load.rows),
                "failed_after_kill": sum(1 for r in load.rows if r[0] >= killed and r[2] != 200),
                "leases_it_held": n, "released_after_s": round(released - killed, 3),
                "leases_left_at_2s": 0 if released - killed <= 2 else n}
    finally:
        cl.stop()


def title(args) -> str:
    return (f"### {os.cpu_count()} cores · {args.fleet} fleet processes · {args.workers} sim workers · "
            f"{args.conns} connections")


def report(args, results: list[dict]) -> str:
    host = f"{platform.node()} · {os.cpu_count()} CPUs · {cpu_model()}"
    lines = [f"Command: `python bench/fleet/failover.py --fleet {args.fleet} --workers {args.workers} "
             f"--conns {args.conns}` · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {host}"
             + (" · **2-core box: not judged**" if (os.cpu_count() or 0) <= 2 else ""), ""]
    ck = [r for r in results if "coordinator" in r["scenario"] or "replicas" in r["scenario"]]
    if ck:
        lines += ["| coordinator kill | requests | failed after kill | takeover (s): first placed request sent – ended | blind after kill | "
                  "predicted/actual before → first after | coordinator leases − client in-flight, before → 1-2 s after takeover (client in-flight) |",
                  "|---|---|---|---|---|---|---|"]
        for r in ck:
            lines.append(f"| {r['scenario']} | {r['requests']} | {r['failed_after_kill']} | "
                         f"{r['takeover_low_s']} – {r['takeover_s']} | "
                         f"{r['blind_after_kill']} | {r['accuracy_before']} → {r['accuracy_after']} | "
                         f"{r['lease_bias_before']} → {r['lease_bias_after']} ({r['client_inflight']}) |")
        lines.append("")
    for r in results:
        if r not in ck:
            lines.append(f"- {r['scenario']}: " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "scenario"))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleet", type=int, default=2, help="fleet processes (16-core host: 8)")
    ap.add_argument("--workers", type=int, default=2, help="sim generation workers")
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=24)
    ap.add_argument("--warm", type=float, default=6.0, help="seconds of load before the kill")
    ap.add_argument("--after", type=float, default=10.0, help="seconds of load after it")
    ap.add_argument("--first", type=int, default=60, help="placements compared before/after")
    ap.add_argument("--sim-decode-us", type=int, default=2000)
    ap.add_argument("--scenarios", default="replicas,single,worker,fleet")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="splitserve-failover-") as tmp:
        for sc in args.scenarios.split(","):
            work = Path(tmp) / sc
            work.mkdir()
            if sc == "replicas":
                r = coordinator_kill(args, work, 2)
            elif sc == "single":
                r = coordinator_kill(args, work, 1)
            elif sc == "worker":
                r = worker_restart(args, work)
            elif sc == "fleet":
                r = fleet_kill(args, work)
            else:
                raise SystemExit(f"unknown scenario {sc!r}")
            print(json.dumps(r), flush=True)
            results.append(r)
    md = report(args, results)
    print(md)
    if not args.no_write:
        replace_subsection(RESULTS, "failover", title(args), md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
