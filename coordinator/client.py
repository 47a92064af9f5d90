"""Clients of the coordinator API: one codec (coordinator/client_codec.py) over pluggable transports.

`CoordinatorClient(transport, channel=None)` has the same async methods, answers and errors
whatever carries the calls:
- `InProcessTransport(coordinator)` — a `Coordinator` in this process: no serialization, no hop,
  no await point (`inline`: a caller cannot be cancelled while a lease is being created), and
  `finish_nowait` is a plain call;
- `HttpTransport(url)` — msgpack over HTTP/1.1 keep-alive (aiohttp), TCP (`http://host:port`) or a
  Unix socket (`unix:///path`); fleet/coord_client.py adds the fleet's pooled variant;
- the persistent channel (`coordinator.channel_client.ChannelClient`) in front of an HTTP
  transport: the per-request calls (`select`, `select_pair`, `finish`, `renew`) go over it when the
  coordinator offers it — batched per event-loop turn, finishes queued without a round trip — and
  over the transport otherwise (`channel=False`, an older coordinator, or while it is unreachable).

Errors: `NoServerAvailable` (a placement found no server), `CoordinatorOverloaded` (shed, with
`retry_after`), `CoordinatorRequestError` (400/404/415, `.field` when known), `CoordinatorUnavailable`
(unreachable, timed out, or failed). Block keys may be passed as a numpy array, bytes (little-endian
u64) or a list; over a wire they travel as one binary blob (8 bytes per key), which the coordinator
reads without a copy.

`HttpCoordinatorClient(url)` and `InProcessCoordinatorClient(coordinator)` build the two usual
stacks; `make_client(target)` picks one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol, runtime_checkable

import aiohttp
import msgpack
import orjson

from coordinator import client_codec as codec
from coordinator.channel_client import ChannelClient, Fallback
from coordinator.client_codec import answer_or_raise
from protocol.failures import Cause
from protocol.coord import BadRequest, CoordinatorUnavailable
from coordinator.identity import IdentityExhausted

__all__ = [
    "CoordinatorClient",
    "HttpCoordinatorClient",
    "HttpTransport",
    "InProcessCoordinatorClient",
    "InProcessTransport",
    "Transport",
    "make_client",
]

log = logging.getLogger("splitserve.coordinator")

MSGPACK = "application/msgpack"
_HEADERS = {"Content-Type": MSGPACK, "Accept": MSGPACK}


@runtime_checkable
class Transport(Protocol):
    """How a call reaches the coordinator. `body` is the call's `protocol.coord` request struct
    (built by the codec) or None; `call` returns the decoded answer of `path` or raises the codec's
    typed errors (`client_codec.answer_or_raise` for a wire transport)."""
    url: str
    inline: bool        # answers without suspending (an in-process coordinator)

    async def call(self, method: str, path: str, body: Any = None) -> Any: ...

    async def close(self) -> None: ...


def parse_url(url: str) -> tuple[str | None, str]:
    """(Unix socket path or None, HTTP base URL) of `http(s)://host:port` or `unix:///path`."""
    url = url.rstrip("/")
    if url.startswith("unix:"):
        # unix:///path (ours) and unix:/path (upstream's) name the same socket.
        path = "/" + url[len("unix:"):].lstrip("/")
        if path == "/":
            raise ValueError(f"unix socket URL has no path: {url!r}")
        return path, "http://localhost"
    if url.startswith(("http://", "https://")):
        return None, url
    raise ValueError(f"coordinator URL must be http(s)://host:port or unix:///path, got {url!r}")


class HttpTransport:
    """msgpack over HTTP/1.1 keep-alive, unlimited connection pool (a capped pool queues calls
    behind each other: upstream measured hundreds of ms of /select latency from a pool of 100)."""
    inline = False

    def __init__(self, url: str, timeout_s: float = 5.0):
        self._uds, self.base = parse_url(url)
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _sess(self) -> aiohttp.ClientSession:
        s = self._session
        if s is None or s.closed:
            if self._uds is not None:
                conn = aiohttp.UnixConnector(path=self._uds, limit=0)
            else:
                conn = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            s = self._session = aiohttp.ClientSession(
                connector=conn, timeout=self.timeout, trust_env=False, auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return s

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        data = codec.encode(body) if body is not None else None
        try:
            async with self._sess().request(method, self.base + path, data=data,
                                            headers=_HEADERS) as r:
                raw = await r.read()
                status = r.status
                ctype = r.headers.get("Content-Type", "")
        except asyncio.TimeoutError:
            raise CoordinatorUnavailable(f"coordinator {self.url} did not answer {path} within "
                                         f"{self.timeout.total:g}s", Cause.TIMEOUT) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise CoordinatorUnavailable(f"coordinator {self.url} unreachable for {path}: "
                                         f"{type(exc).__name__}: {exc}") from None
        try:
            if "msgpack" in ctype:
                obj = msgpack.unpackb(raw, raw=False)
            else:
                obj = orjson.loads(raw) if raw else None
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            obj = None  # an error page from something that is not the coordinator
        return answer_or_raise(self.url, path, status, obj, raw)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class InProcessTransport:
    """The coordinator object's synchronous state calls, behind the transport interface. Answers
    share structure with the coordinator's state (e.g. `info.server_info`): treat them as
    read-only. The only holder of the coordinator object on the fleet's side."""
    inline = True
    url = "in-process"

    def __init__(self, coordinator):
        c = self._coord = coordinator
        self._routes = {
            codec.SELECT: lambda b: c.select(b.role, b.req_id, b.routing_key, b.exclude),
            codec.SELECT_PAIR: lambda b: c.select_pair(b.req_id, b.routing_key, b.exclude_ctx, b.exclude_gen),
            codec.FINISH: lambda b: c.finish(b.role, b.req_id, b.success, b.usage),
            codec.RENEW: lambda b: {"renewed": c.renew(b.role, b.req_id)},
            codec.FIRST_TOKEN: lambda b: {"applied": c.first_token(b.role, b.req_id)},
            codec.CLUSTER_INFO: lambda b: c.cluster_info(),
            codec.HEALTH: lambda b: c.is_ready(),
            codec.IDENTITY: lambda b: c.lease_identity(b.holder, b.node_id, b.process_id),
            codec.IDENTITY_RELEASE: lambda b: {"released": c.release_identity(b.holder)},
        }

    def call_now(self, path: str, body: Any = None) -> Any:
        try:
            return self._routes[path](body)
        except BadRequest as exc:
            raise codec.rejected(exc) from None
        except IdentityExhausted as exc:
            raise CoordinatorUnavailable(str(exc)) from None

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        return self.call_now(path, body)

    async def close(self) -> None:
        return None


