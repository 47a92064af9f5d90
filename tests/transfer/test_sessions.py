"""Sessions end to end between real processes, over real agents and real ZMQ.

Each rank is a process (`session_peer.py`) holding real KV pools; bytes are checked against the
logical KV of the request. Covers context_first, generation_first with pipelined slices, sliding
windows, heterogeneous TP/PP layouts, cancellation before/during/after the transfer, killed peers,
timeouts, config mismatches and retired sessions — and that no session is left behind.
"""
from __future__ import annotations

from tests.transfer.conftest import peer_context
import time

import pytest

from tests.transfer.session_peer import peer_main

MODEL = dict(num_layers=4, kv_heads=2, head_bytes=16, tpb=4, groups=[(0, 4)])
SIDE = dict(tp=1, pp=1, layout="NHD", block_major=True, num_slots=32)
KINDS = ["tcp", "shm", pytest.param("nixl", marks=pytest.mark.nixl)]
# NIXL's agent takes ~0.5 s per process to start: its failure-path variants run with the slow set.
SLOW_NIXL = pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.slow])


class Proc:
    def __init__(self, role, kind, instance, tp_rank=0, pp_rank=0, model=None, side=None, cfg=None,
                 idx=0):
        spec = dict(role=role, kind=kind, instance=instance, tp_rank=tp_rank, pp_rank=pp_rank,
                    model=model or MODEL, side=side or SIDE, cfg=cfg or {}, idx=idx)
        ctx = peer_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, spec), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "peer did not start"
        _, self.endpoint, self.info = self.conn.recv()

    def __call__(self, cmd, *args, timeout=30):
        self.conn.send((cmd, args))
        assert self.conn.poll(timeout), f"peer did not answer {cmd}"
        status, out = self.conn.recv()
        if status == "err":
            raise RuntimeError(out)
        return out

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self("exit", timeout=15)
            except (AssertionError, OSError, EOFError, RuntimeError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture
def procs():
    made = []

    def make(*a, **kw):
        p = Proc(*a, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def wait_status(p, which, req, timeout=20.0, quiescent=True):
    deadline = time.monotonic() + timeout
    while True:
        st = p(which, req)
        if st["quiescent"] == quiescent or time.monotonic() > deadline:
            return st
        time.sleep(0.01)


def assert_idle(*ps):
    for p in ps:
        pend = p("pending")
        assert pend["send"] == 0 and pend["recv"] == 0 and pend["parked"] == 0, pend
        assert pend["inflight_tasks"] == 0, pend


SRC = [list(range(3, 11))]           # 8 blocks = 32 token slots
DST = [[20, 21, 22, 5, 6, 7, 8, 30]]


@pytest.mark.parametrize("kind", KINDS)
def test_context_first_moves_the_exact_bytes(kind, procs):
    ctx = procs("context", kind, "ctx")
    gen = procs("generation", kind, "gen")
    ctx("fill", SRC)
    ctx("begin_send", 11, 30, SRC)
    ctx("finish_send", 11, {"first_gen_tokens": [42]})
    gen("begin_receive", 11, ctx.endpoint, 30, DST)
    st = wait_status(gen, "recv_status", 11)
    assert st["state"] == "done", st
    assert st["meta"] == {"first_gen_tokens": [42]}
    assert gen("check", DST) == {"bad": 0, "total": gen("check", DST)["total"]}
    assert gen("nonzero", DST) == 0  # nothing outside the destination blocks
    cst = wait_status(ctx, "send_status", 11)
    assert cst["state"] == "done" and cst["bytes"] == 8 * 4 * 2 * 2 * 4 * 16
    # destination runs [20,21,22], [5..8], [30] against one source run: 3 descriptors
    assert cst["descriptors"] == 3
    ctx("release_send", 11)
    gen("release_receive", 11)
    assert_idle(ctx, gen)


def test_generation_first_pipelines_finished_chunks(procs):
    ctx = procs("context", "tcp", "ctx")
    gen = procs("generation", "tcp", "gen")
    gen("begin_receive", 12, ctx.endpoint, 30, DST)
    time.sleep(0.2)  # the receive is posted (parked on the context rank) before prefill starts
    assert ctx("pending")["parked"] == 1
    ctx("begin_send", 12, 30, SRC)
    first3 = [SRC[0][:3]]
    ctx("fill", first3)
    ctx("progress_send", 12, 13)  # 3 full blocks + 1 token: the partial block waits
    deadline = time.monotonic() + 10
    while gen("check", [DST[0][:3]])["bad"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gen("check", [DST[0][:3]])["bad"] == 0, "first chunk did not arrive before prefill ended"
    assert gen("check", [[-1, -1, -1, DST[0][3]]])["bad"] > 0  # the partial block was not sent
    assert gen("recv_status", 12)["state"] == "transferring"
    ctx("fill", SRC)
    ctx("progress_send", 12, 25)
    ctx("finish_send", 12, {"first_gen_tokens": [7]})
    st = wait_status(gen, "recv_status", 12)
    assert st["state"] == "done" and st["meta"] == {"first_gen_tokens": [7]}
    assert gen("check", DST)["bad"] == 0
    assert ctx("attr", "stats")["slices_sent"] == 3
    ctx("release_send", 12)
    gen("release_receive", 12)
    assert_idle(ctx, gen)


def test_a_slice_after_an_event_is_written_once_it_completed(procs):
    """`progress_send(after=)` / `finish_send(after=)`: the chunk may still be computing when it is
    handed over; an agent that cannot order its writes on the device (tcp) gets it only once the
    event completed (the transfer thread waits for it, not the caller)."""
    ctx = procs("context", "tcp", "ctx")
    gen = procs("generation", "tcp", "gen")
    gen("begin_receive", 14, ctx.endpoint, 30, DST)
    time.sleep(0.2)
    ctx("begin_send", 14, 30, SRC)
    ctx("gated", "progress_send", "a", 14, 16)          # returns at once: the caller never waits
    ctx("gated", "finish_send", "b", 14, None)
    time.sleep(0.3)
    assert gen("check", DST)["bad"] > 0 and gen("recv_status", 14)["state"] == "transferring"
    ctx("fill", SRC)                                    # "the compute" writes the blocks
    assert ctx("open_gate", "a") is True                # the transfer thread was waiting on it
    ctx("open_gate", "b")
    st = wait_status(gen, "recv_status", 14)
    assert st["state"] == "done" and gen("check", DST)["bad"] == 0
    ctx("release_send", 14)
    gen("release_receive", 14)
    assert_idle(ctx, gen)


def test_pipelining_off_sends_one_slice(procs):
    ctx = procs("context", "tcp", "ctx", cfg={"pipeline": False})
    gen = procs("generation", "tcp", "gen")
    gen("begin_receive", 13, ctx.endpoint, 30, DST)
    ctx("begin_send", 13, 30, SRC)
    ctx("fill", SRC)
    ctx("progress_send", 13, 16)
    time.sleep(0.2)
    assert gen("check", DST)["bad"] > 0
    ctx("finish_send", 13, None)
    assert wait_status(gen, "recv_status", 13)["state"] == "done"
    assert gen("check", DST)["bad"] == 0
    assert ctx("attr", "stats")["slices_sent"] == 1


def test_sliding_window_group_is_deferred_to_the_final_window(procs):
    model = dict(MODEL, windows=[8])
    ctx = procs("context", "tcp", "ctx", model=model)
    gen = procs("generation", "tcp", "gen", model=model)
    gen("begin_receive", 14, ctx.endpoint, 30, DST)
    ctx("begin_send", 14, 30, SRC)
    ctx("fill", SRC)
    ctx("progress_send", 14, 20)
    time.sleep(0.3)
    assert gen("nonzero", [[]]) == 0  # nothing of a windowed group is sent before the last slice
    ctx("finish_send", 14, None)
    assert wait_status(gen, "recv_status", 14)["state"] == "done"
    # tokens [22, 30) are the final window: blocks 5..7 of the request
    window = [[-1] * 5 + DST[0][5:]]  # -1: block index kept, block not checked
    assert gen("check", window)["bad"] == 0
    assert gen("nonzero", window) == 0


@pytest.mark.parametrize("name,src,dst,model", [
    ("tp2->tp1", dict(SIDE, tp=2), SIDE, MODEL),
    ("tp1->tp2", SIDE, dict(SIDE, tp=2), MODEL),
    ("pp2->pp1", dict(SIDE, pp=2), SIDE, MODEL),
    ("tp4dup->tp2 hnd", dict(SIDE, tp=4, layout="HND"), dict(SIDE, tp=2, layout="HND"), MODEL),
])
def test_heterogeneous_layouts(name, src, dst, model, procs):
    ctx = [procs("context", "tcp", "ctx", tp_rank=r % src["tp"], pp_rank=r // src["tp"], side=src,
                 model=model, idx=r) for r in range(src["tp"] * src["pp"])]
    gen = [procs("generation", "tcp", "gen", tp_rank=r % dst["tp"], pp_rank=r // dst["tp"],
                 side=dst, model=model, idx=10 + r) for r in range(dst["tp"] * dst["pp"])]
    ctx[0]("set_instance", [c.info for c in ctx])
    for c in ctx:
        c("fill", SRC)
        c("begin_send", 15, 30, SRC)
        c("finish_send", 15, {"first_gen_tokens": [1]})
    for g in gen:
        g("begin_receive", 15, ctx[0].endpoint, 30, DST)
    for g in gen:
        st = wait_status(g, "recv_status", 15)
        assert st["state"] == "done", (name, st)
        assert g("check", DST)["bad"] == 0, name
        assert g("nonzero", DST) == 0, name
    for c in ctx:
        assert wait_status(c, "send_status", 15)["state"] == "done"
        c("release_send", 15)
    for g in gen:
        g("release_receive", 15)
    assert_idle(*ctx, *gen)


@pytest.mark.parametrize("kind", ["tcp", SLOW_NIXL])
def test_cancel_during_transfer_frees_only_after_the_writer_acknowledged(kind, procs):
    ctx = procs("context", kind, "ctx")
    gen = procs("generation", kind, "gen")
    gen("begin_receive", 16, ctx.endpoint, 30, DST)
    ctx("begin_send", 16, 30, SRC)
    ctx("progress_send", 16, 8)
    deadline = time.monotonic() + 10
    while ctx("send_status", 16)["bytes"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    results = []
    while True:
        ok = gen("cancel_receive", 16)
        results.append(ok)
        if ok or len(results) > 500:
            break
        time.sleep(0.01)
    assert results[-1] is True
    assert results[0] is False  # the context rank had to acknowledge first
    st = gen("recv_status", 16)
    assert st["state"] == "cancelled" and st["quiescent"]
    cst = wait_status(ctx, "send_status", 16)
    assert cst["state"] == "cancelled"
    assert ctx("cancel_send", 16) is True
    ctx("release_send", 16)
    gen("release_receive", 16)
    assert_idle(ctx, gen)
    with pytest.raises(RuntimeError, match="retired"):
        ctx("begin_send", 16, 30, SRC)


def test_cancel_after_transfer_and_context_side_cancel(procs):
    ctx = procs("context", "tcp", "ctx")
    gen = procs("generation", "tcp", "gen")
    ctx("begin_send", 17, 30, SRC)
    ctx("finish_send", 17, None)
    gen("begin_receive", 17, ctx.endpoint, 30, DST)
    assert wait_status(gen, "recv_status", 17)["state"] == "done"
    assert gen("cancel_receive", 17) is True
    # the receive is done once the bytes landed; the context side learns that its write finished
    # a moment later (the agent's acknowledgement): only then may it release
    assert wait_status(ctx, "send_status", 17)["state"] == "done"
    ctx("release_send", 17)
    gen("release_receive", 17)
    # context cancels before any receiver shows up: the late receiver is told, nothing is written
    ctx("begin_send", 18, 30, SRC)
    ctx("fill", SRC)
    assert ctx("cancel_send", 18) is True
    gen("begin_receive", 18, ctx.endpoint, 30, DST)
    st = wait_status(gen, "recv_status", 18)
    assert st["state"] == "failed" and "cancel" in st["error"]
    ctx("release_send", 18)
    # a receive for a retired request gets an error, not a hang
    gen("begin_receive", 19, ctx.endpoint, 30, DST)
    ctx("release_send", 19)
    st = wait_status(gen, "recv_status", 19)
    assert st["state"] == "failed"
    gen("release_receive", 18)
    gen("release_receive", 19)
    assert gen("nonzero", [[]]) == 0
    assert_idle(ctx, gen)


@pytest.mark.parametrize("kind", ["tcp", "shm", SLOW_NIXL])
def test_context_killed_mid_transfer_is_bounded(kind, procs):
    ctx = procs("context", kind, "ctx")
    gen = procs("generation", kind, "gen")
    gen("begin_receive", 20, ctx.endpoint, 30, DST)
    ctx("begin_send", 20, 30, SRC)
    ctx("progress_send", 20, 8)
    deadline = time.monotonic() + 10
    while ctx("send_status", 20)["bytes"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    ctx.kill()
    t0 = time.monotonic()
    st = wait_status(gen, "recv_status", 20, timeout=15)
    assert st["quiescent"] and st["state"] == "failed", st
    assert time.monotonic() - t0 < 12
    gen("release_receive", 20)
    assert_idle(gen)


@pytest.mark.parametrize("kind", ["tcp", SLOW_NIXL])
def test_generation_killed_mid_transfer_is_bounded(kind, procs):
    ctx = procs("context", kind, "ctx", cfg={"send_timeout_s": 3.0})
    gen = procs("generation", kind, "gen")
    gen("begin_receive", 21, ctx.endpoint, 30, DST)
    ctx("begin_send", 21, 30, SRC)
    ctx("progress_send", 21, 8)
    deadline = time.monotonic() + 10
    while ctx("send_status", 21)["bytes"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    gen.kill()
    time.sleep(0.2)
    ctx("finish_send", 21, None)
    st = wait_status(ctx, "send_status", 21, timeout=15)
    assert st["quiescent"] and st["state"] == "failed", st
    ctx("release_send", 21)
    assert_idle(ctx)


def _wait_stat(p, name, want, timeout=3.0):
    deadline = time.monotonic() + timeout
    while True:
        v = p("attr", "stats").get(name, 0)
        if v >= want or time.monotonic() > deadline:
            return v
        time.sleep(0.01)


def test_a_receiver_that_gives_up_before_posting_frees_the_context_at_once(procs):
    """Issue 15 item 7: a generation rank that drops a request before its `recv` reached the
    context rank still tells it, so the pinned KV is not held until the send timeout."""
    ctx = procs("context", "tcp", "ctx", cfg={"send_timeout_s": 30.0})
    gen = procs("generation", "tcp", "gen")
    # 1. cancelled while the receive is still fetching the context instance (first contact:
    #    get_instance → register → recv takes several round trips; the cancel lands before)
    ctx("begin_send", 31, 30, SRC)
    ctx("finish_send", 31, None)
    gen("begin_receive", 31, ctx.endpoint, 30, DST)
    assert gen("cancel_receive", 31) is True
    assert gen("recv_status", 31)["state"] == "cancelled"
    # the recv was not posted yet: the cancel goes out from the listener thread
    assert _wait_stat(gen, "abandons_sent", 1) == 1
    t0 = time.monotonic()
    st = wait_status(ctx, "send_status", 31, timeout=5)
    assert st["state"] == "cancelled" and st["cause"] == "receiver_cancelled", st
    assert time.monotonic() - t0 < 3.0
    # 2. abandoned: the request ended on the generation side before any receive began
    ctx("begin_send", 32, 30, SRC)
    ctx("finish_send", 32, None)
    gen("abandon_receive", 32, ctx.endpoint)
    st = wait_status(ctx, "send_status", 32, timeout=5)
    assert st["state"] == "cancelled" and st["cause"] == "receiver_cancelled", st
    # 3. a completed transfer reports its cause too; abandoning it afterwards changes nothing
    ctx("begin_send", 33, 30, SRC)
    ctx("finish_send", 33, None)
    gen("begin_receive", 33, ctx.endpoint, 30, DST)
    assert wait_status(gen, "recv_status", 33)["state"] == "done"
    assert wait_status(ctx, "send_status", 33)["cause"] == "transferred"
    gen("release_receive", 33)
    gen("abandon_receive", 33, ctx.endpoint)   # retired here: no-op
    assert _wait_stat(gen, "abandons_sent", 2) == 2
    for r in (31, 32, 33):
        ctx("release_send", r)
    gen("release_receive", 31)
    assert_idle(ctx, gen)


def test_an_unclaimed_send_ends_at_the_claim_timeout_and_a_claimed_one_waits(procs):
    """Issue 15 item 7: the KV of a context answer that never reached a generation worker (its
    requester died between the legs) is freed at the claim timeout, not the send timeout; a
    request the generation worker accepted (claimed) waits for its receive as long as needed."""
    ctx = procs("context", "tcp", "ctx", cfg={"send_timeout_s": 30.0, "claim_timeout_s": 0.5})
    gen = procs("generation", "tcp", "gen")
    ctx("begin_send", 41, 30, SRC)
    ctx("finish_send", 41, None)
    gen("claim_receive", 42, ctx.endpoint)       # claimed before the context leg began
    ctx("begin_send", 42, 30, SRC)
    ctx("finish_send", 42, None)
    ctx("begin_send", 43, 30, SRC)
    ctx("finish_send", 43, None)
    gen("claim_receive", 43, ctx.endpoint)       # claimed after the answer
    t0 = time.monotonic()
    st = wait_status(ctx, "send_status", 41, timeout=5)
    assert st["state"] == "failed" and st["cause"] == "unclaimed", st
    assert time.monotonic() - t0 < 3.0
    time.sleep(1.0)                              # twice the claim timeout
    for r in (42, 43):
        st = ctx("send_status", r)
        assert not st["quiescent"] and st["state"] == "waiting", st
        gen("begin_receive", r, ctx.endpoint, 30, DST)
        assert wait_status(gen, "recv_status", r)["state"] == "done"
        assert wait_status(ctx, "send_status", r)["cause"] == "transferred"
        gen("release_receive", r)
    for r in (41, 42, 43):
        ctx("release_send", r)
    assert_idle(ctx, gen)


def test_receive_times_out_when_the_context_never_starts(procs):
    ctx = procs("context", "tcp", "ctx")
    gen = procs("generation", "tcp", "gen", cfg={"recv_timeout_s": 1.0})
    gen("begin_receive", 22, ctx.endpoint, 30, DST)
    st = wait_status(gen, "recv_status", 22, timeout=10)
    assert st["state"] == "failed" and st["timed_out"], st
    gen("release_receive", 22)
    time.sleep(0.1)
    assert_idle(ctx, gen)


def test_block_size_mismatch_fails_at_exchange(procs):
    ctx = procs("context", "tcp", "ctx")
    gen = procs("generation", "tcp", "gen", model=dict(MODEL, tpb=8))
    gen("begin_receive", 23, ctx.endpoint, 30, [DST[0][:4]])
    st = wait_status(gen, "recv_status", 23)
    assert st["state"] == "failed" and "block size" in st["error"], st
    assert gen("nonzero", [[]]) == 0


def test_agent_kind_mismatch_fails_at_exchange(procs):
    ctx = procs("context", "shm", "ctx")
    gen = procs("generation", "tcp", "gen")
    gen("begin_receive", 24, ctx.endpoint, 30, DST)
    st = wait_status(gen, "recv_status", 24)
    assert st["state"] == "failed" and "agent kind" in st["error"], st


def test_status_codes_combine_to_the_instance_outcome():
    from transfer.states import DONE, FAILED, IN_FLIGHT, Status, combine_codes

    assert Status("transferring", False).code == IN_FLIGHT
    assert Status("failed", False, timed_out=True).code == IN_FLIGHT  # a peer may still write
    assert Status("failed", True).code == FAILED
    assert Status("cancelled", True).code == FAILED
    assert Status("done", True).code == DONE
    # min over ranks = global AND: one rank still writing keeps everyone's pages
    assert combine_codes([DONE, IN_FLIGHT, FAILED]) == IN_FLIGHT
    assert combine_codes([DONE, FAILED]) == FAILED
    assert combine_codes([DONE, DONE]) == DONE
    assert combine_codes([]) == IN_FLIGHT


def test_control_messages_keep_their_wire_maps_and_refuse_malformed_ones():
    import msgpack
    import numpy as np

    from transfer import control as C
    from transfer.errors import ProtocolError

    res = C.Result(req=7, sender="inst/0", status=C.ResultStatus.OK, slices=(0, 2), span=(0, 48),
                   last=True, meta={"first_gen_tokens": [3]})
    wire = msgpack.unpackb(msgpack.packb(C.to_wire(res), use_bin_type=True), raw=False)
    # the map a peer of the previous (dict-based) session code sent and read
    assert wire == {"t": "result", "req": 7, "from": "inst/0", "status": "ok", "error": None,
                    "slices": [0, 2], "span": [0, 48], "last": True,
                    "meta": {"first_gen_tokens": [3]}}
    back = C.parse(wire)
    assert back == res and back.status is C.ResultStatus.OK
    # `encode` (what ranks send: straight from the struct) writes the same bytes as the map,
    # late fields left out while at their default
    late = [C.Result(req=7, sender="i", ready=b"tok"), C.Result(req=7, sender="i", ready=b""),
            C.Recv(req=1, n=4, ids=[b"\x01" * 8], notif=True, ready=True),
            C.Recv(req=1, n=4, ids=[]), C.Registered(key="k"), C.Registered(key="k", lane="h:1"),
            C.Registered(key="k", lane="h:1", local_lane="splitserve-lane-x"),
            C.Instance(ranks=[b"x"], answering="k"), C.GetInstance(), C.Cancel(req=3),
            C.Claim(req=2), C.Error(error=None), C.RegisterFailed(error="no")]
    for m in [res, *late]:
        assert C.encode(m) == msgpack.packb(C.to_wire(m), use_bin_type=True), m
    assert b"ready" not in C.encode(res) and b"lane" not in C.encode(C.Registered(key="k"))
    ids = [np.arange(3, dtype=np.int64).tobytes()]
    assert C.parse({"t": "recv", "req": 1, "n": 40, "ids": ids}) == C.Recv(req=1, n=40, ids=ids)
    assert C.parse({"t": "instance", "ranks": [b"x"], "self": "k"}).answering == "k"
    for bad in ({"t": "recv", "req": "1", "n": 40, "ids": []},     # req must be an int
                {"t": "result", "req": 1},                          # no sender
                {"t": "claim"},                                     # no req
                {"t": "nonsense"}):
        with pytest.raises(ProtocolError):
            C.parse(bad)
    assert "nonsense" not in C.TAGS and {"recv", "result", "claim"} <= C.TAGS
