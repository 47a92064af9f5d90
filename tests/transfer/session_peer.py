"""A KvTransceiver in its own process, driven over a multiprocessing pipe by the session tests.

The rank's KV pools are real memory laid out as `tests/transfer/geometry.py` describes; `fill`
writes the logical KV of a request into given blocks, `check` counts bytes that differ from it.
"""
from __future__ import annotations

import os
import threading
import traceback


def peer_main(conn, spec: dict) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    import logging
    import dataclasses

    import numpy as np

    from tests.transfer.geometry import Model, Side, build_rank, fill, kv_elements, realize
    from transfer.session import KvTransceiver, RankTopology, TransferConfig

    logging.basicConfig(level=logging.WARNING)
    model = Model(**spec["model"])
    side = Side(**spec["side"])
    rank = realize(build_rank(model, side, spec["tp_rank"], spec["pp_rank"], spec["instance"],
                              spec.get("idx", 0)), shared=spec["kind"] == "shm")
    topo = RankTopology(role=spec["role"], num_layers=model.num_layers,
                        total_kv_heads=model.kv_heads, tp_size=side.tp, tp_rank=spec["tp_rank"],
                        pp_size=side.pp, pp_rank=spec["pp_rank"], instance_id=spec["instance"])
    tx = KvTransceiver(rank.info.page_table, topo,
                       TransferConfig(agent=spec["kind"], **spec.get("cfg", {})))
    conn.send(("ready", tx.endpoint, tx.info.encode()))

    def ids_by_model_group(ids):
        # tests pass one id list per model group
        return [ids[m] for m in rank.gmap]

    class Gate:
        """Stands where a CUDA event would (`progress_send(after=)`): complete once opened."""

        def __init__(self):
            self.opened = threading.Event()
            self.waited = False

        def synchronize(self):
            self.waited = True
            self.opened.wait(30)

    gates: dict = {}

    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                tx.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "fill":
                fill(rank, *kv_elements(model, rank, args[0]))
                out = None
            elif cmd == "check":
                pools, offs, vals = kv_elements(model, rank, args[0])
                bad = 0
                for p in np.unique(pools):
                    m = pools == p
                    bad += int((rank.buffers[int(p)][offs[m]] != vals[m]).sum())
                out = {"bad": bad, "total": int(offs.size)}
            elif cmd == "nonzero":  # bytes written outside the given blocks
                pools, offs, _ = kv_elements(model, rank, args[0])
                n = 0
                for p, b in enumerate(rank.buffers):
                    mask = np.ones(b.size, bool)
                    mask[offs[pools == p]] = False
                    n += int(np.count_nonzero(b[mask]))
                out = n
            elif cmd in ("send_status", "recv_status"):
                out = dataclasses.asdict(getattr(tx, cmd)(*args))
            elif cmd in ("begin_send", "begin_receive", "progress_send", "finish_send"):
                a = list(args)
                idx = {"begin_send": 2, "begin_receive": 3, "progress_send": 2, "finish_send": 2}[cmd]
                if len(a) > idx and a[idx] is not None:
                    a[idx] = ids_by_model_group(a[idx])
                out = getattr(tx, cmd)(*a)
            elif cmd == "gated":       # (cmd, name, *args): progress_send/finish_send after a gate
                gates[args[1]] = gate = Gate()
                a = list(args[2:])
                if len(a) > 2 and a[2] is not None:
                    a[2] = ids_by_model_group(a[2])
                out = getattr(tx, args[0])(*a, after=gate)
            elif cmd == "open_gate":
                gates[args[0]].opened.set()
                out = gates[args[0]].waited
            elif cmd == "attr":
                out = getattr(tx, args[0])
                out = out() if callable(out) else out
            else:
                out = getattr(tx, cmd)(*args)
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
