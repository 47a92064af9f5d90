"""The host work of one direct GPU write's submit, without a GPU: `submit_prepped` of scattered
KV blocks with the device calls stubbed, per tree.

The agent is a `NixlAgent` with the pump's per-slot prepared lists and a peer whose pool is mapped
by CUDA IPC; the upload of the index or row table is a CPU tensor copy, the Triton launch and the
event records do nothing. What is left is what the tree does in Python and numpy per transfer:
index checks, route, coverage, translation, merges, the table.

Prints, per tree and block count: median µs per submit in a loop (warm), median µs per submit
after a 2 ms idle sleep (cold, as on the critical path: a listener thread that just woke), and
the Python-level function calls per submit (cProfile, deterministic). Trees run in their own
subprocesses, alternating, so they share the machine's state.

Usage: `python bench/transfer/submit_host.py [--tree DIR ...] [--blocks 64 ...] [--calls 2000]`
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 512 * 1024   # one 16-token block of the `1b` geometry
SLOTS = 8192


def child(tree: str, blocks: list[int], calls: int) -> dict:
    sys.path.insert(0, tree)
    import cProfile
    import pstats
    import threading
    import time

    import importlib.util
    import types

    import numpy as np
    import torch

    if importlib.util.find_spec("triton") is None:   # only `tl.int64`/`tl.uint8` are read
        tl = types.ModuleType("triton.language")
        tl.int64, tl.uint8 = "int64", "uint8"
        sys.modules["triton"] = types.ModuleType("triton")
        sys.modules["triton"].language = tl
        sys.modules["triton.language"] = tl
    import transfer.copy_kernels as ck
    import transfer.direct as dr
    import transfer.nixl_agent as na
    from transfer.descs import Coverage, Descs

    assert Path(ck.__file__).resolve().is_relative_to(Path(tree).resolve()), ck.__file__

    class Ev:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    class Stream:
        def wait_event(self, ev):
            pass

    class Launch:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    class Nixl:
        def prep_xfer_dlist(self, *a):
            return object()

    for k in ("int", "strided"):
        ck._KERNELS[k] = Launch()
    copier = ck.DeviceCopier.__new__(ck.DeviceCopier)
    copier.torch, copier.device, copier.tile = torch, torch.device("cpu"), ck.TILE
    copier._next, copier._fast, copier._checked = 0, True, True
    copier.warps, copier.mapped_ids = None, False   # as DeviceCopier.__init__ defaults them
    four = hasattr(ck.DeviceCopier, "_take_slot")   # this tree's slots carry their numpy view

    def slot(cap):
        host = torch.empty(cap, dtype=torch.int64)
        return (host, torch.empty(cap, dtype=torch.int64), Ev()) + ((host.numpy(),) if four else ())
    copier._slot = slot
    copier._slots = [slot(3 * 16384) for _ in range(8)]
    copier._enter = lambda stream: None
    copier._leave = lambda prev: None

    LB, RB, MB = 1 << 40, 2 << 40, 3 << 40   # local pool, peer's pool, its mapping here
    size = SLOTS * BLOCK
    dc = dr.DirectCopies()
    dc._copiers[0], dc._streams[0], dc._events[0] = copier, Stream(), [(Ev(), b"t" * 64)]
    pm = dr._PeerMap()
    pm.base, pm.size, pm.mapped = (np.array([v], np.uint64) for v in (RB, size, MB))
    pm.dev, pm.owned = [0], [False]
    pm.regions = Coverage([(RB, size, 0, "VRAM")])
    dc.peers["peer"] = pm
    a = na.NixlAgent.__new__(na.NixlAgent)
    a._lock, a._remotes, a._direct, a._preps = threading.RLock(), {"peer"}, dc, {}
    a._local, a._nixl_inflight, a._errors, a._agent = Coverage([(LB, size, 0, "VRAM")]), set(), (), Nixl()

    def slots(base):
        arr = np.zeros((SLOTS, 3), np.uint64)
        arr[:, 0] = np.uint64(base) + np.arange(SLOTS, dtype=np.uint64) * np.uint64(BLOCK)
        arr[:, 1] = BLOCK
        return Descs(arr, "VRAM")
    lp, rp = a.prep_descs(None, slots(LB)), a.prep_descs("peer", slots(RB))
    rng = np.random.default_rng(0)
    out = {}
    for nb in blocks:
        si = rng.permutation(SLOTS)[:nb].astype(np.int64)
        di = rng.permutation(SLOTS)[:nb].astype(np.int64)

        def one():
            x = a.submit_prepped("peer", lp, si, rp, di, notif=b"")
            assert x.ready == b"t" * 64   # went the direct way
        for _ in range(50):
            one()
        warm = []
        for _ in range(calls):
            t0 = time.perf_counter()
            one()
            warm.append(time.perf_counter() - t0)
        cold = []
        for _ in range(max(50, calls // 10)):
            time.sleep(0.002)
            t0 = time.perf_counter()
            one()
            cold.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            one()
        prof.disable()
        ncalls = pstats.Stats(prof).total_calls / 100
        if os.environ.get("SUBMIT_HOST_PROFILE"):
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
        out[nb] = (statistics.median(warm) * 1e6, statistics.median(cold) * 1e6, ncalls)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", help="a checkout (default: this one)")
    p.add_argument("--blocks", type=int, action="append")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="cProfile of 100 submits per tree and "
                   "block count, one round (no table)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    blocks = args.blocks or [64, 256, 1024, 4096]
    if args.child:
        print(json.dumps(child(args.child, blocks, args.calls)))
        return 0
    trees = [str(Path(t).resolve()) for t in (args.tree or [str(ROOT)])]
    res: dict = {t: [] for t in trees}
    env = dict(os.environ, PYTHONPATH="")
    if args.profile:
        for t in trees:
            cmd = [sys.executable, __file__, "--child", t, "--calls", "50"]
            for b in blocks:
                cmd += ["--blocks", str(b)]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=t,
                               env=dict(env, SUBMIT_HOST_PROFILE="1"))
            print(f"== {t}\n{r.stderr}")
        return 0
    for _ in range(args.rounds):
        for t in trees:
            cmd = [sys.executable, __file__, "--child", t, "--calls", str(args.calls)]
            for b in blocks:
                cmd += ["--blocks", str(b)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=t)
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            res[t].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"submit_prepped host work, device calls stubbed; {args.rounds} rounds, median of rounds; µs")
    print("| tree | blocks | warm µs | after 2 ms idle µs | Python calls |")
    print("|---|---:|---:|---:|---:|")
    for t in trees:
        for b in blocks:
            rows = [r[str(b)] for r in res[t]]
            w, c, n = (statistics.median(x[i] for x in rows) for i in range(3))
            print(f"| {t} | {b} | {w:.1f} | {c:.1f} | {n:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
