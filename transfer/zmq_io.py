"""ZeroMQ I/O for the transfer package: `IoLoop`, the one thread that owns a ROUTER and a DEALER per
peer, used by the control plane (`Messenger`) and by the pure-Python agents (`PyAgentBase`).

What differs between the two users is passed in (what to do with a message, with a lost peer, with
messages that will never be sent); everything about sockets, queues, connection timeouts and
wake-ups is decided here once.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from typing import Callable, Hashable, Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("splitserve.transfer.zmq_io")

# Poll timeouts of an IoLoop (seconds): they bound only how late a connection timeout is noticed
# (messages wait for a handshake) and how often an idle loop looks round; every message, command
# and handshake wakes the poll at once. tests/transfer/test_control_wakeups.py sets them huge.
DEADLINE_POLL_S = 0.01
IDLE_POLL_S = 0.2
try:   # transfer/_spin.c: a bounded busy-poll with the GIL released (optional, setup.py)
    from . import _spin
except ImportError:   # built without a C compiler: the loops never spin (they sleep in poll)
    _spin = None
SPIN_NATIVE = _spin is not None
# How many times in a row a spin may end on a descriptor that the ZeroMQ poll after it finds
# nothing on (a ZeroMQ socket's descriptor signals its internal commands too) before the loop
# stops spinning for this window: each such turn runs Python holding the GIL.
SPIN_IDLE_TURNS = 8

# A DEALER's monitor reports these two; "connected" is a finished handshake, not a TCP connect, so
# a peer that accepts TCP but never speaks ZMTP still counts as not connected.
MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Wake:
    """A pipe the I/O thread polls; any thread may write one byte to wake it."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def wake(self):
        try:
            os.write(self.w, b"x")
        except BlockingIOError:
            pass  # pipe full: the thread is awake anyway

    def drain(self):
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self):
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass


def bind_router(ctx: zmq.Context, host: str, port: int, advertise_host: str | None, *,
                heartbeat_ms: tuple[int, int], max_msg_bytes: int,
                options: dict[int, int] | None = None) -> tuple[zmq.Socket, str]:
    """A ROUTER bound on `host:port` (port 0 = OS-chosen) and the endpoint peers should dial.

    Unroutable replies raise (ROUTER_MANDATORY) instead of vanishing, and a peer reconnecting with
    the same identity takes over its old pipe (ROUTER_HANDOVER). A wildcard bind advertises the
    host name unless `advertise_host` says otherwise.
    """
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    router.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
    router.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
    for opt, value in (options or {}).items():
        router.setsockopt(opt, value)
    if port:
        router.bind(f"tcp://{host}:{port}")
    else:
        port = router.bind_to_random_port(f"tcp://{host}")
    adv = advertise_host or (host if host not in ("0.0.0.0", "::", "*") else socket.gethostname())
    return router, f"tcp://{adv}:{port}"


