#!/usr/bin/env python3
"""Benchmark of the pure routing core: block keys, event apply, kv_cache_aware select.

Prints a table and (unless --no-write) replaces the "## router core" section of
bench/RESULTS.md. The select latency is measured side by side, interleaved in the same run,
with a TensorRT-LLM-style baseline: one Python ``set`` of block hashes per server, scanned per
server until the first miss, ``score = matched_blocks - 0.25 * in_flight``, argmax with
round-robin ties (``KvCacheAwareRouter._route`` in TensorRT-LLM's ``tensorrt_llm/serve/router.py``).

    python bench/routing/router_core.py            # full run (64 workers x 50k blocks, ~1-2 minutes)
    python bench/routing/router_core.py --quick    # smoke run (seconds), same code paths
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

from bench._common import replace_section  # noqa: E402

from router.block_keys import block_keys, block_keys_list  # noqa: E402
from router.events import (BlocksRemoved, BlocksStored, decode_zmq,  # noqa: E402
                           encode_vllm_batch)
from router.kv_index import KvIndex  # noqa: E402
from router.leases import LeaseTable  # noqa: E402
from router.policies import Candidate, IndexLoadView, RoutingKey, make_policy  # noqa: E402

TARGETS = {"keys": 20e6, "apply": 500e3, "select_p99_us": 200.0, "speedup": 10.0}


def _pct(samples_ns: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(samples_ns, dtype=np.float64), q)) / 1e3


# ---- 1. block keys ---------------------------------------------------------------------------

def bench_keys(n_tokens: int, reps: int, block_size: int) -> dict:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 150_000, size=n_tokens).astype(np.uint32)
    lst = arr.tolist()
    out = {}
    for name, src in (("ndarray", arr), ("list", lst)):
        block_keys(src, block_size)
        wall, cpu = [], []
        for _ in range(reps):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            block_keys(src, block_size)
            wall.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
        w, c = float(np.median(wall)) / 1e9, float(np.median(cpu)) / 1e9
        out[name] = {"tokens_per_s": n_tokens / w, "ms": w * 1e3,
                     "cpu_tokens_per_s": n_tokens / c}
    return out


# ---- 2. event apply --------------------------------------------------------------------------

def _event_stream(n_workers: int, n_events: int, block_size: int, seed: int):
    """A realistic mix per worker: prefills of 1-64 blocks (often extending a cached prefix),
    single-block decode stores, and LRU-ish removals of old leaves. Engine hashes are opaque
    random u64 (a foreign engine), so the index must map them."""
    rng = np.random.default_rng(seed)
    streams = []
    for w in range(n_workers):
        chains: list[tuple[int, list[int]]] = []  # (last engine hash, tokens) resident tails
        resident: list[int] = []
        evs = []
        next_hash = int(rng.integers(1, 2**62))
        for _ in range(n_events):
            r = rng.random()
            if r < 0.2 and len(resident) > 64:
                k = int(rng.integers(1, 8))
                gone, resident[:] = resident[:k], resident[k:]
                evs.append(BlocksRemoved(gone))
                continue
            n = 1 if r < 0.55 else int(rng.integers(2, 65))
            toks = rng.integers(0, 150_000, size=n * block_size).tolist()
            parent = None
            if chains and rng.random() < 0.6:
                parent = chains[int(rng.integers(0, len(chains)))][0]
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            evs.append(BlocksStored(hashes, parent, toks, block_size))
            chains.append((hashes[-1], toks))
            if len(chains) > 256:
                chains.pop(0)
            resident.extend(hashes)
        streams.append((f"http://worker-{w}:8000", evs))
    return streams


def _timed(fn, rounds: int) -> tuple[float, float]:
    """Best wall and best thread-CPU seconds over ``rounds`` runs (noise only adds time)."""
    best_wall = best_cpu = float("inf")
    for _ in range(rounds):
        gc.collect()
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        best_wall = min(best_wall, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.thread_time() - c0)
    return best_wall, best_cpu


def bench_apply(n_workers: int, n_events: int, block_size: int, rounds: int) -> dict:
    streams = _event_stream(n_workers, n_events, block_size, seed=1)
    n_blocks = sum(len(e.engine_hashes) for _, evs in streams for e in evs)
    sizes = []

    def direct():
        idx = KvIndex(block_size)
        for w, evs in streams:
            for ev in evs:
                idx.apply(w, ev)
        sizes.append(idx.size)

    # the same stream from the wire: msgpack payloads of 8 events, decoded then applied
    wire = []
    for w, evs in streams:
        for i in range(0, len(evs), 8):
            wire.append((w, [b"kv", (i // 8).to_bytes(8, "big"),
                             encode_vllm_batch(1.0, evs[i:i + 8], 0)]))

    def from_wire():
        idx = KvIndex(block_size)
        for w, frames in wire:
            idx.apply_batch(w, decode_zmq(frames))
        sizes.append(idx.size)

    wall, cpu = _timed(direct, rounds)
    wwall, wcpu = _timed(from_wire, rounds)
    assert len(set(sizes)) == 1, "wire path and direct path disagree"
    return {"blocks": n_blocks, "apply_blocks_per_s": n_blocks / wall,
            "apply_cpu_blocks_per_s": n_blocks / cpu, "wire_blocks_per_s": n_blocks / wwall,
            "wire_cpu_blocks_per_s": n_blocks / wcpu, "index_keys": sizes[0]}


# ---- 3. select: ours vs TensorRT-LLM-style sets ------------------------------------------------

class TrtStyleRouter:
    """KvCacheAwareRouter's selection: per-server hash sets, per-server consecutive scan."""

    def __init__(self, servers: list[str], tables: dict[str, set], load_weight: float = 0.25):
        self.servers = servers
        self.tables = tables
        self.load_weight = load_weight
        self.active = dict.fromkeys(servers, 0)
        self.rr = 0

    def select(self, block_hashes: list[int], tokens_per_block: int) -> tuple[str, dict]:
        matches = {}
        for s in self.servers:
            table = self.tables[s]
            matched = 0
            for h in block_hashes:
                if h in table:
                    matched += tokens_per_block
                else:
                    break
            matches[s] = matched
        scores = {s: matches[s] / tokens_per_block - self.load_weight * self.active[s]
                  for s in self.servers}
        best = max(scores.values())
        tied = [s for s in self.servers if scores[s] == best]
        server = tied[self.rr % len(tied)]
        self.rr += 1
        return server, {"matches": matches, "match_length": matches[server]}


