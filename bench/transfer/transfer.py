"""KV-transfer benchmark: two rank processes, a worker-shaped KV pool, every available agent.

A context process and a generation process each hold a KV pool shaped like the worker's
(block-major, NHD: one block holds every layer's K and V for 16 tokens) and a `KvTransceiver`.
Geometries: `1b` (16 layers × 8 KV heads × 64 dims, 32 KiB per token) and `70b` (80 layers × 8 KV
heads × 128 dims, 320 KiB per token; its token counts stop at 32k so both pools and the ceiling's
buffers fit one 80 GB GPU). For each prompt size and agent it measures (medians):

- *scattered* (the primary rows: a paged pool after minutes of serving): source and destination
  blocks are fresh random permutations of each pool, so no two blocks merge;
- *contiguous* (the best case): blocks 0..n-1 on both sides;
- *e2e* = the generation side posting its receive (the context side already finished) → the
  receive completing: control round trip, descriptor build, the writes, the completion message;
- *write* = the writes alone, submit → done as the context side's transfer thread saw it;
- *control* = the same protocol with every destination block id -1: nothing is written, so it is
  the control round trip alone;
- *× copy* = e2e over a same-process copy of the same bytes measured in the same run (a
  device-to-device copy on CUDA, memcpy on CPU: the ceiling);
- the bytes are checked block by block after the scattered transfer (per-block checksums).

Then the TTFT of a 16k-token prompt (generation_first, `1b`) with the transfer pipelined with
prefill vs monolithic after it. Prefill is simulated (a sleep per chunk at `--prefill-tok-s`,
default the 1b H200 prefill rate measured by bench/worker/worker.py, 191k tok/s; 20k tok/s on CPU) so the
numbers isolate how much transfer time pipelining hides: `hidden = 1 − exposed_pipelined /
exposed_monolithic`, exposed = TTFT − prefill time. On CUDA (`--real-prefill`, the default there)
the same TTFT again with the worker's own `1b` ModelRunner doing the chunked prefill on the context
side (each chunk synchronised, then handed to the transfer, as the engine does), against the same
prefill with nothing sent.

Usage: `python bench/transfer/transfer.py [--device cpu|cuda] [--geometry 1b --geometry 70b] [--quick]
[--no-write]`. Appends (or replaces) this configuration's subsection under `## transfer` in
bench/RESULTS.md.
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

TPB = 16
# name -> (layers, KV heads, head dim, prompt sizes): the 1b preset, and a 70b-shaped model
GEOMETRIES = {"1b": (16, 8, 64, [1024, 4096, 16384, 65536]),
              "70b": (80, 8, 128, [1024, 4096, 16384, 32768])}
QUICK_SIZES = [1024, 4096]


def elt_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def block_bytes(dtype: str, geo: str = "1b") -> int:
    layers, heads, dim, _ = GEOMETRIES[geo]
    return layers * 2 * TPB * heads * dim * elt_bytes(dtype)


def page_table(base: int, num_blocks: int, dtype: str, mem: str, dev: int, geo: str = "1b"):
    from transfer.page_table import LayerGroup, PageTable, PhysicalPool, PoolView

    LAYERS, KV_HEADS, HEAD_DIM, _ = GEOMETRIES[geo]
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
              pipeline: bool, geo: str = "1b", real: str | None = None,
              engine_chunk: int | None = None) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    import numpy as np
    import torch

    from transfer.session import KvTransceiver, RankTopology, TransferConfig

    nbytes = num_blocks * block_bytes(dtype, geo)
    LAYERS, KV_HEADS = GEOMETRIES[geo][:2]
    runner = None
    if real:   # the worker's own model runner: its KV pool is what moves
        from transfer.page_table import PageTable
        from worker.presets import build_preset
        from worker.runner import ModelRunner

        wdt = getattr(torch, dtype)
        if device == "cuda":
            torch.cuda.init()
        runner = ModelRunner(build_preset(real, device=device, dtype=wdt), num_blocks,
                             block_size=TPB, device=device, dtype=wdt)
        pool = runner.kv_cache.view(-1).view(torch.uint8)
        LAYERS, KV_HEADS = runner.cfg.num_hidden_layers, runner.cfg.num_key_value_heads
        mem, dev = ("VRAM", torch.cuda.current_device()) if device == "cuda" else ("DRAM", 0)
    elif device == "cuda":
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
    pt = PageTable.from_runner_dict(runner.page_table()) if runner is not None else \
        page_table(pool.data_ptr(), num_blocks, dtype, mem, dev, geo)
    topo = RankTopology(role=role, num_layers=LAYERS, total_kv_heads=KV_HEADS, model=geo)
    tcfg = TransferConfig(agent=kind, pipeline=pipeline, send_timeout_s=600, recv_timeout_s=600)
    eng = None
    if engine_chunk:   # the worker's own engine (scheduler, step loop, KV connector) over runner
        eng = EngineRank(runner, real, device, engine_chunk, pt, topo, tcfg)
        tx = eng.tx
    else:
        tx = KvTransceiver(pt, topo, tcfg)
    conn.send(("ready", tx.endpoint, tx.agent.kind))
    posted: dict[int, threading.Event] = {}

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
                if eng is not None:
                    eng.close()
                else:
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
                if eng is not None:    # the connector releases its own sessions
                    st = eng.send_ended(a[0])
                else:
                    st = wait(tx.send_status, a[0])
                    tx.release_send(a[0])
                out = (st.state, st.bytes, st.descriptors, st.write_s, list(st.slices_done),
                       getattr(st, "submit_s", None))
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
            elif cmd == "engine_prefill":   # (req, ntok, send) -> EngineRank.prefill's dict
                req, ntok, send = a
                toks = [int(x) for x in np.random.default_rng(req).integers(
                    0, runner.cfg.vocab_size, ntok)]
                out = eng.prefill(req, toks, send)
            elif cmd == "post_recv":
                req, ep, ntok, ids = a
                posted[req] = threading.Event()

                def done(ev=posted[req]):
                    ev.at = time.monotonic()   # when the receive completed, not when asked
                    ev.set()
                tx.begin_receive(req, ep, ntok, ids, on_done=done)
                out = None
            elif cmd == "wait_recv":   # -> monotonic time of completion (same host clock)
                ev = posted.pop(a[0])
                ev.wait(600)
                t1 = getattr(ev, "at", time.monotonic())
                st = tx.recv_status(a[0])
                tx.release_receive(a[0])
                out = (st.state, t1, st.error)
            elif cmd == "digest":      # per-block checksums, in the order given
                bstride = runner.block_stride if runner is not None else nbytes // num_blocks
                blocks = pool[:num_blocks * bstride].view(num_blocks, -1).view(torch.int64)
                sums = []
                for i in range(0, len(a[0]), 256):
                    idx = torch.as_tensor(a[0][i:i + 256], device=pool.device)
                    sums += blocks[idx].sum(dim=1).tolist()
                out = sums
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


class EngineRank:
    """A context rank that is the worker's own engine: ``TorchEngine`` (scheduler, async step loop,
    chunked prefill of ``chunk`` tokens per step) with its ``TransferKvConnector``, on an asyncio
    loop of its own thread. A prompt goes in as an ``EngineRequest``; its KV leaves exactly as in
    a context worker. Timestamps (CLOCK_MONOTONIC, shared by the processes of one host): when
    each chunk was queued (``prefill_launched``) and seen written (``prefill_progress``), and when
    each slice's write was seen finished (the send session's ``slices_done``)."""

    def __init__(self, runner, model: str, device: str, chunk: int, pt, topo, tcfg):
        import asyncio

        from transfer.session import KvTransceiver
        from worker.engine import TorchEngine
        from worker.kv_connector_transfer import TransferKvConnector
        from protocol.tokenizer import ByteTokenizer

        times = self.times = {"launched": [], "written": []}
        ended = self.ended = {}

        class Recording(KvTransceiver):
            def release_send(self, request_id):
                ended[request_id] = self.send_status(request_id)
                super().release_send(request_id)

        class Timed(TransferKvConnector):
            def prefill_launched(self, req, tokens_done, block_ids, after):
                times["launched"].append(time.monotonic())
                super().prefill_launched(req, tokens_done, block_ids, after)

            def prefill_progress(self, req, tokens_done, block_ids):
                times["written"].append(time.monotonic())
                super().prefill_progress(req, tokens_done, block_ids)

        self.connector = Timed(lambda e: Recording(pt, topo, tcfg))
        self.engine = TorchEngine(runner, ByteTokenizer(vocab_size=runner.cfg.vocab_size),
                                  max_batch_size=4, max_num_tokens=chunk, pin_timeout_s=600,
                                  kv_connector=self.connector)
        if device == "cuda" and not self.engine.async_scheduling:
            raise RuntimeError("the engine rank needs async scheduling (single-rank CUDA runner)")
        self.tx = self.connector.tx
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True).start()
        self._run(self.engine.start())

    def _run(self, coro, timeout: float = 600):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def prefill(self, req: int, toks: list[int], send: bool) -> dict:
        """One prompt: ``send`` = a context_only request whose KV goes to whoever posted a receive
        for ``req``; else an ordinary request of one token (the same prefill, nothing sent)."""
        from worker.requests import (CONTEXT_AND_GENERATION, CONTEXT_ONLY, EngineRequest,
                                     SamplingParams)

        for v in self.times.values():
            v.clear()
        r = EngineRequest(request_id=f"bench-{req}", prompt_token_ids=toks,
                          sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                          request_type=CONTEXT_ONLY if send else CONTEXT_AND_GENERATION,
                          ctx_request_id=req if send else None)

        async def go():
            t0 = time.monotonic()
            first, ctx = None, None
            async for ev in await self.engine.submit(r):
                first = first or time.monotonic()
                if ev.error:
                    raise RuntimeError(f"request {req}: {ev.error}")
                ctx = ev.context or ctx
            return t0, first, ctx

        t0, first, ctx = self._run(go())
        return {"t0": t0, "first": first, "blocks": list(ctx.block_ids) if ctx else None,
                "launched": list(self.times["launched"]), "written": list(self.times["written"])}

    def send_ended(self, req: int, timeout: float = 60):
        """The send session's last status (it is released once quiescent)."""
        deadline = time.monotonic() + timeout
        while req not in self.ended and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.ended.pop(req)

    def close(self) -> None:
        self._run(self.engine.stop())
        self._run(self.connector.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


class Rank:
    def __init__(self, role, device, kind, num_blocks, dtype, pipeline=True, geo="1b", real=None,
                 engine_chunk=None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, role, device, kind, num_blocks,
                                                        dtype, pipeline, geo, real, engine_chunk),
                                daemon=True)
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


