"""Part 1: one KV transfer per prompt size between a context pool on the first GPU and a generation
pool on the last, each in its own process, through the workers' ``KvTransceiver``; next to the
ceiling measured in the same run."""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

from bench.transfer.disagg.cluster import Registry
from bench.transfer.disagg.common import BenchError, say


def _transfer_peer(conn, spec: dict) -> None:
    """One end of the transfer measurement, in its own process (``CUDA_VISIBLE_DEVICES`` set by the
    parent, so ``cuda`` is the pinned GPU). The KV pool is a real ``ModelRunner`` pool of ``spec['model']``
    (the worker's geometry and page-table code), wrapped in a ``KvTransceiver`` exactly as
    ``splitserve worker`` does; the model weights are dropped once the pool exists.

    Commands arrive as ``(name, args)`` tuples; every answer is ``("ok", value)`` or ``("err", text)``.
    Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the host)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import logging
    import traceback

    try:
        import torch

        dev = torch.device(spec["device"])
        if spec["role"] == "ceiling":
            conn.send(("ok", {"device": str(dev)}))
        else:
            from transfer.page_table import PageTable
            from transfer.session import KvTransceiver, RankTopology, TransferConfig
            from worker.loader import load_model
            from worker.runner import ModelRunner

            logging.basicConfig(level=logging.WARNING)
            model, _tok, cfg = load_model(spec["model"], dev, spec["dtype"])
            runner = ModelRunner(model, spec["num_blocks"], spec["block_size"], dev, model.dtype,
                                 cuda_graphs=False)
            runner.model = None
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            kv = runner.kv_cache.view(runner.num_blocks + 1, -1)     # row b = block b's bytes, all layers
            tx = KvTransceiver(PageTable.from_runner_dict(runner.page_table()),
                               RankTopology(role=spec["role"], num_layers=cfg.num_hidden_layers,
                                            total_kv_heads=cfg.num_key_value_heads, model=spec["model"]),
                               TransferConfig(agent=spec["agent"], pipeline=False))
            conn.send(("ok", {"endpoint": tx.endpoint, "agent": tx.info.agent_kind,
                              "block_bytes": runner.block_stride, "device": str(dev)}))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def checksum(nb: int) -> int:
        words = kv[:nb].view(torch.int32)
        sync()
        return int(words.sum(dtype=torch.int64).item()) ^ int((words[:, ::97].to(torch.int64) * 31).sum().item())

    def wait(status, req: int, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            st = status(req)
            if st.quiescent:
                return time.monotonic(), st
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {req}: transfer not finished after {timeout:g}s (state {st.state})")
            time.sleep(0.0001)

    while True:
        cmd, a = conn.recv()
        try:
            if cmd == "quiet":
                # The other end going away first is expected from here on, not worth a warning.
                logging.getLogger("splitserve.transfer").setLevel(logging.ERROR)
                out = None
            elif cmd == "exit":
                if spec["role"] != "ceiling":
                    tx.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "fill":                     # context: random bytes in the blocks to send
                gen = torch.Generator(device=dev).manual_seed(a["seed"])
                kv[:a["blocks"]].view(torch.int32).random_(generator=gen)
                out = checksum(a["blocks"])
            elif cmd == "zero":                   # generation: stale bytes must not pass the checksum
                kv[:a["blocks"]].zero_()
                sync()
                out = None
            elif cmd == "checksum":
                out = checksum(a["blocks"])
            elif cmd == "begin_receive":
                tx.begin_receive(a["req"], a["endpoint"], a["tokens"], list(range(a["blocks"])))
                out = None
            elif cmd == "begin_send":
                tx.begin_send(a["req"], a["tokens"], list(range(a["blocks"])))
                deadline = time.monotonic() + 30
                while tx.send_status(a["req"]).state == "waiting":   # until the receive is attached
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"request {a['req']}: no receiver attached after 30s")
                    time.sleep(0.0005)
                out = None
            elif cmd == "finish_send":            # the data moves from here on
                t0 = time.monotonic()
                tx.finish_send(a["req"])
                t1, st = wait(tx.send_status, a["req"], a["timeout"])
                tx.release_send(a["req"])
                out = {"t0": t0, "t_send_done": t1, "state": st.state, "error": st.error,
                       "bytes": st.bytes, "descriptors": st.descriptors}
            elif cmd == "wait_receive":
                t1, st = wait(tx.recv_status, a["req"], a["timeout"])
                tx.release_receive(a["req"])
                out = {"t_recv_done": t1, "state": st.state, "error": st.error}
            elif cmd == "copy":   # the ceiling (cuda): first visible GPU → last visible GPU, same bytes
                n, reps = a["bytes"], a["repeats"]
                d0, d1 = torch.device("cuda", 0), torch.device("cuda", torch.cuda.device_count() - 1)
                src = torch.empty(n, dtype=torch.uint8, device=d0).fill_(7)
                dst = torch.empty(n, dtype=torch.uint8, device=d1)
                times = []
                for i in range(reps + 1):
                    torch.cuda.synchronize(d0)
                    torch.cuda.synchronize(d1)
                    t = time.perf_counter()
                    dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize(d0)
                    torch.cuda.synchronize(d1)
                    if i:   # the first copy enables peer access and warms the allocator
                        times.append(time.perf_counter() - t)
                del src, dst
                torch.cuda.empty_cache()
                out = {"seconds": sorted(times)[len(times) // 2],
                       "kind": "peer-to-peer copy GPU→GPU" if d0 != d1 else "device-local copy on one GPU"}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception:
            conn.send(("err", traceback.format_exc()))


class _Peer:
    """A ``_transfer_peer`` process and its pipe; ``call`` raises BenchError on a peer error or death."""

    def __init__(self, name: str, spec: dict, gpus: str | None, reg: "Registry"):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:   # a spawned child copies os.environ when it starts: pin it to its GPU(s) this way
            if gpus is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            self.p = ctx.Process(target=_transfer_peer, args=(child, spec), name=name, daemon=True)
            self.p.start()
        finally:
            if gpus is not None:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
        child.close()
        reg.note(self.p.pid, name)

    def result(self, timeout: float):
        if not self.conn.poll(timeout):
            raise BenchError(f"transfer peer {self.name} did not answer within {timeout:g}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise BenchError(f"transfer peer {self.name} died (exit code {self.p.exitcode})") from None
        if status != "ok":
            raise BenchError(f"transfer peer {self.name} failed:\n{value}")
        return value

    def send(self, cmd: str, **a) -> None:
        self.conn.send((cmd, a))

    def call(self, cmd: str, wait_s: float = 120.0, **a):
        self.send(cmd, **a)
        return self.result(wait_s)

    def close(self) -> None:
        if self.p.is_alive():
            with contextlib.suppress(OSError, BenchError, BrokenPipeError):
                self.call("exit", wait_s=10)
        self.p.join(5)
        if self.p.is_alive():
            self.p.kill()
            self.p.join(5)


def transfer_part(args, reg: "Registry", logdir: Path) -> dict:
    """KV transfer of one prompt per size (``--sizes``), context pool on the first GPU and generation pool
    on the last, ``transfer_repeats`` times each (median reported), through the same ``KvTransceiver``
    the workers use with ``--transfer-agent``; each landed copy is checked byte-exact by checksum. Time
    = context ``finish_send`` → the generation side sees the receive done (data plus the result
    message). The ceiling peer copies the same bytes in the same run, interleaved per size."""
    sizes = sorted(set(args.sizes))
    block = 16
    blocks = {n: math.ceil(n / block) for n in sizes}
    base = {"model": args.model, "dtype": args.dtype, "device": args.device, "block_size": block,
            "num_blocks": max(blocks.values()) + 1, "agent": args.transfer_agent}
    g0, g1 = args.gpu_list[0], args.gpu_list[-1]
    peers: list[_Peer] = []
    try:
        ctx = _Peer("transfer-ctx", {**base, "role": "context"}, g0, reg)
        gen = _Peer("transfer-gen", {**base, "role": "generation"}, g1, reg)
        peers += [ctx, gen]
        if args.device == "cuda":
            ceil = _Peer("transfer-ceiling", {**base, "role": "ceiling"}, ",".join(dict.fromkeys(args.gpu_list)), reg)
            peers.append(ceil)
        else:
            ceil = None   # a host memcpy: bench/transfer/transfer.py's baseline, in this process
        infos = [p.result(args.start_timeout) for p in peers]
        cinfo = infos[0]
        say("transfer", f"peers up: agent {cinfo['agent']}, {cinfo['block_bytes']:,} bytes per block")
        rows = []
        req = 1000
        for n in sizes:
            nb = blocks[n]
            want = ctx.call("fill", blocks=nb, seed=n)
            samples = []
            for _ in range(args.scale.transfer_repeats + 1):   # the first run connects the peers
                req += 1
                gen.call("zero", blocks=nb)
                gen.call("begin_receive", req=req, endpoint=cinfo["endpoint"], tokens=n, blocks=nb)
                ctx.call("begin_send", req=req, tokens=n, blocks=nb)
                gen.send("wait_receive", req=req, timeout=args.request_timeout)
                s = ctx.call("finish_send", wait_s=args.request_timeout + 10, req=req, timeout=args.request_timeout)
                r = gen.result(args.request_timeout + 10)
                if s["state"] != "done" or r["state"] != "done":
                    raise BenchError(f"transfer of {n} tokens failed: send {s['state']} ({s['error']}), "
                                     f"receive {r['state']} ({r['error']})")
                got = gen.call("checksum", blocks=nb)
                if got != want:
                    raise BenchError(f"transfer of {n} tokens: the received KV differs from the sent KV "
                                     f"(checksum {got:#x} != {want:#x})")
                samples.append({"seconds": r["t_recv_done"] - s["t0"], "send_seconds": s["t_send_done"] - s["t0"],
                                "bytes": s["bytes"], "descriptors": s["descriptors"]})
            samples = samples[1:]
            med = sorted(samples, key=lambda x: x["seconds"])[len(samples) // 2]
            nbytes = med["bytes"]
            reps = max(3, args.scale.transfer_repeats)
            if ceil is not None:
                copy = ceil.call("copy", wait_s=args.request_timeout, bytes=nbytes, repeats=reps)
            else:
                from bench.transfer.transfer import copy_baseline
                copy = {"seconds": copy_baseline("cpu", nbytes, reps), "kind": "host memcpy"}
            gbps = nbytes / med["seconds"] / 1e9
            cgbps = nbytes / copy["seconds"] / 1e9
            rows.append({"tokens": n, "blocks": nb, "bytes": nbytes, "seconds": med["seconds"],
                         "send_seconds": med["send_seconds"], "gbps": gbps,
                         "ceiling_seconds": copy["seconds"], "ceiling_gbps": cgbps,
                         "pct_of_ceiling": 100.0 * gbps / cgbps, "descriptors": med["descriptors"],
                         "repeats": len(samples),
                         "seconds_all": [x["seconds"] for x in samples]})
            say("transfer", f"{n:>6} tokens: {nbytes / 1e6:,.1f} MB in {med['seconds'] * 1e3:,.2f} ms = "
                             f"{gbps:,.2f} GB/s ({rows[-1]['pct_of_ceiling']:.1f}% of {cgbps:,.2f} GB/s), "
                             f"{med['descriptors']} descriptors")
        where = f"GPU {g0} → GPU {g1}" if args.device == "cuda" else "cpu → cpu"
        return {"path": where + (", two processes" if g0 == g1 else ""), "agent": cinfo["agent"],
                "ceiling_kind": copy["kind"], "block_bytes": cinfo["block_bytes"], "rows": rows,
                "verified": "byte checksum of every transfer"}
    finally:
        for p in peers:
            with contextlib.suppress(OSError, BenchError):
                p.call("quiet", wait_s=10)
        for p in peers:
            p.close()
