"""The public values of KV-transfer sessions: states, end causes, a request's `Status`, and the
rank's configuration. Imported by the sender, the receiver, the facade and the worker."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

#: `Status.code`: what multi-rank workers combine (min over ranks = global AND).
IN_FLIGHT, FAILED, DONE = 0, 1, 2


class State(enum.StrEnum):
    """`Status.state`: where one request's transfer stands on this rank, either side."""

    WAITING = "waiting"            # no receiver attached / the receive is not posted yet
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class SendState(enum.StrEnum):
    """A send session (context side)."""

    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RecvState(enum.StrEnum):
    """A receive session (generation side)."""

    WAITING = "waiting"            # fetching the context instance / registering with its ranks
    POSTED = "posted"              # `recv` sent to every peer rank
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def open(self) -> bool:
        return self in (RecvState.WAITING, RecvState.POSTED)


class WriterState(enum.StrEnum):
    """One context rank writing into a receive session."""

    POSTED = "posted"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"                  # its control connection closed or its heartbeats stopped


class PeerState(enum.StrEnum):
    """A context instance as the generation side knows it."""

    FETCHING = "fetching"          # `get_instance` sent
    REGISTERING = "registering"    # `register` sent to every peer rank
    READY = "ready"


class SendEnd(enum.StrEnum):
    """Why a send session ended (`Status.cause`; the engine releases its pin with this reason)."""

    TRANSFERRED = "transferred"                 # every receiving rank has the KV
    RECEIVER_CANCELLED = "receiver_cancelled"   # a generation rank gave up (abort, client gone)
    WRITE_FAILED = "write_failed"               # a write failed (receiver lost mid-transfer)
    TIMED_OUT = "send_timeout"                  # no (complete) receiver within send_timeout_s
    UNCLAIMED = "unclaimed"                     # no generation rank claimed it in claim_timeout_s
    CANCELLED = "context_cancelled"             # this side dropped the request


@dataclass(frozen=True)
class Status:
    """Where one request's transfer stands on this rank."""

    state: str            # a `State`
    quiescent: bool       # no write into/out of this request's pages can happen any more
    error: str | None = None
    meta: dict | None = None
    timed_out: bool = False
    bytes: int = 0
    descriptors: int = 0
    write_s: float = 0.0
    submit_s: float = 0.0      # (send) of write_s, the host's part: claim → the write posted
    cause: str | None = None   # a send session's `SendEnd` once it ended
    # (send) per slice, when its write to the last receiving rank finished (time.monotonic)
    slices_done: tuple[float, ...] = ()

    @property
    def code(self) -> int:
        if not self.quiescent:
            return IN_FLIGHT
        return DONE if self.state == State.DONE else FAILED


def combine_codes(codes: Sequence[int]) -> int:
    """Instance outcome from every rank's `Status.code`: min = global AND."""
    return min(codes) if codes else IN_FLIGHT


# TransferConfig.spin_s's default: off. Spinning has not been measured on a GPU host yet (the
# session that built it had no device time left); on the 2-core box it made the round trip slower
# (a spinning thread takes the core the other side needs), and through a fleet a generation_first
# receive's window always runs out (~spin_s of one core per request). docs/kv-transfer.md.
DEFAULT_SPIN_S = 0.0


@dataclass
class TransferConfig:
    agent: str = "auto"               # auto | nixl | shm | tcp
    host: str = "127.0.0.1"           # bind host of the control plane (and tcp/shm agents)
    advertise_host: str | None = None
    port: int = 0                     # control port; 0 = pick free
    send_timeout_s: float = 60.0      # ctx: from the final slice until every receiver is served
    claim_timeout_s: float = 10.0     # ctx: from the final slice until a receiver claims (0 = off)
    recv_timeout_s: float = 120.0     # gen: from begin_receive until the KV landed
    connect_timeout_s: float = 5.0
    heartbeat_ivl_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    pipeline: bool = True             # ctx sends each finished chunk's blocks right away
    prepped: str = "auto"             # prepared descriptor lists: auto (nixl only) | on | off
    progress_thread: bool = False     # nixl's own progress thread (spins a core per agent)
    # How long a control listener busy-polls (GIL released, transfer/_spin.c) where a message is
    # expected soon instead of sleeping until it comes (a thread woken from a sleep answers
    # 50-150 µs late per hop): the generation side after posting a receive (its result), the
    # context side after a claim or a context_first finish (the receive). At most this much of
    # one core per expectation; ended by the message. None: DEFAULT_SPIN_S (off). Worker flag
    # --transfer-spin-us.
    spin_s: float | None = None

    @property
    def spin_window_s(self) -> float:
        """`spin_s` resolved: seconds (0 = never spin)."""
        return DEFAULT_SPIN_S if self.spin_s is None else max(0.0, self.spin_s)

    def describe(self) -> dict:
        return {"send_timeout_s": self.send_timeout_s, "recv_timeout_s": self.recv_timeout_s,
                "claim_timeout_s": self.claim_timeout_s,
                "pipeline": self.pipeline, "prepped": self.prepped,
                "spin_s": self.spin_window_s}


@dataclass(frozen=True)
class RankTopology:
    """Where this rank sits in its worker instance."""

    role: str
    num_layers: int
    total_kv_heads: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    model: str = ""
    instance_id: str | None = None
    layers: tuple[int, int] | None = None      # default: layer_range(pp_rank, pp_size, …)
    heads: tuple[int, int] | None = None       # (head_start, kv_heads); default: head_range(…)