def sizes_for(args, geo: str) -> list[int]:
    return QUICK_SIZES if args.quick else GEOMETRIES[geo][3]


def measure(ctx: "Rank", gen: "Rank", ntok: int, src: list[int], dst: list[int], req) -> tuple:
    """One context_first transfer: (e2e s, write s, bytes, descriptors, submit s: the host's
    part of write s, None from a tree without it)."""
    r = next(req)
    ctx("send", r, ntok, src)
    state, dt, err = gen("recv", r, ctx.endpoint, ntok, dst)
    assert state == "done", err
    _, nbytes, ndesc, write_s, _, submit_s = ctx("wait_send", r)
    return dt, write_s, nbytes, ndesc, submit_s


def run(args) -> tuple[str, dict]:
    import numpy as np

    device, dtype = args.device, args.dtype
    repeats = 2 if args.quick else args.repeats
    kinds = args.agent or (["tcp"] if args.quick else
                           (["nixl", "tcp"] + (["shm"] if device == "cpu" else [])))
    rate = args.prefill_tok_s or (191_000.0 if device == "cuda" else 20_000.0)
    results: dict = {"rows": {}, "ttft": {}, "kinds": {}, "base": {}}
    req = iter(range(1, 1 << 30))
    rng = np.random.default_rng(0)
    med = statistics.median
    for geo in ([] if args.ttft_only else args.geometry):
        sizes = sizes_for(args, geo)
        ttft = geo == args.geometry[0]
        max_tok = max(sizes + ([args.ttft_tokens] if ttft else []))
        num_blocks = -(-max_tok // TPB) + 8
        bb = block_bytes(dtype, geo)
        results["kinds"][geo] = []
        for kind in kinds:
            try:
                ctx = Rank("context", device, kind, num_blocks, dtype, geo=geo)
                gen = Rank("generation", device, kind, num_blocks, dtype, geo=geo)
            except RuntimeError as e:
                print(f"agent {kind}: unavailable ({e})", file=sys.stderr)
                continue
            try:
                actual = ctx.kind
                results["kinds"][geo].append(actual)
                # warm-up: connection wire-up, agent loading and kernel compilation happen on
                # first contact
                for ids in ([0, 1, 2, 3], [5, 1, 7, 3]):
                    measure(ctx, gen, 64, ids, ids[::-1], req)
                for ntok in sizes:
                    nblk = -(-ntok // TPB)
                    ids = list(range(nblk))
                    key = (geo, ntok)
                    # the ceiling, measured right next to the transfers it is compared with (the
                    # machine may be shared); best over every agent's turn
                    results["base"][key] = min(results["base"].get(key, float("inf")),
                                               copy_baseline(device, nblk * bb, max(3, repeats)))
                    row = results["rows"][(geo, actual, ntok)] = {}
                    for case in ("scattered", "contiguous", "control"):
                        vals = []
                        for _ in range(repeats):
                            if case == "scattered":
                                src = [int(x) for x in rng.permutation(num_blocks)[:nblk]]
                                dst = [int(x) for x in rng.permutation(num_blocks)[:nblk]]
                            else:
                                src, dst = ids, ids if case == "contiguous" else [-1] * nblk
                            vals.append(measure(ctx, gen, ntok, src, dst, req))
                        if case == "scattered":
                            assert ctx("digest", src) == gen("digest", dst), \
                                "bytes differ after a scattered transfer"
                        subs = [v[4] for v in vals if v[4] is not None]
                        row[case] = (med(v[0] for v in vals), med(v[1] for v in vals),
                                     vals[-1][2], vals[-1][3], med(subs) if subs else None)
                    sc, co, cn = row["scattered"], row["contiguous"], row["control"]
                    base = results["base"][key]
                    print(f"{geo:4s} {actual:5s} {ntok:6d} tok: scattered {sc[0] * 1e3:8.3f} ms "
                          f"({sc[0] / base:5.2f}x copy, write {sc[1] * 1e3:.3f}"
                          + (f" (submit {sc[4] * 1e3:.3f})" if sc[4] is not None else "")
                          + f", {sc[3]} desc) "
                          f"contiguous {co[0] * 1e3:8.3f} ms ({co[0] / base:5.2f}x) control "
                          f"{cn[0] * 1e3:.3f} ms; copy {base * 1e3:.3f} ms", flush=True)
                if ttft:
                    # TTFT: generation_first, simulated prefill in chunks, pipelined or not
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
                        results["ttft"][(actual, pipeline)] = med(vals)
                    tp, tm = results["ttft"][(actual, True)], results["ttft"][(actual, False)]
                    print(f"{actual:5s} TTFT {ntok} tok: pipelined {tp * 1e3:.1f} ms, monolithic "
                          f"{tm * 1e3:.1f} ms (prefill {ntok / rate * 1e3:.1f} ms)", flush=True)
            finally:
                ctx.close()
                gen.close()
    if args.real_prefill:
        real_ttft(args, kinds, results, req, rng)
    return render(args, results, rate), results


def real_ttft(args, kinds, results, req, rng) -> None:
    """TTFT with the worker's own engine doing the chunked prefill on the context side: a
    ``TorchEngine`` (async scheduling, ``--chunk`` tokens per step) over the ``--real-model``
    runner, with its ``TransferKvConnector`` — the code a context worker runs. Per repeat, in
    turn: the prompt as an ordinary one-token request (*prefill alone*: submit → first token),
    then as a context_only request whose receive the generation process posted first, pipelined
    and monolithic (TTFT: submit → the generation side's receive done). Destination blocks are
    scattered; the bytes are checked after each mode."""
    med = statistics.median
    ntok, chunk = args.ttft_tokens, args.chunk
    nblk = -(-ntok // TPB)
    nb = 2 * nblk + 64
    results["ttft_real"] = {}
    results["overlap"] = {}
    for kind in kinds:
        try:
            ctx = Rank("context", args.device, kind, nb, args.dtype, real=args.real_model,
                       engine_chunk=chunk)
            gen = Rank("generation", args.device, kind, nb, args.dtype, real=args.real_model)
        except RuntimeError as e:
            print(f"agent {kind}: unavailable for the real prefill ({e})", file=sys.stderr)
            continue
        try:
            dst = [int(x) for x in rng.permutation(nb)[:nblk]]

            def alone() -> float:
                d = ctx("engine_prefill", next(req), ntok, False)
                return d["first"] - d["t0"]

            def sent(pipeline: bool):
                ctx("pipeline", pipeline)
                r = next(req)
                gen("post_recv", r, ctx.endpoint, ntok, dst)
                time.sleep(0.05)  # the receive is posted before prefill starts
                d = ctx("engine_prefill", r, ntok, True)
                state, t1, err = gen("wait_recv", r)
                assert state == "done", err
                st = ctx("wait_send", r)
                assert st[0] == "done", st
                assert ctx("digest", d["blocks"]) == gen("digest", dst[:len(d["blocks"])]), \
                    f"bytes differ after the {'pipelined' if pipeline else 'monolithic'} transfer"
                return t1 - d["t0"], t1, d, st[4]

            alone(), sent(True), sent(False)   # warm-up: kernels, graphs, connections
            vals: dict = {"alone": [], True: [], False: []}
            for _ in range(args.repeats):
                vals["alone"].append(alone())
                for pipeline in (True, False):
                    ttft, t1, d, done = sent(pipeline)
                    vals[pipeline].append(ttft)
                    if pipeline:
                        last = (t1, d, done)
            a, tp, tm = med(vals["alone"]), med(vals[True]), med(vals[False])
            results["ttft_real"][ctx.kind] = (a, tp, tm)
            t1, d, done = last
            wr = d["written"]
            # slice k's write vs the host seeing chunk k+1 written (its compute ended before)
            margins = [wr[k + 1] - done[k] for k in range(min(len(done), len(wr)) - 1)]
            results["overlap"][ctx.kind] = {
                "chunks": len(wr), "slices": len(done),
                "min_margin_ms": min(margins) * 1e3 if margins else None,
                "kv_landed_vs_answer_ms": (t1 - d["first"]) * 1e3}
            print(f"{ctx.kind:5s} real-prefill TTFT {ntok} tok (engine, {chunk}-token chunks): "
                  f"prefill alone {a * 1e3:.2f} ms, pipelined {tp * 1e3:.2f} ms, monolithic "
                  f"{tm * 1e3:.2f} ms; exposed {(tp - a) * 1e3:.3f} vs {(tm - a) * 1e3:.3f} ms; "
                  f"overlap {results['overlap'][ctx.kind]}", flush=True)
        finally:
            ctx.close()
            gen.close()


def render(args, results, rate) -> str:
    ceiling = "device-to-device copy" if args.device == "cuda" else "memcpy"
    lines = [
        f"- command: `python bench/transfer/transfer.py --device {args.device}"
        + "".join(f" --geometry {g}" for g in args.geometry)
        + "".join(f" --agent {k}" for k in (args.agent or []))
        + f"{' --quick' if args.quick else ''}{' --ttft-only' if args.ttft_only else ''}`",
        f"- machine: {machine(args.device)}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- two processes, block-major NHD pools, {TPB} tokens per block, {args.dtype}; *e2e* = "
        f"receive posted → receive complete; *write* = submit → done on the context side; "
        f"*control* = the same protocol with nothing to write; *× copy* = e2e ÷ a "
        f"{ceiling} of the same bytes in the same run; *descs* = descriptors after merging runs "
        f"contiguous on both sides; medians of {2 if args.quick else args.repeats}",
    ]
    for geo in args.geometry:
        layers, heads, dim, _ = GEOMETRIES[geo]
        bb = block_bytes(args.dtype, geo)
        for k in results["kinds"].get(geo, []):
            lines += ["", f"`{geo}` ({layers} layers × K/V × {heads} heads × {dim} dims = "
                      f"{bb // TPB // 1024} KiB per token), agent `{k}`:", "",
                      "| tokens | KV MiB | scattered e2e ms | scattered × copy | write ms | "
                      "control ms | descs | contiguous e2e ms | contiguous × copy | "
                      f"contiguous descs | {ceiling} ms |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for ntok in sizes_for(args, geo):
                row = results["rows"].get((geo, k, ntok))
                if row is None:
                    continue
                base = results["base"][(geo, ntok)]
                sc, co, cn = row["scattered"], row["contiguous"], row["control"]
                nb = -(-ntok // TPB) * bb
                lines.append(
                    f"| {ntok:,} | {nb / 2**20:,.0f} | {sc[0] * 1e3:,.3f} | {sc[0] / base:,.2f}× | "
                    f"{sc[1] * 1e3:,.3f} | {cn[0] * 1e3:,.3f} | {sc[3]:,} | {co[0] * 1e3:,.3f} | "
                    f"{co[0] / base:,.2f}× | {co[3]:,} | {base * 1e3:,.3f} |")
    if results["ttft"]:
        prefill = args.ttft_tokens / rate
        lines += ["", f"TTFT of a {args.ttft_tokens:,}-token prompt (`{args.geometry[0]}`, "
                  f"generation_first; prefill simulated at {rate:,.0f} tok/s in {args.chunk}-token "
                  f"chunks = {prefill * 1e3:,.1f} ms):", "",
                  "| agent | pipelined ms | monolithic ms | exposed transfer pipelined ms | "
                  "exposed monolithic ms | transfer hidden |", "|---|---:|---:|---:|---:|---:|"]
        for k in results["kinds"][args.geometry[0]]:
            tp, tm = results["ttft"][(k, True)], results["ttft"][(k, False)]
            ep, em = max(0.0, tp - prefill), max(1e-9, tm - prefill)
            lines.append(f"| {k} | {tp * 1e3:,.1f} | {tm * 1e3:,.1f} | {ep * 1e3:,.2f} | "
                         f"{em * 1e3:,.2f} | {max(0.0, 1 - ep / em) * 100:.0f}% |")
    if results.get("ttft_real"):
        lines += ["", f"TTFT of a {args.ttft_tokens:,}-token prompt with the real prefill (the "
                  f"worker's engine: `TorchEngine`, async scheduling, {args.chunk}-token chunks, "
                  f"its `TransferKvConnector`, the `{args.real_model}` model with random weights, "
                  f"{args.dtype}; generation_first, destination blocks scattered; *prefill alone* "
                  f"= the same prompt as an ordinary one-token request, submit → first token; "
                  f"TTFT = submit → the generation side's receive done; *exposed* = TTFT − prefill "
                  f"alone; medians of {args.repeats}, the three interleaved):", "",
                  "| agent | prefill alone ms | pipelined ms | monolithic ms | exposed pipelined "
                  "ms | exposed monolithic ms | transfer hidden |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for k, (alone, tp, tm) in results["ttft_real"].items():
            ep, em = tp - alone, tm - alone
            hidden = (1 - max(0.0, ep) / em) * 100 if em > 0 else float("nan")
            lines.append(f"| {k} | {alone * 1e3:,.2f} | {tp * 1e3:,.2f} | {tm * 1e3:,.2f} | "
                         f"{ep * 1e3:,.3f} | {em * 1e3:,.3f} | {hidden:.0f}% |")
        for k, o in results.get("overlap", {}).items():
            lines.append(f"\n{k}, last pipelined run: {o['chunks']} chunks, {o['slices']} slices; "
                         + (f"each slice's write was seen finished at least "
                            f"{o['min_margin_ms']:,.2f} ms before the host saw the next chunk "
                            f"written; " if o["min_margin_ms"] is not None else "") +
                         f"the KV was complete on the generation side "
                         f"{o['kv_landed_vs_answer_ms']:+,.2f} ms after the context engine's first "
                         f"token (negative: before it).")
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
    p.add_argument("--geometry", action="append", choices=sorted(GEOMETRIES),
                   help="KV geometries (default: 1b; the first one also runs the TTFT case)")
    p.add_argument("--agent", action="append", choices=["nixl", "tcp", "shm"],
                   help="agents to measure (default: nixl, tcp, and shm on cpu; --quick: tcp)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ttft-tokens", type=int, default=None, help="TTFT prompt (default 16384)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--prefill-tok-s", type=float, default=None)
    p.add_argument("--quick", action="store_true", help="small sizes, tcp only (smoke test)")
    p.add_argument("--real-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="also the TTFT with the worker's 1b model doing the prefill (default: on "
                        "cuda without --quick)")
    p.add_argument("--real-model", default="1b", help="preset for --real-prefill")
    p.add_argument("--ttft-only", action="store_true",
                   help="only the real-prefill TTFT (the worker's engine; implies --real-prefill)")
    p.add_argument("--no-write", action="store_true", help="do not touch bench/RESULTS.md")
    p.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    args = p.parse_args(argv)
    if args.ttft_tokens is None:
        args.ttft_tokens = 4096 if args.quick else 16384
    if args.quick:
        args.chunk = min(args.chunk, 1024)
    args.geometry = args.geometry or ["1b"]
    if args.real_prefill is None:
        args.real_prefill = args.ttft_only or (args.device == "cuda" and not args.quick)
    body, _ = run(args)
    title = f"### {args.device} · {args.dtype} · {'+'.join(args.geometry)}" + (
        " · quick" if args.quick else "") + (" · TTFT with the real prefill" if args.ttft_only else "")
    print(f"\n## transfer — {args.device}\n\n{body}")
    if not args.no_write:
        write_results(Path(args.results), body, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
