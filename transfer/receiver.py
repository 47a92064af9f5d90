"""The generation side of one rank: receive sessions, the context instances it knows, and the
control messages a generation rank handles (see `transfer/session.py` for the rules).

`begin` registers the session *before* anything is posted, then (on the listener thread) fetches
the context instance's RankInfos once per endpoint (cached), registers its own RankInfo with every
context rank that shares layers and heads, and posts one receive per such rank. It completes when
every one of those ranks sent a final `ok` result.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from msgspec.structs import replace as msgspec_replace

from .control import Cancel, Claim, Error, GetInstance, Instance, Recv, Register, Registered
from .control import RegisterFailed, Result, ResultStatus
from .errors import SessionError, TransferError, UnsupportedTopology
from .peers import are_peers
from .rank_info import RankInfo, check_compatible, decode_rank_info
from .session_core import RankCore
from .states import PeerState, RecvState, State, Status, WriterState

log = logging.getLogger("splitserve.transfer.session")


@dataclass
class Writer:
    endpoint: str
    agent: str = ""     # its transfer agent's name: the only sender of its result notifications
    state: WriterState = WriterState.POSTED
    slices: int = 0

    @property
    def terminal(self) -> bool:
        return self.state != WriterState.POSTED


@dataclass
class RecvSession:
    request_id: int
    endpoint: str
    num_tokens: int
    dst_ids: list[np.ndarray]
    deadline: float
    state: RecvState = RecvState.WAITING
    writers: dict[str, Writer] = field(default_factory=dict)
    meta: dict | None = None
    error: str | None = None
    cancel_requested: bool = False
    cancel_sent: bool = False
    timed_out: bool = False
    on_done: Callable[[], None] | None = None   # called once (any thread) when quiescent


@dataclass
class PeerInstance:
    endpoint: str
    state: PeerState = PeerState.FETCHING
    ranks: list[RankInfo] = field(default_factory=list)
    peers: list[RankInfo] = field(default_factory=list)
    pending: set = field(default_factory=set)
    waiting: list[int] = field(default_factory=list)


def _fine_sleeps(slack_ns: int) -> None:
    """Let the calling thread's short sleeps end on time (Linux `PR_SET_TIMERSLACK`, this
    thread only); elsewhere, or where it fails, sleeps stay as they are."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, slack_ns, 0, 0, 0)   # PR_SET_TIMERSLACK
    except Exception:
        pass


class LandingWaiter:
    """One thread that waits for direct writes whose results came ahead of their bytes (sent
    when the write was posted, `control.Result.ready`), then hands each result back.

    Only a result whose write has not landed when it arrives comes here (a large write: the
    result overtook its kernel); a small write has landed by the time its result is read, and
    is completed on the listener thread without any hand-off. `waiter.landed(token)` never
    blocks, so a writer that died mid-write (its event never passes) cannot wedge the thread:
    its entry is dropped once the receive stops waiting for it (`alive()` False: the peer was
    lost, the receive ended)."""

    POLL_S = 20e-6   # between looks while a write is in flight: a fraction of any write's time
    SLACK_NS = 1000  # this thread's timer slack: Linux's default 50 µs made each 20 µs sleep
                     # ~87 µs (2-core box, 2026-12-07: median 87.5 µs; 31 µs at 1 µs slack)

    def __init__(self, waiter) -> None:
        self._waiter = waiter
        self._cv = threading.Condition()
        self._items: list = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-landing", daemon=True)
        self._thread.start()

    def add(self, token: bytes, then: Callable[[str | None], None],
            alive: Callable[[], bool]) -> None:
        """Call `then(None)` once the write of `token` landed (`then(error)` if it cannot be
        told), unless `alive()` turned False first."""
        with self._cv:
            self._items.append((token, then, alive))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        _fine_sleeps(self.SLACK_NS)
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                items = list(self._items)
            done = []
            for item in items:
                token, then, alive = item
                error = None
                try:
                    landed = self._waiter.landed(token)
                except Exception as e:
                    landed, error = True, f"cannot wait on the write's end event: {e}"
                if landed or not alive():
                    done.append(item)
                    if landed:
                        try:
                            then(error)
                        except Exception:
                            log.exception("landed-write handler failed")
            with self._cv:
                for item in done:
                    self._items.remove(item)
                pending = bool(self._items)
            if pending and not done:
                time.sleep(self.POLL_S)


