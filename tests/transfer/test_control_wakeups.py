"""The control path waits on nothing but wake-ups: with every timer of the transfer package set to
ten minutes (the I/O loops' poll timeouts, the transfer thread's deadline tick), receives still
complete — context_first and generation_first, with nothing to write and with a block written —
and the context side still learns its write finished. A step that polled would hang here.

Two real transceivers on loopback with real tcp / shm agents; the pools are host memory (shared
files for shm).
"""
from __future__ import annotations

import socket
import sys
import threading
import time

import numpy as np
import pytest

from transfer import pump, zmq_io
from transfer.memory import alloc_shared_array
from transfer.page_table import LayerGroup, PageTable, PhysicalPool, PoolView
from transfer.session import KvTransceiver, RankTopology, TransferConfig

TPB, LAYERS, HEADS, HEAD_BYTES, SLOTS = 16, 2, 2, 32, 8
ENTRY = TPB * HEADS * HEAD_BYTES
BLOCK = LAYERS * 2 * ENTRY
NEVER = 600.0   # a timer this long never fires within the test
BOUND = 10.0    # what a wake-up-driven step needs, with room for a loaded 2-core box


def _page_table(base: int) -> PageTable:
    pp = PhysicalPool(base=base, layer_stride=2 * ENTRY, slot_stride=BLOCK,
                      slot_bytes=2 * ENTRY, num_slots=SLOTS, layers=LAYERS, mem_type="DRAM",
                      device_id=0)
    view = PoolView(pool=0, role=frozenset(["kv"]), layer_ids=tuple(range(LAYERS)),
                    buffer_entries=tuple((lay, c * ENTRY, ENTRY) for lay in range(LAYERS)
                                         for c in (0, 1)), layout="NHD", kv_heads=HEADS)
    return PageTable(tokens_per_block=TPB, pools=(pp,),
                     groups=(LayerGroup(tuple(range(LAYERS)), (view,)),), dtype="bfloat16")


def _rank(role: str, kind: str, **cfg):
    pool = alloc_shared_array(SLOTS * BLOCK) if kind == "shm" else np.zeros(SLOTS * BLOCK, np.uint8)
    if role == "context":
        pool[:] = np.arange(pool.size, dtype=np.uint64).astype(np.uint8)
    pt = _page_table(pool.ctypes.data)
    tx = KvTransceiver(pt, RankTopology(role=role, num_layers=LAYERS, total_kv_heads=HEADS,
                                        model="wakeups"),
                       TransferConfig(agent=kind, send_timeout_s=NEVER, recv_timeout_s=NEVER,
                                      **cfg))
    return tx, pool


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_receives_complete_with_every_timer_off(kind, monkeypatch):
    monkeypatch.setattr(zmq_io, "DEADLINE_POLL_S", NEVER)
    monkeypatch.setattr(zmq_io, "IDLE_POLL_S", NEVER)
    for name in ("DEADLINE_TICK_S", "POLL_S", "IDLE_S"):
        monkeypatch.setattr(pump, name, NEVER)
    ctx, src = _rank("context", kind)
    gen, dst = _rank("generation", kind)
    try:
        cases = [(1, [-1], False), (2, [3], False), (3, [-1], True), (4, [5], True)]
        for req, dst_ids, gen_first in cases:
            done, ended = threading.Event(), threading.Event()
            if gen_first:   # the receive waits at the context side before prefill ends
                gen.begin_receive(req, ctx.endpoint, TPB, [dst_ids], on_done=done.set)
            ctx.begin_send(req, TPB, [1], on_end=ended.set)
            ctx.finish_send(req, {"first_gen_tokens": [req]})
            if not gen_first:
                gen.begin_receive(req, ctx.endpoint, TPB, [dst_ids], on_done=done.set)
            assert done.wait(BOUND), f"request {req}: the receive did not complete"
            st = gen.recv_status(req)
            assert st.state == "done", st.error
            assert st.meta == {"first_gen_tokens": [req]}
            if dst_ids[0] >= 0:
                b = dst_ids[0]
                assert (dst[b * BLOCK:(b + 1) * BLOCK] == src[BLOCK:2 * BLOCK]).all()
            assert ended.wait(BOUND), f"request {req}: the context side never saw its end"
            cst = ctx.send_status(req)
            assert cst.state == "done"
            # the host's part of the write (claim → posted) is inside the write's time
            assert 0.0 <= cst.submit_s <= cst.write_s
            assert (cst.write_s > 0.0) == (dst_ids[0] >= 0)
            gen.release_receive(req)
            ctx.release_send(req)
        # every ok result went with its write (or as a bare notification), none by control message
        assert ctx.stats["results_by_notif"] == len(cases)
        # the receives went on a control lane, over the context rank's Unix socket (same host)
        lanes_out = list(gen.messenger._lanes_out.values())
        assert len(lanes_out) == 1 and gen.messenger.lane_stats["sent"] >= len(cases)
        if sys.platform.startswith("linux"):
            assert lanes_out[0].sock.family == socket.AF_UNIX
    finally:
        gen.shutdown()
        ctx.shutdown()


