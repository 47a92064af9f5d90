"""KV-transfer sessions: the per-rank transceiver that moves one request's KV from a context rank
to generation ranks.

Threads per rank: the caller (the worker's engine loop) calls the API; a *listener* thread
(`Messenger`) handles control messages and only changes state; a *transfer* thread loads peer
agents, builds descriptors, submits one-sided writes, polls them, and enforces timeouts. All
session state is under one lock; nothing blocks while holding it.

Protocol (ZMQ ROUTER/DEALER, msgpack maps, `t` = type):

    gen → ctx rank 0   get_instance                       → instance {ranks: [RankInfo]}
    gen → ctx rank i   register {info}                    → registered | register_failed {error}
    gen → ctx rank i   recv {req, n, ids: [int64 bytes per group]}   (one whole-prompt receive)
    ctx → gen          result {req, from, status: ok|error|cancelled, slices, span, last, meta}
    gen → ctx          cancel {req}                       → result {status: cancelled, last}
    gen → ctx rank 0   claim {req}            (no reply: "a generation rank holds this request")

Context side (sender): `begin_send` creates a send session; `progress_send` appends block-aligned
slices as prefill chunks finish (pipelining), `finish_send` appends the final slice (always, even
when empty: it carries completion and `meta`, e.g. first_gen_tokens). Slice bounds in blocks: the
first slice starts at block 0 (a reused prefix is sent too); non-final slices end at
floor(tokens_done / tpb) — partial blocks wait; the final slice ends at ceil(num_tokens / tpb).
Sliding-window groups are not pipelined: the last slice carries their final window. The reported
token span is exact. Each receiving rank's slices are dispatched in order, one transfer at a time
(pending slices are coalesced into one transfer), so a result for slice k is sent only after all
earlier slices landed.

Generation side (receiver): `begin_receive` registers the session *before* anything is posted, then
(on the listener thread) fetches the context instance's RankInfos once per endpoint (cached),
registers its own RankInfo with every context rank that shares layers and heads, and posts one
receive per such rank. It completes when every one of those ranks sent a final `ok` result.

Lifecycle rules:
- `cancel_*` returns True when the pages may be freed now, False while a write may be in flight
  ("not yet" is not an error; call again next iteration). Submitted writes are never aborted.
- A timeout is non-terminal while a peer may still write: a timed-out receive cancels its writers
  and becomes terminal only when each acknowledged, finished, or was lost (connection closed /
  heartbeat timeout: a dead process cannot write).
- `release_*` retires a request; a retired request cannot be re-created, and a late `recv` for it
  gets an error result.
- A generation rank that gives up on a request before its `recv` was posted (cancelled while it
  was still fetching the context instance, or — `abandon_receive` — a request that ended before
  its receive began) still sends `cancel` to the context instance: only then does the context rank
  learn that nobody will fetch the pinned KV, instead of holding it until its send timeout.
- A context rank learns that a generation rank holds a request when its `recv` arrives, or — so
  that a request queued on the generation side for long is not mistaken for a lost one — from a
  `claim` sent as soon as the generation worker accepted it (`claim_receive`). A finished send
  session that nobody claimed within `claim_timeout_s` is ended (`SendEnd.UNCLAIMED`): whoever
  carried the context answer to a generation worker is gone (a fleet process killed between the
  two legs), and only the pin timeout would free the KV otherwise. Flat rank 0 decides (the
  endpoint peers are given); a multi-rank worker then cancels its other ranks.
- A send session ends with a typed `Status.cause` (`SendEnd`): what the engine's pin is released
  with.
- Multi-rank workers must agree before acting: each rank reports `Status.code` (0 in flight,
  1 failed, 2 done); `combine_codes` (min over ranks = global AND) gives the instance's outcome.
"""
from __future__ import annotations

import base64
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import msgpack
import numpy as np
from msgspec.structs import replace as msgspec_replace

from protocol.failures import Cause, cause_of

from .agent import ERR as XERR, PROC as XPROC, TransferAgent, make_agent
from .descs import build_pair, merge_runs
from .errors import (ConfigMismatch, PeerLost, ProtocolError, SessionError, TransferError,
                     UnsupportedTopology)
from .messenger import Messenger
from .page_table import PageTable
from .peers import (PairPlan, are_peers, head_range, layer_range, peer_flat_ranks, plan_pair,
                    standard_layout)
from .rank_info import RankInfo, check_compatible, decode_rank_info

log = logging.getLogger("splitserve.transfer.session")

IN_FLIGHT, FAILED, DONE = 0, 1, 2
OPAQUE_VERSION = 1
RETIRED_MAX = 65536
SPIN_S = 0.002
# Prepared lists (NIXL merges runs and posts from indices) beat building lists per transfer even
# for a single run: on an H200 a 512 MiB contiguous write took 0.54 ms prepped vs 0.80 ms through
# initialize_xfer with one merged descriptor (the per-call list building costs ~0.3 ms). Transfers
# with at most this many runs take the per-transfer path.
PREPPED_MIN_RUNS = 0


# ============================================================================ public data

class SendEnd:
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

    state: str            # waiting | transferring | done | failed | cancelled
    quiescent: bool       # no write into/out of this request's pages can happen any more
    error: str | None = None
    meta: dict | None = None
    timed_out: bool = False
    bytes: int = 0
    descriptors: int = 0
    write_s: float = 0.0
    cause: str | None = None   # a send session's SendEnd once it ended

    @property
    def code(self) -> int:
        if not self.quiescent:
            return IN_FLIGHT
        return DONE if self.state == "done" else FAILED


def combine_codes(codes: Sequence[int]) -> int:
    """Instance outcome from every rank's `Status.code`: min = global AND."""
    return min(codes) if codes else IN_FLIGHT


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

    def describe(self) -> dict:
        return {"send_timeout_s": self.send_timeout_s, "recv_timeout_s": self.recv_timeout_s,
                "claim_timeout_s": self.claim_timeout_s,
                "pipeline": self.pipeline, "prepped": self.prepped}


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


def encode_opaque_state(endpoint: str, instance_id: str, req_id: int, num_tokens: int,
                        agent_kind: str) -> str:
    """What a generation worker needs to pull the KV: base64(msgpack)."""
    return base64.b64encode(msgpack.packb({
        "v": OPAQUE_VERSION, "ep": endpoint, "inst": instance_id, "req": int(req_id),
        "n": int(num_tokens), "agent": agent_kind})).decode()


