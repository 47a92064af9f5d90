"""KV-transfer benchmark: two rank processes, the `1b` KV shape, every available agent.

A context process and a generation process each hold a KV pool shaped like the worker's for the
`1b` preset (16 layers × K/V × 16 tokens × 8 KV heads × 64 dims per block, block-major, NHD) and a
`KvTransceiver`. For 1k/4k/16k/64k-token prompts it measures, per agent (NIXL when importable,
the TCP fallback, and the shared-memory fallback on CPU):

- the transfer time of one whole prompt — from the generation side posting its receive (the
  context side already finished) to the receive completing: control round trip, descriptor build,
  the writes, the completion message — and its bandwidth, next to a same-process copy of the same
  bytes in the same run (memcpy on CPU, a device-to-device copy on CUDA: the ceiling);
- descriptor counts: one per (layer, K/V, block) without merging, after merging runs contiguous
  on both sides (contiguous destination blocks), and for scattered destination blocks, with the
  measured time of the scattered case;
- TTFT of a 16k-token prompt (generation_first) with the transfer pipelined with prefill vs
  monolithic after it. Prefill is simulated (a sleep per chunk at `--prefill-tok-s`, default the
  1b H200 prefill rate measured by bench/worker/worker.py, 191k tok/s; 20k tok/s on CPU) so the numbers
  isolate how much transfer time pipelining hides: `hidden = 1 − exposed_pipelined /
  exposed_monolithic`, exposed = TTFT − prefill time.

Usage: `python bench/transfer/transfer.py [--device cpu|cuda] [--quick] [--no-write]`. Appends (or
replaces) this configuration's subsection under `## transfer` in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as `python bench/<subject>/<script>.py`, sys.path[0] is bench/<subject>/, whose fleet.py, worker.py,
# coordinator.py... would shadow the packages of those names: the repository root goes first and
# bench/ and this folder are dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench", Path(__file__).resolve().parent)]

from bench._common import cpu_model, replace_subsection  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, TPB = 16, 8, 64, 16   # the 1b preset's KV geometry, block size 16
SIZES = [1024, 4096, 16384, 65536]
QUICK_SIZES = [1024, 4096]


def elt_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def block_bytes(dtype: str) -> int:
    return LAYERS * 2 * TPB * KV_HEADS * HEAD_DIM * elt_bytes(dtype)


def page_table(base: int, num_blocks: int, dtype: str, mem: str, dev: int):
    from transfer.page_table import LayerGroup, PageTable, PhysicalPool, PoolView

    entry = TPB * KV_HEADS * HEAD_DIM * elt_bytes(dtype)
    pool = PhysicalPool(base=base, layer_stride=2 * entry, slot_stride=LAYERS * 2 * entry,
                        slot_bytes=2 * entry, num_slots=num_blocks, layers=LAYERS, mem_type=mem,
                        device_id=dev)
    view = PoolView(pool=0, role=frozenset(["kv"]), layer_ids=tuple(range(LAYERS)),
                    buffer_entries=tuple((l, c * entry, entry) for l in range(LAYERS) for c in (0, 1)),
                    layout="NHD", kv_heads=KV_HEADS)
    return PageTable(tokens_per_block=TPB, pools=(pool,),
                     groups=(LayerGroup(tuple(range(LAYERS)), (view,)),), dtype=dtype)


# ------------------------------------------------------------------------------ rank process
def rank_main(conn, role: str, device: str, kind: str, num_blocks: int, dtype: str,
              pipeline: bool) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    import torch

    from transfer.session import KvTransceiver, RankTopology, TransferConfig

    nbytes = num_blocks * block_bytes(dtype)
    if device == "cuda":
        torch.cuda.init()
        pool = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        mem, dev = "VRAM", torch.cuda.current_device()
    elif kind == "shm":
        from transfer.memory import alloc_shared_host

        pool, mem, dev = alloc_shared_host(nbytes), "DRAM", 0
    else:
        pool, mem, dev = torch.empty(nbytes, dtype=torch.uint8), "DRAM", 0
    if role == "context":
        g = torch.Generator(device=pool.device).manual_seed(1)
        pool.random_(0, 256, generator=g)
    else:
        pool.zero_()
    tx = KvTransceiver(page_table(pool.data_ptr(), num_blocks, dtype, mem, dev),
                       RankTopology(role=role, num_layers=LAYERS, total_kv_heads=KV_HEADS, model="1b"),
                       TransferConfig(agent=kind, pipeline=pipeline, send_timeout_s=600,
                                      recv_timeout_s=600))
    conn.send(("ready", tx.endpoint, tx.agent.kind))

    def wait(fn, req):
        while True:
            st = fn(req)
            if st.quiescent:
                return st
            time.sleep(0.0002)

    while True:
        cmd, a = conn.recv()
        try:
            if cmd == "exit":
                tx.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "send":          # (req, ntok, ids): context_first, prefill already done
                req, ntok, ids = a
                tx.begin_send(req, ntok, ids)
                tx.finish_send(req, None)
                out = None
            elif cmd == "prefill":     # (req, ntok, ids, chunk, rate): generation_first, simulated
                req, ntok, ids, chunk, rate = a
                t0 = time.monotonic()
                tx.begin_send(req, ntok, ids)
                done = 0
                while done < ntok:
                    n = min(chunk, ntok - done)
                    time.sleep(n / rate)
                    done += n
                    if done < ntok:
                        tx.progress_send(req, done)
                tx.finish_send(req, None)
                out = t0
            elif cmd == "pipeline":    # (on,): pipelined slices on/off for later sends
                tx.cfg.pipeline = bool(a[0])
                out = None
            elif cmd == "wait_send":
                st = wait(tx.send_status, a[0])
                tx.release_send(a[0])
                out = (st.state, st.bytes, st.descriptors, st.write_s)
            elif cmd == "recv":        # (req, ep, ntok, ids) -> seconds from post to done
                req, ep, ntok, ids = a
                ev = threading.Event()
                t0 = time.monotonic()
                tx.begin_receive(req, ep, ntok, ids, on_done=ev.set)
                ev.wait(600)
                t1 = time.monotonic()
                st = tx.recv_status(req)
                tx.release_receive(req)
                out = (st.state, t1 - t0, st.error)
            elif cmd == "post_recv":
                req, ep, ntok, ids = a
                tx.begin_receive(req, ep, ntok, ids)
                out = None
            elif cmd == "wait_recv":   # -> monotonic time of completion (same host clock)
                st = wait(tx.recv_status, a[0])
                t1 = time.monotonic()
                tx.release_receive(a[0])
                out = (st.state, t1, st.error)
            elif cmd == "digest":      # a cheap fingerprint of blocks, to check the bytes moved
                idx = torch.as_tensor(a[0], device=pool.device)
                blocks = pool.view(num_blocks, -1)[idx]
                out = int(blocks.view(torch.int64).sum().item()) if blocks.numel() % 8 == 0 \
                    else int(blocks.sum().item())
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


class Rank:
    def __init__(self, role, device, kind, num_blocks, dtype, pipeline=True):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, role, device, kind, num_blocks,
                                                        dtype, pipeline), daemon=True)
        self.proc.start()
        if not self.conn.poll(300):
            raise RuntimeError(f"{role} rank did not start")
        _, self.endpoint, self.kind = self.conn.recv()

    def __call__(self, cmd, *a, timeout=600):
        self.conn.send((cmd, a))
        if not self.conn.poll(timeout):
            raise RuntimeError(f"rank did not answer {cmd}")
        st, out = self.conn.recv()
        if st == "err":
            raise RuntimeError(out)
        return out

    def close(self):
        try:
            self("exit", timeout=30)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ------------------------------------------------------------------------------ measurements
def copy_baseline(device: str, nbytes: int, repeats: int) -> float:
    """Seconds for one same-process copy of `nbytes` (best of `repeats`: a ceiling is the best
    case; transfers report medians)."""
    import torch

    if device == "cuda":
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        return min(ts)
    import numpy as np

    a = np.ones(nbytes, np.uint8)
    b = np.zeros(nbytes, np.uint8)
    np.copyto(b, a)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return min(ts)


def descriptor_counts(ntok: int, dtype: str) -> tuple[int, int]:
    """(unmerged, merged) descriptor counts for contiguous ids, from the real mapper."""
    from transfer.mappers import build_mapper

    nblk = -(-ntok // TPB)
    pt = page_table(1 << 40, nblk, dtype, "DRAM", 0)
    pt2 = page_table(1 << 41, nblk, dtype, "DRAM", 0)
    v, v2 = pt.groups[0].views[0], pt2.groups[0].views[0]
    m = build_mapper(pt, 0, v, pt2, 0, v2, range(LAYERS))
    src, dst, size = m.copies(list(range(nblk)), list(range(nblk)))
    return nblk * LAYERS * 2, int(size.size)


def run(args) -> tuple[str, dict]:
    import numpy as np

    device, dtype = args.device, args.dtype
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = 2 if args.quick else args.repeats
    max_tok = max(sizes + [args.ttft_tokens])
    num_blocks = -(-max_tok // TPB) + 8
    kinds = args.agent or (["tcp"] if args.quick else
                           (["nixl", "tcp"] + (["shm"] if device == "cpu" else [])))
    rate = args.prefill_tok_s or (191_000.0 if device == "cuda" else 20_000.0)
    results: dict = {"bw": {}, "write": {}, "scatter": {}, "ttft": {}, "kinds": []}
    base: dict[int, float] = {}
    req = iter(range(1, 1 << 30))
    rng = np.random.default_rng(0)
    for kind in kinds:
        try:
            ctx = Rank("context", device, kind, num_blocks, dtype)
            gen = Rank("generation", device, kind, num_blocks, dtype)
        except RuntimeError as e:
            print(f"agent {kind}: unavailable ({e})", file=sys.stderr)
            continue
        try:
            actual = ctx.kind
            results["kinds"].append(actual)
            # warm-up: connection wire-up and agent loading happen on first contact
            for _ in range(2):
                r = next(req)
                ctx("send", r, 64, [0, 1, 2, 3])
                gen("recv", r, ctx.endpoint, 64, [0, 1, 2, 3])
                ctx("wait_send", r)
            for ntok in sizes:
                nblk = -(-ntok // TPB)
                ids = list(range(nblk))
                # the ceiling, measured right next to the transfers it is compared with (the
                # machine may be shared); best over every agent's turn
                base[ntok] = min(base.get(ntok, float("inf")),
                                 copy_baseline(device, nblk * block_bytes(dtype), max(3, repeats)))
                ts, ws = [], []
                for _ in range(repeats):
                    r = next(req)
                    ctx("send", r, ntok, ids)
                    state, dt, err = gen("recv", r, ctx.endpoint, ntok, ids)
                    assert state == "done", err
                    _, nbytes, ndesc, write_s = ctx("wait_send", r)
                    ts.append(dt)
                    ws.append(write_s)
                assert ctx("digest", ids) == gen("digest", ids), "bytes differ after transfer"
                results["bw"][(actual, ntok)] = (statistics.median(ts), nbytes, ndesc)
                results["write"][(actual, ntok)] = statistics.median(ws)
                # scattered destination blocks: nothing merges across blocks
                perm = [int(x) for x in rng.permutation(num_blocks)[:nblk]]
                r = next(req)
                ctx("send", r, ntok, ids)
                state, dt, err = gen("recv", r, ctx.endpoint, ntok, perm)
                assert state == "done", err
                _, _, ndesc_s, _ = ctx("wait_send", r)
                results["scatter"][(actual, ntok)] = (dt, ndesc_s)
                print(f"{actual:5s} {ntok:6d} tok: {statistics.median(ts) * 1e3:9.2f} ms "
                      f"({nbytes / statistics.median(ts) / 1e9:7.2f} GB/s, {ndesc} desc) "
                      f"scattered {dt * 1e3:9.2f} ms ({ndesc_s} desc)", flush=True)
            # TTFT: generation_first, simulated prefill in chunks, transfer pipelined or not
            ntok = args.ttft_tokens
            ids = list(range(-(-ntok // TPB)))
            for pipeline in (True, False):
                ctx("pipeline", pipeline)
                vals = []
                for _ in range(repeats):
                    r = next(req)
                    gen("post_recv", r, ctx.endpoint, ntok, ids)
                    time.sleep(0.05)  # the receive is posted before prefill starts
                    t0 = ctx("prefill", r, ntok, ids, args.chunk, rate)
                    state, t1, err = gen("wait_recv", r)
                    assert state == "done", err
                    ctx("wait_send", r)
                    vals.append(t1 - t0)
                results["ttft"][(actual, pipeline)] = statistics.median(vals)
        finally:
            ctx.close()
            gen.close()
        prefill = ntok / rate
        tp, tm = results["ttft"][(actual, True)], results["ttft"][(actual, False)]
        print(f"{actual:5s} TTFT {ntok} tok: pipelined {tp * 1e3:.1f} ms, monolithic "
              f"{tm * 1e3:.1f} ms (prefill {prefill * 1e3:.1f} ms)", flush=True)
    return render(args, results, base, rate), results


def render(args, results, base, rate) -> str:
    sizes = QUICK_SIZES if args.quick else SIZES
    kinds = results["kinds"]
    ceiling = "device-to-device copy" if args.device == "cuda" else "memcpy"
    lines = [
        f"- command: `python bench/transfer/transfer.py --device {args.device}"
        f"{' --quick' if args.quick else ''}`",
        f"- machine: {machine(args.device)}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- KV shape: `1b` ({LAYERS} layers × K/V × {TPB} tokens × {KV_HEADS} heads × {HEAD_DIM} dims, "
        f"{args.dtype}) = {block_bytes(args.dtype) // 1024} KiB per block, "
        f"{block_bytes(args.dtype) // TPB // 1024} KiB per token; two processes. *e2e* = receive "
        f"posted → receive complete (control round trip included); *write* = the writes alone, "
        f"submit → done on the context side; medians of {2 if args.quick else args.repeats}",
        "",
        "| tokens | KV MiB | " + " | ".join(f"{k} e2e ms | {k} e2e GB/s | {k} write ms | "
                                             f"{k} write GB/s | {k} write % of ceiling"
                                             for k in kinds)
        + f" | {ceiling} ms | {ceiling} GB/s |",
        "|---:|---:|" + "---:|---:|---:|---:|---:|" * len(kinds) + "---:|---:|",
    ]
    for ntok in sizes:
        nb = -(-ntok // TPB) * block_bytes(args.dtype)
        row = [f"{ntok:,}", f"{nb / 2**20:,.0f}"]
        for k in kinds:
            t, nbytes, _ = results["bw"].get((k, ntok), (float("nan"), nb, 0))
            w = results["write"].get((k, ntok), float("nan")) or float("nan")
            row += [f"{t * 1e3:,.2f}", f"{nbytes / t / 1e9:,.2f}", f"{w * 1e3:,.2f}",
                    f"{nbytes / w / 1e9:,.2f}", f"{base[ntok] / w * 100:.0f}%"]
        row += [f"{base[ntok] * 1e3:,.2f}", f"{nb / base[ntok] / 1e9:,.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Descriptors per transfer (unmerged = one per layer × K/V × block; merged = runs "
              "contiguous on both sides; scattered = destination blocks permuted):", "",
              "| tokens | unmerged | merged, contiguous | " +
              " | ".join(f"{k} scattered: descs | {k} scattered ms | {k} contiguous ms"
                         for k in kinds) + " |",
              "|---:|---:|---:|" + "---:|---:|---:|" * len(kinds)]
    for ntok in sizes:
        unmerged, merged = descriptor_counts(ntok, args.dtype)
        row = [f"{ntok:,}", f"{unmerged:,}", f"{merged:,}"]
        for k in kinds:
            dt, nd = results["scatter"].get((k, ntok), (float("nan"), 0))
            row += [f"{nd:,}", f"{dt * 1e3:,.2f}", f"{results['bw'][(k, ntok)][0] * 1e3:,.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    prefill = args.ttft_tokens / rate
    lines += ["", f"TTFT of a {args.ttft_tokens:,}-token prompt (generation_first; prefill "
              f"simulated at {rate:,.0f} tok/s in {args.chunk}-token chunks = "
              f"{prefill * 1e3:,.1f} ms):", "",
              "| agent | pipelined ms | monolithic ms | exposed transfer pipelined ms | "
              "exposed monolithic ms | transfer hidden |", "|---|---:|---:|---:|---:|---:|"]
    for k in kinds:
        tp, tm = results["ttft"][(k, True)], results["ttft"][(k, False)]
        ep, em = max(0.0, tp - prefill), max(1e-9, tm - prefill)
        lines.append(f"| {k} | {tp * 1e3:,.1f} | {tm * 1e3:,.1f} | {ep * 1e3:,.1f} | "
                     f"{em * 1e3:,.1f} | {max(0.0, 1 - ep / em) * 100:.0f}% |")
    return "\n".join(lines)


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{cpu_model()}, {os.cpu_count()} logical CPUs (torch {torch.__version__})"


def write_results(path: Path, body: str, title: str) -> None:
    """Replace this configuration's subsection under ``## transfer`` (or add it)."""
    replace_subsection(path, "transfer", title, body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--agent", action="append", choices=["nixl", "tcp", "shm"],
                   help="agents to measure (default: nixl, tcp, and shm on cpu; --quick: tcp)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ttft-tokens", type=int, default=None, help="TTFT prompt (default 16384)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--prefill-tok-s", type=float, default=None)
    p.add_argument("--quick", action="store_true", help="small sizes, tcp only (smoke test)")
    p.add_argument("--no-write", action="store_true", help="do not touch bench/RESULTS.md")
    p.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    args = p.parse_args(argv)
    if args.ttft_tokens is None:
        args.ttft_tokens = 4096 if args.quick else 16384
    if args.quick:
        args.chunk = min(args.chunk, 1024)
    body, _ = run(args)
    title = f"### {args.device} · {args.dtype}" + (" · quick" if args.quick else "")
    print(f"\n## transfer — {args.device}\n\n{body}")
    if not args.no_write:
        write_results(Path(args.results), body, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
