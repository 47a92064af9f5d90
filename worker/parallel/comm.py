"""Rank layout, process groups and the leader↔follower wire of a multi-rank (TP × PP) worker.

A multi-rank worker is ``tp_size × pp_size`` processes on one host. Flat rank
``r = pp_rank·tp_size + tp_rank`` (the transfer layer's CP-minor flattening with CP = 1). Rank 0 is
the *leader* (HTTP server, scheduler, sampling); ranks 1..N-1 are *followers* it spawns
(``worker/parallel/rank_worker.py``).

* PP stage ``p`` holds the global layers ``transfer.peers.layer_range(p, pp, L)`` (even split,
  earlier stages one extra when uneven); TP rank ``t`` holds the KV heads
  ``transfer.peers.head_range(t, tp, H_kv)`` — ``H_kv/tp`` each, or, when ``tp > H_kv``, one head
  replicated on ``tp/H_kv`` consecutive ranks (as TensorRT-LLM does). Using the transfer layer's own
  functions keeps every rank's page table and its RankInfo in agreement by construction.
* Collectives run on process groups built directly from a ``FileStore`` in a private directory
  (no TCP store listening on every interface; gloo binds to 127.0.0.1): one *world* group for
  stage-to-stage sends and one *TP* group per stage for the all-reduces. They are not registered
  as torch's default group, so several multi-rank workers (a test's context and generation
  workers) can live in one leader process. gloo on CPU, NCCL on CUDA.
* Leader↔follower control uses two ``AF_UNIX`` socket pairs per follower, framed as 4-byte
  big-endian length + msgpack (never pickle): the *step* channel (init, per-step chunks, stop) and
  the *RPC* channel (page tables, health, calls into the transfer layer), served by a follower
  thread so a transfer call never waits for a model step.
"""
from __future__ import annotations

import datetime
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

__all__ = ["RankLayout", "RankComm", "ParallelConfigError", "send_msg", "recv_msg",
           "encode_chunks", "decode_chunks", "WireClosed", "rank_timeout_s"]

#: Largest control message accepted (a read_blocks reply of a big test pool stays well below).
MAX_MESSAGE_BYTES = 1 << 30
_LEN = struct.Struct(">I")


class ParallelConfigError(ValueError):
    """A TP/PP layout that this model or machine cannot run (sizes, head counts, devices)."""


class WireClosed(ConnectionError):
    """The peer process closed its end of a control channel (it exited or crashed)."""


def rank_timeout_s() -> float:
    """Bound on one collective (a peer that hangs instead of dying): ``SPLITSERVE_RANK_TIMEOUT_S``,
    default 600 s — longer than any single step of a sane configuration."""
    env = os.environ.get("SPLITSERVE_RANK_TIMEOUT_S")
    if not env:
        return 600.0
    try:
        v = float(env)
    except ValueError:
        raise ParallelConfigError(f"SPLITSERVE_RANK_TIMEOUT_S must be a number of seconds, "
                                  f"found {env!r}") from None
    if v <= 0:
        raise ParallelConfigError(f"SPLITSERVE_RANK_TIMEOUT_S must be positive, found {v}")
    return v


