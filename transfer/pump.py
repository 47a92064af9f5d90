"""The transfer thread of one rank: loads peer agents, builds descriptors, submits one-sided writes,
polls them, hands finished ones to the sender, and enforces both sides' timeouts.

Nothing here blocks while holding the rank's lock; the control-plane listener only changes state
and wakes this thread (`RankCore.cv`).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .agent import ERR as XERR, PROC as XPROC
from .descs import Descs, build_pair, merge_runs
from .errors import FailureCause, PeerLost, TransferError
from .peers import plan_pair
from .rank_info import RankInfo
from .receiver import Receiver
from .control import RegisterFailed, Registered, Result, ResultStatus, result_notif
from .sender import RegisteredReceiver, Sender, SendSession, Target
from .session_core import RankCore
from .states import SendState

log = logging.getLogger("splitserve.transfer.session")

SPIN_S = 0.002
# Without `on_finished` (NIXL): the transfer thread polls its writes this often, and looks round
# this often when idle.
POLL_S, IDLE_S = 0.0005, 0.005
# With an agent that reports finished writes (`on_finished`), the thread sleeps until it is woken
# (a submit, a control message, a finished write); the timeout only paces the deadline checks.
DEADLINE_TICK_S = 0.02
# Prepared lists (NIXL merges runs and posts from indices) beat building lists per transfer even
# for a single run: on an H200 a 512 MiB contiguous write took 0.54 ms prepped vs 0.80 ms through
# initialize_xfer with one merged descriptor (the per-call list building costs ~0.3 ms). Transfers
# with at most this many runs take the per-transfer path.
PREPPED_MIN_RUNS = 0


@dataclass
class Task:
    """One transfer in flight: slices [s0, s1) of a send session to one receiving rank."""

    session: SendSession
    target: Target
    s0: int
    s1: int
    handles: list = field(default_factory=list)
    error: str | None = None
    peer_lost: bool = False     # the receiver's agent is gone (FailureCause.PEER_LOST / PeerLost)
    nbytes: int = 0
    ndescs: int = 0
    started: float = 0.0
    notified: bool = False      # its `ok` result went as the notification of its write
    result_sent: bool = False   # its `ok` result left when the write was posted (Result.ready)
    posted: bool = False        # `_submit` returned: its handles are all there (another thread
                                # may have claimed it and be submitting still)
    posted_at: float = 0.0      # when it did (time.monotonic; `started` is the claim)


def _runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """Block runs consecutive on both sides (each becomes one copy when merged)."""
    if src_ids.size <= 1:
        return int(src_ids.size)
    return 1 + int(np.count_nonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)))


def _task_end(slices, s0: int) -> int:
    """Pending slices go out as one transfer, up to and including the first that waits for a
    CUDA event (`Slice.after`): a chunk still computing must not hold back the one before it
    (pipelined prefill appends chunk k+1's slice while chunk k computes)."""
    s1 = s0
    while s1 < len(slices):
        s1 += 1
        if slices[s1 - 1].after is not None:
            break
    return s1


class Pump:
    def __init__(self, core: RankCore, sender: Sender, receiver: Receiver) -> None:
        self.c = core
        self.sender = sender
        self.receiver = receiver
        self.work: collections.deque = collections.deque()
        self.tasks: list[Task] = []
        self.stop = False
        cfg, agent = core.cfg, core.agent
        self.use_prepped = cfg.prepped == "on" or (cfg.prepped == "auto" and agent.kind == "nixl")
        self.kicked = False   # a write finished since this thread last looked (under core.lock)
        self.pushed = agent.on_finished(self._kick)
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread; False when it was already stopped."""
        with self.c.lock:
            if self.stop:
                return False
            self.stop = True
            self.c.cv.notify_all()
        self._thread.join(timeout=10)
        return True

    def load(self, ident: bytes, info: RankInfo) -> None:
        """(listener) A generation rank registered: load its agent on this thread."""
        with self.c.lock:
            self.work.append(("load", ident, info))
            self.c.cv.notify()

    def _kick(self) -> None:
        """(agent thread) A write left PROC: poll it now."""
        with self.c.lock:
            self.kicked = True
            self.c.cv.notify()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        c = self.c
        while True:
            with c.lock:
                if self.stop:
                    break
                self.kicked = False
            try:
                busy = self._step()
            except Exception:
                log.exception("kv-transfer step failed")
                busy = False
            if not busy and self.tasks and self.c.agent.wait_any(
                    [h for t in self.tasks for h in t.handles]):
                continue   # a write finished (or may have): poll it at once
            spin = False
            with c.lock:
                if self.stop:
                    break
                if busy or self.work or self.kicked:
                    continue
                if self.pushed:
                    c.cv.wait(DEADLINE_TICK_S)
                    continue
                # A write just posted usually completes within a fraction of a millisecond on
                # NVLink/CMA: yield-spin for SPIN_S after a submit, then back off to short sleeps
                # (long TCP transfers must not burn a core the agent's own thread needs).
                spin = any(time.monotonic() - t.started < SPIN_S for t in self.tasks)
                if not spin:
                    c.cv.wait(POLL_S if self.tasks else IDLE_S)
            if spin:
                time.sleep(0)

    def _step(self) -> bool:
        self.c.agent.progress()
        busy = False
        while True:
            with self.c.lock:
                item = self.work.popleft() if self.work else None
            if item is None:
                break
            busy = True
            self._do_work(item)
        busy |= self._poll_tasks()
        busy |= self._dispatch()
        now = time.monotonic()
        with self.c.lock:
            self.sender.timeouts_locked(now)
            self.receiver.timeouts_locked(now)
        return busy

    def _do_work(self, item) -> None:
        op = item[0]
        c = self.c
        if op == "load":
            _, ident, info = item
            try:
                name = c.agent.load_remote_agent(info.agent_desc)
                plan = plan_pair(c.info, info)
            except TransferError as e:
                c.reply(ident, RegisterFailed(error=str(e), key=c.info.key))
                return
            rx = RegisteredReceiver(info=info, identity=ident, agent_name=name, plan=plan)
            if self.use_prepped:
                try:
                    self._prepare(rx)
                except TransferError as e:
                    log.warning("prepared descriptor lists for %s unavailable (%s); using "
                                "per-transfer lists", info.key, e)
            with c.lock:
                self.sender.receivers[info.key] = rx
            c.reply(ident, Registered(key=c.info.key, lane=c.messenger.lane_address,
                                      local_lane=c.messenger.lane_local))

    def _prepare(self, rx: RegisteredReceiver) -> None:
        """Per-slot descriptor lists for single-fragment mappers: a transfer then only names block
        indices and NIXL merges runs adjacent on both sides."""
        agent = self.c.agent
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
            lp = agent.prep_descs(None, Descs(ls, sp.mem_type))
            rp = agent.prep_descs(rx.agent_name, Descs(rs, dp.mem_type))
            rx.preps[i] = (lp, rp)

    def _dispatch(self) -> bool:
        with self.c.lock:
            claimed = self._claim_locked(self.sender.sessions.values())
        self._submit_all(claimed)
        return bool(claimed)

    def dispatch_now(self, s: SendSession) -> None:
        """Submit what session `s` has ready on the calling thread: the listener's when a
        receive arrives after the prefill, the engine's when a slice is added. The transfer
        thread is not woken for it unless a write is left in flight (to see it finish): one
        Python thread hand-off less on the critical path. Agents whose submit copies the payload
        (`posts_async` False) leave it to the transfer thread, as before."""
        if not self.c.agent.posts_async:
            with self.c.lock:
                self.c.cv.notify()
            return
        while True:
            with self.c.lock:
                if self.stop:
                    return
                claimed = self._claim_locked((s,), inline=True)
            if not claimed:
                return
            self._submit_all(claimed)
            # Nothing in flight (nothing to write, refused, or done at post): done here, and a
            # slice added meanwhile goes next. A write in flight is the transfer thread's to
            # see finish (one thread polls a handle); it dispatches what follows.
            settled = [t for t in claimed if all(h.state != XPROC for h in t.handles)]
            if settled:
                self._finish([(t, [h.state for h in t.handles]) for t in settled])
            if len(settled) < len(claimed):
                with self.c.lock:
                    self.c.cv.notify()
                return

    def _claim_locked(self, sessions, inline: bool = False) -> list[Task]:
        """A task for every receiving rank of `sessions` with slices to send and no write in
        flight; each target is TRANSFERRING (`inflight`) before any byte moves, so only one
        thread ever submits it. `inline` (a thread other than the transfer thread): a task whose
        slices wait for a CUDA event the agent cannot order on the device for that peer is left
        to the transfer thread (it would wait for the event on the host: the engine's thread
        must not)."""
        agent = self.c.agent
        claimed = []
        for s in sessions:
            if s.state != SendState.ACTIVE or s.cancel_requested or s.timed_out:
                continue
            for t in s.targets.values():
                if t.inflight is None and not t.cancelled and not t.final_sent \
                        and t.next_slice < len(s.slices):
                    end = _task_end(s.slices, t.next_slice)
                    if inline and not agent.orders_on_device(t.rx.agent_name) and any(
                            sl.after is not None for sl in s.slices[t.next_slice:end]):
                        self.c.cv.notify()
                        continue
                    task = Task(session=s, target=t, s0=t.next_slice, s1=end,
                                started=time.monotonic())
                    t.inflight = task
                    self.tasks.append(task)
                    claimed.append(task)
        return claimed

    def _submit_all(self, claimed: list[Task]) -> None:
        for task in claimed:
            try:
                self._submit(task)
            except Exception as e:  # validation / peer lost: nothing was posted
                task.error = f"{type(e).__name__}: {e}"
                task.peer_lost = isinstance(e, PeerLost)
            task.posted_at = time.monotonic()
            task.posted = True

    def _submit(self, task: Task) -> None:
        agent = self.c.agent
        s, t = task.session, task.target
        name = t.rx.agent_name
        ranges: dict[int, tuple[int, int]] = {}
        # The compute stream runs in order: the latest slice's event covers every earlier one (a
        # slice without one was appended once its tokens were written).
        after = next((sl.after for sl in reversed(s.slices[task.s0:task.s1])
                      if sl.after is not None), None)
        if after is not None and not agent.orders_after:
            after.synchronize()   # releases the GIL; this thread only
            after = None
        order = {"after": after} if after is not None else {}
        for sl in s.slices[task.s0:task.s1]:
            for g, (b0, b1) in sl.blocks.items():
                if g in ranges:
                    ranges[g] = (min(ranges[g][0], b0), max(ranges[g][1], b1))
                else:
                    ranges[g] = (b0, b1)
        posts = []   # each: notif -> (handle, bytes, descriptors)
        pairs: dict[tuple, list] = {}
        for i, m in enumerate(t.rx.plan.mappers):
            if m.src_group not in ranges:
                continue
            b0, b1 = ranges[m.src_group]
            if b1 <= b0:
                continue
            src_ids = s.src_ids[m.src_group][b0:b1]
            dst_ids = t.dst_ids[m.dst_group][b0:b1]
            # (at PREPPED_MIN_RUNS 0 every range takes them: its runs need no counting)
            if i in t.rx.preps and (PREPPED_MIN_RUNS == 0
                                    or _runs(src_ids, dst_ids) > PREPPED_MIN_RUNS):
                # Negative where either id is (-1: cached at the receiver, not sent): two
                # numpy calls when nothing is skipped, each ~10 µs on a cold path.
                either = src_ids | dst_ids
                if either.min() < 0:
                    keep = either >= 0
                    if not keep.any():
                        continue   # every block cached at the receiver: nothing to post
                    src_ids, dst_ids = src_ids[keep], dst_ids[keep]
                lp, rp = t.rx.preps[i]

                def post(notif, lp=lp, rp=rp, si=src_ids, di=dst_ids):
                    h = agent.submit_prepped(name, lp, si, rp, di, notif=notif, **order)
                    return h, h.nbytes, h.ndescs
                posts.append(post)
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

            def post(notif, ld=ld, rd=rd):
                return (agent.submit_transfer(name, ld, rd, notif=notif, **order),
                        ld.total_bytes, len(ld))
            posts.append(post)
        # The `ok` result rides on the write it reports when the receiver takes it so and one
        # write carries the whole task (its notification lands after its last byte); with
        # nothing to write it goes as a bare notification. Several writes: a control message
        # once all are DONE, as before.
        res = self._ok_result(task) if t.by_notif and len(posts) <= 1 else None
        notif = result_notif(res) if res is not None else b""
        if not posts and notif:
            agent.notify(name, notif)
            task.notified = True
        for post in posts:
            h, nbytes, ndescs = post(notif)
            task.notified = bool(notif)
            task.handles.append(h)
            task.nbytes += nbytes
            task.ndescs += ndescs
        # The receiver waits on the write's end event itself (Recv.ready): the result leaves
        # now, from this thread, instead of after the transfer thread saw the write finish and
        # handed the result to the listener.
        if t.by_ready and not notif and len(task.handles) == 1 and task.handles[0].ready:
            res = self._ok_result(task)
            if res is not None:
                with self.c.lock:
                    if res.last:
                        t.final_sent = True
                    task.result_sent = True
                self.c.reply_result(t.rx.info.key, res.req, ResultStatus.OK, slices=res.slices,
                                    span=res.span, last=res.last, meta=res.meta,
                                    ready=task.handles[0].ready)

    def _ok_result(self, task: Task) -> Result | None:
        """The `ok` result that reports `task`'s slices (None when it covers none)."""
        s = task.session
        covered = s.slices[task.s0:task.s1]
        if not covered:
            return None
        last = covered[-1].last
        return Result(
            req=s.request_id, sender=self.c.info.key, status=ResultStatus.OK,
            slices=(task.s0, task.s1 - 1), span=(covered[0].tokens[0], covered[-1].tokens[1]),
            last=last, meta=s.meta if last else None)

    def _poll_tasks(self) -> bool:
        agent = self.c.agent
        with self.c.lock:
            tasks = list(self.tasks)
        finished = []
        for task in tasks:
            if not task.posted:
                continue
            states = [agent.poll(h) for h in task.handles]
            if not any(st == XPROC for st in states):
                finished.append((task, states))
        if not finished:
            return False
        self._finish(finished)
        return True

    def _finish(self, finished: list) -> None:
        """Complete `(task, handle states)` pairs whose writes all left PROC: release the
        handles, reply, move the sessions. A task is completed once, by whichever thread takes
        it out of `tasks` first."""
        agent = self.c.agent
        with self.c.lock:
            finished = [(t, st) for t, st in finished if t in self.tasks]
            for task, _st in finished:
                self.tasks.remove(task)
        for task, states in finished:
            for h, st in zip(task.handles, states):
                if st == XERR:
                    task.error = task.error or agent.error(h) or "transfer failed"
                    task.peer_lost |= h.cause == FailureCause.PEER_LOST
                agent.release(h)
        lost = []
        with self.c.lock:
            for task, _st in finished:
                self.sender.complete_locked(task)
                if task.peer_lost:
                    lost.append(task.target.rx)
        for rx in lost:
            self._drop_receiver(rx)

    def _drop_receiver(self, rx: RegisteredReceiver) -> None:
        with self.c.lock:
            if self.sender.receivers.get(rx.info.key) is not rx:
                return
            del self.sender.receivers[rx.info.key]
        self.release_preps(rx)
        self.c.agent.invalidate_remote_agent(rx.agent_name)

    def release_preps(self, rx: RegisteredReceiver) -> None:
        for lp, rp in rx.preps.values():
            self.c.agent.release_prepped(lp)
            self.c.agent.release_prepped(rp)
