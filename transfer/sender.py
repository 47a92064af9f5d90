"""The context side of one rank: send sessions, the generation ranks registered with this rank, and
the control messages a context rank answers (see `transfer/session.py` for the rules).

Slice bounds in blocks: the first slice starts at block 0 (a reused prefix is sent too); non-final
slices end at floor(tokens_done / tpb) — partial blocks wait; the final slice ends at
ceil(num_tokens / tpb). Sliding-window groups are not pipelined: the last slice carries their
final window. The reported token span is exact. Each receiving rank's slices are dispatched in
order, one transfer at a time (pending slices are coalesced into one transfer by the pump), so a
result for slice k is sent only after all earlier slices landed.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .control import Cancel, Claim, GetInstance, Instance, Recv, Register, RegisterFailed
from .control import ResultStatus as RS
from .errors import ConfigMismatch, ProtocolError, SessionError
from .peers import PairPlan, peer_flat_ranks
from .rank_info import RankInfo, check_compatible, decode_rank_info
from .session_core import RETIRED_MAX, RankCore, ids_from
from .states import SendEnd, SendState, State, Status

if TYPE_CHECKING:
    from .pump import Task

log = logging.getLogger("splitserve.transfer.session")


@dataclass
class Slice:
    sid: int
    blocks: dict[int, tuple[int, int]]    # src group -> [b0, b1)
    tokens: tuple[int, int]
    last: bool
    after: object = None    # CUDA event after the compute writing these blocks (None: written)


@dataclass
class RegisteredReceiver:
    """A generation rank registered with this context rank."""

    info: RankInfo
    identity: bytes
    agent_name: str
    plan: PairPlan
    preps: dict = field(default_factory=dict)   # mapper index -> (local PrepHandle, remote PrepHandle)
    expected: int | None = None   # ranks of its instance that are peers of this one (once known)


@dataclass
class Target:
    """One receiving rank of a send session."""

    rx: RegisteredReceiver
    dst_ids: list[np.ndarray]
    next_slice: int = 0
    inflight: "Task | None" = None
    cancelled: bool = False
    final_sent: bool = False
    by_notif: bool = False    # its receiver takes `ok` results as agent notifications (Recv.notif)
    by_ready: bool = False    # its receiver waits on a direct write's end event (Recv.ready)


@dataclass
class SendSession:
    request_id: int
    num_tokens: int
    src_ids: list[np.ndarray]
    created: float
    slices: list[Slice] = field(default_factory=list)
    last_added: bool = False
    meta: dict | None = None
    deadline: float | None = None
    state: SendState = SendState.ACTIVE
    error: str | None = None
    cause: SendEnd | None = None            # once not active
    claimed: bool = False                   # a generation rank said it holds the request
    finished_at: float | None = None        # when the final slice was appended
    targets: dict[str, Target] = field(default_factory=dict)
    expected: int | None = None
    cancel_requested: bool = False
    timed_out: bool = False
    nbytes: int = 0
    ndescs: int = 0
    write_s: float = 0.0                    # time writes were in flight (submit → DONE)
    submit_s: float = 0.0                   # of which posting them (claim → submit returned)
    slices_done: dict = field(default_factory=dict)   # slice id -> when its write finished
    on_end: Callable[[], None] | None = None   # called once (any thread) when quiescent

    def inflight(self) -> bool:
        return any(t.inflight is not None for t in self.targets.values())

    @property
    def quiescent(self) -> bool:
        return self.state != SendState.ACTIVE and not self.inflight()

    def blocks_sent_end(self) -> dict[int, int]:
        return {g: b1 for s in self.slices for g, (_b0, b1) in s.blocks.items()}


class Sender:
    def __init__(self, core: RankCore) -> None:
        self.c = core
        self.sessions: dict[int, SendSession] = {}
        self.parked: dict[int, list[tuple[float, str, Recv]]] = {}   # recv before begin_send
        self.claims: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.receivers: dict[str, RegisteredReceiver] = {}
        self.retired: collections.OrderedDict = collections.OrderedDict()
        self.instance: list[bytes] = [core.info.encode()]

    def set_instance(self, infos: Sequence[bytes]) -> None:
        decoded = [decode_rank_info(b) for b in infos]
        if not any(d.key == self.c.info.key for d in decoded):
            raise SessionError("set_instance: this rank's own RankInfo is not in the list")
        with self.c.lock:
            self.instance = list(infos)

    # ================================================================== API
    def begin(self, request_id: int, num_tokens: int, block_ids,
              on_end: Callable[[], None] | None = None) -> None:
        ids = self.c.group_ids(block_ids)
        if num_tokens <= 0:
            raise SessionError(f"request {request_id}: num_tokens must be positive; found {num_tokens}")
        with self.c.lock:
            if request_id in self.sessions:
                raise SessionError(f"request {request_id}: a send session already exists")
            if request_id in self.retired:
                raise SessionError(f"request {request_id}: its send session was retired and cannot be "
                                   f"re-created")
            s = SendSession(request_id=request_id, num_tokens=num_tokens, src_ids=ids,
                            created=time.monotonic(),
                            claimed=self.claims.pop(request_id, None) is not None, on_end=on_end)
            self.sessions[request_id] = s
            for _t, key, msg in self.parked.pop(request_id, []):
                self._attach_locked(s, key, msg)
            # No wake-up: a new session has no slice to send yet (waking the transfer thread
            # here made it run, NIXL progress and all, just as the receive arrived).

    def progress(self, request_id: int, tokens_done: int, block_ids=None, after=None) -> None:
        if not self.c.cfg.pipeline:
            return
        with self.c.lock:
            s = self._session(request_id)
            if block_ids is not None:
                s.src_ids = self.c.group_ids(block_ids)
            if s.last_added or s.state != SendState.ACTIVE or s.cancel_requested:
                return
            self._add_slice_locked(s, min(tokens_done, s.num_tokens), last=False, after=after)
            # A chunk before the last is off the critical path: the transfer thread submits
            # it while this (the engine's) thread goes on with the next chunk (submitting here
            # measured slower: 105 vs 89 ms TTFT, simulated 16k prefill, H100, 2026-12-07).
            self.c.cv.notify()

    def finish(self, request_id: int, meta: dict | None = None, block_ids=None,
               after=None) -> None:
        with self.c.lock:
            s = self._session(request_id)
            if s.last_added:
                raise SessionError(f"request {request_id}: final slice already appended")
            if block_ids is not None:
                s.src_ids = self.c.group_ids(block_ids)
            s.meta = meta
            self._add_slice_locked(s, s.num_tokens, last=True, after=after)
            s.finished_at = time.monotonic()
            s.deadline = s.finished_at + self.c.cfg.send_timeout_s
            self.check_locked(s)
            if not s.targets:
                # context_first: the receive's arrival dispatches it (Sender.on_recv); it comes
                # once the answer reached the generation worker, maybe within the spin window.
                if self.c.spin_s and s.state == SendState.ACTIVE:
                    self.c.messenger.expect(self.c.spin_s)
                return
        self.c.pump.dispatch_now(s)   # generation_first: the receive is here; write now

    def status(self, request_id: int) -> Status:
        with self.c.lock:
            s = self._session(request_id)
            if s.state == SendState.ACTIVE:
                state = State.TRANSFERRING if s.inflight() or s.targets else State.WAITING
            else:
                state = State(s.state)
            return Status(state=state, quiescent=s.quiescent, error=s.error, meta=s.meta,
                          timed_out=s.timed_out, bytes=s.nbytes, descriptors=s.ndescs,
                          write_s=s.write_s, submit_s=s.submit_s, cause=s.cause,
                          slices_done=tuple(s.slices_done[i] for i in sorted(s.slices_done)))

    def cancel(self, request_id: int) -> bool:
        with self.c.lock:
            s = self.sessions.get(request_id)
            if s is None:
                for _t, key, _m in self.parked.pop(request_id, []):
                    self.c.reply_result(key, request_id, RS.CANCELLED, error="cancelled by context")
                return True
            s.cancel_requested = True
            if s.inflight():
                return False
            if s.state == SendState.ACTIVE:
                self.end_locked(s, SendState.CANCELLED, "cancelled by context", SendEnd.CANCELLED)
            return True

    def release(self, request_id: int) -> None:
        with self.c.lock:
            s = self.sessions.get(request_id)
            if s is None:
                self.c.retire(self.retired, request_id)
                for _t, key, _m in self.parked.pop(request_id, []):
                    self.c.reply_result(key, request_id, RS.ERROR,
                                        error=f"request {request_id} was released by the context rank")
                return
            if s.state == SendState.ACTIVE and not self.cancel(request_id):
                raise SessionError(f"request {request_id}: a write is in flight; cancel_send() must "
                                   f"return True before release")
            if s.inflight():
                raise SessionError(f"request {request_id}: a write is in flight")
            del self.sessions[request_id]
            self.c.retire(self.retired, request_id)

    def _session(self, request_id: int) -> SendSession:
        s = self.sessions.get(request_id)
        if s is None:
            raise SessionError(f"request {request_id}: no send session"
                               + (" (retired)" if request_id in self.retired else ""))
        return s

    def _add_slice_locked(self, s: SendSession, tokens_done: int, last: bool,
                          after=None) -> None:
        tpb, n = self.c.tokens_per_block, s.num_tokens
        full_end = -(-n // tpb)
        ends = s.blocks_sent_end()
        prev_tok = s.slices[-1].tokens[1] if s.slices else 0
        blocks: dict[int, tuple[int, int]] = {}
        for g, grp in enumerate(self.c.page_table.groups):
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
                raise SessionError(f"request {s.request_id}: group {g} needs blocks up to {b1}; "
                                   f"{s.src_ids[g].size} given")
        s.slices.append(Slice(sid=len(s.slices), blocks=blocks, tokens=(prev_tok, span_end),
                              last=last, after=after))
        if last:
            s.last_added = True

    # ================================================================== messages (listener)
    def on_get_instance(self, ident: bytes, msg: GetInstance) -> None:
        with self.c.lock:
            ranks = list(self.instance)
        self.c.reply(ident, Instance(ranks=ranks, answering=self.c.info.key))

    def on_register(self, ident: bytes, msg: Register) -> None:
        try:
            info = decode_rank_info(msg.info)
            check_compatible(self.c.info, info)
        except (ConfigMismatch, ProtocolError) as e:
            self.c.reply(ident, RegisterFailed(error=str(e), key=self.c.info.key))
            return
        self.c.pump.load(ident, info)

    def on_recv(self, ident: bytes, msg: Recv) -> None:
        key = ident.decode()
        req = msg.req
        with self.c.lock:
            if key not in self.receivers:
                self.c.reply_result(key, req, RS.ERROR, ident=ident,
                                    error=f"generation rank {key} is not registered with "
                                          f"{self.c.info.key}", last=True)
                return
            if req in self.retired:
                self.c.reply_result(key, req, RS.ERROR, error=f"request {req} already finished "
                                    f"on context rank {self.c.info.key}")
                return
            s = self.sessions.get(req)
            if s is None:
                self.parked.setdefault(req, []).append((time.monotonic(), key, msg))
                return
            self._attach_locked(s, key, msg)
            if not s.slices:
                return   # prefill is still running: its slices dispatch it
        self.c.pump.dispatch_now(s)   # context_first: answer on this (the listener's) thread

    def on_claim(self, ident: bytes, msg: Claim) -> None:
        req = msg.req
        if self.c.spin_s:   # a generation worker took the request: its receive follows
            self.c.messenger.expect(self.c.spin_s)
        with self.c.lock:
            s = self.sessions.get(req)
            if s is not None:
                s.claimed = True
            elif req not in self.retired:  # generation_first: the claim comes first
                self.claims[req] = time.monotonic()
                while len(self.claims) > RETIRED_MAX:
                    self.claims.popitem(last=False)

    def on_cancel(self, ident: bytes, msg: Cancel) -> None:
        """A generation rank gave up on a request: the KV will not be used by anyone (a request is
        all-or-nothing), so the whole send session ends as soon as no write is in flight."""
        key = ident.decode()
        req = msg.req
        with self.c.lock:
            parked = self.parked.get(req)
            if parked:
                self.parked[req] = [p for p in parked if p[1] != key]
                if not self.parked[req]:
                    del self.parked[req]
            s = self.sessions.get(req)
            tgt = s.targets.get(key) if s else None
            if tgt is None:
                self.c.reply_result(key, req, RS.CANCELLED, ident=ident, error="cancelled by peer")
            else:
                tgt.cancelled = True
            if s is None:
                return
            if s.state == SendState.ACTIVE:
                s.cancel_requested = True
                s.error = s.error or f"cancelled by generation rank {key}"
                s.cause = s.cause or SendEnd.RECEIVER_CANCELLED
                if not s.inflight():
                    self.end_locked(s, SendState.CANCELLED, s.error, SendEnd.RECEIVER_CANCELLED)
            elif tgt is not None and tgt.inflight is None and not tgt.final_sent:
                tgt.final_sent = True
                self.c.reply_result(key, req, RS.CANCELLED, error="cancelled by generation rank")

    def _attach_locked(self, s: SendSession, key: str, msg: Recv) -> None:
        rx = self.receivers.get(key)
        req = s.request_id
        try:
            if rx is None:
                raise ProtocolError(f"generation rank {key} is not registered")
            if key in s.targets:
                raise ProtocolError(f"duplicate receive from {key}")
            if s.state != SendState.ACTIVE or s.cancel_requested:
                raise ProtocolError(f"send session is {s.state}"
                                    + (" (cancel requested)" if s.cancel_requested else ""))
            n = msg.n
            if n != s.num_tokens:
                raise ProtocolError(f"receiver expects {n} tokens; context has {s.num_tokens}")
            ids = [ids_from(b) for b in msg.ids]
            ng = len(rx.info.page_table.groups)
            if len(ids) != ng:
                raise ProtocolError(f"receiver sent ids for {len(ids)} groups; it has {ng}")
            need = -(-n // self.c.tokens_per_block)
            for g, a in enumerate(ids):
                if a.size < need:
                    raise ProtocolError(f"receiver group {g} has {a.size} blocks; need {need}")
            if s.expected is None:
                if rx.expected is None:   # the same for every receive of this rank
                    rx.expected = len(peer_flat_ranks(self.c.info, rx.info))
                s.expected = rx.expected
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            self.c.reply_result(key, req, RS.ERROR, error=f"receive refused: {e}")
            return
        s.targets[key] = Target(rx=rx, dst_ids=ids, by_notif=msg.notif, by_ready=msg.ready)
        s.claimed = True

    # ================================================================== outcomes (under lock)
    def complete_locked(self, task: "Task") -> None:
        """A transfer of `task` finished (the pump): reply to its receiver, move the session."""
        s = task.session
        self._complete_locked(task)
        self.fire_locked(s)

    def _complete_locked(self, task: "Task") -> None:
        s, t = task.session, task.target
        t.inflight = None
        if task.handles:
            s.write_s += time.monotonic() - task.started
            s.submit_s += task.posted_at - task.started
        s.nbytes += task.nbytes
        s.ndescs += task.ndescs
        key = t.rx.info.key
        if task.error is not None:
            self.c.stats["send_errors"] += 1
            if not t.final_sent:
                t.final_sent = True
                self.c.reply_result(key, s.request_id, RS.ERROR, error=task.error)
            if s.state == SendState.ACTIVE:
                self.end_locked(s, SendState.FAILED, f"write to {key} failed: {task.error}",
                                SendEnd.WRITE_FAILED)
            return
        t.next_slice = task.s1
        covered = s.slices[task.s0:task.s1]
        now = time.monotonic()
        for sl in covered:
            s.slices_done[sl.sid] = now
        last = bool(covered) and covered[-1].last
        if t.cancelled:
            if not t.final_sent:
                t.final_sent = True
                self.c.reply_result(key, s.request_id, RS.CANCELLED,
                                    error="cancelled by generation rank")
        elif s.state != SendState.ACTIVE or s.cancel_requested:
            pass  # the session ended while this write was in flight; its end notice goes below
        else:
            self.c.stats["slices_sent"] += len(covered)
            if last:
                t.final_sent = True
            if task.notified:
                self.c.stats["results_by_notif"] += 1   # it went with the write
            elif task.result_sent:
                self.c.stats["results_ready"] += 1      # it went when the write was posted
            else:
                self.c.reply_result(key, s.request_id, RS.OK, slices=(task.s0, task.s1 - 1),
                                    span=(covered[0].tokens[0], covered[-1].tokens[1]), last=last,
                                    meta=s.meta if last else None)
        if s.state != SendState.ACTIVE or s.cancel_requested:
            if not s.inflight():
                if s.state == SendState.ACTIVE:
                    self.end_locked(s, SendState.CANCELLED, s.error or "cancelled by context",
                                    s.cause or SendEnd.CANCELLED)
                else:
                    self._notify_end_locked(s)
            return
        self.check_locked(s)

    def end_locked(self, s: SendSession, state: SendState, error: str | None,
                   cause: SendEnd) -> None:
        s.state, s.error = state, error
        s.cause = s.cause or cause
        self.c.stats[f"send_{state}"] += 1
        self._notify_end_locked(s)
        for _t, key, _m in self.parked.pop(s.request_id, []):
            self.c.reply_result(key, s.request_id,
                                RS.CANCELLED if state == SendState.CANCELLED else RS.ERROR,
                                error=error)
        self.fire_locked(s)

    def _notify_end_locked(self, s: SendSession) -> None:
        """Tell every receiver not yet told that no (more) data is coming."""
        status = RS.CANCELLED if s.state == SendState.CANCELLED else RS.ERROR
        for key, t in s.targets.items():
            if not t.final_sent and t.inflight is None:
                t.final_sent = True
                self.c.reply_result(key, s.request_id, status, error=s.error)

    def check_locked(self, s: SendSession) -> None:
        if s.state != SendState.ACTIVE or not s.last_added or s.expected is None:
            return
        if len(s.targets) < s.expected:
            return
        if all(t.final_sent and t.inflight is None for t in s.targets.values()):
            if any(t.cancelled for t in s.targets.values()):
                self.end_locked(s, SendState.CANCELLED, "cancelled by generation rank",
                                SendEnd.RECEIVER_CANCELLED)
            else:
                s.state, s.cause = SendState.DONE, SendEnd.TRANSFERRED
                self.c.stats["send_done"] += 1
                self.fire_locked(s)

    @staticmethod
    def fire_locked(s: SendSession) -> None:
        """Call the session's completion callback once it is quiescent (once)."""
        if s.on_end is None or not s.quiescent:
            return
        cb, s.on_end = s.on_end, None
        try:
            cb()
        except Exception:  # a callback bug must not break the transfer thread
            log.exception("send completion callback failed")

    def timeouts_locked(self, now: float) -> None:
        cfg = self.c.cfg
        ct = cfg.claim_timeout_s
        topo = self.c.topology
        decides = topo.pp_rank == 0 and topo.tp_rank == 0
        for s in self.sessions.values():
            if ct > 0 and decides and s.state == SendState.ACTIVE and not s.claimed \
                    and s.finished_at is not None and now > s.finished_at + ct \
                    and not s.inflight():
                s.error = f"no generation worker claimed the KV within {ct:.1f}s of the " \
                          f"context answer (its requester is gone)"
                log.warning("request %s: %s", s.request_id, s.error)
                self.end_locked(s, SendState.FAILED, s.error, SendEnd.UNCLAIMED)
                continue
            if s.state == SendState.ACTIVE and s.deadline is not None and now > s.deadline \
                    and not s.timed_out:
                s.timed_out = True
                s.error = f"timed out after {cfg.send_timeout_s:.1f}s waiting for " \
                          f"receivers ({len(s.targets)}/{s.expected or '?'} posted)"
                log.warning("request %s: %s", s.request_id, s.error)
            if s.timed_out and s.state == SendState.ACTIVE and not s.inflight():
                self.end_locked(s, SendState.FAILED, s.error, SendEnd.TIMED_OUT)
        while self.claims and now - next(iter(self.claims.values())) > cfg.recv_timeout_s:
            self.claims.popitem(last=False)   # its context leg never started here
        for req in list(self.parked):
            keep = []
            for item in self.parked[req]:
                if now - item[0] > cfg.recv_timeout_s:
                    self.c.reply_result(item[1], req, RS.ERROR,
                                        error=f"request {req} never started on the context "
                                              f"rank within {cfg.recv_timeout_s:.1f}s")
                else:
                    keep.append(item)
            if keep:
                self.parked[req] = keep
            else:
                del self.parked[req]
