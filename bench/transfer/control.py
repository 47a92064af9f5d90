"""KV-transfer control plane: round trip and critical path, p50/p99, hop by hop, on any machine.

Two rank processes (a context and a generation `KvTransceiver`, a small host KV pool, the tcp or
shm agent — the control plane is the same Python with any agent) measure:

- *round trip* (context_first): the context side already finished (`begin_send` + `finish_send`);
  the generation side posts its receive and waits for it to complete. Every destination block id
  is -1, so nothing is written: control messages only. Timed in the generation process from
  `begin_receive` to its `on_done` callback (`rt`), and to the waiting thread waking (`rt_wake`).
- *critical path* (generation_first): the receive is posted first (the context side holds it
  parked); then the context side calls `begin_send` + `finish_send` and the time until the
  generation side's `on_done` fires is measured across the two processes (one host:
  CLOCK_MONOTONIC is shared). `crit0`: nothing to write; `crit1`: one real 16-token block written
  (the completion must follow the bytes).
- *hops*: timestamps of each step of the round trip (methods of the transfer package wrapped in
  this benchmark's processes only), median µs after `begin_receive`.
- *CPU per iteration*: each rank process's CPU time (all its threads) over the measured
  iterations (one round trip and the two critical paths each, with the benchmark's own pipe
  commands), divided by their number; median over rounds. Less sensitive to a loaded machine
  than the latencies, and it shows what spinning listeners cost.

`--tree DIR` (repeatable) measures other checkouts in the same run, alternating trees round by
round so that load on a shared machine hits them alike: e.g. `git archive main | tar -x -C
/tmp/ctl-base` then `--tree /tmp/ctl-base --tree .`. Prints a Markdown table; never writes
bench/RESULTS.md itself.

`--spin-us N` sets `TransferConfig.spin_s` (how long a listener busy-polls where a message is
expected; off by default) in every tree that has the
field (a tree without it runs as it is); repeated, its values alternate round by round like
trees, a row each: `--spin-us 0 --spin-us 500` says what spinning does.

Usage: `python bench/transfer/control.py [--agent tcp|shm|nixl] [--n 200] [--rounds 3] [--tree DIR]... [--spin-us N]`
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = Path(os.environ.get("SPLITSERVE_BENCH_TREE") or HERE.parents[2]).resolve()
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, HERE.parents[1], HERE.parent)]

TPB = 16
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
NUM_BLOCKS = 8

# (step name, module, class, method, the side it is stamped on or None for either): where the
# round trip's hops are timestamped. A lane read is the listener's first look at the message
# (woken or spinning), before it is decoded and routed.
HOPS = [("posted (gen)", "transfer.receiver", "Receiver", "_post_locked", None),
        ("lane read (ctx listener)", "transfer.messenger", "Messenger", "_read", "context"),
        ("recv handled (ctx listener)", "transfer.sender", "Sender", "on_recv", None),
        ("submitted (ctx)", "transfer.pump", "Pump", "_submit", None),
        ("completed (ctx)", "transfer.sender", "Sender", "complete_locked", None),
        ("lane read (gen listener)", "transfer.messenger", "Messenger", "_read", "generation"),
        ("result handled (gen)", "transfer.receiver", "Receiver", "on_result", None)]


def _instrument(stamps: dict, role: str) -> None:
    import importlib

    for name, mod, cls, meth, side in HOPS:
        if side is not None and side != role:
            continue
        c = getattr(importlib.import_module(mod), cls, None)
        fn = getattr(c, meth, None) if c is not None else None
        if fn is None:
            continue

        def wrap(fn=fn, name=name):
            def w(*a, **k):
                stamps.setdefault(name, time.monotonic())
                return fn(*a, **k)
            return w
        setattr(c, meth, wrap())


def rank_main(conn, role: str, kind: str, spin_us: float | None = None) -> None:
    """A rank process: its failure (an import, the agent, an assertion) goes back to the parent
    as ("error", traceback) instead of a bare closed pipe."""
    try:
        _rank_main(conn, role, kind, spin_us)
    except BaseException:
        import traceback

        try:
            conn.send(("error", f"{role} rank: {traceback.format_exc()}"))
        except Exception:
            pass
        raise


def _rank_main(conn, role: str, kind: str, spin_us: float | None = None) -> None:
    import numpy as np

    from transfer.page_table import LayerGroup, PageTable, PhysicalPool, PoolView
    from transfer.session import KvTransceiver, RankTopology, TransferConfig

    stamps: dict = {}
    _instrument(stamps, role)
    entry = TPB * KV_HEADS * HEAD_DIM * 2
    bb = LAYERS * 2 * entry
    nbytes = NUM_BLOCKS * bb
    if kind == "shm":
        from transfer.memory import alloc_shared_array
        pool = alloc_shared_array(nbytes)
    else:
        pool = np.zeros(nbytes, np.uint8)
    pool[:] = 7 if role == "context" else 0
    ppool = PhysicalPool(base=pool.ctypes.data, layer_stride=2 * entry, slot_stride=bb,
                         slot_bytes=2 * entry, num_slots=NUM_BLOCKS, layers=LAYERS,
                         mem_type="DRAM", device_id=0)
    view = PoolView(pool=0, role=frozenset(["kv"]), layer_ids=tuple(range(LAYERS)),
                    buffer_entries=tuple((l, c * entry, entry) for l in range(LAYERS)
                                         for c in (0, 1)), layout="NHD", kv_heads=KV_HEADS)
    pt = PageTable(tokens_per_block=TPB, pools=(ppool,),
                   groups=(LayerGroup(tuple(range(LAYERS)), (view,)),), dtype="bfloat16")
    extra = {}
    if spin_us is not None and "spin_s" in getattr(TransferConfig, "__dataclass_fields__", {}):
        extra["spin_s"] = spin_us * 1e-6
    tx = KvTransceiver(pt, RankTopology(role=role, num_layers=LAYERS, total_kv_heads=KV_HEADS,
                                        model="ctl"),
                       TransferConfig(agent=kind, send_timeout_s=60, recv_timeout_s=60, **extra))
    conn.send(("ready", tx.endpoint))
    done_at: dict[int, float] = {}
    events: dict[int, threading.Event] = {}

    def on_done(req):
        done_at[req] = time.monotonic()
        events[req].set()

    while True:
        cmd, a = conn.recv()
        if cmd == "exit":
            tx.shutdown()
            conn.send(None)
            return
        if cmd == "send":            # (req, ids)
            req, ids = a
            t0 = time.monotonic()
            tx.begin_send(req, TPB, ids)
            tx.finish_send(req, None)
            conn.send(t0)
        elif cmd == "wait_send":
            while not tx.send_status(a).quiescent:
                time.sleep(0.0005)
            tx.release_send(a)
            conn.send(None)
        elif cmd == "rt":            # (req, ep, ids) -> (rt, rt_wake, hops)
            req, ep, ids = a
            stamps.clear()
            events[req] = threading.Event()
            t0 = time.monotonic()
            tx.begin_receive(req, ep, TPB, ids, on_done=lambda r=req: on_done(r))
            events[req].wait(30)
            t1 = time.monotonic()
            assert tx.recv_status(req).state == "done", tx.recv_status(req).error
            tx.release_receive(req)
            conn.send((done_at.pop(req) - t0, t1 - t0, t0, dict(stamps)))
        elif cmd == "post":          # (req, ep, ids)
            req, ep, ids = a
            events[req] = threading.Event()
            tx.begin_receive(req, ep, TPB, ids, on_done=lambda r=req: on_done(r))
            conn.send(None)
        elif cmd == "done_at":
            events[a].wait(30)
            assert tx.recv_status(a).state == "done", tx.recv_status(a).error
            tx.release_receive(a)
            conn.send(done_at.pop(a))
        elif cmd == "stamps":
            conn.send(dict(stamps))
            stamps.clear()
        elif cmd == "cpu":           # this process's CPU time so far (every thread)
            conn.send(time.process_time())
        elif cmd == "spins":         # the listener's spins so far (trees that spin)
            conn.send(dict(getattr(tx.messenger.io, "spin_stats", {})))


def measure_tree(kind: str, n: int, spin_us: float | None = None) -> dict:
    ctx_mp = mp.get_context("spawn")
    ranks = {}
    for role in ("context", "generation"):
        parent, child = ctx_mp.Pipe()
        p = ctx_mp.Process(target=rank_main, args=(child, role, kind, spin_us), daemon=True)
        p.start()
        ranks[role] = (parent, p)

    def answer(role):
        conn, proc = ranks[role]
        try:
            out = conn.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"{role} rank process died (exit code {proc.exitcode}) without "
                               f"reporting an error") from None
        if isinstance(out, tuple) and len(out) == 2 and out[0] == "error":
            raise RuntimeError(out[1])
        return out

    def call(role, cmd, *a):
        ranks[role][0].send((cmd, a[0] if len(a) == 1 else a))
        return answer(role)

    eps = {r: answer(r)[1] for r in ranks}
    ep = eps["context"]
    out = {"rt": [], "rt_wake": [], "crit0": [], "crit1": [], "hops": {}}
    req = iter(range(1, 1 << 30))
    cpu0 = {}
    try:
        for i in range(n + 10):     # the first 10 wire up connections and agents
            if i == 10:
                cpu0 = {role: call(role, "cpu") for role in ranks}
            r = next(req)
            call("context", "send", r, [0])
            rt, rt_wake, t_post, hops = call("generation", "rt", r, ep, [-1])
            call("context", "wait_send", r)
            for case, dst in (("crit0", [-1]), ("crit1", [1 + i % (NUM_BLOCKS - 1)])):
                r2 = next(req)
                call("generation", "post", r2, ep, dst)
                time.sleep(0.002)   # the Recv reaches the context side and is parked
                t0 = call("context", "send", r2, [0])
                t1 = call("generation", "done_at", r2)
                call("context", "wait_send", r2)
                if i >= 10:
                    out[case].append(t1 - t0)
            if i >= 10:
                out["rt"].append(rt)
                out["rt_wake"].append(rt_wake)
                # both processes stamp CLOCK_MONOTONIC of one host: relative to the post
                for k, v in {**hops, **call("context", "stamps")}.items():
                    out["hops"].setdefault(k, []).append(v - t_post)
        # CPU per iteration (a round trip and both critical paths): what each rank process
        # spent, every thread (listeners spinning included), the parent's pipe commands too
        for role in ranks:
            out[f"cpu_{role}"] = [(call(role, "cpu") - cpu0[role]) / n] if n else [0.0]
            out[f"spins_{role}"] = [call(role, "spins")]
    finally:
        for role in ranks:
            try:
                call(role, "exit")
            except Exception:
                pass
            ranks[role][1].join(5)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", default="tcp", choices=["tcp", "shm", "nixl"])
    p.add_argument("--n", type=int, default=200, help="measured round trips per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", action="append", help="checkouts to compare (default: this one)")
    p.add_argument("--spin-us", type=float, action="append",
                   help="TransferConfig.spin_s in µs, in trees that have it: how long a listener "
                        "busy-polls where a message is expected (default: the tree's default); "
                        "repeat it to alternate the values, a row each")
    p.add_argument("--json", help="also write the raw samples here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:   # one round in one tree: samples as JSON on stdout
        print(json.dumps(measure_tree(args.agent, args.n,
                                      args.spin_us[-1] if args.spin_us else None)))
        return 0
    trees = [str(Path(t).resolve()) for t in (args.tree or [str(HERE.parents[2])])]
    spins = args.spin_us or [None]
    # one row per (tree, spin): alternated round by round, like the trees
    rows = [(t, sp, t if len(spins) == 1
             else f"{t} spin {'default' if sp is None else f'{sp:g} µs'}")
            for t in trees for sp in spins]
    samples = {label: {} for _t, _sp, label in rows}
    for rnd in range(args.rounds):
        for t, sp, label in rows:
            # The tree goes first; the rest of PYTHONPATH stays (on the GPU host the wheels are
            # installed in a --target folder named there: dropping it made every rank process
            # die on `import zmq`, seen by the parent only as EOFError on the rank's pipe).
            keep = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if x and Path(x).resolve() not in {Path(u).resolve() for u in trees}]
            env = dict(os.environ, SPLITSERVE_BENCH_TREE=t,
                       PYTHONPATH=os.pathsep.join([t] + keep))
            spin = [] if sp is None else ["--spin-us", str(sp)]
            r = subprocess.run([sys.executable, str(HERE), "--child", "--agent", args.agent,
                                "--n", str(args.n), *spin], env=env,
                               cwd=t, capture_output=True, text=True, timeout=600)
            if r.returncode:
                print(f"round {rnd} in {label} failed (exit {r.returncode}):\n{r.stderr[-6000:]}",
                      file=sys.stderr)
                return 1
            got = json.loads(r.stdout.strip().splitlines()[-1])
            for k, v in got.items():
                if k == "hops":
                    for h, xs in v.items():
                        samples[label].setdefault("hops", {}).setdefault(h, []).extend(xs)
                else:
                    samples[label].setdefault(k, []).extend(v)
            print(f"round {rnd} {label}: rt p50 {statistics.median(got['rt']) * 1e6:.0f} µs",
                  file=sys.stderr, flush=True)
    trees = [label for _t, _sp, label in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(samples))
    us = 1e6
    print(f"\nagent {args.agent}, {args.rounds} rounds × {args.n} per tree, alternating trees; "
          f"µs\n")
    print("| tree | round trip p50 | p99 | + waiter wakes p50 | critical path, nothing written "
          "p50 | p99 | critical path, 1 block p50 | p99 | CPU per iteration, context | "
          "generation |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in trees:
        s = samples[t]
        cpu = [f"{statistics.median(s[k]) * us:,.0f}" if s.get(k) else "—"
               for k in ("cpu_context", "cpu_generation")]
        print(f"| {t} | {statistics.median(s['rt']) * us:,.0f} | {pct(s['rt'], .99) * us:,.0f} | "
              f"{statistics.median(s['rt_wake']) * us:,.0f} | "
              f"{statistics.median(s['crit0']) * us:,.0f} | {pct(s['crit0'], .99) * us:,.0f} | "
              f"{statistics.median(s['crit1']) * us:,.0f} | {pct(s['crit1'], .99) * us:,.0f} | "
              f"{cpu[0]} | {cpu[1]} |")
    if any(x.get("caught") or x.get("ran_out") for t in trees
           for role in ("context", "generation") for x in samples[t].get(f"spins_{role}", ())):
        print("\nListener spins (all rounds, warm-up included): ended by a message / ran out, "
              "and the time spent spinning per measured iteration (µs):\n")
        print("| tree | context caught | ran out | µs/iteration | generation caught | ran out | "
              "µs/iteration |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for t in trees:
            cells = []
            for role in ("context", "generation"):
                st = samples[t].get(f"spins_{role}", [])
                caught = sum(x.get("caught", 0) for x in st)
                ran_out = sum(x.get("ran_out", 0) for x in st)
                per = sum(x.get("spin_s", 0.0) for x in st) / max(1, args.n * args.rounds)
                cells += [f"{caught:,}", f"{ran_out:,}", f"{per * us:,.0f}"]
            print(f"| {t} | " + " | ".join(cells) + " |")
    print("\nRound trip hop by hop (median µs after `begin_receive`):\n")
    names = [h[0] for h in HOPS]
    print("| tree | " + " | ".join(names) + " | on_done |")
    print("|---|" + "---:|" * (len(names) + 1))
    for t in trees:
        h = samples[t].get("hops", {})
        cells = [f"{statistics.median(h[n]) * us:,.0f}" if n in h else "—" for n in names]
        print(f"| {t} | " + " | ".join(cells) + f" | {statistics.median(samples[t]['rt']) * us:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
