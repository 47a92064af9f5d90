"""Control lanes between two real messengers (ZeroMQ ROUTER/DEALER plus the lane's TCP socket):
messages and replies travel on the lane once it is open, in order, and a peer that goes away is
reported lost through the lane without waiting for ZeroMQ's heartbeats."""
from __future__ import annotations

import socket
import threading
import time

from transfer.messenger import Messenger


class Inbox:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.msgs: list = []
        self.lost: list = []

    def on_message(self, source, msg) -> None:
        with self.cv:
            self.msgs.append((source, msg))
            self.cv.notify_all()

    def on_lost(self, endpoint, reason) -> None:
        with self.cv:
            self.lost.append((endpoint, reason))
            self.cv.notify_all()

    def wait(self, pred, timeout=10.0) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: pred(self), timeout)


def _pair(heartbeat_timeout_s: float = 60.0):
    ib_ctx, ib_gen = Inbox(), Inbox()
    # heartbeats far longer than the test: a loss seen in time came through the lane
    kw = dict(heartbeat_ivl_s=30.0, heartbeat_timeout_s=heartbeat_timeout_s)
    ctx = Messenger("ctx/0", ib_ctx.on_message, ib_ctx.on_lost, **kw)
    gen = Messenger("gen/0", ib_gen.on_message, ib_gen.on_lost, **kw)
    return ctx, gen, ib_ctx, ib_gen


def _open(gen: Messenger, ctx: Messenger) -> None:
    done = threading.Event()
    out = {}

    def run():
        out["ok"] = gen.open_lane(ctx.endpoint, ctx.lane_address)
        done.set()
    gen.call_soon(run)   # lanes are opened on the listener thread
    assert done.wait(5) and out["ok"]


def test_messages_and_replies_travel_on_the_lane_in_order():
    ctx, gen, ib_ctx, ib_gen = _pair()
    try:
        host = ctx.lane_address.rpartition(":")[0]
        assert host == "127.0.0.1"   # the configured host, as every listener
        _open(gen, ctx)
        for i in range(200):
            gen.send(ctx.endpoint, {"t": "ping", "i": i})
        assert ib_ctx.wait(lambda ib: len(ib.msgs) == 200)
        assert [m["i"] for _s, m in ib_ctx.msgs] == list(range(200))
        kind, ident = ib_ctx.msgs[0][0]
        assert (kind, ident) == ("router", b"gen/0")
        for i in range(50):
            ctx.reply(ident, {"t": "pong", "i": i})
        assert ib_gen.wait(lambda ib: len(ib.msgs) == 50)
        assert [m["i"] for _s, m in ib_gen.msgs] == list(range(50))
        assert ib_gen.msgs[0][0] == ("dealer", ctx.endpoint)
        assert gen.lane_stats == {"sent": 200, "received": 50}
        assert ctx.lane_stats == {"sent": 50, "received": 200}
    finally:
        gen.close()
        ctx.close()


def test_a_peer_that_goes_away_is_lost_through_its_lane():
    ctx, gen, ib_ctx, ib_gen = _pair()
    try:
        _open(gen, ctx)
        gen.send(ctx.endpoint, {"t": "ping"})
        assert ib_ctx.wait(lambda ib: ib.msgs)
        t0 = time.monotonic()
        ctx.close()
        assert ib_gen.wait(lambda ib: ib.lost, timeout=5)
        assert time.monotonic() - t0 < 5   # not ZeroMQ's 60 s heartbeat timeout
        endpoint, reason = ib_gen.lost[0]
        assert endpoint == ctx.endpoint and "control lane" in reason
    finally:
        gen.close()
        ctx.close()


def test_a_lane_that_never_says_who_it_is_is_closed():
    ctx, gen, ib_ctx, _ = _pair()
    try:
        host, _, port = ctx.lane_address.rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"\x00\x00\x00\x03abc")   # a frame that is no hello
        s.settimeout(5)
        assert s.recv(16) == b""   # closed by the messenger
        s.close()
        assert not ib_ctx.msgs
    finally:
        gen.close()
        ctx.close()