@pytest.mark.nixl
@pytest.mark.skipif(not zmq_io.SPIN_NATIVE, reason="transfer/_spin.c not built (no C compiler)")
def test_results_on_the_lane_arrive_while_and_after_the_listeners_spin(monkeypatch):
    """`spin_s`: the generation side's listener busy-polls after each post, the context side's
    after a context_first finish and after a claim; the messages still come (on the control
    lane: nixl answers there), during those windows and after they ran out, with the I/O loops'
    poll timeouts at ten minutes (a message noticed only by a timeout would hang)."""
    monkeypatch.setattr(zmq_io, "DEADLINE_POLL_S", NEVER)
    monkeypatch.setattr(zmq_io, "IDLE_POLL_S", NEVER)
    spins = []
    real = zmq_io._spin

    class Counted:   # the listeners did spin (and each spin ended)
        @staticmethod
        def wait(fds, seconds):
            spins.append(seconds)
            return real.wait(fds, seconds)
    monkeypatch.setattr(zmq_io, "_spin", Counted)
    ctx, src = _rank("context", "nixl", spin_s=0.2)
    gen, dst = _rank("generation", "nixl", spin_s=0.2)
    try:
        # context_first (inside the window), generation_first with the prefill ending after the
        # window ran out, and both with a block written; a claim before the receive
        cases = [(1, [-1], 0.0), (2, [3], 0.0), (3, [-1], 0.4), (4, [5], 0.4), (5, [6], 0.0)]
        for req, dst_ids, prefill_s in cases:
            done = threading.Event()
            if req == 5:
                gen.claim_receive(req, ctx.endpoint)
            if prefill_s:
                gen.begin_receive(req, ctx.endpoint, TPB, [dst_ids], on_done=done.set)
                time.sleep(prefill_s)
            ctx.begin_send(req, TPB, [1])
            ctx.finish_send(req, {"first_gen_tokens": [req]})
            if not prefill_s:
                gen.begin_receive(req, ctx.endpoint, TPB, [dst_ids], on_done=done.set)
            assert done.wait(BOUND), f"request {req}: the receive did not complete"
            st = gen.recv_status(req)
            assert st.state == "done" and st.meta == {"first_gen_tokens": [req]}, st
            if dst_ids[0] >= 0:
                b = dst_ids[0]
                assert (dst[b * BLOCK:(b + 1) * BLOCK] == src[BLOCK:2 * BLOCK]).all()
            gen.release_receive(req)
            deadline = time.monotonic() + BOUND
            while not ctx.send_status(req).quiescent:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            ctx.release_send(req)
        assert gen.messenger.lane_stats["received"] >= len(cases)   # the results came on it
        assert spins and all(0 < x <= 0.2 for x in spins), spins
        # Every window ran out: idle, neither listener spins (the process uses next to no CPU).
        time.sleep(0.3)
        n, cpu = len(spins), time.process_time()
        time.sleep(0.3)
        assert len(spins) == n and time.process_time() - cpu < 0.1
    finally:
        gen.shutdown()
        ctx.shutdown()


