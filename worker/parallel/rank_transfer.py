"""KV transfer for a multi-rank worker: one ``KvTransceiver`` per rank, driven as one.

Each rank — the leader and every follower process — hosts its own transfer agent and control
endpoint over its own KV pool (its layers, its KV heads), so every rank writes (context side) or
receives (generation side) its own shard over the data plane; nothing funnels through rank 0.
Rank 0's transceiver answers ``get_instance`` with every rank's RankInfo (``set_instance``), so a
peer needs only rank 0's endpoint (the ``ctx_info_endpoint`` / opaque state) to find them all.

:class:`MultiRankTransceiver` lives on the leader and offers ``transfer.transceiver.Transceiver``,
which the worker's KV connector (``worker/kv_connector_transfer.py``) drives. Each operation runs
on every rank at once (``RankGroup.call_all``) with identical arguments — block ids are global,
one scheduler — and the results are combined so that the instance moves only when every rank
agrees:

* a status is quiescent only when every rank's is; it is ``done`` only when every rank is done
  (``transfer.session.combine_codes``: min over ranks), else the first failure's state and error;
* ``cancel_*`` is True only when every rank said True (a False anywhere means a write may still
  be in flight: nothing may be freed);
* once one rank failed, the others are cancelled, so the instance converges instead of waiting
  out their timeouts.

When the rank group is gone (shut down, or a rank died) follower processes can no longer write or
be written: their part counts as cancelled and only rank 0 is still driven.

The functions ``_setup``, ``_set_instance``, ``_op`` run inside each rank (``RankGroup.call_all``).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any, Callable

from transfer.states import DONE, FAILED, IN_FLIGHT, Status, combine_codes
from transfer.transceiver import Transceiver

log = logging.getLogger("splitserve.worker.rank_transfer")

__all__ = ["MultiRankTransceiver", "build_rank_transfer", "combine_statuses"]

_SETUP = "worker.parallel.rank_transfer:_setup"
_SET_INSTANCE = "worker.parallel.rank_transfer:_set_instance"
_OP = "worker.parallel.rank_transfer:_op"
WATCH_POLL_S = 0.002

#: Transceiver methods a rank may be asked to run (the ``Transceiver`` surface).
_OPS = frozenset({"begin_send", "progress_send", "finish_send", "send_status", "cancel_send",
                  "release_send", "begin_receive", "recv_status", "cancel_receive",
                  "release_receive", "abandon_receive", "pending", "shutdown"})


# ---------------------------------------------------------------------------------- in each rank
def _setup(ctx, cfg: dict, role: str, model_name: str, instance_id: str) -> bytes:
    """Build this rank's transceiver over its own pool; returns its encoded RankInfo."""
    from transfer.page_table import PageTable
    from transfer.session import KvTransceiver, RankTopology, TransferConfig

    if "kv_transceiver" in ctx.state:
        raise RuntimeError(f"rank {ctx.rank} already has a KV transceiver")
    runner, lay, mc = ctx.runner, ctx.layout, ctx.model_config
    if cfg.get("agent") == "shm":
        if runner.device.type != "cpu":
            raise ValueError("--transfer-agent shm moves host memory only; use nixl or tcp on cuda")
        from transfer.memory import alloc_shared_host

        # Peers write straight into these pages: move the (still empty) pool into a shared file
        # before anything registers its address.
        t = runner.kv_cache
        runner.kv_cache = alloc_shared_host(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    ls, le = lay.layer_range(mc.num_hidden_layers)
    hs, nh = lay.head_range(mc.num_key_value_heads)
    pt = PageTable.from_runner_dict(runner.page_table(), layer_offset=ls, head_start=hs)
    topo = RankTopology(role=role, num_layers=mc.num_hidden_layers,
                        total_kv_heads=mc.num_key_value_heads, tp_size=lay.tp_size,
                        tp_rank=lay.tp_rank, pp_size=lay.pp_size, pp_rank=lay.pp_rank,
                        model=model_name, instance_id=instance_id)
    tx = KvTransceiver(pt, topo, TransferConfig(**cfg))
    ctx.state["kv_transceiver"] = tx
    if ctx.rank != 0:
        # A follower's process ends with the group; rank 0's transceiver is closed by its link
        # (after the link cancelled what is still in flight — shutting it down first would leave
        # those cancels waiting on a stopped transfer thread).
        ctx.at_exit.append(tx.shutdown)
    return tx.info.encode()


def _set_instance(ctx, infos: list[bytes]) -> None:
    ctx.state["kv_transceiver"].set_instance(infos)


def _op(ctx, name: str, *args) -> Any:
    if name not in _OPS:
        raise ValueError(f"unknown transceiver operation {name!r}; expected one of {sorted(_OPS)}")
    out = getattr(ctx.state["kv_transceiver"], name)(*args)
    return dataclasses.asdict(out) if isinstance(out, Status) else out


# ---------------------------------------------------------------------------------- combining
def combine_statuses(statuses: list[Status]) -> Status:
    """The instance's status from every rank's (see the module docstring). Byte and descriptor
    counts add up; ``write_s`` and ``submit_s`` (ranks write in parallel) are the longest; any other field is
    rank 0's."""
    code = combine_codes([s.code for s in statuses])
    bad = next((s for s in statuses if s.quiescent and s.state != "done"), None)
    if code == DONE:
        state = "done"
    elif code == FAILED:
        state = bad.state
    else:
        state = "transferring" if any(s.state == "transferring" for s in statuses) else statuses[0].state
    out = dataclasses.asdict(statuses[0])
    out.update(state=state, quiescent=code != IN_FLIGHT,
               error=next((s.error for s in statuses if s.error), None),
               meta=next((s.meta for s in statuses if s.meta is not None), None),
               timed_out=any(s.timed_out for s in statuses),
               cause=(bad.cause if bad is not None and code == FAILED else statuses[0].cause),
               bytes=sum(s.bytes for s in statuses),
               descriptors=sum(s.descriptors for s in statuses))
    for k in ("write_s", "submit_s"):
        if k in out:
            out[k] = max(getattr(s, k, 0.0) for s in statuses)
    return Status(**out)


def _status_from(d: dict) -> Status:
    names = {f.name for f in dataclasses.fields(Status)}
    return Status(**{k: v for k, v in d.items() if k in names})


_GONE = Status(state="cancelled", quiescent=True, error="the rank's process has stopped")


# ---------------------------------------------------------------------------------- the facade
class MultiRankTransceiver(Transceiver):
    """Every rank's ``KvTransceiver`` behind the ``transfer.transceiver.Transceiver`` surface (see
    the module doc)."""

    def __init__(self, engine, config, *, role: str, model_name: str,
                 instance_id: str | None = None) -> None:
        """``config.port`` is rank 0's control port (the one peers are told about); the other
        ranks pick free ports and are announced through rank 0's instance list."""
        self.group = engine.rank_group
        self.cfg = config
        inst = instance_id or uuid.uuid4().hex[:16]
        base = dataclasses.asdict(config)
        per_rank = [[{**base, "port": base["port"] if r == 0 else 0}, role, model_name, inst]
                    for r in range(self.group.world_size)]
        infos = self.group.call_all(_SETUP, per_rank=per_rank)
        try:
            self.group.call(0, _SET_INSTANCE, infos)
        except Exception:
            self._shutdown_all()
            raise
        self._rank_infos = infos
        self.tx0 = self.group.context.state["kv_transceiver"]
        self._watch_lock = threading.Lock()
        self._watched: dict[tuple[str, int], Callable[[], None]] = {}
        self._watcher: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ identity (rank 0's)
    @property
    def endpoint(self) -> str:
        return self.tx0.endpoint

    @property
    def instance_id(self) -> str:
        return self.tx0.instance_id

    @property
    def agent(self):
        return self.tx0.agent

    @property
    def tokens_per_block(self) -> int:
        return self.tx0.tokens_per_block

    @property
    def info(self):
        return self.tx0.info

    @property
    def topology(self):
        return self.tx0.topology

    @property
    def page_table(self):
        return self.tx0.page_table

    def rank_infos(self) -> list:
        from transfer.rank_info import decode_rank_info

        return [decode_rank_info(b) for b in self._rank_infos]

    def server_info(self) -> dict:
        d = self.tx0.server_info()
        d["ranks"] = [{"rank": i.flat_rank, "endpoint": i.endpoint, "tp_rank": i.tp_rank,
                       "pp_rank": i.pp_rank, "layers": [i.layer_start, i.layer_end],
                       "heads": [i.head_start, i.head_start + i.kv_heads]}
                      for i in self.rank_infos()]
        return d

    # ------------------------------------------------------------------ fan-out
    def _all(self, name: str, *args) -> list[Any]:
        """Run a transceiver operation on every rank; None stands for a follower that is gone."""
        g = self.group
        if g.healthy:
            from worker.parallel.rank_group import RankGroupFailed

            try:
                return g.call_all(_OP, name, *args)
            except RankGroupFailed:
                pass  # fall through: only rank 0 is left to drive
        return [_op(g.context, name, *args)] + [None] * (g.world_size - 1)

    def _statuses(self, name: str, request_id: int) -> list[Status]:
        return [_status_from(r) if r is not None else _GONE for r in self._all(name, request_id)]

    def _status(self, kind: str, request_id: int) -> Status:
        sts = self._statuses(f"{kind}_status", request_id)
        if any(s.quiescent and s.state != "done" for s in sts) and not all(s.quiescent for s in sts):
            # One rank failed: the instance's outcome is failure; stop the others' writes now.
            self._all(f"cancel_{kind}", request_id)
            sts = self._statuses(f"{kind}_status", request_id)
        return combine_statuses(sts)

    # ------------------------------------------------------------------ context side
    def begin_send(self, request_id: int, num_tokens: int, block_ids,
                   on_end: Callable[[], None] | None = None) -> None:
        """As ``KvTransceiver.begin_send``; ``on_end()`` is called once, from a watcher thread,
        when the send is quiescent on every rank."""
        self._all("begin_send", request_id, num_tokens, _ids(block_ids))
        if on_end is not None:
            self._watch("send", request_id, on_end)

    def progress_send(self, request_id: int, tokens_done: int, block_ids=None,
                      after=None) -> None:
        _no_event(after)
        self._all("progress_send", request_id, tokens_done, _ids(block_ids))

    def finish_send(self, request_id: int, meta: dict | None = None, block_ids=None,
                    after=None) -> None:
        _no_event(after)
        self._all("finish_send", request_id, meta, _ids(block_ids))

    def send_status(self, request_id: int) -> Status:
        return self._status("send", request_id)

    def cancel_send(self, request_id: int) -> bool:
        return all(r is None or r for r in self._all("cancel_send", request_id))

    def release_send(self, request_id: int) -> None:
        with self._watch_lock:
            self._watched.pop(("send", request_id), None)
        self._all("release_send", request_id)

    # ------------------------------------------------------------------ generation side
    def begin_receive(self, request_id: int, ctx_endpoint: str, num_tokens: int, block_ids,
                      on_done: Callable[[], None] | None = None) -> None:
        """As ``KvTransceiver.begin_receive``; ``on_done()`` is called once, from a watcher
        thread, when the receive is quiescent on every rank."""
        self._all("begin_receive", request_id, ctx_endpoint, num_tokens, _ids(block_ids))
        if on_done is not None:
            self._watch("recv", request_id, on_done)

    def _watch(self, kind: str, request_id: int, cb: Callable[[], None]) -> None:
        with self._watch_lock:
            self._watched[(kind, request_id)] = cb
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch_sessions,
                                                 name="rank-transfer-watch", daemon=True)
                self._watcher.start()

    def _watch_sessions(self) -> None:
        """Fire ``on_end``/``on_done`` callbacks: the ranks' own callbacks fire in their processes
        (no callable crosses the rank channel), so the leader polls the combined status while
        any watched session is open."""
        while not self._closed:
            with self._watch_lock:
                if not self._watched:
                    self._watcher = None
                    return
                items = list(self._watched.items())
            for (kind, request_id), cb in items:
                try:
                    done = self._status(kind, request_id).quiescent
                except Exception:  # released or unknown by now: nothing left to wait for
                    done = True
                if done:
                    with self._watch_lock:
                        if self._watched.pop((kind, request_id), None) is None:
                            continue  # released meanwhile
                    try:
                        cb()
                    except Exception:
                        log.exception("%s completion callback failed", kind)
            time.sleep(WATCH_POLL_S)

    def recv_status(self, request_id: int) -> Status:
        return self._status("recv", request_id)

    def cancel_receive(self, request_id: int) -> bool:
        return all(r is None or r for r in self._all("cancel_receive", request_id))

    def claim_receive(self, request_id: int, ctx_endpoint: str) -> None:
        # Once per accepted request: the context instance's rank 0 decides whether a send was
        # claimed, so rank 0's claim is enough (no round trip to the followers).
        tx0 = self.group.context.state.get("kv_transceiver")
        if tx0 is not None:
            tx0.claim_receive(request_id, ctx_endpoint)

    def abandon_receive(self, request_id: int, ctx_endpoint: str) -> None:
        self._all("abandon_receive", request_id, ctx_endpoint)

    def release_receive(self, request_id: int) -> None:
        with self._watch_lock:
            self._watched.pop(("recv", request_id), None)
        self._all("release_receive", request_id)

    # ------------------------------------------------------------------ shared
    def pending(self) -> dict:
        out: dict[str, int] = {}
        for p in self._all("pending"):
            for k, v in (p or {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def shutdown(self) -> None:
        self._closed = True
        self._shutdown_all()

    def _shutdown_all(self) -> None:
        try:
            self._all("shutdown")
        except Exception:  # rank 0's own shutdown still has to happen
            log.exception("shutting down the ranks' KV transceivers")
            tx0 = self.group.context.state.get("kv_transceiver")
            if tx0 is not None:
                tx0.shutdown()


def _ids(block_ids):
    """Block ids as plain ints (msgpack), per group or flat, None kept."""
    if block_ids is None:
        return None
    out = []
    for b in block_ids:
        if isinstance(b, (list, tuple)) or hasattr(b, "tolist") and getattr(b, "ndim", 0) > 0:
            out.append([int(x) for x in (b.tolist() if hasattr(b, "tolist") else b)])
        else:
            out.append(int(b))
    return out


def _no_event(after) -> None:
    """The ranks' transceivers live in other processes: a CUDA event of this one means nothing
    there. (A multi-rank engine steps synchronously and hands chunks on once written.)"""
    if after is not None:
        raise ValueError("a multi-rank transceiver takes chunks once written: expected after=None, "
                         f"found {type(after).__name__}")


def build_rank_transfer(engine, cfg, *, role: str, model_name: str) -> MultiRankTransceiver:
    """``worker.kv_connector_transfer.transceiver_for`` for a multi-rank engine: the same flags
    (already a ``TransferConfig``, ``worker.cli.transfer_config``), one transceiver per rank."""
    from transfer.errors import TransferError

    try:
        return MultiRankTransceiver(engine, cfg, role=role, model_name=model_name)
    except TransferError as e:
        raise ValueError(f"KV transfer setup failed: {e}") from None
