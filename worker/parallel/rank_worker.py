"""A follower rank of a multi-rank worker: ``python -m worker.parallel.rank_worker --step-fd N --rpc-fd M``.

Spawned by the leader (:mod:`worker.parallel.rank_group`), never by hand. Lifecycle:

1. arrange to die with the leader (``PR_SET_PDEATHSIG`` = SIGKILL, then check the parent is still
   the leader: it may have died before the call);
2. read the ``init`` message on the step channel, join the process groups, build this rank's model
   shard and KV pool, answer ``ready`` with the rank's page table (or ``error``);
3. serve the RPC channel on a thread; run every ``step`` the leader sends, in order, until
   ``stop`` or until the step channel closes (the leader exited) — then exit.

A step that fails validation (:class:`worker.runner.RunnerInputError`) failed identically on every
rank before any collective, so the follower carries on. Any other failure leaves the collectives
out of step: the follower exits non-zero and the leader, seeing it gone, fails the whole worker.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Any, Callable

from worker.parallel.comm import WireClosed, decode_chunks, recv_msg, send_msg

log = logging.getLogger("splitserve.worker.rank")

#: Modules a ``call`` RPC may name (the leader is the only peer; this guards against typos, and
#: keeps the channel from becoming a general "import anything" hook). Extensions (and tests) add
#: package prefixes with ``SPLITSERVE_RANK_CALLABLE_PACKAGES`` (comma-separated, e.g.
#: ``myplugin.``); followers inherit it from the leader's environment.
CALLABLE_PACKAGES = ("worker.", "transfer.")


def callable_packages() -> tuple[str, ...]:
    extra = os.environ.get("SPLITSERVE_RANK_CALLABLE_PACKAGES", "")
    return CALLABLE_PACKAGES + tuple(p.strip() for p in extra.split(",") if p.strip())


class RankContext:
    """What a per-rank function (``RankGroup.call_all``) gets as its first argument.

    ``state`` is this process's scratch space for the transfer layer (e.g. its ``KvTransceiver``);
    it lives as long as the rank. ``at_exit`` callbacks run when the rank stops cleanly (the
    leader's shutdown), before the process groups close."""

    def __init__(self, layout, runner, model_config, model_name: str) -> None:
        self.layout = layout
        self.runner = runner
        self.model_config = model_config
        self.model_name = model_name
        self.state: dict[str, Any] = {}
        self.at_exit: list[Callable[[], None]] = []

    @property
    def rank(self) -> int:
        return self.layout.rank

    def run_at_exit(self) -> None:
        while self.at_exit:
            fn = self.at_exit.pop()
            try:
                fn()
            except Exception:
                log.exception("rank %d exit hook %r", self.rank, fn)

    def page_table(self) -> dict:
        """The runner's page table plus this rank's coordinates (docs/worker.md, "Multi-rank internals")."""
        pt = self.runner.page_table()
        pt.update(self.layout.describe(self.model_config))
        pt["pid"] = os.getpid()
        return pt


def resolve_callable(path: str) -> Callable:
    """``"package.module:function"`` within :data:`CALLABLE_PACKAGES`."""
    mod, sep, name = path.partition(":")
    allowed = callable_packages()
    if not sep or not name or not mod.startswith(allowed):
        raise ValueError(f"rank call target must be 'module:function' inside {allowed}, "
                         f"found {path!r}")
    fn = importlib.import_module(mod)
    for part in name.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"rank call target {path!r} is not callable")
    return fn


def handle_rpc(ctx: RankContext, msg: dict) -> Any:
    op = msg.get("op")
    if op == "ping":
        return {"rank": ctx.rank, "pid": os.getpid()}
    if op == "page_table":
        return ctx.page_table()
    if op == "call":
        return resolve_callable(msg["fn"])(ctx, *msg.get("args", ()))
    if op == "read_blocks":
        # Diagnostics/tests: float32 bytes whatever the pool's dtype (numpy has no bfloat16).
        t = ctx.runner.read_blocks(msg["ids"])
        return {"shape": list(t.shape), "pool_dtype": str(t.dtype).removeprefix("torch."),
                "dtype": "float32", "data": t.float().cpu().numpy().tobytes()}
    raise ValueError(f"unknown rank RPC op {op!r}; expected ping, page_table, call or read_blocks")


