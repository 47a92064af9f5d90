#!/usr/bin/env python3
"""The coordinator's placement cost in process: this tree against a baseline tree, interleaved.

No sockets, no other processes: a real `Coordinator` with `kv_cache_aware` on both roles, KV
indexes loaded from snapshots, and channel frames decoded, answered and encoded by
`ChannelServer.run_batch` on one thread (its CPU time, `time.thread_time`). Scenarios:

- `select`: 32 servers serving both roles, 4k-token prompts (256 block keys) over 64 shared
  3k-token documents, each on ~2 servers (bench/coordinator/coordinator.py's cluster), one leg per call,
  then its finish: what bench/coordinator/coordinator.py's channel phases send;
- `select_pair`: the same cluster and prompts, both legs in one call, then both finishes: what
  a fleet process sends per two-leg kv_cache_aware request;
- `fleet-like pair`: 2 context + 2 generation servers and one ~960-token prompt, both legs
  and both finishes (bench/fleet/fleet.py's two-leg kv_cache_aware request);
- `select unique-prompts`: the `select` cluster, but every prompt's 1k-token tail is new and
  speculative entries live 0.25 s (`speculative_ttl_s`), so each placement inserts its tail's
  64 keys and expiry runs in steady state, as under production traffic with distinct prompts
  (in the other scenarios prompts repeat and the runs end before the 30 s TTL).

`--baseline DIR` runs the same measurement against the `router/` and `coordinator/` of another
checkout (e.g. `git worktree add /tmp/main main`) in a subprocess, alternating with this tree
round by round, and reports medians and the ratio (the box may be shared: compare CPU µs
measured in the same run).

`--first-tokens` adds every leg's first-token report (phase-aware load) to the frame that carries
its finish, as the fleet sends them; a baseline from before the reports gets none, so the ratio is
then the whole cost of the phases per placement. `--kv-capacity N` turns on the KV index's
capacity model (every server publishes N blocks).

    python bench/routing/placement.py [--baseline DIR] [--rounds 5] [--calls 8192] [--scenarios select]
                                      [--first-tokens] [--kv-capacity N]
"""
from __future__ import annotations

import os
import sys

# The code under test: this tree, or the baseline's when run as its subprocess.
_CODE = os.environ.get("SPLITSERVE_PLACEMENT_CODE")
if __name__ == "__main__":
    from pathlib import Path as _P
    _root = _P(__file__).resolve().parents[2]
    sys.path[:] = ([_CODE] if _CODE else []) + [str(_root)] + [
        p for p in sys.path if _P(p or ".").resolve() not in (_root, _root / "bench", _P(__file__).resolve().parent)]

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
PROMPT_TOKENS = 4096
SCENARIOS = ("select", "select_pair", "fleet-like pair", "select unique-prompts")
# --kv-capacity: every server's /server_info kv_capacity_blocks (0: none), passed to the rounds'
# subprocesses in the environment
KV_CAPACITY = int(os.environ.get("SPLITSERVE_PLACEMENT_KV_CAPACITY") or 0)
# --first-tokens: every leg's first-token report rides the batch that carries its finish (the
# fleet sends one per leg; applied before the finishes), in the trees that take them
FIRST_TOKENS = os.environ.get("SPLITSERVE_PLACEMENT_FIRST_TOKENS") == "1"


def _channel_wire():
    """The channel's frame codec (protocol/channel.py; the coordinator's `channel_wire` module in
    older trees, so a baseline checkout from before the move runs too)."""
    try:
        from protocol import channel
    except ImportError:
        from coordinator import channel_wire as channel
    return channel


def _decoder(cw):
    """How the coordinator decodes a frame: `decode_frame` (items in the one pass), or
    `decode_batch` in trees from before it."""
    return getattr(cw, "decode_frame", cw.decode_batch)


def _prompts(seed: int, docs: int, n: int) -> list[np.ndarray]:
    """bench/coordinator/coordinator.py's prompts: a document's 3k-token prefix + a 1k-token unique tail."""
    from router.block_keys import block_keys
    rng = np.random.default_rng(seed)
    doc_tokens = [rng.integers(0, 50_000, PROMPT_TOKENS).tolist() for _ in range(docs)]
    out = []
    for i in range(n):
        d = doc_tokens[i % docs]
        tail = rng.integers(0, 50_000, PROMPT_TOKENS - 3072).tolist()
        out.append(block_keys(d[:3072] + tail, BLOCK))
    return out