class CoordinatorClient:
    """The coordinator API over `transport`, with `channel` (optional) in front for the
    per-request calls."""

    def __init__(self, transport: Transport, channel: ChannelClient | None = None):
        self.transport = transport
        self.url = transport.url
        self.inline = transport.inline
        self._chan = channel

    @property
    def channel(self) -> ChannelClient | None:
        return self._chan

    async def __aenter__(self) -> "CoordinatorClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._chan is not None:
            await self._chan.close()     # first: it flushes queued finishes
        await self.transport.close()

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        return await self.transport.call(method, path, body)

    async def select(self, role: str, req_id: int, routing_key: Any = None, exclude: Any = None) -> dict:
        ch = self._chan
        if ch is not None and ch.usable():
            try:
                return await ch.select(role, req_id, routing_key, exclude)
            except Fallback:
                pass
        return await self._call("POST", codec.SELECT, codec.select_body(role, req_id, routing_key, exclude,
                                                                        wire=not self.inline))

    async def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                          exclude_gen: Any = None) -> dict:
        ch = self._chan
        if ch is not None and ch.usable():
            try:
                return await ch.select_pair(req_id, routing_key, exclude_ctx, exclude_gen)
            except Fallback:
                pass
        return await self._call("POST", codec.SELECT_PAIR,
                                codec.select_pair_body(req_id, routing_key, exclude_ctx, exclude_gen,
                                                       wire=not self.inline))

    def finish_nowait(self, role: str, req_id: int, success: bool = True,
                      usage: dict | None = None) -> bool:
        """End a lease without awaiting: applied at once (in-process: its errors are raised here) or
        queued on the channel (True); False: the caller awaits `finish` instead (no channel, or the
        channel declined a field the coordinator would reject, so that its 400 is reported)."""
        if self.inline:
            self.transport.call_now(codec.FINISH, codec.finish_body(role, req_id, success, usage))
            return True
        ch = self._chan
        return ch is not None and ch.finish(role, req_id, success, usage)

    def first_token_nowait(self, role: str, req_id: int) -> bool:
        """Report a leg's first token without awaiting: applied at once (in-process) or queued on
        the channel (True); False: the caller awaits `first_token` instead (no channel)."""
        if self.inline:
            self.transport.call_now(codec.FIRST_TOKEN, codec.first_token_body(role, req_id))
            return True
        ch = self._chan
        return ch is not None and ch.first_token(role, req_id)

    async def first_token(self, role: str, req_id: int) -> bool:
        """Report a leg's first token over the HTTP API (`POST /first_token`); True when it
        applied (the lease was live and in prefill)."""
        ans = await self._call("POST", codec.FIRST_TOKEN, codec.first_token_body(role, req_id))
        return bool(ans.get("applied")) if isinstance(ans, dict) else False

    async def finish(self, role: str, req_id: int, success: bool = True, usage: dict | None = None) -> None:
        """Returns once the coordinator applied it (on the channel: its batch was acknowledged)."""
        ch = self._chan
        if ch is not None and await ch.finish_acked(role, req_id, success, usage):
            return
        await self._call("POST", codec.FINISH, codec.finish_body(role, req_id, success, usage))

    async def _finish_retrying(self, role: str, req_id: int, success: bool,
                               usage: dict | None = None) -> None:
        """A channel's unacknowledged finish, over the transport (idempotent, so retried)."""
        body = codec.finish_body(role, req_id, success, usage)
        delay = 0.05
        for attempt in range(4):
            try:
                await self._call("POST", codec.FINISH, body)
                return
            except CoordinatorUnavailable:
                if attempt == 3:
                    raise
                await asyncio.sleep(delay)
                delay *= 2

    async def renew(self, role: str, req_id: int) -> bool:
        ch = self._chan
        if ch is not None and ch.usable():
            try:
                return await ch.renew(role, req_id)
            except Fallback:
                pass
        return codec.renewed(await self._call("POST", codec.RENEW, codec.renew_body(role, req_id)))

    async def cluster_info(self) -> dict:
        return await self._call("GET", codec.CLUSTER_INFO)

    async def health(self) -> bool:
        try:
            ans = await self._call("GET", codec.HEALTH)
        except CoordinatorUnavailable:
            return False
        return ans if isinstance(ans, bool) else True

    async def lease_identity(self, holder: str, node_id: int | None = None,
                             process_id: int | None = None) -> tuple[int, int]:
        return codec.identity(await self._call("POST", codec.IDENTITY,
                                               codec.identity_body(holder, node_id, process_id)))

    async def release_identity(self, holder: str) -> bool:
        return codec.released(await self._call("POST", codec.IDENTITY_RELEASE, codec.identity_release_body(holder)))