def build_cluster(n_workers: int, blocks_per_worker: int, prompt_tokens: int, block_size: int,
                  scenario: str, seed: int = 2):
    """Index + per-server sets holding the same content.

    scenario "shared-system-prompt": every worker caches the prompt's first 1/4 (a system
    prompt), 8 workers its first half (an earlier turn), one worker 3/4. "hot-prefix": every
    worker caches the whole prompt (a viral prompt; the baseline's worst case and the deepest
    walk for us). The rest of each worker's blocks are other conversations.
    """
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, size=prompt_tokens).astype(np.uint32)
    keys = block_keys_list(prompt, block_size)
    nk = len(keys)
    if scenario == "hot-prefix":
        depth = [nk] * n_workers
    else:
        depth = [nk // 4] * n_workers
        for w in range(min(8, n_workers)):
            depth[w] = nk // 2
        depth[n_workers // 2] = (3 * nk) // 4
    servers = [f"http://worker-{w}:8000" for w in range(n_workers)]
    idx = KvIndex(block_size)
    tables = {}
    for w, s in enumerate(servers):
        other = rng.integers(1, 2**63, size=blocks_per_worker - depth[w], dtype=np.int64)
        resident = keys[:depth[w]] + other.tolist()
        idx.load_snapshot(s, resident)
        tables[s] = set(resident)
    return servers, idx, tables, prompt, keys, depth


class _TimedView(IndexLoadView):
    """Records the CPU time of the index walk inside each policy call."""

    def __init__(self, index, leases):
        super().__init__(index, leases)
        self.walk_ns: list[int] = []
        self.fresh = True

    def matched_blocks(self, keys):
        if self.fresh:
            self.index.drop_walk_memo()     # a prompt not walked just before: the full walk
        c0 = time.thread_time_ns()
        out = self.index.longest_prefix(keys)
        self.walk_ns.append(time.thread_time_ns() - c0)
        return out


def bench_select(n_workers: int, blocks_per_worker: int, prompt_tokens: int, block_size: int,
                 iters: int, scenario: str) -> dict:
    servers, idx, tables, prompt, keys, depth = build_cluster(
        n_workers, blocks_per_worker, prompt_tokens, block_size, scenario)
    leases = LeaseTable()
    rng = np.random.default_rng(3)
    for i in range(n_workers * 4):
        leases.acquire("ctx", i, servers[int(rng.integers(0, n_workers))], 0.0, 1e9,
                       int(rng.integers(100, 8000)))
    view = _TimedView(idx, leases)
    policy = make_policy("kv_cache_aware", {}, block_size=block_size)
    cands = [Candidate(s) for s in servers]
    # the coordinator receives block keys in a msgpack array: a list of ints
    key_list = list(keys)
    base = TrtStyleRouter(servers, tables)
    for s in servers:
        base.active[s] = leases.requests(s)
    # correctness: both see the same matches
    d = policy.select(cands, RoutingKey(key_list, prompt_tokens), view)
    _, binfo = base.select(keys, block_size)
    # the explanation lists the top rows only: compare every server through the index walk
    ours_match = idx.longest_prefix(key_list, servers)
    for s, w in zip(servers, depth):
        assert binfo["matches"][s] == w * block_size
        assert ours_match[s] == w
    for r in d.explanation["candidates"]:
        assert r["matched_tokens"] == min(depth[servers.index(r["server"])] * block_size,
                                          prompt_tokens - 1)
    ours_ns, base_ns, keys_sel_ns = [], [], []
    walk_in_select = []
    ours_cpu, base_cpu = [], []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    gc.collect()
    gc.disable()
    try:
        for it in range(iters):
            # alternate who runs first: each side's scan evicts the other's lines from the
            # caches, so a fixed order would hand one side systematically warm caches
            if it % 2:
                c1, t1 = cpu_clock(), clock()
                base.select(keys, block_size)
                t2, c2 = clock(), cpu_clock()
                c0, t0 = cpu_clock(), clock()
                policy.select(cands, RoutingKey(key_list, prompt_tokens), view)
                tx, cx = clock(), cpu_clock()
                ours_ns.append(tx - t0)
                ours_cpu.append(cx - c0)
                walk_in_select.append(view.walk_ns[-1])
            else:
                c0, t0 = cpu_clock(), clock()
                policy.select(cands, RoutingKey(key_list, prompt_tokens), view)
                tx, cx = clock(), cpu_clock()
                c1, t1 = cpu_clock(), clock()
                base.select(keys, block_size)
                t2, c2 = clock(), cpu_clock()
                ours_ns.append(tx - t0)
                ours_cpu.append(cx - c0)
                walk_in_select.append(view.walk_ns[-1])
            base_ns.append(t2 - t1)
            base_cpu.append(c2 - c1)
            t2 = clock()
            k = block_keys(prompt, block_size)
            policy.select(cands, RoutingKey(k, prompt_tokens), view)
            keys_sel_ns.append(clock() - t2)
    finally:
        gc.enable()
    # the prefix match alone: one index walk vs the per-server scans (scoring excluded)
    walk_cpu, scan_cpu = [], []
    tables_list = [tables[s] for s in servers]

    def scan():
        out = []
        for table in tables_list:
            matched = 0
            for h in keys:
                if h in table:
                    matched += block_size
                else:
                    break
            out.append(matched)
        return out

    for it in range(max(2, iters // 2)):
        if it % 2:
            c1 = cpu_clock()
            scan()
            idx.drop_walk_memo()
            c2 = cpu_clock()
            idx.longest_prefix(key_list)
            c3 = cpu_clock()
            walk_cpu.append(c3 - c2)
        else:
            idx.drop_walk_memo()
            c0 = cpu_clock()
            idx.longest_prefix(key_list)
            c1 = cpu_clock()
            scan()
            c2 = cpu_clock()
            walk_cpu.append(c1 - c0)
        scan_cpu.append(c2 - c1)
    # the same prompt placed again with nothing changed on its keys: the walk memo answers
    view.fresh = False
    policy.select(cands, RoutingKey(key_list, prompt_tokens), view)
    again_cpu = []
    for _ in range(max(2, iters // 2)):
        c0 = cpu_clock()
        policy.select(cands, RoutingKey(key_list, prompt_tokens), view)
        again_cpu.append(cpu_clock() - c0)
    view.fresh = True
    return {
        "again_cpu_p50_us": _pct(again_cpu, 50),
        "scenario": scenario, "index_keys": idx.size,
        "probes": min(max(depth) + 1, len(keys)),
        "walk_cpu_p50_us": _pct(walk_cpu, 50), "scan_cpu_p50_us": _pct(scan_cpu, 50),
        "walk_in_select_p50_us": _pct(walk_in_select, 50),
        "rest_in_select_p50_us": _pct([o - w for o, w in zip(ours_cpu, walk_in_select)], 50),
        "ours_p50_us": _pct(ours_ns, 50), "ours_p99_us": _pct(ours_ns, 99),
        "base_p50_us": _pct(base_ns, 50), "base_p99_us": _pct(base_ns, 99),
        "ours_cpu_p50_us": _pct(ours_cpu, 50), "ours_cpu_p99_us": _pct(ours_cpu, 99),
        "base_cpu_p50_us": _pct(base_cpu, 50), "base_cpu_p99_us": _pct(base_cpu, 99),
        "keys_select_p50_us": _pct(keys_sel_ns, 50), "keys_select_p99_us": _pct(keys_sel_ns, 99),
        "speedup_p50": _pct(base_ns, 50) / _pct(ours_ns, 50),
        "speedup_p99": _pct(base_ns, 99) / _pct(ours_ns, 99),
        "cpu_speedup_p50": _pct(base_cpu, 50) / _pct(ours_cpu, 50),
        "cpu_speedup_p99": _pct(base_cpu, 99) / _pct(ours_cpu, 99),
    }


# ---- report ------------------------------------------------------------------------------------

def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.1f} M" if x >= 1e6 else f"{x / 1e3:.0f} k"


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def render(cfg: dict, keys: dict, apply: dict, selects: list[dict]) -> list[str]:
    """Rows show wall-clock time, then thread CPU time in brackets; verdicts use CPU time
    (identical on an idle machine, immune to other processes' preemption on a shared one)."""
    kn, kl = keys["ndarray"], keys["list"]
    rows = [
        "| measure | wall (CPU) | target | verdict (CPU) |",
        "|---|---|---|---|",
        f"| block keys, {cfg['key_tokens']} tokens from ndarray | "
        f"{_fmt_rate(kn['tokens_per_s'])}tokens/s ({_fmt_rate(kn['cpu_tokens_per_s'])}) | "
        f"≥ 20 M tokens/s | {_verdict(kn['cpu_tokens_per_s'] >= TARGETS['keys'])} |",
        f"| block keys, {cfg['key_tokens']} tokens from a list | "
        f"{_fmt_rate(kl['tokens_per_s'])}tokens/s ({_fmt_rate(kl['cpu_tokens_per_s'])}) | "
        f"≥ 20 M tokens/s | {_verdict(kl['cpu_tokens_per_s'] >= TARGETS['keys'])} |",
        f"| event apply (decoded events, foreign engine hashes), {apply['blocks']} blocks | "
        f"{_fmt_rate(apply['apply_blocks_per_s'])}blocks/s "
        f"({_fmt_rate(apply['apply_cpu_blocks_per_s'])}) | ≥ 500 k blocks/s | "
        f"{_verdict(apply['apply_cpu_blocks_per_s'] >= TARGETS['apply'])} |",
        f"| event decode + apply from msgpack frames | "
        f"{_fmt_rate(apply['wire_blocks_per_s'])}blocks/s "
        f"({_fmt_rate(apply['wire_cpu_blocks_per_s'])}) | (info) | |",
    ]
    for s in selects:
        sc = s["scenario"]
        rows += [
            f"| select p50 / p99, {sc}: ours | {s['ours_p50_us']:.0f} / {s['ours_p99_us']:.0f} µs "
            f"({s['ours_cpu_p50_us']:.0f} / {s['ours_cpu_p99_us']:.0f}) | p99 ≤ 200 µs | "
            f"{_verdict(s['ours_cpu_p99_us'] <= TARGETS['select_p99_us'])} |",
            f"| select p50 / p99, {sc}: TRT-LLM-style sets | {s['base_p50_us']:.0f} / "
            f"{s['base_p99_us']:.0f} µs ({s['base_cpu_p50_us']:.0f} / "
            f"{s['base_cpu_p99_us']:.0f}) | | |",
            f"| speedup p50 / p99, {sc} | {s['speedup_p50']:.1f}x / {s['speedup_p99']:.1f}x "
            f"({s['cpu_speedup_p50']:.1f}x / {s['cpu_speedup_p99']:.1f}x) | ≥ 10x | "
            f"{_verdict(s['cpu_speedup_p99'] >= TARGETS['speedup'])} |",
            f"| prefix match only p50, {sc}: one index walk vs per-server scans | "
            f"({s['walk_cpu_p50_us']:.0f} vs {s['scan_cpu_p50_us']:.0f} µs: "
            f"{s['scan_cpu_p50_us'] / s['walk_cpu_p50_us']:.1f}x) | (info) | |",
            f"| select p50, {sc}: ours, the same prompt again (walk memo, "
            "router/kv_memo.py) | "
            f"({s['again_cpu_p50_us']:.0f} µs) | (info) | |",
            f"| block keys + select p50 / p99, {sc}: ours | "
            f"{s['keys_select_p50_us']:.0f} / {s['keys_select_p99_us']:.0f} µs | (info) | |",
        ]
    return rows


def notes(selects: list[dict], load_before: float, load_after: float) -> list[str]:
    """Where the select time goes, from this run's numbers (so a missed target is explained
    by measurements, not by prose written once)."""
    out = ["", "Where the time goes (CPU p50, this run):", ""]
    for s in selects:
        out.append(
            f"- {s['scenario']}: inside the policy call the index walk takes "
            f"{s['walk_in_select_p50_us']:.0f} µs for {s['probes']} probes of a "
            f"{s['index_keys']:,}-key dict (one per block up to the deepest match, plus the miss "
            f"that ends it) and the rest "
            f"{s['rest_in_select_p50_us']:.0f} µs, spent per candidate (loads, cost, hot-spot "
            "check, explanation rows for the top 8: work the baseline does not do). The baseline's scan grows "
            "with the sum of all servers' match depths, the walk with the deepest one.")
    cores = os.cpu_count() or 1
    if max(load_before, load_after) >= cores:
        out.append(f"- The machine was shared (load average {load_before:.1f}/{load_after:.1f} on "
                   f"{cores} cores): CPU-time p99 still includes cache and SMT interference from "
                   "other processes; rerun on an idle machine for clean tails.")
    return out


def _machine() -> str:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    return (f"`{platform.machine()}`, {os.cpu_count()} cores (nproc), Python "
            f"{platform.python_version()}, numpy {np.__version__}, commit {commit or '?'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    ap.add_argument("--no-write", action="store_true", help="do not touch bench/RESULTS.md")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--blocks-per-worker", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=None, help="select iterations per scenario")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    a = ap.parse_args(argv)
    cfg = {
        "workers": a.workers or (8 if a.quick else 64),
        "blocks": a.blocks_per_worker or (2_000 if a.quick else 50_000),
        "iters": a.iters or (50 if a.quick else 2_000),
        "key_tokens": 4096 if a.quick else 32768,
        "apply_workers": 4 if a.quick else 16,
        "apply_events": 200 if a.quick else 2_000,
    }
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    keys = bench_keys(cfg["key_tokens"], 20 if a.quick else 200, a.block_size)
    apply = bench_apply(cfg["apply_workers"], cfg["apply_events"], a.block_size,
                        1 if a.quick else 3)
    selects = [bench_select(cfg["workers"], cfg["blocks"], a.prompt_tokens, a.block_size,
                            cfg["iters"], sc) for sc in ("shared-system-prompt", "hot-prefix")]
    load_after = os.getloadavg()[0]
    rows = render(cfg, keys, apply, selects)
    cmd = "python bench/routing/router_core.py" + (" --quick" if a.quick else "")
    head = [
        "## router core",
        "",
        f"Command: `{cmd}` · machine: {_machine()} · date: "
        f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
        + f" · 1-min load average {load_before:.1f} before, {load_after:.1f} after"
        + (" · **quick run (small sizes; not comparable to the targets)**" if a.quick else ""),
        "",
        "Each cell is wall-clock time with thread CPU time in brackets. The two agree on an "
        "idle machine; on a shared one the wall clock also counts time the process spent "
        "preempted by others, so the verdicts use CPU time (wall-clock p99 is only meaningful "
        "at a load average below the core count).",
        "",
        f"Select: `kv_cache_aware` over {cfg['workers']} workers x {cfg['blocks']} resident "
        f"blocks each, {a.prompt_tokens}-token prompt, block size {a.block_size}, "
        f"{cfg['iters']} interleaved iterations per scenario; \"ours\" is the full policy call "
        "(one index walk, lease loads, cost, hot-spot cap, explanation record with the 8 cheapest candidates' rows); the baseline "
        "scans one Python set per server as TensorRT-LLM's KvCacheAwareRouter does. "
        "shared-system-prompt: all workers hold the first 1/4 of the prompt, 8 the first half, "
        "one 3/4; hot-prefix: all hold all of it.",
        "",
    ]
    section = head + rows + notes(selects, load_before, load_after)
    print("\n".join(section))
    print(f"\n(total {time.perf_counter() - t_start:.1f} s)")
    if not a.no_write:
        replace_section(a.results, section)
        print(f"wrote {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