def decode_opaque_state(s: str) -> dict:
    try:
        d = msgpack.unpackb(base64.b64decode(s, validate=True), raw=False)
    except Exception as e:
        raise ProtocolError(f"encoded_opaque_state is not base64 msgpack: {e}") from None
    if not isinstance(d, dict) or d.get("v") != OPAQUE_VERSION:
        raise ProtocolError(f"encoded_opaque_state version {d.get('v') if isinstance(d, dict) else d!r}; "
                            f"expected {OPAQUE_VERSION}")
    for k, typ in (("ep", str), ("req", int), ("n", int)):
        if not isinstance(d.get(k), typ):
            raise ProtocolError(f"encoded_opaque_state field {k!r} missing or not {typ.__name__}")
    return d


# ============================================================================ internal state

@dataclass
class _Slice:
    sid: int
    blocks: dict[int, tuple[int, int]]    # src group -> [b0, b1)
    tokens: tuple[int, int]
    last: bool


@dataclass
class _Receiver:
    """A generation rank registered with this context rank."""

    info: RankInfo
    identity: bytes
    agent_name: str
    plan: PairPlan
    preps: dict = field(default_factory=dict)   # mapper index -> (local PrepHandle, remote PrepHandle)


@dataclass
class _Target:
    """One receiving rank of a send session."""

    rx: _Receiver
    dst_ids: list[np.ndarray]
    next_slice: int = 0
    inflight: "_Task | None" = None
    cancelled: bool = False
    final_sent: bool = False


@dataclass
class _Task:
    session: "_SendSession"
    target: _Target
    s0: int
    s1: int
    handles: list = field(default_factory=list)
    error: str | None = None
    cause: Cause | None = None      # typed cause of `error` (PEER_LOST: drop the receiver)
    nbytes: int = 0
    ndescs: int = 0
    started: float = 0.0


@dataclass
class _SendSession:
    req_id: int
    num_tokens: int
    src_ids: list[np.ndarray]
    created: float
    slices: list[_Slice] = field(default_factory=list)
    last_added: bool = False
    meta: dict | None = None
    deadline: float | None = None
    state: str = "active"                   # active | done | failed | cancelled
    error: str | None = None
    cause: str | None = None                # SendEnd, once not active
    claimed: bool = False                   # a generation rank said it holds the request
    finished_at: float | None = None        # when the final slice was appended
    targets: dict[str, _Target] = field(default_factory=dict)
    expected: int | None = None
    cancel_requested: bool = False
    timed_out: bool = False
    nbytes: int = 0
    ndescs: int = 0
    write_s: float = 0.0                    # time writes were in flight (submit → DONE)

    def inflight(self) -> bool:
        return any(t.inflight is not None for t in self.targets.values())

    def blocks_sent_end(self) -> dict[int, int]:
        return {g: b1 for s in self.slices for g, (_b0, b1) in s.blocks.items()}


@dataclass
class _Writer:
    endpoint: str
    state: str = "posted"                    # posted | done | failed | cancelled | lost
    slices: int = 0

    @property
    def terminal(self) -> bool:
        return self.state != "posted"


@dataclass
class _RecvSession:
    req_id: int
    endpoint: str
    num_tokens: int
    dst_ids: list[np.ndarray]
    deadline: float
    state: str = "waiting"                   # waiting | posted | done | failed | cancelled
    writers: dict[str, _Writer] = field(default_factory=dict)
    meta: dict | None = None
    error: str | None = None
    cancel_requested: bool = False
    cancel_sent: bool = False
    timed_out: bool = False
    on_done: object = None                   # called once (any thread) when quiescent


@dataclass
class _PeerInstance:
    endpoint: str
    state: str = "fetching"                  # fetching | registering | ready
    ranks: list[RankInfo] = field(default_factory=list)
    peers: list[RankInfo] = field(default_factory=list)
    pending: set = field(default_factory=set)
    waiting: list[int] = field(default_factory=list)


def _runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """Block runs consecutive on both sides (each becomes one copy when merged)."""
    if src_ids.size <= 1:
        return int(src_ids.size)
    return 1 + int(np.count_nonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)))


def _ids_bytes(ids) -> bytes:
    return np.asarray(ids, dtype=np.int64).reshape(-1).tobytes()


def _ids_from(b) -> np.ndarray:
    if not isinstance(b, (bytes, bytearray)) or len(b) % 8:
        raise ProtocolError("block ids must be int64 bytes")
    return np.frombuffer(b, dtype=np.int64).copy()


# ============================================================================ transceiver