class Receiver:
    def __init__(self, core: RankCore) -> None:
        self.c = core
        self.sessions: dict[int, RecvSession] = {}
        self.peers: dict[str, PeerInstance] = {}
        self.retired: collections.OrderedDict = collections.OrderedDict()
        self.landing: LandingWaiter | None = None

    # ================================================================== API
    def begin(self, request_id: int, ctx_endpoint: str, num_tokens: int, block_ids,
              on_done: Callable[[], None] | None = None) -> None:
        ids = self.c.group_ids(block_ids)
        need = -(-num_tokens // self.c.tokens_per_block)
        for g, a in enumerate(ids):
            if a.size < need:
                raise SessionError(f"request {request_id}: group {g} has {a.size} blocks; "
                                   f"{num_tokens} tokens need {need}")
        with self.c.lock:
            if request_id in self.sessions:
                raise SessionError(f"request {request_id}: a receive session already exists")
            if request_id in self.retired:
                raise SessionError(f"request {request_id}: its receive session was retired")
            self.sessions[request_id] = RecvSession(
                request_id=request_id, endpoint=ctx_endpoint, num_tokens=num_tokens, dst_ids=ids,
                deadline=time.monotonic() + self.c.cfg.recv_timeout_s, on_done=on_done)
            pi = self.peers.get(ctx_endpoint)
            if pi is not None and pi.state == PeerState.READY:
                # Known peer: post from this thread (on its lanes, no hand-off to the listener).
                self._post_locked(pi, self.sessions[request_id])
                return
        self.c.messenger.call_soon(lambda: self._ensure_peer(ctx_endpoint, request_id))

    def status(self, request_id: int) -> Status:
        with self.c.lock:
            r = self._session(request_id)
            state = State.TRANSFERRING if r.state == RecvState.POSTED else State(r.state)
            return Status(state=state, quiescent=not r.state.open, error=r.error, meta=r.meta,
                          timed_out=r.timed_out)

    def cancel(self, request_id: int) -> bool:
        with self.c.lock:
            r = self.sessions.get(request_id)
            if r is None:
                return True
            r.cancel_requested = True
            if r.state == RecvState.WAITING:
                # No recv was posted, so no write can come; but the context rank holds the KV
                # for us until told (its send session may already exist).
                self._final_locked(r, RecvState.CANCELLED, "cancelled")
                self.c.messenger.call_soon(
                    lambda: self._send_to_instance(r.endpoint, Cancel(req=request_id)))
                return True
            if r.state != RecvState.POSTED:
                return True
            self._send_cancels_locked(r)
            self._check_locked(r)
            return r.state != RecvState.POSTED

    def claim(self, request_id: int, ctx_endpoint: str) -> None:
        self.c.messenger.call_soon(lambda: self._send_to_instance(ctx_endpoint, Claim(req=request_id)))

    def abandon(self, request_id: int, ctx_endpoint: str) -> None:
        with self.c.lock:
            if request_id in self.sessions or request_id in self.retired:
                return
        self.c.messenger.call_soon(
            lambda: self._send_to_instance(ctx_endpoint, Cancel(req=request_id)))

    def release(self, request_id: int) -> None:
        with self.c.lock:
            r = self.sessions.get(request_id)
            if r is not None:
                if r.state.open and not self.cancel(request_id):
                    raise SessionError(f"request {request_id}: a context rank may still write; "
                                       f"cancel_receive() must return True before release")
                del self.sessions[request_id]
            self.c.retire(self.retired, request_id)

    def _session(self, request_id: int) -> RecvSession:
        r = self.sessions.get(request_id)
        if r is None:
            raise SessionError(f"request {request_id}: no receive session"
                               + (" (retired)" if request_id in self.retired else ""))
        return r

    def _send_to_instance(self, endpoint: str, msg: Cancel | Claim) -> None:
        """(listener thread) `cancel`/`claim` to the context instance at `endpoint`: every rank of
        it we know, else the rank the endpoint names."""
        with self.c.lock:
            pi = self._peer_for_endpoint(endpoint)
            eps = {endpoint} | ({x.endpoint for x in pi.peers} if pi is not None else set())
        self.c.stats["abandons_sent" if isinstance(msg, Cancel) else "claims_sent"] += 1
        for ep in eps:
            self.c.send(ep, msg)

    # ================================================================== peers (listener)
    def _ensure_peer(self, endpoint: str, request_id: int) -> None:
        with self.c.lock:
            r = self.sessions.get(request_id)
            if r is None or r.state != RecvState.WAITING:
                return
            if r.cancel_requested:
                self._final_locked(r, RecvState.CANCELLED, "cancelled")
                return
            pi = self.peers.get(endpoint)
            if pi is None:
                pi = self.peers[endpoint] = PeerInstance(endpoint=endpoint)
                pi.waiting.append(request_id)
                self.c.send(endpoint, GetInstance())
                return
            if pi.state == PeerState.READY:
                self._post_locked(pi, r)
            else:
                pi.waiting.append(request_id)

    def _peer_for_endpoint(self, endpoint: str) -> PeerInstance | None:
        pi = self.peers.get(endpoint)
        if pi is not None:
            return pi
        for p in self.peers.values():
            if any(x.endpoint == endpoint for x in p.peers):
                return p
        return None

    def on_instance(self, endpoint: str, msg: Instance) -> None:
        info = self.c.info
        with self.c.lock:
            pi = self.peers.get(endpoint)
            if pi is None or pi.state != PeerState.FETCHING:
                return
            try:
                ranks = [decode_rank_info(b) for b in msg.ranks]
                for x in ranks:
                    check_compatible(info, x)
                peers = [x for x in ranks if are_peers(x, info)]
                if not peers:
                    raise UnsupportedTopology(f"no rank of {endpoint} shares layers and heads with "
                                              f"{info.key}")
            except TransferError as e:
                self._fail_peer_locked(pi, f"context instance at {endpoint}: {e}")
                return
            # The rank that answered is reached through the endpoint string we used (it may
            # advertise another spelling of it); one connection per rank.
            peers = [msgspec_replace(x, endpoint=endpoint) if x.key == msg.answering else x
                     for x in peers]
            for x in peers:   # the ranks that will write here: e.g. open their CUDA events
                self.c.agent.expect_writes_from(x.agent_desc)
            pi.ranks, pi.peers, pi.state = ranks, peers, PeerState.REGISTERING
            pi.pending = {x.key for x in peers}
            enc = info.encode()
            for x in peers:
                self.c.send(x.endpoint, Register(info=enc))

    def on_registered(self, endpoint: str, msg: Registered) -> None:
        with self.c.lock:
            pi = self._peer_for_endpoint(endpoint)
            if pi is None or pi.state != PeerState.REGISTERING:
                return
            if msg.key in pi.pending and msg.lane:
                # Before any receive is posted to that rank: everything to it goes on the lane.
                self.c.messenger.open_lane(endpoint, msg.lane, msg.local_lane)
            pi.pending.discard(msg.key)
            if not pi.pending:
                pi.state = PeerState.READY
                waiting, pi.waiting = pi.waiting, []
                for req in waiting:
                    r = self.sessions.get(req)
                    if r is not None and r.state == RecvState.WAITING:
                        if r.cancel_requested:
                            self._final_locked(r, RecvState.CANCELLED, "cancelled")
                        else:
                            self._post_locked(pi, r)

    def on_register_failed(self, endpoint: str, msg: RegisterFailed) -> None:
        with self.c.lock:
            pi = self._peer_for_endpoint(endpoint)
            if pi is not None:
                self._fail_peer_locked(pi, f"context rank {msg.key} refused registration: "
                                           f"{msg.error}")

    def on_error(self, endpoint, msg: Error) -> None:
        log.warning("peer %r reported an error: %s", endpoint, msg.error)
        if isinstance(endpoint, str):
            with self.c.lock:
                pi = self._peer_for_endpoint(endpoint)
                if pi is not None and pi.state != PeerState.READY:
                    self._fail_peer_locked(pi, f"peer {endpoint}: {msg.error}")

    def _fail_peer_locked(self, pi: PeerInstance, reason: str) -> None:
        log.warning("%s", reason)
        self.peers.pop(pi.endpoint, None)
        for req in pi.waiting:
            r = self.sessions.get(req)
            if r is not None and r.state == RecvState.WAITING:
                self._final_locked(r, RecvState.FAILED, reason)
        pi.waiting = []

    def _post_locked(self, pi: PeerInstance, r: RecvSession) -> None:
        # Its result comes on the control plane within a round trip in context_first (in
        # generation_first after the prefill: the window is then spent for nothing, once per
        # receive). Asked before the receive leaves, so that a listener asleep wakes while the
        # receive travels, not after. A result that comes as the write's notification is read
        # by the agent's thread, not this listener: nothing to spin for.
        if self.c.spin_s and not self.c.results_by_notif:
            self.c.messenger.expect(self.c.spin_s)
        ids = [a.tobytes() for a in r.dst_ids]   # 1-D int64 (RankCore.group_ids)
        for x in pi.peers:
            r.writers[x.key] = Writer(endpoint=x.endpoint, agent=x.agent_name)
            self.c.send(x.endpoint, Recv(req=r.request_id, n=r.num_tokens, ids=ids,
                                         notif=self.c.results_by_notif,
                                         ready=self.c.ready_waiter is not None))
        r.state = RecvState.POSTED

    def on_result(self, endpoint: str | None, msg: Result, agent: str | None = None) -> None:
        """A context rank's result: a control message (`endpoint` its rank) or, for `ok` results
        of a receive posted with `notif`, the notification of the write from transfer agent
        `agent` (`endpoint` None, on the agent's thread)."""
        with self.c.lock:
            r = self.sessions.get(msg.req)
            if r is None:
                return
            w = r.writers.get(msg.sender)
            if w is None or w.terminal:
                return
            if endpoint is None and (agent != w.agent or msg.status != ResultStatus.OK):
                log.warning("request %s: result notification from agent %r for rank %s (agent "
                            "%r) ignored", msg.req, agent, msg.sender, w.agent)
                return
            if msg.ready is not None:
                # Sent when the write was posted: its slices count once its end event passed.
                msg = self._landed_locked(r, w, endpoint, msg)
                if msg is None:
                    return
            if msg.status == ResultStatus.OK:
                w.slices += 1
                if msg.last:
                    w.state = WriterState.DONE
                    if msg.meta is not None and r.meta is None:
                        r.meta = msg.meta
            elif msg.status == ResultStatus.CANCELLED:
                w.state = WriterState.CANCELLED
                if not r.cancel_requested and r.error is None:
                    r.error = f"context rank {msg.sender} cancelled: {msg.error}"
            else:
                w.state = WriterState.FAILED
                if r.error is None:
                    r.error = f"context rank {msg.sender}: {msg.error}"
            if w.state in (WriterState.FAILED, WriterState.CANCELLED):
                self._send_cancels_locked(r)
            self._check_locked(r)

    def on_peer_lost(self, endpoint: str, reason: str) -> None:
        with self.c.lock:
            pi = self._peer_for_endpoint(endpoint)
            if pi is not None:
                self.peers.pop(pi.endpoint, None)
                if pi.state != PeerState.READY:
                    self._fail_peer_locked(pi, f"context instance at {pi.endpoint}: {reason}")
                for p in pi.peers:
                    if p.endpoint != endpoint:
                        self.c.messenger.forget(p.endpoint)
            gone = {endpoint} | ({p.endpoint for p in pi.peers} if pi is not None else set())
            for r in self.sessions.values():
                hit = False
                for w in r.writers.values():
                    if not w.terminal and w.endpoint in gone:
                        w.state = WriterState.LOST
                        hit = True
                if hit:
                    log.warning("request %s: context rank at %s lost (%s)", r.request_id, endpoint,
                                reason)
                    r.error = r.error or f"context rank at {endpoint} lost: {reason}"
                    self._send_cancels_locked(r)
                    self._check_locked(r)
                elif r.state == RecvState.WAITING and r.endpoint == endpoint:
                    self._final_locked(r, RecvState.FAILED,
                                       f"context instance at {endpoint}: {reason}")

    def _landed_locked(self, r: RecvSession, w: Writer, endpoint, msg: Result) -> Result | None:
        """`msg` (a result carrying its write's end event) as a plain result once the write
        landed; None while it has not (a `LandingWaiter` hands it back when it has)."""
        waiter = self.c.ready_waiter
        if waiter is None or msg.status != ResultStatus.OK:
            return msgspec_replace(msg, status=ResultStatus.ERROR, ready=None,
                                   error=f"a result with a completion event this rank cannot "
                                         f"wait on (status {msg.status})")
        try:
            if waiter.landed(msg.ready):
                return msgspec_replace(msg, ready=None)
        except TransferError as e:
            return msgspec_replace(msg, status=ResultStatus.ERROR, ready=None,
                                   error=f"cannot wait on the write's end event: {e}")
        if self.landing is None:
            self.landing = LandingWaiter(waiter)
        plain = msgspec_replace(msg, ready=None)

        def then(error: str | None) -> None:
            self.on_result(endpoint, plain if error is None else msgspec_replace(
                plain, status=ResultStatus.ERROR, error=error))
        self.landing.add(msg.ready, then,
                         lambda: not w.terminal and self.sessions.get(r.request_id) is r)
        return None

    def shutdown(self) -> None:
        if self.landing is not None:
            self.landing.close()

    # ================================================================== outcomes (under lock)
    def _send_cancels_locked(self, r: RecvSession) -> None:
        if r.cancel_sent:
            return
        r.cancel_sent = True
        for w in r.writers.values():
            if not w.terminal:
                self.c.send(w.endpoint, Cancel(req=r.request_id))

    @staticmethod
    def _final_locked(r: RecvSession, state: RecvState, error: str | None = None) -> None:
        """Move a receive to a terminal state and fire its completion callback (once)."""
        r.state = state
        if error is not None or state != RecvState.DONE:
            r.error = r.error or error or str(state)
        cb, r.on_done = r.on_done, None
        if cb is not None:
            try:
                cb()
            except Exception:  # a callback bug must not break the control plane
                log.exception("receive completion callback failed")

    def _check_locked(self, r: RecvSession) -> None:
        if r.state != RecvState.POSTED or not all(w.terminal for w in r.writers.values()):
            return
        if r.cancel_requested:
            self._final_locked(r, RecvState.CANCELLED, "cancelled")
        elif all(w.state == WriterState.DONE for w in r.writers.values()) and not r.timed_out:
            self._final_locked(r, RecvState.DONE)
        else:
            self._final_locked(r, RecvState.FAILED, "transfer failed")
        self.c.stats[f"recv_{r.state}"] += 1

    def timeouts_locked(self, now: float) -> None:
        for r in self.sessions.values():
            if r.state.open and now > r.deadline and not r.timed_out:
                r.timed_out = True
                r.error = r.error or f"timed out after {self.c.cfg.recv_timeout_s:.1f}s"
                log.warning("request %s: receive %s", r.request_id, r.error)
                if r.state == RecvState.WAITING:
                    self._final_locked(r, RecvState.FAILED, r.error)
                else:
                    self._send_cancels_locked(r)
                    self._check_locked(r)
