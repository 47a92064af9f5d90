"""Control lanes between two real messengers (ZeroMQ ROUTER/DEALER plus the lane's TCP or Unix
socket): messages and replies travel on the lane once it is open, in order, a peer that goes away
is reported lost through the lane without waiting for ZeroMQ's heartbeats, and a process of
another user can neither connect to a rank's Unix socket nor pose as its listener."""
from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time

import pytest

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


def _open(gen: Messenger, ctx: Messenger, local: str | None = None) -> None:
    done = threading.Event()
    out = {}

    def run():
        out["ok"] = gen.open_lane(ctx.endpoint, ctx.lane_address,
                                  ctx.lane_local if local is None else local)
        done.set()
    gen.call_soon(run)   # lanes are opened on the listener thread
    assert done.wait(5) and out["ok"]


def _lane_family(gen: Messenger, ctx: Messenger) -> int:
    return gen._lanes_out[ctx.endpoint].sock.family


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets: Linux")
def test_a_peer_on_this_host_is_reached_through_its_unix_socket_else_over_tcp():
    """A context rank names a Unix socket of its host beside its TCP lane listener; a peer on
    the same host connects there, and one that cannot reach it (another host, another network
    namespace: no socket under that name) over TCP. Either way messages and replies travel."""
    for local, family in ((None, socket.AF_UNIX), ("splitserve-lane-nobody", socket.AF_INET)):
        ctx, gen, ib_ctx, ib_gen = _pair()
        try:
            assert ctx.lane_local.startswith("splitserve-lane-")
            _open(gen, ctx, local)
            assert _lane_family(gen, ctx) == family
            gen.send(ctx.endpoint, {"t": "ping", "i": 1})
            assert ib_ctx.wait(lambda ib: ib.msgs)
            ctx.reply(ib_ctx.msgs[0][0][1], {"t": "pong", "i": 2})
            assert ib_gen.wait(lambda ib: ib.msgs)
            assert gen.lane_stats == {"sent": 1, "received": 1, "refused": 0, "bad_hello": 0}
            assert ctx.lane_stats == {"sent": 1, "received": 1, "refused": 0, "bad_hello": 0}
        finally:
            gen.close()
            ctx.close()


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
        assert gen.lane_stats == {"sent": 200, "received": 50, "refused": 0, "bad_hello": 0}
        assert ctx.lane_stats == {"sent": 50, "received": 200, "refused": 0, "bad_hello": 0}
    finally:
        gen.close()
        ctx.close()


@pytest.mark.parametrize("local", [None, ""], ids=["unix", "tcp"])
def test_a_peer_that_goes_away_is_lost_through_its_lane(local):
    ctx, gen, ib_ctx, ib_gen = _pair()
    try:
        _open(gen, ctx, local)
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
        assert ctx.lane_stats["bad_hello"] == 1
    finally:
        gen.close()
        ctx.close()


NOBODY = 65534
_needs_root = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="needs a process of another uid: a forked child drops to uid 65534 with "
           "os.setuid, which only root may do (this test runs as a non-root user)")


def _as_nobody(fn) -> tuple[int, int]:
    """Fork a child that drops to uid/gid 65534 and runs `fn(write_fd)` (plain os/socket calls
    only: this process has threads); (its pid, the read end of the pipe it wrote to)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _read_all(fd: int, timeout: float = 10.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            out += chunk
    os.close(fd)
    return out


@_needs_root
def test_a_process_of_another_user_cannot_take_a_peers_unix_lane(caplog):
    """Abstract socket names are listed in /proc/net/unix: any local user can connect under the
    announced name and send a hello naming a real peer. The listener checks the connecting
    process's uid (SO_PEERCRED) first: a process of another user is closed before its hello is
    read, counted and logged, and the real peer's lane is still the one its replies take."""
    from transfer import lanes
    from transfer.messenger import pack

    ctx, gen, ib_ctx, ib_gen = _pair()
    try:
        _open(gen, ctx)
        assert _lane_family(gen, ctx) == socket.AF_UNIX
        gen.send(ctx.endpoint, {"t": "ping", "i": 0})
        assert ib_ctx.wait(lambda ib: len(ib.msgs) == 1)
        real = ctx._lanes_in[b"gen/0"]
        # prepared before the fork: the child makes only os/socket calls
        hello = pack({"t": "lane", "id": b"gen/0"})
        forged = pack({"t": "ping", "i": 666})
        name = ctx.lane_local
        stream = b"".join(lanes.FRAME.pack(len(f)) + f for f in (hello, forged))

        def impostor(w):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect("\0" + name)
            except OSError as e:
                os.write(w, f"no connection: {e}".encode())
                return
            try:
                s.sendall(stream)
                got = s.recv(16)
                os.write(w, b"closed" if got == b"" else b"answered " + got)
            except (ConnectionResetError, BrokenPipeError):
                os.write(w, b"closed")
            except socket.timeout:
                os.write(w, b"still open after 5 s")

        with caplog.at_level("WARNING", logger="splitserve.transfer.messenger"):
            pid, r = _as_nobody(impostor)
            outcome = _read_all(r)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert outcome == b"closed"
        assert ctx.lane_stats["refused"] == 1 and ctx.lane_stats["bad_hello"] == 0
        assert any("refused a control lane on the Unix socket" in r.message and
                   f"found uid {NOBODY}" in r.message and name not in r.message
                   for r in caplog.records)
        # the real peer's lane is untouched: its messages arrive, replies go back on it
        assert ctx._lanes_in[b"gen/0"] is real and not real.closed
        gen.send(ctx.endpoint, {"t": "ping", "i": 1})
        assert ib_ctx.wait(lambda ib: len(ib.msgs) == 2)
        assert [m["i"] for _s, m in ib_ctx.msgs] == [0, 1]   # nothing forged got through
        ctx.reply(b"gen/0", {"t": "pong", "i": 2})
        assert ib_gen.wait(lambda ib: ib.msgs)
        assert gen.lane_stats["received"] == 1 and ctx.lane_stats["received"] == 2
        assert not ib_gen.lost
    finally:
        gen.close()
        ctx.close()