class KvTransceiver:
    """One rank's end of KV transfer (see the module docstring)."""

    def __init__(self, page_table: PageTable, topology: RankTopology,
                 config: TransferConfig | None = None, agent: TransferAgent | None = None):
        self.cfg = cfg = config or TransferConfig()
        page_table.validate()
        self.page_table = page_table
        self.topology = topo = topology
        inst = topo.instance_id or uuid.uuid4().hex[:16]
        self.instance_id = inst
        flat = topo.pp_rank * topo.tp_size + topo.tp_rank
        self.agent = agent or make_agent(cfg.agent, name=f"{topo.role}-{inst}-{flat}",
                                         host=cfg.host, advertise_host=cfg.advertise_host,
                                         progress_thread=cfg.progress_thread)
        self._regs = []
        try:
            for base, extent, dev, mem in page_table.regions():
                self._regs.append(self.agent.register_memory([(base, extent, dev)], mem))
        except Exception:
            if agent is None:
                self.agent.shutdown()
            raise
        ls, le = topo.layers or layer_range(topo.pp_rank, topo.pp_size, topo.num_layers)
        hs, nh = topo.heads or head_range(topo.tp_rank, topo.tp_size, topo.total_kv_heads)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._send: dict[int, _SendSession] = {}
        self._parked: dict[int, list[tuple[float, str, dict]]] = {}
        self._claims: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._recv: dict[int, _RecvSession] = {}
        self._receivers: dict[str, _Receiver] = {}
        self._peers: dict[str, _PeerInstance] = {}
        self._retired_send: collections.OrderedDict = collections.OrderedDict()
        self._retired_recv: collections.OrderedDict = collections.OrderedDict()
        self._work: collections.deque = collections.deque()
        self._tasks: list[_Task] = []
        self._stop = False
        self.stats = collections.Counter()
        self.messenger = Messenger(f"{inst}/{flat}", self._on_message, self._on_peer_lost,
                                   host=cfg.host, port=cfg.port, advertise_host=cfg.advertise_host,
                                   connect_timeout_s=cfg.connect_timeout_s,
                                   heartbeat_ivl_s=cfg.heartbeat_ivl_s,
                                   heartbeat_timeout_s=cfg.heartbeat_timeout_s)
        self.info = RankInfo(
            instance_id=inst, role=topo.role, endpoint=self.messenger.endpoint,
            agent_kind=self.agent.kind, agent_name=self.agent.name,
            agent_desc=self.agent.get_local_agent_desc(), page_table=page_table,
            num_layers=topo.num_layers, total_kv_heads=topo.total_kv_heads, layer_start=ls,
            layer_end=le, head_start=hs, kv_heads=nh, tp_size=topo.tp_size, tp_rank=topo.tp_rank,
            pp_size=topo.pp_size, pp_rank=topo.pp_rank, dp_size=topo.dp_size, dp_rank=topo.dp_rank,
            model=topo.model,
            instance_layout=standard_layout(topo.num_layers, topo.total_kv_heads, topo.tp_size,
                                            topo.pp_size) if topo.layers is None and topo.heads is None
            else ())
        self._instance: list[bytes] = [self.info.encode()]
        self._use_prepped = cfg.prepped == "on" or (cfg.prepped == "auto" and self.agent.kind == "nixl")
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ identity
    @property
    def endpoint(self) -> str:
        return self.messenger.endpoint

    @property
    def tokens_per_block(self) -> int:
        return self.page_table.tokens_per_block

    def set_instance(self, infos: Sequence[bytes]) -> None:
        """Rank 0 of a multi-rank worker: every rank's encoded RankInfo, in flat-rank order (what
        `get_instance` answers). Each is validated."""
        decoded = [decode_rank_info(b) for b in infos]
        if not any(d.key == self.info.key for d in decoded):
            raise SessionError("set_instance: this rank's own RankInfo is not in the list")
        with self._lock:
            self._instance = list(infos)

    def server_info(self) -> dict:
        """The `transfer` field of the worker's /server_info."""
        return {"endpoint": self.endpoint, "instance_id": self.instance_id,
                "agent": self.agent.describe(), "tokens_per_block": self.tokens_per_block,
                "layout_version": self.page_table.layout_version,
                "tp_size": self.topology.tp_size, "pp_size": self.topology.pp_size,
                **self.cfg.describe()}

    def opaque_state(self, req_id: int, num_tokens: int) -> str:
        return encode_opaque_state(self.endpoint, self.instance_id, req_id, num_tokens,
                                   self.agent.kind)

    # ================================================================== context side API
    def begin_send(self, req_id: int, num_tokens: int, block_ids) -> None:
        """Open a send session for `num_tokens` prompt tokens stored in `block_ids` (per group, or
        one list for a single-group table). Receivers that posted early (generation_first) are
        adopted."""
        ids = self._group_ids(block_ids)
        if num_tokens <= 0:
            raise SessionError(f"request {req_id}: num_tokens must be positive; found {num_tokens}")
        with self._lock:
            if req_id in self._send:
                raise SessionError(f"request {req_id}: a send session already exists")
            if req_id in self._retired_send:
                raise SessionError(f"request {req_id}: its send session was retired and cannot be "
                                   f"re-created")
            s = _SendSession(req_id=req_id, num_tokens=num_tokens, src_ids=ids,
                             created=time.monotonic(),
                             claimed=self._claims.pop(req_id, None) is not None)
            self._send[req_id] = s
            for _t, key, msg in self._parked.pop(req_id, []):
                self._attach_locked(s, key, msg)
            self._cv.notify()

    def progress_send(self, req_id: int, tokens_done: int, block_ids=None) -> None:
        """Prefill has computed tokens [0, tokens_done): send the full blocks not sent yet."""
        if not self.cfg.pipeline:
            return
        with self._lock:
            s = self._send_session(req_id)
            if block_ids is not None:
                s.src_ids = self._group_ids(block_ids)
            if s.last_added or s.state != "active" or s.cancel_requested:
                return
            self._add_slice_locked(s, min(tokens_done, s.num_tokens), last=False)
            self._cv.notify()

    def finish_send(self, req_id: int, meta: dict | None = None, block_ids=None) -> None:
        """Prefill is done: append the final slice (always sent; carries `meta`) and start the
        send timeout."""
        with self._lock:
            s = self._send_session(req_id)
            if s.last_added:
                raise SessionError(f"request {req_id}: final slice already appended")
            if block_ids is not None:
                s.src_ids = self._group_ids(block_ids)
            s.meta = meta
            self._add_slice_locked(s, s.num_tokens, last=True)
            s.finished_at = time.monotonic()
            s.deadline = s.finished_at + self.cfg.send_timeout_s
            self._check_send_locked(s)
            self._cv.notify()

    def send_status(self, req_id: int) -> Status:
        with self._lock:
            s = self._send_session(req_id)
            state = s.state
            if state == "active":
                state = "transferring" if s.inflight() or s.targets else "waiting"
            return Status(state=state, quiescent=not s.inflight() and s.state != "active",
                          error=s.error, meta=s.meta, timed_out=s.timed_out, bytes=s.nbytes,
                          descriptors=s.ndescs, write_s=s.write_s, cause=s.cause)

    def cancel_send(self, req_id: int) -> bool:
        """True: no write from these pages can happen any more (free them). False: a write is in
        flight; nothing may be freed yet — call again later."""
        with self._lock:
            s = self._send.get(req_id)
            if s is None:
                for _t, key, msg in self._parked.pop(req_id, []):
                    self._reply_result(key, req_id, "cancelled", error="cancelled by context")
                return True
            s.cancel_requested = True
            if s.inflight():
                return False
            if s.state == "active":
                self._end_send_locked(s, "cancelled", "cancelled by context", SendEnd.CANCELLED)
            return True

    def release_send(self, req_id: int) -> None:
        """The worker freed the request's pages: retire the session (never re-created)."""
        with self._lock:
            s = self._send.get(req_id)
            if s is None:
                self._retire(self._retired_send, req_id)
                for _t, key, _m in self._parked.pop(req_id, []):
                    self._reply_result(key, req_id, "error",
                                       error=f"request {req_id} was released by the context rank")
                return
            if s.state == "active" and not self.cancel_send(req_id):
                raise SessionError(f"request {req_id}: a write is in flight; cancel_send() must "
                                   f"return True before release")
            if s.inflight():
                raise SessionError(f"request {req_id}: a write is in flight")
            del self._send[req_id]
            self._retire(self._retired_send, req_id)

    # ================================================================== generation side API
    def begin_receive(self, req_id: int, ctx_endpoint: str, num_tokens: int, block_ids,
                      on_done=None) -> None:
        """Register a whole-prompt receive of `num_tokens` tokens into `block_ids` (per group or one
        list) from the context instance at `ctx_endpoint`. Returns at once; poll `recv_status`, or
        pass `on_done()`: called once, from a transfer thread, when the receive is quiescent."""
        ids = self._group_ids(block_ids)
        need = -(-num_tokens // self.tokens_per_block)
        for g, a in enumerate(ids):
            if a.size < need:
                raise SessionError(f"request {req_id}: group {g} has {a.size} blocks; "
                                   f"{num_tokens} tokens need {need}")
        with self._lock:
            if req_id in self._recv:
                raise SessionError(f"request {req_id}: a receive session already exists")
            if req_id in self._retired_recv:
                raise SessionError(f"request {req_id}: its receive session was retired")
            self._recv[req_id] = _RecvSession(
                req_id=req_id, endpoint=ctx_endpoint, num_tokens=num_tokens, dst_ids=ids,
                deadline=time.monotonic() + self.cfg.recv_timeout_s, on_done=on_done)
        self.messenger.call_soon(lambda: self._ensure_peer(ctx_endpoint, req_id))

    def recv_status(self, req_id: int) -> Status:
        with self._lock:
            r = self._recv_session(req_id)
            quiescent = r.state in ("done", "failed", "cancelled")
            state = "transferring" if r.state == "posted" else r.state
            return Status(state=state, quiescent=quiescent, error=r.error, meta=r.meta,
                          timed_out=r.timed_out)

    def cancel_receive(self, req_id: int) -> bool:
        """True: no peer can write into these pages any more (free them). False: a context rank may
        still be writing; its cancel acknowledgement is awaited — call again later."""
        with self._lock:
            r = self._recv.get(req_id)
            if r is None:
                return True
            r.cancel_requested = True
            if r.state == "waiting":
                # No recv was posted, so no write can come; but the context rank holds the KV
                # for us until told (its send session may already exist).
                self._recv_final_locked(r, "cancelled", "cancelled")
                self.messenger.call_soon(
                    lambda: self._send_to_instance(r.endpoint, "cancel", req_id))
                return True
            if r.state != "posted":
                return True
            self._send_cancels_locked(r)
            self._check_recv_locked(r)
            return r.state != "posted"

    def claim_receive(self, req_id: int, ctx_endpoint: str) -> None:
        """This worker accepted a request whose KV the context instance at `ctx_endpoint` holds
        (its receive may begin much later, once blocks are free): claim it, so the context rank
        does not end the send as unclaimed."""
        self.messenger.call_soon(lambda: self._send_to_instance(ctx_endpoint, "claim", req_id))

    def abandon_receive(self, req_id: int, ctx_endpoint: str) -> None:
        """A request that will never call `begin_receive` here (it ended first: aborted, client
        gone, shutdown) but whose context leg may have pinned KV for it: tell the context
        instance, which ends its send session (`SendEnd.RECEIVER_CANCELLED`). No-op for a request
        that has a receive session (`cancel_receive` covers it)."""
        with self._lock:
            if req_id in self._recv or req_id in self._retired_recv:
                return
        self.messenger.call_soon(lambda: self._send_to_instance(ctx_endpoint, "cancel", req_id))

    def _send_to_instance(self, endpoint: str, t: str, req_id: int) -> None:
        """(listener thread) `cancel`/`claim` to the context instance at `endpoint`: every rank of
        it we know, else the rank the endpoint names."""
        with self._lock:
            pi = self._peer_for_endpoint(endpoint)
            eps = {endpoint} | ({x.endpoint for x in pi.peers} if pi is not None else set())
        self.stats["abandons_sent" if t == "cancel" else "claims_sent"] += 1
        for ep in eps:
            self.messenger.send(ep, {"t": t, "req": req_id})

    def release_receive(self, req_id: int) -> None:
        with self._lock:
            r = self._recv.get(req_id)
            if r is not None:
                if r.state in ("waiting", "posted") and not self.cancel_receive(req_id):
                    raise SessionError(f"request {req_id}: a context rank may still write; "
                                       f"cancel_receive() must return True before release")
                del self._recv[req_id]
            self._retire(self._retired_recv, req_id)

    # ================================================================== shared
    def pending(self) -> dict:
        with self._lock:
            return {"send": len(self._send), "recv": len(self._recv),
                    "parked": sum(len(v) for v in self._parked.values()),
                    "inflight_tasks": len(self._tasks), "receivers": len(self._receivers),
                    "peer_instances": len(self._peers)}

    def shutdown(self) -> None:
        with self._lock:
            if self._stop:
                return
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        self.messenger.close()
        for rx in self._receivers.values():
            for lp, rp in rx.preps.values():
                self.agent.release_prepped(lp)
                self.agent.release_prepped(rp)
        self.agent.shutdown()

    # ------------------------------------------------------------------ helpers
    def _group_ids(self, block_ids) -> list[np.ndarray]:
        """Block ids per layer group; a flat list is accepted for a single-group table."""
        groups = self.page_table.groups
        if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1:
            block_ids = [block_ids]
        elif len(groups) == 1 and (len(block_ids) == 0 or np.isscalar(block_ids[0])):
            block_ids = [block_ids]
        if len(block_ids) != len(groups):
            raise SessionError(f"block ids for {len(block_ids)} groups; the page table has "
                               f"{len(groups)}")
        out = []
        for g, ids in enumerate(block_ids):
            a = np.asarray(ids, dtype=np.int64).reshape(-1)
            lim = min(self.page_table.pools[v.pool].num_slots for v in groups[g].views)
            if a.size and a.max() >= lim:
                raise SessionError(f"group {g}: block id {int(a.max())} ≥ pool size {lim}")
            out.append(a)
        return out

    def _send_session(self, req_id: int) -> _SendSession:
        s = self._send.get(req_id)
        if s is None:
            raise SessionError(f"request {req_id}: no send session"
                               + (" (retired)" if req_id in self._retired_send else ""))
        return s

    def _recv_session(self, req_id: int) -> _RecvSession:
        r = self._recv.get(req_id)
        if r is None:
            raise SessionError(f"request {req_id}: no receive session"
                               + (" (retired)" if req_id in self._retired_recv else ""))
        return r

    @staticmethod
    def _retire(table: collections.OrderedDict, req_id: int) -> None:
        table[req_id] = time.monotonic()
        while len(table) > RETIRED_MAX:
            table.popitem(last=False)

    def _add_slice_locked(self, s: _SendSession, tokens_done: int, last: bool) -> None:
        tpb, n = self.tokens_per_block, s.num_tokens
        full_end = -(-n // tpb)
        ends = s.blocks_sent_end()
        prev_tok = s.slices[-1].tokens[1] if s.slices else 0
        blocks: dict[int, tuple[int, int]] = {}
        for g, grp in enumerate(self.page_table.groups):
            if grp.sliding_window:
                if last:  # deferred: only the final window, and only in the last slice
                    blocks[g] = (max(0, n - grp.sliding_window) // tpb, full_end)
                continue
            start = ends.get(g, 0)
            end = full_end if last else tokens_done // tpb  # partial blocks wait
            if end > start or last:
                blocks[g] = (start, max(start, end))
        if not last and not any(b1 > b0 for b0, b1 in blocks.values()):
            return  # nothing new is complete yet
        span_end = n if last else max(prev_tok, (tokens_done // tpb) * tpb)
        for g, (b0, b1) in blocks.items():
            if b1 > s.src_ids[g].size:
                raise SessionError(f"request {s.req_id}: group {g} needs blocks up to {b1}; "
                                   f"{s.src_ids[g].size} given")
        s.slices.append(_Slice(sid=len(s.slices), blocks=blocks, tokens=(prev_tok, span_end),
                               last=last))
        if last:
            s.last_added = True

    # ------------------------------------------------------------------ listener: messages
    _REQUESTS = frozenset({"get_instance", "register", "recv", "cancel", "claim"})
    _REPLIES = frozenset({"instance", "registered", "register_failed", "result", "error"})

    def _on_message(self, source: tuple, msg: dict) -> None:
        kind, who = source
        t = msg["t"]
        allowed = self._REQUESTS if kind == "router" else self._REPLIES
        handler = getattr(self, f"_h_{t}", None) if t in allowed else None
        if handler is None:
            log.warning("unknown control message %r from %r", t, who)
            return
        try:
            handler(who, msg)
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            log.warning("bad %r message from %r: %s", t, who, e)
            if kind == "router":
                self.messenger.reply(who, {"t": "error", "error": f"bad {t!r}: {e}"})

    # -- context side
    def _h_get_instance(self, ident: bytes, msg: dict) -> None:
        with self._lock:
            ranks = list(self._instance)
        self.messenger.reply(ident, {"t": "instance", "ranks": ranks, "self": self.info.key})

    def _h_register(self, ident: bytes, msg: dict) -> None:
        try:
            info = decode_rank_info(msg["info"])
            check_compatible(self.info, info)
        except (ConfigMismatch, ProtocolError) as e:
            self.messenger.reply(ident, {"t": "register_failed", "error": str(e),
                                         "key": self.info.key})
            return
        with self._lock:
            self._work.append(("load", ident, info))
            self._cv.notify()

    def _h_recv(self, ident: bytes, msg: dict) -> None:
        key = ident.decode()
        req = int(msg["req"])
        with self._lock:
            if key not in self._receivers:
                self._reply_result(key, req, "error", ident=ident,
                                   error=f"generation rank {key} is not registered with "
                                         f"{self.info.key}", last=True)
                return
            if req in self._retired_send:
                self._reply_result(key, req, "error", error=f"request {req} already finished on "
                                   f"context rank {self.info.key}")
                return
            s = self._send.get(req)
            if s is None:
                self._parked.setdefault(req, []).append((time.monotonic(), key, msg))
                return
            self._attach_locked(s, key, msg)
            self._cv.notify()

    def _h_claim(self, ident: bytes, msg: dict) -> None:
        req = int(msg["req"])
        with self._lock:
            s = self._send.get(req)
            if s is not None:
                s.claimed = True
            elif req not in self._retired_send:  # generation_first: the claim comes first
                self._claims[req] = time.monotonic()
                while len(self._claims) > RETIRED_MAX:
                    self._claims.popitem(last=False)

    def _h_cancel(self, ident: bytes, msg: dict) -> None:
        """A generation rank gave up on a request: the KV will not be used by anyone (a request is
        all-or-nothing), so the whole send session ends as soon as no write is in flight."""
        key = ident.decode()
        req = int(msg["req"])
        with self._lock:
            parked = self._parked.get(req)
            if parked:
                self._parked[req] = [p for p in parked if p[1] != key]
                if not self._parked[req]:
                    del self._parked[req]
            s = self._send.get(req)
            tgt = s.targets.get(key) if s else None
            if tgt is None:
                self._reply_result(key, req, "cancelled", ident=ident, error="cancelled by peer")
            else:
                tgt.cancelled = True
            if s is None:
                return
            if s.state == "active":
                s.cancel_requested = True
                s.error = s.error or f"cancelled by generation rank {key}"
                s.cause = s.cause or SendEnd.RECEIVER_CANCELLED
                if not s.inflight():
                    self._end_send_locked(s, "cancelled", s.error, SendEnd.RECEIVER_CANCELLED)
            elif tgt is not None and tgt.inflight is None and not tgt.final_sent:
                tgt.final_sent = True
                self._reply_result(key, req, "cancelled", error="cancelled by generation rank")

    def _attach_locked(self, s: _SendSession, key: str, msg: dict) -> None:
        rx = self._receivers.get(key)
        req = s.req_id
        try:
            if rx is None:
                raise ProtocolError(f"generation rank {key} is not registered")
            if key in s.targets:
                raise ProtocolError(f"duplicate receive from {key}")
            if s.state != "active" or s.cancel_requested:
                raise ProtocolError(f"send session is {s.state}"
                                    + (" (cancel requested)" if s.cancel_requested else ""))
            n = int(msg["n"])
            if n != s.num_tokens:
                raise ProtocolError(f"receiver expects {n} tokens; context has {s.num_tokens}")
            ids = [_ids_from(b) for b in msg["ids"]]
            ng = len(rx.info.page_table.groups)
            if len(ids) != ng:
                raise ProtocolError(f"receiver sent ids for {len(ids)} groups; it has {ng}")
            need = -(-n // self.tokens_per_block)
            for g, a in enumerate(ids):
                if a.size < need:
                    raise ProtocolError(f"receiver group {g} has {a.size} blocks; need {need}")
            if s.expected is None:
                s.expected = len(peer_flat_ranks(self.info, rx.info))
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            self._reply_result(key, req, "error", error=f"receive refused: {e}")
            return
        s.targets[key] = _Target(rx=rx, dst_ids=ids)
        s.claimed = True

    # -- generation side
    def _ensure_peer(self, endpoint: str, req_id: int) -> None:
        with self._lock:
            r = self._recv.get(req_id)
            if r is None or r.state != "waiting":
                return
            if r.cancel_requested:
                self._recv_final_locked(r, "cancelled", "cancelled")
                return
            pi = self._peers.get(endpoint)
            if pi is None:
                pi = self._peers[endpoint] = _PeerInstance(endpoint=endpoint)
                pi.waiting.append(req_id)
                self.messenger.send(endpoint, {"t": "get_instance"})
                return
            if pi.state == "ready":
                self._post_locked(pi, r)
            else:
                pi.waiting.append(req_id)

    def _peer_for_endpoint(self, endpoint: str) -> _PeerInstance | None:
        pi = self._peers.get(endpoint)
        if pi is not None:
            return pi
        for p in self._peers.values():
            if any(x.endpoint == endpoint for x in p.peers):
                return p
        return None

    def _h_instance(self, endpoint: str, msg: dict) -> None:
        with self._lock:
            pi = self._peers.get(endpoint)
            if pi is None or pi.state != "fetching":
                return
            try:
                ranks = [decode_rank_info(b) for b in msg["ranks"]]
                for info in ranks:
                    check_compatible(self.info, info)
                peers = [x for x in ranks if are_peers(x, self.info)]
                if not peers:
                    raise UnsupportedTopology(f"no rank of {endpoint} shares layers and heads with "
                                              f"{self.info.key}")
            except TransferError as e:
                self._fail_peer_locked(pi, f"context instance at {endpoint}: {e}")
                return
            # The rank that answered is reached through the endpoint string we used (it may
            # advertise another spelling of it); one connection per rank.
            answering = str(msg.get("self", ""))
            peers = [msgspec_replace(x, endpoint=endpoint) if x.key == answering else x
                     for x in peers]
            pi.ranks, pi.peers, pi.state = ranks, peers, "registering"
            pi.pending = {x.key for x in peers}
            enc = self.info.encode()
            for x in peers:
                self.messenger.send(x.endpoint, {"t": "register", "info": enc})

    def _h_registered(self, endpoint: str, msg: dict) -> None:
        with self._lock:
            pi = self._peer_for_endpoint(endpoint)
            if pi is None or pi.state != "registering":
                return
            pi.pending.discard(str(msg["key"]))
            if not pi.pending:
                pi.state = "ready"
                waiting, pi.waiting = pi.waiting, []
                for req in waiting:
                    r = self._recv.get(req)
                    if r is not None and r.state == "waiting":
                        if r.cancel_requested:
                            self._recv_final_locked(r, "cancelled", "cancelled")
                        else:
                            self._post_locked(pi, r)

    def _h_register_failed(self, endpoint: str, msg: dict) -> None:
        with self._lock:
            pi = self._peer_for_endpoint(endpoint)
            if pi is not None:
                self._fail_peer_locked(pi, f"context rank {msg.get('key')} refused registration: "
                                           f"{msg.get('error')}")

    def _h_error(self, endpoint, msg: dict) -> None:
        log.warning("peer %r reported an error: %s", endpoint, msg.get("error"))
        if isinstance(endpoint, str):
            with self._lock:
                pi = self._peer_for_endpoint(endpoint)
                if pi is not None and pi.state != "ready":
                    self._fail_peer_locked(pi, f"peer {endpoint}: {msg.get('error')}")

    def _fail_peer_locked(self, pi: _PeerInstance, reason: str) -> None:
        log.warning("%s", reason)
        self._peers.pop(pi.endpoint, None)
        for req in pi.waiting:
            r = self._recv.get(req)
            if r is not None and r.state == "waiting":
                self._recv_final_locked(r, "failed", reason)
        pi.waiting = []

    def _post_locked(self, pi: _PeerInstance, r: _RecvSession) -> None:
        ids = [_ids_bytes(a) for a in r.dst_ids]
        for x in pi.peers:
            r.writers[x.key] = _Writer(endpoint=x.endpoint)
            self.messenger.send(x.endpoint, {"t": "recv", "req": r.req_id, "n": r.num_tokens,
                                             "ids": ids})
        r.state = "posted"

    def _h_result(self, endpoint: str, msg: dict) -> None:
        req = int(msg["req"])
        with self._lock:
            r = self._recv.get(req)
            if r is None:
                return
            w = r.writers.get(str(msg.get("from")))
            if w is None or w.terminal:
                return
            status = msg.get("status")
            if status == "ok":
                w.slices += 1
                if msg.get("last"):
                    w.state = "done"
                    if msg.get("meta") is not None and r.meta is None:
                        r.meta = msg["meta"]
            elif status == "cancelled":
                w.state = "cancelled"
                if not r.cancel_requested and r.error is None:
                    r.error = f"context rank {msg.get('from')} cancelled: {msg.get('error')}"
            else:
                w.state = "failed"
                if r.error is None:
                    r.error = f"context rank {msg.get('from')}: {msg.get('error')}"
            if w.state in ("failed", "cancelled"):
                self._send_cancels_locked(r)
            self._check_recv_locked(r)

    def _send_cancels_locked(self, r: _RecvSession) -> None:
        if r.cancel_sent:
            return
        r.cancel_sent = True
        for w in r.writers.values():
            if not w.terminal:
                self.messenger.send(w.endpoint, {"t": "cancel", "req": r.req_id})

    @staticmethod
    def _recv_final_locked(r: _RecvSession, state: str, error: str | None = None) -> None:
        """Move a receive to a terminal state and fire its completion callback (once)."""
        r.state = state
        if error is not None or state != "done":
            r.error = r.error or error or state
        cb, r.on_done = r.on_done, None
        if cb is not None:
            try:
                cb()
            except Exception:  # a callback bug must not break the control plane
                log.exception("receive completion callback failed")

    def _check_recv_locked(self, r: _RecvSession) -> None:
        if r.state != "posted" or not all(w.terminal for w in r.writers.values()):
            return
        if r.cancel_requested:
            self._recv_final_locked(r, "cancelled", "cancelled")
        elif all(w.state == "done" for w in r.writers.values()) and not r.timed_out:
            self._recv_final_locked(r, "done")
        else:
            self._recv_final_locked(r, "failed", "transfer failed")
        self.stats[f"recv_{r.state}"] += 1

    def _on_peer_lost(self, endpoint: str, reason: str) -> None:
        with self._lock:
            pi = self._peer_for_endpoint(endpoint)
            if pi is not None:
                self._peers.pop(pi.endpoint, None)
                if pi.state != "ready":
                    self._fail_peer_locked(pi, f"context instance at {pi.endpoint}: {reason}")
                for p in pi.peers:
                    if p.endpoint != endpoint:
                        self.messenger.forget(p.endpoint)
            for r in self._recv.values():
                hit = False
                for w in r.writers.values():
                    if not w.terminal and (w.endpoint == endpoint or
                                           (pi is not None and w.endpoint in
                                            {p.endpoint for p in pi.peers})):
                        w.state = "lost"
                        hit = True
                if hit:
                    log.warning("request %s: context rank at %s lost (%s)", r.req_id, endpoint,
                                reason)
                    r.error = r.error or f"context rank at {endpoint} lost: {reason}"
                    self._send_cancels_locked(r)
                    self._check_recv_locked(r)
                elif r.state == "waiting" and r.endpoint == endpoint:
                    self._recv_final_locked(r, "failed",
                                            f"context instance at {endpoint}: {reason}")

    # -- replies (context side)
    def _reply_result(self, key: str, req: int, status: str, *, ident: bytes | None = None,
                      error: str | None = None, slices=(0, 0), span=(0, 0), last: bool = True,
                      meta: dict | None = None) -> None:
        self.messenger.reply(ident or key.encode(), {
            "t": "result", "req": req, "from": self.info.key, "status": status, "error": error,
            "slices": list(slices), "span": list(span), "last": last, "meta": meta})

    # ================================================================== transfer thread
    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    break
            try:
                busy = self._step()
            except Exception:
                log.exception("kv-transfer step failed")
                busy = False
            with self._lock:
                if self._stop:
                    break
                if busy or self._work:
                    continue
                # A write just posted usually completes within a fraction of a millisecond on
                # NVLink/CMA: yield-spin for SPIN_S after a submit, then back off to short sleeps
                # (long TCP transfers must not burn a core the agent's own thread needs).
                spin = any(time.monotonic() - t.started < SPIN_S for t in self._tasks)
                if not spin:
                    self._cv.wait(0.0005 if self._tasks else 0.005)
            if spin:
                time.sleep(0)

    def _step(self) -> bool:
        self.agent.progress()
        busy = False
        while True:
            with self._lock:
                item = self._work.popleft() if self._work else None
            if item is None:
                break
            busy = True
            self._do_work(item)
        busy |= self._poll_tasks()
        busy |= self._dispatch()
        self._timeouts()
        return busy

    def _do_work(self, item) -> None:
        op = item[0]
        if op == "load":
            _, ident, info = item
            try:
                name = self.agent.load_remote_agent(info.agent_desc)
                plan = plan_pair(self.info, info)
            except TransferError as e:
                self.messenger.reply(ident, {"t": "register_failed", "error": str(e),
                                             "key": self.info.key})
                return
            rx = _Receiver(info=info, identity=ident, agent_name=name, plan=plan)
            if self._use_prepped:
                try:
                    self._prepare(rx)
                except TransferError as e:
                    log.warning("prepared descriptor lists for %s unavailable (%s); using "
                                "per-transfer lists", info.key, e)
            with self._lock:
                self._receivers[info.key] = rx
            self.messenger.reply(ident, {"t": "registered", "key": self.info.key})

    def _prepare(self, rx: _Receiver) -> None:
        """Per-slot descriptor lists for single-fragment mappers: a transfer then only names block
        indices and NIXL merges runs adjacent on both sides."""
        from .descs import Descs

        for i, m in enumerate(rx.plan.mappers):
            if m.fragments_per_block != 1:
                continue
            sp, dp = m.src_pool, m.dst_pool
            ls = np.zeros((sp.num_slots, 3), np.uint64)
            ls[:, 0] = sp.base + np.arange(sp.num_slots, dtype=np.uint64) * np.uint64(sp.slot_stride) + m.src_off[0]
            ls[:, 1], ls[:, 2] = m.size[0], sp.device_id
            rs = np.zeros((dp.num_slots, 3), np.uint64)
            rs[:, 0] = dp.base + np.arange(dp.num_slots, dtype=np.uint64) * np.uint64(dp.slot_stride) + m.dst_off[0]
            rs[:, 1], rs[:, 2] = m.size[0], dp.device_id
            lp = self.agent.prep_descs(None, Descs(ls, sp.mem_type))
            rp = self.agent.prep_descs(rx.agent_name, Descs(rs, dp.mem_type))
            rx.preps[i] = (lp, rp)

    def _dispatch(self) -> bool:
        todo = []
        with self._lock:
            for s in self._send.values():
                if s.state != "active" or s.cancel_requested or s.timed_out:
                    continue
                for t in s.targets.values():
                    if t.inflight is None and not t.cancelled and not t.final_sent \
                            and t.next_slice < len(s.slices):
                        task = _Task(session=s, target=t, s0=t.next_slice, s1=len(s.slices),
                                     started=time.monotonic())
                        t.inflight = task  # TRANSFERRING before any byte moves
                        self._tasks.append(task)
                        todo.append(task)
        for task in todo:
            try:
                self._submit(task)
            except Exception as e:  # validation / peer lost: nothing was posted
                task.error = f"{type(e).__name__}: {e}"
                task.cause = cause_of(e)
                if isinstance(e, PeerLost):
                    self._drop_receiver(task.target.rx)
        return bool(todo)

    def _submit(self, task: _Task) -> None:
        s, t = task.session, task.target
        ranges: dict[int, tuple[int, int]] = {}
        for sl in s.slices[task.s0:task.s1]:
            for g, (b0, b1) in sl.blocks.items():
                if g in ranges:
                    ranges[g] = (min(ranges[g][0], b0), max(ranges[g][1], b1))
                else:
                    ranges[g] = (b0, b1)
        pairs: dict[tuple, list] = {}
        for i, m in enumerate(t.rx.plan.mappers):
            if m.src_group not in ranges:
                continue
            b0, b1 = ranges[m.src_group]
            if b1 <= b0:
                continue
            src_ids = s.src_ids[m.src_group][b0:b1]
            dst_ids = t.dst_ids[m.dst_group][b0:b1]
            if i in t.rx.preps and _runs(src_ids, dst_ids) > PREPPED_MIN_RUNS:
                keep = (src_ids >= 0) & (dst_ids >= 0)
                lp, rp = t.rx.preps[i]
                h = self.agent.submit_prepped(t.rx.agent_name, lp, src_ids[keep], rp, dst_ids[keep])
                task.handles.append(h)
                task.nbytes += h.nbytes
                task.ndescs += h.ndescs
                continue
            src, dst, size = m.copies(src_ids, dst_ids)
            if not size.size:
                continue
            key = (m.src_pool.mem_type, m.src_pool.device_id, m.dst_pool.mem_type, m.dst_pool.device_id)
            pairs.setdefault(key, []).append((src, dst, size))
        for (smem, sdev, dmem, ddev), parts in pairs.items():
            src = np.concatenate([p[0] for p in parts])
            dst = np.concatenate([p[1] for p in parts])
            size = np.concatenate([p[2] for p in parts])
            src, dst, size = merge_runs(src, dst, size)
            ld, rd = build_pair(src, dst, size, sdev, ddev, smem, dmem)
            h = self.agent.submit_transfer(t.rx.agent_name, ld, rd)
            task.handles.append(h)
            task.nbytes += ld.total_bytes
            task.ndescs += len(ld)

    def _poll_tasks(self) -> bool:
        with self._lock:
            tasks = list(self._tasks)
        finished = []
        for task in tasks:
            states = [self.agent.poll(h) for h in task.handles]
            if any(st == XPROC for st in states):
                continue
            for h, st in zip(task.handles, states):
                if st == XERR and task.error is None:
                    task.error = self.agent.error(h) or "transfer failed"
                    task.cause = self.agent.cause(h)
                self.agent.release(h)
            finished.append(task)
        if not finished:
            return False
        lost = []
        with self._lock:
            for task in finished:
                self._tasks.remove(task)
                self._complete_locked(task)
                if task.cause is Cause.PEER_LOST:
                    lost.append(task.target.rx)
        for rx in lost:
            self._drop_receiver(rx)
        return True

    def _drop_receiver(self, rx: _Receiver) -> None:
        with self._lock:
            if self._receivers.get(rx.info.key) is not rx:
                return
            del self._receivers[rx.info.key]
        for lp, rp in rx.preps.values():
            self.agent.release_prepped(lp)
            self.agent.release_prepped(rp)
        self.agent.invalidate_remote_agent(rx.agent_name)

    def _complete_locked(self, task: _Task) -> None:
        s, t = task.session, task.target
        t.inflight = None
        if task.handles:
            s.write_s += time.monotonic() - task.started
        s.nbytes += task.nbytes
        s.ndescs += task.ndescs
        key = t.rx.info.key
        if task.error is not None:
            self.stats["send_errors"] += 1
            if not t.final_sent:
                t.final_sent = True
                self._reply_result(key, s.req_id, "error", error=task.error)
            if s.state == "active":
                self._end_send_locked(s, "failed", f"write to {key} failed: {task.error}",
                                      SendEnd.WRITE_FAILED)
            return
        t.next_slice = task.s1
        covered = s.slices[task.s0:task.s1]
        last = bool(covered) and covered[-1].last
        if t.cancelled:
            if not t.final_sent:
                t.final_sent = True
                self._reply_result(key, s.req_id, "cancelled", error="cancelled by generation rank")
        elif s.state != "active" or s.cancel_requested:
            pass  # the session ended while this write was in flight; its end notice goes below
        else:
            self.stats["slices_sent"] += len(covered)
            if last:
                t.final_sent = True
            self._reply_result(key, s.req_id, "ok", slices=(task.s0, task.s1 - 1),
                               span=(covered[0].tokens[0], covered[-1].tokens[1]), last=last,
                               meta=s.meta if last else None)
        if s.state != "active" or s.cancel_requested:
            if not s.inflight():
                if s.state == "active":
                    self._end_send_locked(s, "cancelled", s.error or "cancelled by context",
                                          s.cause or SendEnd.CANCELLED)
                else:
                    self._notify_end_locked(s)
            return
        self._check_send_locked(s)

    def _end_send_locked(self, s: _SendSession, state: str, error: str | None,
                         cause: str) -> None:
        s.state, s.error = state, error
        s.cause = s.cause or cause
        self.stats[f"send_{state}"] += 1
        self._notify_end_locked(s)
        for _t, key, _m in self._parked.pop(s.req_id, []):
            self._reply_result(key, s.req_id, "cancelled" if state == "cancelled" else "error",
                               error=error)

    def _notify_end_locked(self, s: _SendSession) -> None:
        """Tell every receiver not yet told that no (more) data is coming."""
        status = "cancelled" if s.state == "cancelled" else "error"
        for key, t in s.targets.items():
            if not t.final_sent and t.inflight is None:
                t.final_sent = True
                self._reply_result(key, s.req_id, status, error=s.error)

    def _check_send_locked(self, s: _SendSession) -> None:
        if s.state != "active" or not s.last_added or s.expected is None:
            return
        if len(s.targets) < s.expected:
            return
        if all(t.final_sent and t.inflight is None for t in s.targets.values()):
            if any(t.cancelled for t in s.targets.values()):
                self._end_send_locked(s, "cancelled", "cancelled by generation rank",
                                      SendEnd.RECEIVER_CANCELLED)
            else:
                s.state, s.cause = "done", SendEnd.TRANSFERRED
                self.stats["send_done"] += 1

    def _timeouts(self) -> None:
        now = time.monotonic()
        ct = self.cfg.claim_timeout_s
        decides = self.topology.pp_rank == 0 and self.topology.tp_rank == 0
        with self._lock:
            for s in self._send.values():
                if ct > 0 and decides and s.state == "active" and not s.claimed \
                        and s.finished_at is not None and now > s.finished_at + ct \
                        and not s.inflight():
                    s.error = f"no generation worker claimed the KV within {ct:.1f}s of the " \
                              f"context answer (its requester is gone)"
                    log.warning("request %s: %s", s.req_id, s.error)
                    self._end_send_locked(s, "failed", s.error, SendEnd.UNCLAIMED)
                    continue
                if s.state == "active" and s.deadline is not None and now > s.deadline \
                        and not s.timed_out:
                    s.timed_out = True
                    s.error = f"timed out after {self.cfg.send_timeout_s:.1f}s waiting for " \
                              f"receivers ({len(s.targets)}/{s.expected or '?'} posted)"
                    log.warning("request %s: %s", s.req_id, s.error)
                if s.timed_out and s.state == "active" and not s.inflight():
                    self._end_send_locked(s, "failed", s.error, SendEnd.TIMED_OUT)
            while self._claims and now - next(iter(self._claims.values())) > self.cfg.recv_timeout_s:
                self._claims.popitem(last=False)   # its context leg never started here
            for req in list(self._parked):
                keep = []
                for item in self._parked[req]:
                    if now - item[0] > self.cfg.recv_timeout_s:
                        self._reply_result(item[1], req, "error",
                                           error=f"request {req} never started on the context "
                                                 f"rank within {self.cfg.recv_timeout_s:.1f}s")
                    else:
                        keep.append(item)
                if keep:
                    self._parked[req] = keep
                else:
                    del self._parked[req]
            for r in self._recv.values():
                if r.state in ("waiting", "posted") and now > r.deadline and not r.timed_out:
                    r.timed_out = True
                    r.error = r.error or f"timed out after {self.cfg.recv_timeout_s:.1f}s"
                    log.warning("request %s: receive %s", r.req_id, r.error)
                    if r.state == "waiting":
                        self._recv_final_locked(r, "failed", r.error)
                    else:
                        self._send_cancels_locked(r)
                        self._check_recv_locked(r)
