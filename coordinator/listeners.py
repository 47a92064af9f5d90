"""The coordinator's listeners: TCP and Unix-socket setup, the HTTP server behind them and the
fleet channel's upgrade site.

`CoordinatorServer` serves one `Coordinator` (coordinator/service.py) over both sockets with either
the API's own HTTP/1.1 protocol (`coordinator.http`, which also hands `GET /channel` upgrades to
`coordinator.channel`) or aiohttp's low-level server; it owns their start and graceful stop. The
Unix socket is created mode 0660 and a stale one left by a dead process is replaced, never a live
one or a file that is not a socket.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.web_request import BaseRequest
from aiohttp.web_runner import ServerRunner
from aiohttp.web_server import Server

from coordinator.api import Api, aiohttp_handler
from coordinator.channel import ChannelServer, LoopWatch
from coordinator.http import HttpServer
from coordinator.service import Coordinator
from coordinator.snapshot import ChannelCounts, ListenerCounters

__all__ = ["CoordinatorServer", "MAX_BODY_BYTES"]

log = logging.getLogger("splitserve.coordinator")

MAX_BODY_BYTES = 32 * 1024 * 1024


class CoordinatorServer:
    """Serves a Coordinator over TCP and (optionally) a Unix socket; owns its start and stop.

    `http="fast"` (default) uses the API's own HTTP/1.1 protocol (`coordinator.http`);
    `http="aiohttp"` uses aiohttp's low-level server with the same handlers."""

    def __init__(self, coord: Coordinator, host: str = "127.0.0.1", port: int = 0,
                 uds_path: str | None = None, shutdown_timeout_s: float = 5.0, http: str = "fast"):
        if http not in ("fast", "aiohttp"):
            raise ValueError(f"http must be 'fast' or 'aiohttp', got {http!r}")
        self.coord = coord
        self.host = host
        self.port = port
        self.uds_path = uds_path
        self.shutdown_timeout_s = shutdown_timeout_s
        self.http = http
        co = coord.config.coordinator
        self.watch = LoopWatch()
        self.api = Api(coord, watch=self.watch, max_queue_delay_s=co.max_queue_delay_s,
                       counters=self.counters)
        # The fleet channel rides on the fast server's listeners (an HTTP upgrade).
        self.channel = (ChannelServer(coord, max_queue_delay_s=co.max_queue_delay_s)
                        if co.channel and http == "fast" else None)
        self._fast: HttpServer | None = None
        self._runner: ServerRunner | None = None
        self.urls: list[str] = []
        self.tcp_url: str | None = None
        self.uds_url: str | None = None

    def counters(self) -> ListenerCounters:
        """What these listeners counted, for the coordinator's snapshot (`/metrics`)."""
        ch = self.channel.stats if self.channel is not None else None
        return ListenerCounters(
            http_shed=self.api.shed,
            channel=None if ch is None else ChannelCounts(
                connections=ch.connections, batches=ch.batches, calls=ch.calls,
                finishes=ch.finishes, malformed=ch.bad_calls, shed=ch.shed))

    async def start(self, start_coordinator: bool = True) -> list[str]:
        if start_coordinator:
            await self.coord.start()
        socks = [_tcp_socket(self.host, self.port)]
        if self.uds_path:
            try:
                socks.append(_unix_socket(self.uds_path))
            except OSError:
                socks[0].close()
                raise
        if self.http == "fast":
            self._fast = HttpServer(self.api, max_body=MAX_BODY_BYTES, channel=self.channel)
            for sock in socks:
                await self._fast.serve(sock)
        else:
            srv = Server(aiohttp_handler(self.api), access_log=None, keepalive_timeout=75.0)
            srv.request_factory = _request_factory(srv)
            self._runner = ServerRunner(srv, shutdown_timeout=self.shutdown_timeout_s)
            await self._runner.setup()
            for sock in socks:
                await web.SockSite(self._runner, sock, backlog=4096).start()
        self.watch.start()
        h, p = socks[0].getsockname()[:2]
        self.port = p
        shown = f"[{h}]" if ":" in h else h
        self.tcp_url = f"http://{shown}:{p}"
        self.urls = [self.tcp_url]
        if self.uds_path:
            self.uds_url = f"unix://{self.uds_path}"
            self.urls.append(self.uds_url)
        self._check_cluster_uri()
        return self.urls

    def _check_cluster_uri(self) -> None:
        """An `http://` `disagg_cluster.cluster_uri` names where workers register: say so when it
        is not this coordinator's port (workers pointed there would never reach it)."""
        dc = self.coord.config.disagg_cluster
        if dc is None or not dc.cluster_uri.startswith(("http://", "https://")):
            return
        u = urlsplit(dc.cluster_uri)
        named = u.port or (443 if u.scheme == "https" else 80)
        if named != self.port:
            log.warning("disagg_cluster.cluster_uri %s names port %d, but this coordinator listens on "
                        "%d: workers registering at that URL will not reach it", dc.cluster_uri, named,
                        self.port)

    async def stop(self) -> None:
        """Stop listening, let in-flight requests finish (bounded), then stop the coordinator."""
        if self._fast is not None:
            await self._fast.close(self.shutdown_timeout_s)
            self._fast = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.watch.stop()
        if self.uds_path:
            try:
                os.unlink(self.uds_path)
            except FileNotFoundError:
                pass
        await self.coord.stop()


def _request_factory(server: Server):
    loop = asyncio.get_running_loop()

    def make(message, payload, protocol, writer, task) -> BaseRequest:
        return BaseRequest(message, payload, protocol, writer, task, loop,
                           client_max_size=MAX_BODY_BYTES)
    return make


def _tcp_socket(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _t, _p, _c, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
    except OSError as exc:
        s.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    return s


def _unix_socket(path: str) -> socket.socket:
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale socket of a process that is gone
        else:
            raise OSError(errno.EADDRINUSE, f"{path} is in use by a running process")
        finally:
            probe.close()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o660)  # same user/group only: the socket grants full control of placement
    s.setblocking(False)
    return s
