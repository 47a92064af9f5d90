"""The connection and listener plumbing of an HTTP/1.1 server on asyncio protocols.

`Connection` is one client connection: it owns the transport, the llhttp parser (which calls the
subclass's `on_*` callbacks), back-pressure and idle time. `Server` owns the listening sockets, the
set of live connections, the keep-alive sweep and the bounded shutdown. A server built on them
says what a request is by two answers of its connection: `idle()` (nothing received or served:
the sweep may close it) and `in_flight()` (a request that shutdown waits for).

Invariants:
- a connection is in `Server.conns` from `connection_made` until `connection_lost` (or until it is
  handed to another protocol, which removes it);
- once `closing` is set nothing more is read from the connection;
- while the transport's write buffer is over its high-water mark reading is paused and `drain()`
  waits; `resume_writing` resumes reading only where the server's own `may_read()` agrees.
"""
from __future__ import annotations

import abc
import asyncio
import socket
import time

import httptools


class Connection(asyncio.Protocol, metaclass=abc.ABCMeta):
    """One client connection; subclasses add the httptools callbacks and the request model."""

    __slots__ = ("srv", "loop", "transport", "parser", "last", "closing", "_paused_w", "_drain")

    def __init__(self, srv: "Server"):
        self.srv = srv
        self.loop = srv.loop
        self.transport = None
        self.parser = httptools.HttpRequestParser(self)
        self.last = time.monotonic()
        self.closing = False
        self._paused_w = False
        self._drain: asyncio.Future | None = None

    # ---- what the server asks --------------------------------------------------------------------
    @abc.abstractmethod
    def idle(self) -> bool:
        """Nothing received and nothing being served: the keep-alive sweep may close it."""

    @abc.abstractmethod
    def in_flight(self) -> bool:
        """A request the shutdown waits for (bounded)."""

    def may_read(self) -> bool:
        """Whether reading may resume once the client reads its answers again."""
        return True

    # ---- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.srv.conns.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc) -> None:
        self.srv.conns.discard(self)
        self.transport = None
        self.closing = True
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        # a client that does not read its answers: stop reading its requests too
        self._paused_w = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused_w = False
        if self.transport is not None and not self.closing and self.may_read():
            self.transport.resume_reading()
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    # ---- writing -----------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        t.write(data)

    async def drain(self) -> None:
        """Wait until the client has read enough of what was written (no-op when it keeps up)."""
        if not self._paused_w:
            return
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        self._drain = self.loop.create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


class Server(abc.ABC):
    """Listening sockets (TCP or Unix), the live connections, the keep-alive sweep, shutdown."""

    def __init__(self, *, keepalive_s: float):
        self.keepalive_s = keepalive_s
        self.conns: set[Connection] = set()
        self.servers: list[asyncio.base_events.Server] = []
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task | None = None

    @abc.abstractmethod
    def protocol(self) -> Connection:
        """A new connection object (the protocol factory)."""

    async def serve(self, sock: socket.socket, backlog: int = 4096) -> None:
        self.loop = loop = asyncio.get_running_loop()
        if sock.family == socket.AF_UNIX:
            srv = await loop.create_unix_server(self.protocol, sock=sock, backlog=backlog)
        else:
            srv = await loop.create_server(self.protocol, sock=sock, backlog=backlog)
        self.servers.append(srv)
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, max(0.05, self.keepalive_s / 2)))
            cutoff = time.monotonic() - self.keepalive_s
            for c in list(self.conns):
                if c.idle() and c.last < cutoff and c.transport is not None:
                    c.close()

    async def _stopping(self) -> None:
        """Called once accepting has stopped and idle connections are closed (a server's hook)."""

    async def _abandon(self) -> None:
        """Called when the bounded wait for requests in flight is over (a server's hook)."""

    async def close(self, timeout: float = 5.0) -> None:
        """Stop accepting; close connections with nothing in flight; wait for the rest (bounded),
        then close everything."""
        self.stopping = True
        for s in self.servers:
            s.close()
        for c in list(self.conns):
            if not c.in_flight():
                c.close()
        await self._stopping()
        deadline = time.monotonic() + timeout
        while any(c.in_flight() for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self._abandon()
        for c in list(self.conns):
            c.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for s in self.servers:
            await s.wait_closed()
        self.servers.clear()
