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
stacks; `make_client(target)` picks one. `ReplicaClient(clients)` is one client over several
coordinator replicas (docs/failover.md): it walks them in order, follows a replica's `NotServing`
answer to the one that serves, and re-registers the leases it holds with a replica it moves to.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

import aiohttp
import msgpack
import orjson

from coordinator import client_codec as codec
from coordinator.channel_client import ChannelClient, Fallback
from coordinator.client_codec import answer_or_raise
from protocol.failures import Cause
from protocol.coord import BadRequest, CoordinatorRequestError, CoordinatorUnavailable, NotServing
from coordinator.identity import IdentityExhausted
from protocol import coord as wire

__all__ = [
    "CoordinatorClient",
    "HttpCoordinatorClient",
    "HttpTransport",
    "InProcessCoordinatorClient",
    "InProcessTransport",
    "ReplicaClient",
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
        if channel is not None and not self.inline:
            # Over a channel these are the channel's own (what the methods below would call):
            # one Python call less per leg on the fleet's request path.
            self.finish_nowait = channel.finish
            self.first_token_nowait = channel.first_token

    @property
    def channel(self) -> ChannelClient | None:
        return self._chan

    @property
    def cancel_safe(self) -> bool:
        """A placement started now cannot leak its lease when its caller is cancelled: in-process
        (no await point while the lease is created) or over the connected channel (whose client
        ends a cancelled caller's lease itself). Otherwise the caller must shield the call and end
        the leases it may have created (fleet/placement.py `Placer._leased`)."""
        if self.inline:
            return True
        ch = self._chan
        return ch is not None and ch.connected

    def count_abandoned(self, fn: Callable[[], None]) -> None:
        """Call `fn` for every lease the channel ended because its caller was cancelled."""
        if self._chan is not None:
            self._chan.on_abandoned = fn

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

    def select_answer(self, role: str, req_id: int, routing_key: Any = None,
                      exclude: Any = None) -> Awaitable[wire.SelectAnswer]:
        """`select`'s answer checked as `protocol.coord.SelectAnswer`: the connected channel's own
        (checked before its kv explanation is built, no extra coroutine in between), else `select`'s
        answer checked here (`BadAnswer` when it does not fit)."""
        ch = self._chan
        if ch is not None and not self.inline and ch.connected:
            return ch.select_answer(role, req_id, routing_key, exclude)
        return _checked(self.select(role, req_id, routing_key, exclude), wire.SelectAnswer, codec.SELECT)

    def select_pair_answer(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                           exclude_gen: Any = None) -> Awaitable[wire.SelectPairAnswer]:
        """`select_pair`'s answer checked as `protocol.coord.SelectPairAnswer` (as `select_answer`)."""
        ch = self._chan
        if ch is not None and not self.inline and ch.connected:
            return ch.select_pair_answer(req_id, routing_key, exclude_ctx, exclude_gen)
        return _checked(self.select_pair(req_id, routing_key, exclude_ctx, exclude_gen),
                        wire.SelectPairAnswer, codec.SELECT_PAIR)

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

    async def release_identity(self, holder: str, end_leases: bool = False) -> bool:
        return codec.released(await self._call("POST", codec.IDENTITY_RELEASE,
                                               codec.identity_release_body(holder, end_leases)))

    async def register_leases(self, leases) -> dict:
        """`POST /leases`: `(role, req_id, server, tokens, started)` tuples this process holds."""
        return await self._call("POST", codec.LEASES, codec.leases_body(leases))


async def _quietly(call: Awaitable[Any]) -> None:
    """A lease end nobody waits for: when it cannot go, the coordinator expires the lease."""
    try:
        await call
    except (CoordinatorUnavailable, CoordinatorRequestError) as e:
        log.debug("ending an abandoned lease failed: %s", e)


async def _checked(call: Awaitable[Any], typ: type, path: str) -> Any:
    return wire.as_answer(typ, await call, path)


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


class ReplicaClient:
    """Several coordinator replicas as one client (docs/failover.md), the fleet's only view of them.

    - Calls go to the current replica. One that cannot be reached is marked down for `down_s` and
      the walk moves on to the first replica in list order not marked down; one that answers
      `NotServing` is left for the replica it names (when that one is not marked down), else
      asked again `retry_s` later (it re-checks the replicas ahead of it when it refuses).
    - A placement waits at most `failover_wait_s` for a replica that serves; then the last error
      is raised (`CoordinatorUnavailable`: the fleet places locally, blind).
    - It knows the leases it holds (each placement's answer until its finish) and re-registers
      them with a replica before its first call there (`POST /leases`, idempotent by `(role,
      req_id)`), once per move however many callers are waiting, so that replica's load counters
      include the requests in flight before it places anything.
    - While the current replica holds our leases and its channel is connected, a placement goes
      straight to that channel (`cancel_safe`: the channel ends a cancelled caller's lease itself),
      the answer recorded as a held lease: one coroutine more than a single coordinator, no Task
      or shield. A placement that fails there (the channel broke, `NotServing`) walks on as above,
      shielded so that a caller cancelled meanwhile leaks no lease.
    """
    inline = False
    channel = None

    def __init__(self, clients: list[CoordinatorClient], *, failover_wait_s: float = 1.0,
                 down_s: float = 1.0, retry_s: float = 0.02,
                 on_move: Callable[[str, str, int], None] | None = None):
        if not clients:
            raise ValueError("ReplicaClient needs at least one coordinator client")
        self.clients = clients
        self.urls = [c.url for c in clients]
        self.url = self.urls[0]
        self.failover_wait_s = failover_wait_s
        self.down_s = down_s
        self.retry_s = retry_s
        self.on_move = on_move     # (from url, to url, leases re-registered)
        self.current = 0
        self._registered = 0       # the replica that has our leases
        self._down_until = [0.0] * len(clients)
        # (role, req_id) -> [server, tokens, its first token reported]
        self._leases: dict[tuple[str, int], list] = {}
        self._moving: tuple[int, asyncio.Future] | None = None
        self.stats = {"moves": 0, "leases_reregistered": 0, "not_serving": 0, "unreachable": 0,
                      "gave_up": 0}
        self._bg: set[asyncio.Task] = set()

    @property
    def cancel_safe(self) -> bool:
        """A placement started now goes to the current replica's connected channel (see above)."""
        return self._registered == self.current and self.clients[self.current].cancel_safe

    @property
    def leases(self) -> int:
        return len(self._leases)

    # ---- the walk -----------------------------------------------------------------------------
    def _next(self, now: float) -> int | None:
        for i, until in enumerate(self._down_until):
            if until <= now:
                return i
        return None

    async def _on(self, i: int) -> CoordinatorClient:
        """Replica `i`, holding our leases (re-registered once per move)."""
        if self._registered != i:
            mv = self._moving
            if mv is None or mv[0] != i:
                fut = asyncio.get_running_loop().create_future()
                self._moving = (i, fut)
                try:
                    leases = [(role, rid, *rec) for (role, rid), rec in self._leases.items()]
                    if leases:
                        await self.clients[i].register_leases(leases)
                    old = self.urls[self._registered]
                    self._registered = i
                    self.stats["moves"] += 1
                    self.stats["leases_reregistered"] += len(leases)
                    log.warning("coordinator: moved from %s to %s (%d lease(s) re-registered)",
                                old, self.urls[i], len(leases))
                    if self.on_move is not None:
                        self.on_move(old, self.urls[i], len(leases))
                    fut.set_result(None)
                except BaseException as exc:
                    fut.set_exception(exc)
                    fut.exception()        # retrieved here: the waiters get it from `await`
                    raise
                finally:
                    if self._moving is not None and self._moving[1] is fut:
                        self._moving = None
            else:
                await asyncio.shield(mv[1])
        return self.clients[i]

    async def _run(self, call: Callable[[CoordinatorClient], Awaitable[Any]]) -> Any:
        deadline = None
        while True:
            i = self.current
            try:
                return await call(await self._on(i))
            except NotServing as exc:
                self.stats["not_serving"] += 1
                err: CoordinatorUnavailable = exc
                j = self.urls.index(exc.serving.rstrip("/")) if exc.serving and \
                    exc.serving.rstrip("/") in self.urls else None
                now = time.monotonic()
                if j is not None and j != i and self._down_until[j] <= now:
                    self.current = j
                    continue
            except CoordinatorUnavailable as exc:
                self.stats["unreachable"] += 1
                err = exc
                now = time.monotonic()
                self._down_until[i] = now + self.down_s
                j = self._next(now)
                if j is not None:
                    self.current = j
                    continue
                # every replica failed just now: walk the list again from the start
                self._down_until = [0.0] * len(self.clients)
                self.current = 0
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.failover_wait_s
            if now >= deadline:
                self.stats["gave_up"] += 1
                raise err
            await asyncio.sleep(min(self.retry_s, deadline - now))

    # ---- the client API -----------------------------------------------------------------------
    def _held(self, role: str, req_id: int, ans: Any, routing_key: Any) -> None:
        if isinstance(ans, dict) and isinstance(ans.get("server"), str):
            tokens = routing_key.get("num_tokens") if isinstance(routing_key, dict) else None
            self._leases[(role, req_id)] = [ans["server"], tokens if type(tokens) is int else 0, False]

    async def select(self, role: str, req_id: int, routing_key: Any = None, exclude: Any = None) -> dict:
        ans = await self._run(lambda c: c.select(role, req_id, routing_key, exclude))
        self._held(wire.parse_role(role), req_id, ans, routing_key)
        return ans

    async def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                          exclude_gen: Any = None) -> dict:
        ans = await self._run(lambda c: c.select_pair(req_id, routing_key, exclude_ctx, exclude_gen))
        if isinstance(ans, dict):
            for role in ("context", "generation"):
                self._held(role, req_id, ans.get(role), routing_key)
        return ans

    def select_answer(self, role: str, req_id: int, routing_key: Any = None,
                      exclude: Any = None) -> Awaitable[wire.SelectAnswer]:
        if self.cancel_safe:
            return self._direct(role, req_id, routing_key, exclude)
        return _checked(self.select(role, req_id, routing_key, exclude), wire.SelectAnswer, codec.SELECT)

    def select_pair_answer(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                           exclude_gen: Any = None) -> Awaitable[wire.SelectPairAnswer]:
        if self.cancel_safe:
            return self._direct_pair(req_id, routing_key, exclude_ctx, exclude_gen)
        return _checked(self.select_pair(req_id, routing_key, exclude_ctx, exclude_gen),
                        wire.SelectPairAnswer, codec.SELECT_PAIR)

    def _hold(self, role: str, req_id: int, server: str, routing_key: Any) -> None:
        tokens = routing_key.get("num_tokens") if isinstance(routing_key, dict) else None
        self._leases[(role, req_id)] = [server, tokens if type(tokens) is int else 0, False]

    async def _direct(self, role, req_id, routing_key, exclude) -> wire.SelectAnswer:
        try:
            ans = await self.clients[self.current].select_answer(role, req_id, routing_key, exclude)
        except CoordinatorUnavailable:     # the channel broke, or NotServing: walk on
            return await self._guarded(_checked(self.select(role, req_id, routing_key, exclude),
                                                wire.SelectAnswer, codec.SELECT), (role,), req_id)
        self._hold(wire.parse_role(role), req_id, ans.server, routing_key)
        return ans

    async def _direct_pair(self, req_id, routing_key, exclude_ctx, exclude_gen) -> wire.SelectPairAnswer:
        try:
            ans = await self.clients[self.current].select_pair_answer(req_id, routing_key,
                                                                      exclude_ctx, exclude_gen)
        except CoordinatorUnavailable:
            return await self._guarded(_checked(self.select_pair(req_id, routing_key, exclude_ctx,
                                                                 exclude_gen),
                                                wire.SelectPairAnswer, codec.SELECT_PAIR),
                                       ("context", "generation"), req_id)
        if ans.context is not None:
            self._hold("context", req_id, ans.context.server, routing_key)
        self._hold("generation", req_id, ans.generation.server, routing_key)
        return ans

    async def _guarded(self, call: Awaitable[Any], roles: tuple[str, ...], req_id: int) -> Any:
        """`call` run to its end even when the caller is cancelled meanwhile, whose leases are then
        ended (the caller was told the placement is cancel-safe)."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def orphaned(t: asyncio.Task) -> None:
                if t.cancelled() or t.exception() is not None:
                    return
                for role in roles:
                    if not self.finish_nowait(role, req_id, True):
                        f = asyncio.ensure_future(_quietly(self.finish(role, req_id, True)))
                        self._bg.add(f)
                        f.add_done_callback(self._bg.discard)
            task.add_done_callback(orphaned)
            raise

    def count_abandoned(self, fn: Callable[[], None]) -> None:
        for c in self.clients:
            c.count_abandoned(fn)

    def finish_nowait(self, role: str, req_id: int, success: bool = True,
                      usage: dict | None = None) -> bool:
        self._drop(role, req_id)
        if self._registered != self.current:
            return False          # the move is under way: `finish` waits for it
        return self.clients[self.current].finish_nowait(role, req_id, success, usage)

    def _drop(self, role: str, req_id: int) -> None:
        canon = wire.ROLES.get(role) if isinstance(role, str) else None
        self._leases.pop((canon or role, req_id), None)

    def _started(self, role: str, req_id: int) -> None:
        canon = wire.ROLES.get(role) if isinstance(role, str) else None
        rec = self._leases.get((canon or role, req_id))
        if rec is not None:
            rec[2] = True

    def first_token_nowait(self, role: str, req_id: int) -> bool:
        self._started(role, req_id)
        if self._registered != self.current:
            return False
        return self.clients[self.current].first_token_nowait(role, req_id)

    async def first_token(self, role: str, req_id: int) -> bool:
        self._started(role, req_id)
        return await self._run(lambda c: c.first_token(role, req_id))

    async def finish(self, role: str, req_id: int, success: bool = True, usage: dict | None = None) -> None:
        self._drop(role, req_id)
        await self._run(lambda c: c.finish(role, req_id, success, usage))

    async def renew(self, role: str, req_id: int) -> bool:
        return await self._run(lambda c: c.renew(role, req_id))

    async def cluster_info(self) -> dict:
        return await self._run(lambda c: c.cluster_info())

    async def health(self) -> bool:
        return await self.clients[self.current].health()

    async def lease_identity(self, holder: str, node_id: int | None = None,
                             process_id: int | None = None) -> tuple[int, int]:
        return await self._run(lambda c: c.lease_identity(holder, node_id, process_id))

    async def release_identity(self, holder: str, end_leases: bool = False) -> bool:
        return await self._run(lambda c: c.release_identity(holder, end_leases))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def __aenter__(self) -> "ReplicaClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