def error_reply(rid, e: BaseException) -> dict:
    return {"id": rid, "ok": False, "type": type(e).__name__, "module": type(e).__module__,
            "error": str(e) or type(e).__name__}


def _serve_rpc(ctx: RankContext, sock: socket.socket) -> None:
    while True:
        try:
            msg = recv_msg(sock)
        except (WireClosed, OSError):
            os._exit(0)  # the leader is gone; the step loop may be stuck in a collective
        rid = msg.get("id")
        try:
            reply = {"id": rid, "ok": True, "result": handle_rpc(ctx, msg)}
        except Exception as e:  # reported to the leader, which re-raises it there
            log.debug("rank %d RPC %s failed", ctx.rank, msg.get("op"), exc_info=True)
            reply = error_reply(rid, e)
        try:
            send_msg(sock, reply)
        except OSError:
            os._exit(0)


def _die_with_parent(leader_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != leader_pid:  # the leader died before the prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-fd", type=int, required=True)
    ap.add_argument("--rpc-fd", type=int, required=True)
    ap.add_argument("--leader-pid", type=int, required=True)
    args = ap.parse_args(argv)
    _die_with_parent(args.leader_pid)
    # SIGTERM/SIGINT to the whole process group (a terminal's Ctrl-C) must not kill a follower
    # before its leader has drained: the leader tells it when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    step = socket.socket(fileno=args.step_fd)
    rpc = socket.socket(fileno=args.rpc_fd)
    try:
        init = recv_msg(step)
    except WireClosed:
        return 1
    logging.basicConfig(level=str(init.get("log_level", "WARNING")).upper(),
                        format=f"%(asctime)s %(levelname)s rank{init.get('rank')} %(name)s: %(message)s")
    try:
        ctx, comm = _build(init)
    except Exception as e:
        log.error("rank %s failed to start: %s", init.get("rank"), e, exc_info=True)
        try:
            send_msg(step, {"op": "error", "error": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
        return 1
    send_msg(step, {"op": "ready", "page_table": ctx.page_table()})
    threading.Thread(target=_serve_rpc, args=(ctx, rpc), name="rank-rpc", daemon=True).start()
    return _step_loop(ctx, comm, step)


def _build(init: dict):
    import torch

    from worker.loader import resolve_dtype
    from worker.model_config import ModelConfig
    from worker.parallel.comm import RankComm, RankLayout
    from worker.runner import ModelRunner
    from worker.parallel.tp_model import build_rank_model

    layout = RankLayout(tp_size=init["tp_size"], pp_size=init["pp_size"], rank=init["rank"])
    device = torch.device(init["device"])
    dtype = resolve_dtype(init["dtype"], device)
    if init.get("cpu_threads"):
        torch.set_num_threads(int(init["cpu_threads"]))
    cfg = ModelConfig(**{k: (tuple(v) if k == "eos_token_id" else v) for k, v in init["config"].items()})
    comm = RankComm(layout, init["store_path"], device, float(init["timeout_s"]))
    model = build_rank_model(init["model"], cfg, layout, comm, device, dtype)
    runner = ModelRunner(model, int(init["num_blocks"]), int(init["block_size"]), device=device,
                         dtype=dtype, cuda_graphs=False)
    return RankContext(layout, runner, cfg, init["model"]), comm


def _step_loop(ctx: RankContext, comm, step: socket.socket) -> int:
    from worker.runner import RunnerInputError

    while True:
        try:
            msg = recv_msg(step)
        except (WireClosed, OSError):
            log.warning("rank %d: the leader closed the step channel; exiting", ctx.rank)
            comm.abort()
            os._exit(1)
        op = msg.get("op")
        if op == "stop":
            ctx.run_at_exit()
            comm.shutdown()
            return 0
        if op != "step":
            log.error("rank %d: unknown step-channel op %r", ctx.rank, op)
            comm.abort()
            os._exit(1)
        try:
            ctx.runner.step(decode_chunks(msg["chunks"]))
        except RunnerInputError:
            continue  # rejected identically on every rank, before any collective
        except Exception:
            traceback.print_exc()
            log.error("rank %d: step failed; the worker's collectives are out of step, exiting",
                      ctx.rank)
            comm.abort()
            os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