def _cluster(ctx: list[str], gen: list[str], resident: dict[str, list[int]], router: dict | None = None):
    from coordinator.service import Coordinator
    router = router or {"type": "kv_cache_aware"}
    c = Coordinator({"context_servers": {"urls": ctx, "router": router},
                     "generation_servers": {"urls": gen, "router": router}, "leases": {"ttl_s": 60.0}})
    now = c.clock()
    for i, u in enumerate(dict.fromkeys(ctx + gen)):
        role = "both" if u in ctx and u in gen else "context" if u in ctx else "generation"
        info = {"role": role, "block_size": BLOCK, "key_scheme": "xxh3_chain_v1",
                "worker_id": f"bench-{i}", "max_batch_size": 256}
        if KV_CAPACITY:     # the index's capacity model on (a tree without one ignores the key)
            info["kv_capacity_blocks"] = KV_CAPACITY
        c.registry.prepared(u, info, now)
        if hasattr(c, "kv_capacity"):
            c.index.set_capacity(u, c.kv_capacity(u))
        c.index.load_snapshot(u, resident.get(u, []))
    c.kv.kv_ready = lambda server: True
    c._bump()
    return c


def build(scenario: str, calls: int, batch: int, seed: int = 0, servers: int = 32, docs: int = 64,
          prompts: int = 512):
    """(coordinator, channel server, frames) for one scenario."""
    cw = _channel_wire()
    from coordinator.channel import ChannelServer
    from router.block_keys import block_keys
    if scenario == "fleet-like pair":
        ctx = [f"http://127.0.0.1:{20000 + i}" for i in range(2)]
        gen = [f"http://127.0.0.1:{21000 + i}" for i in range(2)]
        c = _cluster(ctx, gen, {})
        n_tok = 960
        keys = [block_keys(list(range(1000, 1000 + n_tok)), BLOCK).astype("<u8").tobytes()]
    else:
        urls = [f"http://127.0.0.1:{20000 + i}" for i in range(servers)]
        rng = np.random.default_rng(seed)
        doc_keys = [block_keys(rng.integers(0, 50_000, PROMPT_TOKENS).tolist(), BLOCK).tolist()
                    for _ in range(docs)]
        resident = {}
        for i, u in enumerate(urls):   # as bench/coordinator/coordinator.py: each doc's prefix on ~2 servers
            resident[u] = [k for d in range(i % docs, docs, max(1, servers // 2))
                           for k in doc_keys[d][:192]]
        unique = scenario == "select unique-prompts"
        c = _cluster(urls, urls, resident, {"type": "kv_cache_aware", "speculative_ttl_s": 0.25}
                     if unique else None)
        n_tok = PROMPT_TOKENS
        keys = [p.astype("<u8").tobytes() for p in _prompts(seed, docs, calls if unique else prompts)]
    srv = ChannelServer(c, max_queue_delay_s=1e9)
    frames, rid = [], 1
    pair = scenario in ("select_pair", "fleet-like pair")
    for b in range(calls // batch):
        if pair:
            calls_ = [cw.SelectPair(rid + j, rid + j, {"block_keys": keys[(rid + j) % len(keys)],
                                                       "num_tokens": n_tok}) for j in range(batch)]
            fins = [cw.Finish(role, r) for r in range(rid - batch, rid)
                    for role in ("context", "generation")] if b else []
        else:
            calls_ = [cw.Select(rid + j, "context" if (rid + j) & 1 else "generation", rid + j,
                                {"block_keys": keys[(rid + j) % len(keys)], "num_tokens": n_tok})
                      for j in range(batch)]
            fins = [cw.Finish("context" if r & 1 else "generation", r)
                    for r in range(rid - batch, rid)] if b else []
        started = [cw.FirstToken(f.role, f.req_id) for f in fins] \
            if FIRST_TOKENS and hasattr(cw, "FirstToken") else None
        frames.append((cw.batch_frame(b + 1, None, calls_, fins, started) if started else
                       cw.batch_frame(b + 1, None, calls_, fins))[4:])
        rid += batch
    return c, srv, frames


def measure(scenario: str, calls: int = 8192, batch: int = 64) -> float:
    """CPU µs per call (with its finishes) on a fresh cluster, after one warm-up pass."""
    cw = _channel_wire()
    c, srv, frames = build(scenario, calls, batch)
    dec = _decoder(cw)
    for f in frames[:len(frames) // 4]:       # warm-up: routed blocks fill the index
        cw.frame(srv.run_batch(dec(f), time.monotonic()))
    gc.collect()
    t0 = time.thread_time()
    for f in frames:
        cw.frame(srv.run_batch(dec(f), time.monotonic()))
    return (time.thread_time() - t0) / (len(frames) * batch) * 1e6


def _one_round(code: str | None, calls: int, scenarios: tuple) -> dict:
    """One round of the scenarios, in a subprocess importing `code`'s router/ and coordinator/."""
    env = {**os.environ, "SPLITSERVE_PLACEMENT_CODE": code or ""}
    out = subprocess.run([sys.executable, __file__, "--_round", "--calls", str(calls),
                          "--scenarios", ",".join(scenarios)], env=env,
                         cwd=code or str(ROOT), capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"placement round for {code or ROOT} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(baseline: str | None, rounds: int, calls: int, scenarios: tuple = SCENARIOS) -> dict:
    trees = [("this tree", None)] + ([("baseline", str(Path(baseline).resolve()))] if baseline else [])
    got: dict[str, dict[str, list]] = {t: {s: [] for s in scenarios} for t, _ in trees}
    for r in range(rounds):
        for name, code in (trees if r % 2 == 0 else trees[::-1]):
            for s, us in _one_round(code, calls, scenarios).items():
                got[name][s].append(us)
    res = {t: {s: float(np.median(v)) for s, v in by.items()} | {"_runs": by} for t, by in got.items()}
    if baseline:
        # the ratio of each round's back-to-back pair, whose noise is shared
        res["paired"] = {s: float(np.median([b / t for b, t in zip(got["baseline"][s], got["this tree"][s])]))
                         for s in scenarios}
    return res


def render(res: dict, baseline: str | None, rounds: int, calls: int,
           scenarios: tuple = SCENARIOS) -> list[str]:
    head = "| scenario | this tree: CPU µs per call | calls/s per core |"
    sep = "|---|---:|---:|"
    if baseline:
        head += " baseline: CPU µs per call | baseline calls/s | ratio of medians | median of paired ratios |"
        sep += "---:|---:|---:|---:|"
    lines = [head, sep]
    for s in scenarios:
        us = res["this tree"][s]
        row = f"| {s} | {us:.1f} | {1e6 / us:,.0f} |"
        if baseline:
            b = res["baseline"][s]
            row += f" {b:.1f} | {1e6 / b:,.0f} | {b / us:.2f}× | {res['paired'][s]:.2f}× |"
        lines.append(row)
    lines.append("")
    lines.append(f"Medians of {rounds} rounds (trees alternating), {calls:,} calls per scenario and round, "
                 "each on a fresh cluster after a warm-up quarter; a call is one select with its finish "
                 "(`select`) or one select_pair with both finishes.")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="another checkout's root to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=8192)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--kv-capacity", type=int, default=0,
                    help="every server's kv_capacity_blocks in /server_info (0: none): the KV "
                         "index's capacity model on, in the trees that have one")
    ap.add_argument("--first-tokens", action="store_true",
                    help="every leg's first-token report in the frame with its finish, as the fleet "
                         "sends them (trees from before the reports, e.g. 90b8a7b, get none: the "
                         "comparison is then the whole per-placement cost of phase-aware load)")
    ap.add_argument("--_round", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.kv_capacity:
        os.environ["SPLITSERVE_PLACEMENT_KV_CAPACITY"] = str(a.kv_capacity)
    if a.first_tokens:
        os.environ["SPLITSERVE_PLACEMENT_FIRST_TOKENS"] = "1"
    scenarios = tuple(x for x in a.scenarios.split(",") if x)
    unknown = [x for x in scenarios if x not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario {unknown[0]!r}; expected some of {', '.join(SCENARIOS)}")
    if a._round:
        print(json.dumps({s: measure(s, a.calls) for s in scenarios}))
        return 0
    res = run(a.baseline, a.rounds, a.calls, scenarios)
    print("\n".join(render(res, a.baseline, a.rounds, a.calls, scenarios)))
    if a.json_out:
        a.json_out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