# ---------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits: its TP/PP coordinates and what slice of the model it holds."""

    tp_size: int
    pp_size: int
    rank: int

    def __post_init__(self) -> None:
        for k in ("tp_size", "pp_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParallelConfigError(f"{k} must be a positive integer, found {v!r}")
        if not 0 <= self.rank < self.world_size:
            raise ParallelConfigError(f"rank must be in [0, {self.world_size}), found {self.rank}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def flat(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    @property
    def prev_rank(self) -> int:
        """Same TP rank, previous stage (the sender of this stage's input hidden states)."""
        return self.flat(self.pp_rank - 1, self.tp_rank)

    @property
    def next_rank(self) -> int:
        return self.flat(self.pp_rank + 1, self.tp_rank)

    @property
    def logits_rank(self) -> int:
        """The rank that computes logits: TP rank 0 of the last stage (sent on to rank 0 when it is
        not rank 0 itself)."""
        return self.flat(self.pp_size - 1, 0)

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """Global layers ``[start, end)`` of this rank's stage."""
        from transfer.errors import UnsupportedTopology
        from transfer.peers import layer_range

        try:
            return layer_range(self.pp_rank, self.pp_size, num_layers)
        except UnsupportedTopology as e:
            raise ParallelConfigError(f"pp_size {self.pp_size} over {num_layers} layers: {e}") from None

    def head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """``(head_start, kv_heads)``: the global KV heads this rank stores."""
        from transfer.errors import UnsupportedTopology
        from transfer.peers import head_range

        try:
            return head_range(self.tp_rank, self.tp_size, num_kv_heads)
        except UnsupportedTopology as e:
            raise ParallelConfigError(f"tp_size {self.tp_size} with {num_kv_heads} KV heads: {e}") from None

    def check_model(self, cfg) -> None:
        """Raise :class:`ParallelConfigError` unless a ``worker.model_config.ModelConfig`` shards this way."""
        tp, pp = self.tp_size, self.pp_size
        if cfg.num_attention_heads % tp:
            raise ParallelConfigError(f"--tp-size {tp} must divide the model's "
                                      f"{cfg.num_attention_heads} attention heads")
        kv = cfg.num_key_value_heads
        if kv % tp and tp % kv:
            raise ParallelConfigError(f"--tp-size {tp} must divide the model's {kv} KV heads or be "
                                      f"a multiple of them (heads are then replicated)")
        if cfg.intermediate_size % tp:
            raise ParallelConfigError(f"--tp-size {tp} must divide the MLP intermediate size "
                                      f"{cfg.intermediate_size}")
        if pp > cfg.num_hidden_layers:
            raise ParallelConfigError(f"--pp-size {pp} exceeds the model's {cfg.num_hidden_layers} "
                                      f"layers")

    def describe(self, cfg) -> dict[str, Any]:
        """The rank fields every per-rank page table carries (docs/worker.md, "Multi-rank internals")."""
        ls, le = self.layer_range(cfg.num_hidden_layers)
        hs, nh = self.head_range(cfg.num_key_value_heads)
        return {"rank": self.rank, "world_size": self.world_size, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "pp_rank": self.pp_rank, "pp_size": self.pp_size,
                "layer_start": ls, "layer_end": le, "head_start": hs, "kv_heads": nh,
                "total_layers": cfg.num_hidden_layers, "total_kv_heads": cfg.num_key_value_heads,
                "duplicate_head_factor": max(1, self.tp_size // cfg.num_key_value_heads)}


# ---------------------------------------------------------------------------------- process groups
class RankComm:
    """This rank's process groups. ``all_reduce`` sums over the stage's TP ranks in place;
    ``send``/``recv`` move a tensor between any two ranks (stage to stage, logits to rank 0)."""

    def __init__(self, layout: RankLayout, store_path: str, device, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        self.layout = layout
        self.device = device
        store = dist.FileStore(store_path, layout.world_size)
        timeout = datetime.timedelta(seconds=timeout_s)
        tp, stage = layout.tp_size, layout.pp_rank

        def group(prefix: str, rank: int, size: int):
            s = dist.PrefixStore(prefix, store)
            if device.type == "cuda":
                # NCCL's bootstrap listens on the first non-loopback interface by default; every
                # rank is on this host, so keep it on loopback (an operator's setting wins).
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                torch.cuda.set_device(device)
                return dist.ProcessGroupNCCL(s, rank, size, opts)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            # Every rank of a worker runs on this host: keep gloo's sockets on loopback.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            return dist.ProcessGroupGloo(s, rank, size, opts)

        self._groups = []
        self.world = group("world", layout.rank, layout.world_size)
        self._groups.append(self.world)
        self.tp = None
        if tp > 1:
            self.tp = group(f"tp{stage}", layout.tp_rank, tp)
            self._groups.append(self.tp)

    def all_reduce(self, t):
        if self.tp is not None:
            self.tp.allreduce([t]).wait()
        return t

    def send(self, t, dst: int, tag: int = 0) -> None:
        self.world.send([t.contiguous()], dst, tag).wait()

    def recv(self, t, src: int, tag: int = 0):
        self.world.recv([t], src, tag).wait()
        return t

    def abort(self) -> None:
        """Make any collective in flight (or later) fail at once; safe from any thread, repeatable.
        Needed before exit after a peer died (a broken gloo pair otherwise aborts the process in
        its destructor; NCCL would hang)."""
        for g in self._groups:
            try:
                g.abort()
            except Exception:  # already aborted / backend without abort: nothing left to stop
                pass

    def shutdown(self) -> None:
        for g in self._groups:
            try:
                g.shutdown()
            except Exception:
                pass


# ---------------------------------------------------------------------------------- wire
def send_msg(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireClosed(f"peer closed the channel after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Any:
    """One message; raises :class:`WireClosed` at EOF."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise WireClosed(f"control message of {n} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return msgpack.unpackb(_recv_exact(sock, n), raw=False)


def encode_chunks(chunks) -> list:
    """``worker.runner.Chunk`` list → wire form ``[[tokens i64 bytes, start, blocks i64 bytes]]``."""
    return [[np.asarray(c.token_ids, dtype=np.int64).tobytes(), int(c.start_pos),
             np.asarray(c.block_ids, dtype=np.int64).tobytes()] for c in chunks]


def decode_chunks(wire: list):
    from worker.runner import Chunk

    return [Chunk(token_ids=np.frombuffer(t, dtype=np.int64).copy(), start_pos=int(s),
                  block_ids=np.frombuffer(b, dtype=np.int64).copy()) for t, s, b in wire]