def open_dealer(ctx: zmq.Context, endpoint: str, identity: bytes, *, heartbeat_ms: tuple[int, int],
                options: dict[int, int] | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connecting to `endpoint` and its monitor socket (`MONITOR_EVENTS`).

    IMMEDIATE keeps sends queued in the caller (send raises `zmq.Again`) until the connection is
    up, which is what lets the callers time a connection attempt out.
    """
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IMMEDIATE, 1)
    s.setsockopt(zmq.ROUTING_ID, identity)
    s.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
    for opt, value in (options or {}).items():
        s.setsockopt(opt, value)
    mon = s.get_monitor_socket(MONITOR_EVENTS)
    s.connect(endpoint)
    return s, mon


def close_dealer(poller: zmq.Poller, s: zmq.Socket, monitors: dict, key) -> None:
    """Unregister and close DEALER `s` and every monitor in `monitors` mapped to `key`."""
    s.disable_monitor()
    for m, k in list(monitors.items()):
        if k == key:
            poller.unregister(m)
            del monitors[m]
            m.close(0)
    poller.unregister(s)
    s.close(0)


def monitor_events(mon: zmq.Socket) -> Iterator[int]:
    """The event codes waiting on monitor socket `mon`, without blocking.

    Stop iterating before closing `mon` (the next read would hit a closed socket).
    """
    while True:
        try:
            ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        yield ev["event"]


class IoLoop:
    """One I/O thread: a bound ROUTER, one monitored DEALER per peer key, and their out-queues.

    Invariants:
    - every socket is created, used and closed on the loop's thread only; any thread talks to it by
      `send`/`reply`/`connect`/`forget`/`call_soon`, which enqueue a command and wake the thread
      through a `Wake` pipe — the thread never sleeps on a timer to notice work (the poll timeout
      only bounds how late a connection timeout is noticed: `deadline_poll_s` while messages wait
      for a connection, else `idle_poll_s`);
    - messages to one key leave in the order they were enqueued; while a DEALER is not connected
      (IMMEDIATE: sends raise `Again`) they wait in its out-queue, and if none could be sent for
      `connect_timeout_s` the peer is lost;
    - a peer is *lost* once (its established connection dropped: the process died or heartbeats
      stopped; or the connect timeout): `on_lost(key, reason, unsent_tags)` runs on the loop's
      thread with the tags of the queued messages that will never go. With `close_on_lost` the
      DEALER is closed too and a later `send` with an endpoint opens a fresh connection; without,
      ZeroMQ keeps reconnecting it and later sends are queued again;
    - messages that will never go for another reason (`forget`, or `send` to a key that has no
      DEALER and no endpoint) are reported through `on_refused(key, tags, reason)`;
    - a queued message whose tag fails `is_live(tag)` is dropped unsent (e.g. its transfer failed).

    While a message is expected (`expect`), the thread busy-polls every descriptor it watches
    (transfer/_spin.c: the GIL released, bounded by the window) instead of sleeping in its poll.

    Handlers run on the loop's thread; an exception in one is logged and the loop goes on.
    `on_router(frames)` gets the ROUTER's frames (identity first) and `on_dealer(key, frames)` a
    DEALER's, both as `zmq.Frame`s (no copy).
    """

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, identity: bytes, *, name: str,
                 on_router: Callable[[list], None],
                 on_dealer: Callable[[Hashable, list], None],
                 on_lost: Callable[[Hashable, str, list], None],
                 on_refused: Callable[[Hashable, list, str], None] | None = None,
                 is_live: Callable[[object], bool] | None = None,
                 heartbeat_ms: tuple[int, int], connect_timeout_s: float,
                 dealer_options: dict[int, int] | None = None, close_on_lost: bool = True,
                 deadline_poll_s: float | None = None, idle_poll_s: float | None = None,
                 batch: int = 256):
        self.ctx, self.router, self.identity = ctx, router, identity
        self._on_router, self._on_dealer, self._on_lost = on_router, on_dealer, on_lost
        self._on_refused, self._is_live = on_refused, is_live
        self._hb, self._connect_timeout_s = heartbeat_ms, connect_timeout_s
        self._dealer_options = dealer_options or {}
        self._close_on_lost = close_on_lost
        self.deadline_poll_s = DEADLINE_POLL_S if deadline_poll_s is None else deadline_poll_s
        self.idle_poll_s = IDLE_POLL_S if idle_poll_s is None else idle_poll_s
        self._batch = batch
        self._cmds: collections.deque = collections.deque()
        self._wake = Wake()
        self._closed = False
        # loop-thread state
        self._poller = zmq.Poller()
        self._dealers: dict[Hashable, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, Hashable] = {}
        self._connected: dict[Hashable, bool] = {}
        self._outq: dict[Hashable, collections.deque] = {}
        self._waiting_since: dict[Hashable, float] = {}
        self._fds: dict[int, Callable[[], None]] = {}
        self._spin_until = 0.0   # expect: spin until then (monotonic; 0 = not asked)
        self._spin_fds: list[int] | None = None   # what a spin watches (None: to collect)
        # spins that ended on something readable, that ran their window out, and the seconds
        # spent spinning (a diagnostic: bench/transfer/control.py prints them)
        self.spin_stats = {"caught": 0, "ran_out": 0, "spin_s": 0.0}
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def send(self, key: Hashable, frames: list, tag=None, endpoint: str | None = None) -> None:
        """Queue `frames` for peer `key` (opening its DEALER to `endpoint` if there is none)."""
        self._put(("send", key, frames, tag, endpoint))

    def reply(self, identity: bytes, frames: list) -> None:
        """Send `frames` on the ROUTER to `identity` (dropped with a log line if unroutable)."""
        self._put(("reply", identity, frames))

    def connect(self, key: Hashable, endpoint: str) -> None:
        self._put(("connect", key, endpoint))

    def forget(self, key: Hashable, reason: str = "forgotten") -> None:
        """Close `key`'s DEALER; its queued messages go to `on_refused` (not a loss)."""
        self._put(("forget", key, reason))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop's thread, serialised with the message handlers."""
        self._put(("call", fn))

    def watch_fd(self, fd: int, on_readable: Callable[[], None]) -> None:
        """(loop thread) Poll file descriptor `fd` with the sockets; `on_readable()` runs on this
        thread whenever it is readable (a control lane: transfer/lanes.py)."""
        self._fds[fd] = on_readable
        self._poller.register(fd, zmq.POLLIN)
        self._spin_fds = None

    def expect(self, seconds: float) -> None:
        """(any thread) A message is expected within about `seconds`: until then the thread
        busy-polls its descriptors instead of sleeping in its poll, so the message is read by a
        thread that is running (its core awake, its caches warm) instead of one the kernel must
        wake. The spin releases the GIL (transfer/_spin.c: the engine's thread runs meanwhile)
        and costs one core for at most `seconds`; it ends when anything arrives, and starts
        again (the window permitting) after the loop handled it. Nothing without SPIN_NATIVE."""
        if _spin is None or seconds <= 0:
            return
        until = time.monotonic() + seconds
        if until > self._spin_until:
            self._spin_until = until
            if not self.on_loop_thread:
                self._wake.wake()   # it may be asleep in a long poll

    def unwatch_fd(self, fd: int) -> None:
        """(loop thread) Stop polling `fd` (before it is closed)."""
        if self._fds.pop(fd, None) is not None:
            self._poller.unregister(fd)
            self._spin_fds = None

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _put(self, cmd) -> None:
        if self._closed:
            return   # shut down: nothing will be sent any more (callers say so if they must)
        if self.on_loop_thread and cmd[0] in ("send", "reply") and self._send_now(cmd):
            return
        self._cmds.append(cmd)
        self._wake.wake()

    def _send_now(self, cmd) -> bool:
        """(loop thread) Send `cmd` at once instead of queueing it and waking this thread for
        another turn of the poll loop: a handler answering (a Recv answered by its Result) is
        the common case on the critical path. Messages other threads queued before it go first,
        so the messages to one peer keep their order; when a command of another kind (a call,
        a forget) is queued before it, it waits its turn as before (False)."""
        q = self._cmds
        while q:
            head = q[0]
            if head[0] not in ("send", "reply"):
                return False
            self._command(q.popleft())
            if head[0] == "send":
                self._flush_key(head[1])
        self._command(cmd)
        if cmd[0] == "send":
            self._flush_key(cmd[1])
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cmds.append(("stop",))
        self._wake.wake()
        self._thread.join(timeout=5)
        self._wake.close()

    # ------------------------------------------------------------------ the loop's thread
    def _open(self, key: Hashable, endpoint: str) -> None:
        s, mon = open_dealer(self.ctx, endpoint, self.identity, heartbeat_ms=self._hb,
                             options=self._dealer_options)
        self._dealers[key] = s
        self._monitors[mon] = key
        self._connected[key] = False
        self._outq[key] = collections.deque()
        self._poller.register(s, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)
        self._spin_fds = None

    def _close(self, key: Hashable) -> list:
        """Close `key`'s DEALER; the tags of what was still queued."""
        s = self._dealers.pop(key, None)
        if s is not None:
            close_dealer(self._poller, s, self._monitors, key)
            self._spin_fds = None
        self._connected.pop(key, None)
        self._waiting_since.pop(key, None)
        return [tag for _f, tag in self._outq.pop(key, ())]

    def _lose(self, key: Hashable, reason: str) -> None:
        if self._close_on_lost:
            unsent = self._close(key)
        else:
            self._connected[key] = False
            self._waiting_since.pop(key, None)
            q = self._outq.get(key)
            unsent = [tag for _f, tag in q] if q else []
            if q:
                q.clear()
        self._safe(self._on_lost, key, reason, [t for t in unsent if t is not None])

    def _refuse(self, key: Hashable, tags: list, reason: str) -> None:
        tags = [t for t in tags if t is not None]
        if tags and self._on_refused is not None:
            self._safe(self._on_refused, key, tags, reason)

    def _command(self, cmd) -> bool:
        op = cmd[0]
        if op == "stop":
            return False
        if op == "send":
            _, key, frames, tag, endpoint = cmd
            if key not in self._outq:
                if endpoint is None:
                    self._refuse(key, [tag], "not connected")
                    return True
                self._open(key, endpoint)
            self._outq[key].append((frames, tag))
        elif op == "reply":
            try:
                self.router.send_multipart([cmd[1], *cmd[2]], flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:   # the peer is gone: nothing to answer
                log.info("%s: reply to %r dropped: %s", self._thread.name, cmd[1], e)
        elif op == "connect":
            if cmd[1] not in self._dealers:
                self._open(cmd[1], cmd[2])
        elif op == "forget":
            self._refuse(cmd[1], self._close(cmd[1]), cmd[2])
        elif op == "call":
            self._safe(cmd[1])
        return True

    def _flush_key(self, key: Hashable) -> None:
        """Send what is queued for `key` now, as far as its connection takes it. A connection
        still being set up keeps its messages for the loop's `_flush`, which also times it out
        (a loss is never reported from inside a handler)."""
        q, s = self._outq.get(key), self._dealers.get(key)
        while q and s is not None:
            frames, tag = q[0]
            if tag is not None and self._is_live is not None and not self._is_live(tag):
                q.popleft()
                continue
            try:
                s.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            q.popleft()
            self._waiting_since.pop(key, None)

    def _flush(self, now: float) -> None:
        for key in list(self._outq):
            q = self._outq.get(key)
            while q:
                frames, tag = q[0]
                if tag is not None and self._is_live is not None and not self._is_live(tag):
                    q.popleft()
                    continue
                try:
                    self._dealers[key].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    q.popleft()
                    self._waiting_since.pop(key, None)
                except zmq.Again:
                    start = self._waiting_since.setdefault(key, now)
                    if now - start > self._connect_timeout_s:
                        self._lose(key, f"no connection within {self._connect_timeout_s:.1f}s")
                    break

    def _drain(self, s: zmq.Socket, handler, *key) -> None:
        for _ in range(self._batch):
            try:
                frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._safe(handler, *key, frames)

    def _main(self) -> None:
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self._wake.r, zmq.POLLIN)
        running = True
        idle_turns = 0   # spins in a row that ended on a descriptor with nothing to handle
        while running:
            waiting = any(self._outq.values())
            timeout = self.deadline_poll_s if waiting else self.idle_poll_s
            spun = 0
            if self._spin_until:
                # (not reset when the window ran out: another thread's `expect` may be moving
                # it later this moment)
                left = self._spin_until - time.monotonic()
                if idle_turns >= SPIN_IDLE_TURNS:
                    self._spin_until = 0.0
                    idle_turns = 0
                elif left > 0:
                    if self._spin_fds is None:
                        self._spin_fds = self._descriptors()
                    t0 = time.monotonic()
                    spun = _spin.wait(self._spin_fds, left)
                    st = self.spin_stats
                    st["spin_s"] += time.monotonic() - t0
                    st["caught" if spun else "ran_out"] += 1
                    timeout = 0   # the spin waited: ZeroMQ is only asked what is there now
            try:
                events = dict(self._poller.poll(None if timeout is None else timeout * 1000))
            except zmq.ZMQError:
                break
            idle_turns = idle_turns + 1 if spun and not events else 0
            # Watched descriptors first: a control lane carries the critical path's messages,
            # and everything this thread runs after a wake-up runs slowly (cold).
            for fd, on_readable in list(self._fds.items()):
                if fd in events and self._fds.get(fd) is on_readable:
                    self._safe(on_readable)
            if self._wake.r in events:
                self._wake.drain()
            cmds = self._cmds
            while cmds:   # only this thread pops
                running = self._command(cmds.popleft()) and running
            if self.router in events:
                self._drain(self.router, self._on_router)
            for key, s in list(self._dealers.items()):
                if s in events:
                    self._drain(s, self._on_dealer, key)
            for mon, key in list(self._monitors.items()):
                if mon in events:
                    for ev in monitor_events(mon):
                        if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            self._connected[key] = True
                            self._waiting_since.pop(key, None)
                        elif ev == zmq.EVENT_DISCONNECTED and self._connected.get(key):
                            self._lose(key, "peer closed the connection or stopped answering "
                                            "heartbeats")
                            if self._close_on_lost:
                                break   # _lose closed `mon`
            self._flush(time.monotonic())
        for key in list(self._dealers):
            self._close(key)
        self.router.close(0)

    def _descriptors(self) -> list[int]:
        """(loop thread) The file descriptors behind everything the poller watches: a ZeroMQ
        socket's is readable when it has something to process (a message or a command)."""
        return [s if isinstance(s, int) else s.getsockopt(zmq.FD)
                for s, _flags in self._poller.sockets]

    def _safe(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:   # a handler bug must not kill the I/O thread
            log.exception("%s: handler failed", self._thread.name)
