"""Where the host time of one direct GPU write goes: `DeviceCopier.copy` (the row table, its upload,
the Triton launch) for scattered KV blocks, in one process on one GPU, no peer.

Prints the median host µs per call of: `copy_strided` (what a prepared-list direct write queues:
the picked indices uploaded, one launch), the whole `copy`, its table upload alone, the kernel
launch alone (table already on the device), the same with the interprocess end event recorded
(what a direct write adds), and a cProfile of `copy` (top functions by own time); and the device
time of both kernels and of a torch copy of the same bytes. Needs CUDA.

Usage: `python bench/transfer/submit_probe.py [--blocks 64 --blocks 1024] [--calls 300]`
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

BLOCK = 512 * 1024   # one 16-token block of the `1b` geometry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, action="append")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--sweep", action="store_true", help="only the strided kernel's device time "
                   "per (tile, num_warps), against a torch copy of the same bytes")
    args = p.parse_args(argv)
    import numpy as np
    import torch
    import triton.language as tl

    from transfer import copy_kernels as ck

    slots = 4096
    src = torch.empty(slots * BLOCK, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copier = ck.DeviceCopier(torch.cuda.current_device())
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)

    def device_us(fn, n=20):
        ts = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a.record()
                fn()
                b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return statistics.median(ts)

    if args.sweep:
        for nb in args.blocks or [64, 1024, 4096]:
            si = rng.permutation(slots)[:nb].astype(np.int64)
            di = rng.permutation(slots)[:nb].astype(np.int64)
            base = device_us(lambda: dst[:nb * BLOCK].copy_(src[:nb * BLOCK]))
            cells = []
            for tile in (16 << 10, 32 << 10, 64 << 10, 128 << 10):
                for warps in (4, 8, 16):
                    c = ck.DeviceCopier(torch.cuda.current_device(), tile=tile, warps=warps)

                    def go(c=c):
                        c.copy_strided(src.data_ptr(), BLOCK, si, dst.data_ptr(), BLOCK, di, BLOCK,
                                       stream)
                    go()
                    t = device_us(go)
                    cells.append(f"{tile >> 10}K/{warps}w {t:.1f} ({t / base:.2f}x)")
            print(f"{nb} blocks, torch copy {base:.1f} µs; strided kernel: " + ", ".join(cells),
                  flush=True)
        return 0
    for nb in args.blocks or [64, 1024]:
        s = src.data_ptr() + rng.permutation(slots)[:nb].astype(np.uint64) * np.uint64(BLOCK)
        d = dst.data_ptr() + rng.permutation(slots)[:nb].astype(np.uint64) * np.uint64(BLOCK)
        n = np.full(nb, BLOCK, np.uint64)
        for _ in range(20):   # compile, warm the launcher's caches
            copier.copy(s, d, n, stream)
        torch.cuda.synchronize()

        def timed(fn):
            ts = []
            for i in range(args.calls):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
                if i % 16 == 15:
                    stream.synchronize()
            stream.synchronize()
            return statistics.median(ts) * 1e6

        whole = timed(lambda: copier.copy(s, d, n, stream))
        table = np.stack([np.arange(nb, dtype=np.int64)] * 3)

        def upload_one():
            prev = copier._enter(stream)
            copier._upload(table, stream)
            copier._leave(prev)
        upload = timed(upload_one)
        # the launch alone: the table as copy() would make it (rows of 512 KiB: 8 tiles each)
        so = ((s.astype(np.int64) - int(s[0])) // 16)
        do = ((d.astype(np.int64) - int(d[0])) // 16)
        prev = copier._enter(stream)
        tab = copier._upload(np.stack([so, do, (n // np.uint64(16)).astype(np.int64)]), stream)
        copier._leave(prev)
        tiles = BLOCK // ck.TILE

        def launch():
            prev = copier._enter(stream)
            ck._kernel()[(nb * tiles,)](int(s[0]), int(d[0]), tab, nb, tiles, VEC=2,
                                        TILE_E=ck.TILE // 8, ELT=tl.int64, num_warps=8)
            copier._leave(prev)
        launch_us = timed(launch)

        def torch_scopes():
            with torch.cuda.device(copier.device), torch.cuda.stream(stream):
                pass

        def our_scope():
            copier._leave(copier._enter(stream))
        scopes = (timed(torch_scopes), timed(our_scope))
        ev = torch.cuda.Event(interprocess=True)
        ev.ipc_handle()

        def copy_and_event():
            copier.copy(s, d, n, stream)
            ev.record(stream)
        with_event = timed(copy_and_event)
        # what a prepared-list direct write queues now (DirectCopies.write_strided): the picked
        # slot indices uploaded, one `_copy_strided` launch, no row table built on the host
        si = rng.permutation(slots)[:nb].astype(np.int64)
        di = rng.permutation(slots)[:nb].astype(np.int64)
        for _ in range(20):
            copier.copy_strided(src.data_ptr(), BLOCK, si, dst.data_ptr(), BLOCK, di, BLOCK, stream)
        strided = timed(lambda: copier.copy_strided(src.data_ptr(), BLOCK, si, dst.data_ptr(),
                                                    BLOCK, di, BLOCK, stream))
        # the experiment: the kernel reads the indices from the pinned slot (no upload)
        mapped = ck.DeviceCopier(torch.cuda.current_device(), mapped_ids=True)
        try:
            for _ in range(20):
                mapped.copy_strided(src.data_ptr(), BLOCK, si, dst.data_ptr(), BLOCK, di, BLOCK,
                                    stream)
            stream.synchronize()
            ok = torch.equal(dst[di[0] * BLOCK:(di[0] + 1) * BLOCK],
                             src[si[0] * BLOCK:(si[0] + 1) * BLOCK])
            mapped_host = timed(lambda: mapped.copy_strided(src.data_ptr(), BLOCK, si,
                                                            dst.data_ptr(), BLOCK, di, BLOCK,
                                                            stream))
            mapped_dev = device_us(lambda: mapped.copy_strided(src.data_ptr(), BLOCK, si,
                                                               dst.data_ptr(), BLOCK, di, BLOCK,
                                                               stream))
            mapped_line = (f"mapped indices: host {mapped_host:.1f} µs, device {mapped_dev:.1f} "
                           f"µs, bytes right: {ok}")
        except Exception as e:   # an experiment: say why it did not run
            mapped_line = f"mapped indices: failed ({type(e).__name__}: {e})"
        # the device time of each kernel for the same blocks, against a device copy of the bytes
        dev_t = {name: device_us(fn) for name, fn in (
            ("rows", lambda: copier.copy(s, d, n, stream)),
            ("strided", lambda: copier.copy_strided(src.data_ptr(), BLOCK, si, dst.data_ptr(),
                                                    BLOCK, di, BLOCK, stream)),
            ("torch copy", lambda: dst[:nb * BLOCK].copy_(src[:nb * BLOCK])))}
        print(f"{nb} blocks: copy_strided {strided:.1f} µs host; device µs: "
              + ", ".join(f"{k} {v:.1f}" for k, v in dev_t.items()) + f"; {mapped_line}",
              flush=True)
        print(f"{nb} blocks: copy {whole:.1f} µs (upload {upload:.1f}, launch {launch_us:.1f}); "
              f"copy + interprocess event record {with_event:.1f} µs; stream scope: torch's "
              f"context managers {scopes[0]:.1f} µs, DeviceCopier._enter/_leave {scopes[1]:.1f} "
              f"µs (fast path: {copier._fast})", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            copier.copy(s, d, n, stream)
        prof.disable()
        stream.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print("\n".join(out.getvalue().splitlines()[:30]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