@pytest.mark.skipif(not zmq_io.SPIN_NATIVE, reason="transfer/_spin.c not built (no C compiler)")
def test_a_spinning_listener_leaves_the_gil_to_other_threads(monkeypatch):
    """The spin runs with the GIL released: another Python thread (the engine's, in a worker)
    runs as usual meanwhile. With a switch interval of 50 ms, a listener that held the GIL while
    it spun would make each of the 20 sleeps below wait about that long for it (≥ 1 s)."""
    import sys

    tx, _pool = _rank("generation", "tcp", spin_s=2.0)
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        tx.messenger.expect(2.0)
        time.sleep(0.05)   # it is spinning now
        t0 = time.monotonic()
        for _ in range(20):
            time.sleep(0.001)
        assert time.monotonic() - t0 < 0.5
    finally:
        sys.setswitchinterval(old)
        tx.shutdown()


def test_spin_is_off_unless_asked_for():
    """`spin_s` unset: off (not measured on a GPU host yet; slower on small machines); set: as
    given (0 = never, negative read as 0)."""
    assert TransferConfig().spin_window_s == 0.0
    assert TransferConfig(spin_s=2e-4).spin_window_s == 2e-4
    assert TransferConfig(spin_s=-1).spin_window_s == 0.0
    assert TransferConfig(spin_s=0).spin_window_s == 0.0


def test_the_landing_thread_hands_back_landed_writes_and_polls_with_fine_timer_slack():
    """receiver.LandingWaiter: a write that lands after a few looks is handed back once, one
    whose receive stopped waiting is dropped unanswered, and the thread's sleeps between looks
    run at `SLACK_NS` timer slack (Linux), not the default 50 µs that made a 20 µs look ~87 µs."""
    import ctypes
    import sys

    from transfer.receiver import LandingWaiter

    slack = []

    class Waiter:
        def __init__(self):
            self.looks = {}

        def landed(self, token):
            if sys.platform == "linux":
                slack.append(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))   # PR_GET_TIMERSLACK
            self.looks[token] = self.looks.get(token, 0) + 1
            return token == b"a" and self.looks[token] >= 3

    got = []
    done = threading.Event()
    lw = LandingWaiter(Waiter())
    try:
        lw.add(b"b", lambda err: got.append(("b", err)), lambda: len(got) == 0)
        lw.add(b"a", lambda err: (got.append(("a", err)), done.set()), lambda: True)
        assert done.wait(BOUND)
        deadline = time.monotonic() + BOUND
        while lw._items and time.monotonic() < deadline:
            time.sleep(0.001)
        assert got == [("a", None)] and not lw._items
    finally:
        lw.close()
    if sys.platform == "linux":
        assert slack and set(slack) == {LandingWaiter.SLACK_NS}


def test_block_ids_become_int64_arrays_checked_against_the_pool_whatever_their_form():
    """RankCore.group_ids, on every post and send: short and long Python lists (a short list's
    largest id in Python, a long one's in numpy after `fromiter`), tuples, numpy arrays, -1 for
    a cached block; an id past the pool is refused, a non-integer list says why."""
    from transfer.errors import SessionError
    from transfer.session_core import PY_MAX_IDS, RankCore

    pt = _page_table(1 << 20)
    core = RankCore(TransferConfig(agent="tcp"), RankTopology(role="generation", num_layers=LAYERS,
                                                              total_kv_heads=HEADS), pt, None)
    for ids in ([3, -1, 5], list(range(SLOTS)) * (PY_MAX_IDS // SLOTS + 1), (1, 2),
                np.array([7, 0], np.int32), []):
        (a,) = core.group_ids(ids)
        assert a.dtype == np.int64 and a.tolist() == list(ids)
    for bad in ([1, SLOTS], [0] * PY_MAX_IDS + [SLOTS], np.array([SLOTS])):
        with pytest.raises(SessionError, match="pool size"):
            core.group_ids(bad)
    assert core.group_ids([1, 2.0])[0].tolist() == [1, 2]   # as np.asarray took it
    (a,) = core.group_ids([2] + [1] * PY_MAX_IDS)
    a[0] = 3   # the arrays are the transfer's own (writable), not views of a shared buffer
    with pytest.raises((SessionError, OverflowError)):
        core.group_ids([1, 1 << 70])   # not an int64: refused as np.asarray refuses it