class HttpCoordinatorClient(CoordinatorClient):
    """The coordinator at `url` (`http://host:port` or `unix:///path`): the channel when offered,
    HTTP otherwise. `transport` replaces the HTTP transport (fleet/coord_client.py)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, timeout: float | None = None,
                 channel: bool = True, max_pending: int = 4096, transport: Transport | None = None):
        timeout_s = timeout if timeout is not None else timeout_s
        transport = transport or HttpTransport(url, timeout_s)
        url = url.rstrip("/")
        chan = (ChannelClient(url, timeout_s=timeout_s, max_pending=max_pending,
                              fallback_finish=self._finish_retrying)
                if channel and not url.startswith("https://") else None)
        super().__init__(transport, chan)
        self.url = url


class InProcessCoordinatorClient(CoordinatorClient):
    """The coordinator object in this process (one-process topology). `start(config)` also owns
    its life: it creates and starts the coordinator, and `close()` stops it."""

    def __init__(self, coordinator, *, stop=None):
        super().__init__(InProcessTransport(coordinator))
        self._stop = stop

    @classmethod
    async def start(cls, config) -> "InProcessCoordinatorClient":
        """A started coordinator for `config`. With dynamic membership through the coordinator
        (`disagg_cluster.cluster_uri: http://…`) workers must reach it to register, so it also
        serves its API (loopback by default) on its port
        (the fleet's port - 1) and its Unix socket."""
        from coordinator.service import Coordinator
        coord = Coordinator(config)
        dc = config.disagg_cluster
        if dc is None or dc.cluster_uri.startswith("etcd://"):
            # etcd: workers register in etcd, which the coordinator watches; no API to serve.
            await coord.start()
            return cls(coord, stop=coord.stop)
        from coordinator.listeners import CoordinatorServer
        server = CoordinatorServer(coord, host=config.coordinator.host, port=config.coordinator_port,
                                   uds_path=config.coordinator_uds_path)
        urls = await server.start()
        log.info("in-process coordinator serving its API on %s", " and ".join(urls))
        return cls(coord, stop=server.stop)

    async def close(self) -> None:
        await super().close()
        stop, self._stop = self._stop, None
        if stop is not None:
            await stop()


def make_client(target: Any, *, timeout_s: float = 5.0) -> CoordinatorClient:
    """A client for a URL (`http://…`, `unix:///…`) or an in-process `Coordinator`."""
    if isinstance(target, str):
        return HttpCoordinatorClient(target, timeout_s=timeout_s)
    return InProcessCoordinatorClient(target)