@_needs_root
def test_a_unix_listener_of_another_user_is_not_trusted_tcp_is_used():
    """A connecting rank checks the listener too: under the announced name sits a process of
    another user (the real rank's name taken over, or ranks of one host run as different
    users): it connects over TCP instead, and no peer is lost."""
    name = f"splitserve-lane-impostor-{os.getpid()}"
    go_r, go_w = os.pipe()   # closed by the parent when the child may exit

    def squatter(w):
        os.close(go_w)   # else the child's own copy keeps go_r from ever reading EOF
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\0" + name)
        s.listen(8)
        os.write(w, b"listening")
        os.read(go_r, 1)   # until the parent is done

    pid, r = _as_nobody(squatter)
    os.close(go_r)
    ctx, gen, ib_ctx, ib_gen = _pair()
    try:
        ready, _, _ = select.select([r], [], [], 10)
        assert ready and os.read(r, 64) == b"listening"
        _open(gen, ctx, name)
        assert _lane_family(gen, ctx) == socket.AF_INET
        gen.send(ctx.endpoint, {"t": "ping", "i": 1})
        assert ib_ctx.wait(lambda ib: ib.msgs)
        ctx.reply(ib_ctx.msgs[0][0][1], {"t": "pong", "i": 2})
        assert ib_gen.wait(lambda ib: ib.msgs)
        assert not ib_gen.lost
    finally:
        os.close(go_w)
        os.close(r)
        os.waitpid(pid, 0)
        gen.close()
        ctx.close()


def test_without_peer_credentials_there_is_no_unix_lane(monkeypatch):
    """Where the kernel cannot tell who connected (no SO_PEERCRED), a rank names no Unix
    socket and connects to none: its lanes go over TCP rather than unchecked."""
    from transfer import lanes

    monkeypatch.setattr(lanes, "SO_PEERCRED", None)
    assert lanes.listen_local() == (None, "")
    with pytest.raises(OSError):
        lanes.connect_local("splitserve-lane-anything", 1.0)
    ctx, gen, ib_ctx, _ = _pair()
    try:
        assert ctx.lane_local == ""
        _open(gen, ctx)
        assert _lane_family(gen, ctx) == socket.AF_INET
        gen.send(ctx.endpoint, {"t": "ping"})
        assert ib_ctx.wait(lambda ib: ib.msgs)
    finally:
        gen.close()
        ctx.close()


def _tcp_pair():
    ls = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    ls.close()
    return a, b


def test_frames_of_any_length_come_out_whole_however_the_stream_is_cut():
    """A lane reads into one buffer it keeps: frames split anywhere (inside the length prefix,
    across reads), several in one read, and frames longer than the buffer all come out whole and
    in order, and a frame over the limit closes the lane."""
    import random

    from transfer import lanes

    rng = random.Random(7)
    a, b = _tcp_pair()
    reader = lanes.Lane(b)
    sizes = [0, 1, 3, 4, 5, 100, lanes.Lane.READ_BYTES - 4, lanes.Lane.READ_BYTES,
             3 * lanes.Lane.READ_BYTES + 17, 7, 2] + [rng.randrange(0, 5000) for _ in range(200)]
    frames = [bytes(rng.getrandbits(8) for _ in range(min(n, 64))) * (n // 64) +
              bytes(n % 64) for n in sizes]
    stream = b"".join(lanes.FRAME.pack(len(f)) + f for f in frames)
    got: list[bytes] = []
    pos = 0
    while pos < len(stream):
        cut = rng.choice([1, 2, 3, 5, 61, 4096, 70000])
        a.sendall(stream[pos:pos + cut])
        pos += cut
        while True:
            got += reader.read()   # non-blocking: [] once the socket is drained
            b.setblocking(False)
            try:
                if not b.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                break
    assert got == frames
    assert len(reader._buf) == lanes.Lane.READ_BYTES   # back to its size after the long frames
    a.sendall(lanes.FRAME.pack(lanes.MAX_FRAME + 1))
    time.sleep(0.05)
    try:
        reader.read()
        raise AssertionError("a frame over MAX_FRAME was accepted")
    except lanes.LaneClosed as e:
        assert "at most" in str(e)
    a.close()
    reader.close()


def test_a_write_to_a_peer_that_stopped_reading_gives_up_after_the_send_timeout():
    from transfer import lanes

    a, b = _tcp_pair()
    writer = lanes.Lane(a, send_timeout_s=0.3)
    t0 = time.monotonic()
    sent = 0
    while writer.send(b"x" * 65536):   # nobody reads `b`: the socket buffers fill up
        sent += 1
        assert time.monotonic() - t0 < 5
    assert sent > 0 and writer.closed
    assert 0.3 <= time.monotonic() - t0 < 5
    assert not writer.send(b"late")
    b.close()
