"""A KvTransceiver over a CUDA KV pool in its own process, for the GPU transfer tests.

The pool is laid out like the worker's (block-major: one block holds every layer's K and V for
`tpb` tokens), filled with random bytes on the context side and zeros on the generation side.
"""
from __future__ import annotations

import os
import traceback


def page_table(base: int, num_blocks: int, layers: int, heads: int, head_bytes: int, tpb: int,
               dev: int):
    from transfer.page_table import LayerGroup, PageTable, PhysicalPool, PoolView

    entry = tpb * heads * head_bytes
    pool = PhysicalPool(base=base, layer_stride=2 * entry, slot_stride=layers * 2 * entry,
                        slot_bytes=2 * entry, num_slots=num_blocks, layers=layers, mem_type="VRAM",
                        device_id=dev)
    view = PoolView(pool=0, role=frozenset(["kv"]), layer_ids=tuple(range(layers)),
                    buffer_entries=tuple((l, c * entry, entry) for l in range(layers) for c in (0, 1)),
                    layout="NHD", kv_heads=heads)
    return PageTable(tokens_per_block=tpb, pools=(pool,),
                     groups=(LayerGroup(tuple(range(layers)), (view,)),), dtype="bfloat16")


def gpu_peer(conn, role: str, geo: dict, cfg: dict) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    import threading

    import numpy as np
    import torch

    from transfer.session import KvTransceiver, RankTopology, TransferConfig

    torch.cuda.init()
    nb = geo["num_blocks"]
    runner = None
    if geo.get("model"):   # the worker's model runner: its KV pool moves, its prefill fills it
        from transfer.page_table import PageTable
        from worker.presets import build_preset
        from worker.runner import ModelRunner

        runner = ModelRunner(build_preset(geo["model"], device="cuda", dtype=torch.bfloat16), nb,
                             block_size=geo["tpb"], device="cuda", dtype=torch.bfloat16)
        bb = runner.block_stride
        pool = runner.kv_cache.view(-1).view(torch.uint8)[:nb * bb]
        pool.zero_()
        pt = PageTable.from_runner_dict(runner.page_table())
        c = runner.cfg
        topo = RankTopology(role=role, num_layers=c.num_hidden_layers,
                            total_kv_heads=c.num_key_value_heads, model=geo["model"])
    else:
        bb = geo["layers"] * 2 * geo["tpb"] * geo["heads"] * geo["head_bytes"]
        pool = torch.zeros(nb * bb, dtype=torch.uint8, device="cuda")
        if role == "context":
            pool.random_(0, 256, generator=torch.Generator(device="cuda").manual_seed(geo["seed"]))
        pt = page_table(pool.data_ptr(), nb, geo["layers"], geo["heads"], geo["head_bytes"],
                        geo["tpb"], torch.cuda.current_device())
        topo = RankTopology(role=role, num_layers=geo["layers"], total_kv_heads=geo["heads"],
                            model="gpu-test")
    tx = KvTransceiver(pt, topo,
                       TransferConfig(agent="nixl", send_timeout_s=60, recv_timeout_s=60, **cfg))
    conn.send(("ready", tx.endpoint, tx.agent.kind))
    while True:
        cmd, a = conn.recv()
        try:
            if cmd == "exit":
                tx.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "send":               # (req, ntok, ids): prefill already done
                tx.begin_send(a[0], a[1], a[2])
                tx.finish_send(a[0], None)
                out = None
            elif cmd == "chunked_send":     # (req, ntok, ids, chunk): progress per chunk
                req, ntok, ids, chunk = a
                tx.begin_send(req, ntok, ids)
                for done in range(chunk, ntok, chunk):
                    tx.progress_send(req, done)
                tx.finish_send(req, None)
                out = None
            elif cmd == "prefill_send":     # (req, ntok, ids, chunk): the runner's chunked prefill
                import time

                from worker.runner import Chunk

                req, ntok, ids, chunk = a
                toks = [int(x) for x in np.random.default_rng(req).integers(
                    0, runner.cfg.vocab_size, ntok)]
                tx.begin_send(req, ntok, ids)
                ends = []
                for done in range(0, ntok, chunk):
                    n = min(chunk, ntok - done)
                    runner.step([Chunk(token_ids=toks[done:done + n], start_pos=done,
                                       block_ids=ids)])
                    # as the engine does: a chunk is handed on once its K/V is written
                    torch.cuda.current_stream().synchronize()
                    ends.append(time.monotonic())
                    if done + n < ntok:
                        tx.progress_send(req, done + n)
                tx.finish_send(req, None)
                out = ends
            elif cmd == "pipeline":
                tx.cfg.pipeline = bool(a[0])
                out = None
            elif cmd == "wait_send":
                while not (st := tx.send_status(a[0])).quiescent:
                    threading.Event().wait(0.001)
                tx.release_send(a[0])
                out = (st.state, st.bytes, st.descriptors, st.error, st.slices_done)
            elif cmd == "recv":             # (req, ep, ntok, ids) -> state, error
                ev = threading.Event()
                tx.begin_receive(a[0], a[1], a[2], a[3], on_done=ev.set)
                ev.wait(60)
                st = tx.recv_status(a[0])
                tx.release_receive(a[0])
                out = (st.state, st.error)
            elif cmd == "blocks":           # the bytes of blocks, in the order given
                idx = torch.as_tensor(a[0], device="cuda", dtype=torch.int64)
                out = pool.view(nb, bb)[idx].cpu().numpy()
            elif cmd == "clear":
                pool.zero_()
                torch.cuda.synchronize()
                out = None
            elif cmd == "agent":
                out = tx.agent.describe()
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
