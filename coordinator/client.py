"""Clients of the coordinator API: over HTTP (TCP or Unix socket) or in the same process.

Both implement `CoordinatorClient` with the same async methods, answers and errors:
- `NoServerAvailable` — the coordinator answered 503 for a placement (no server fits);
- `CoordinatorRequestError` — it rejected the call (400/404/415), with `.field` when known;
- `CoordinatorUnavailable` — it could not be reached, timed out, or failed (other 5xx).
Block keys may be passed as a numpy array, bytes (little-endian u64) or a list; the HTTP client
sends arrays as one binary blob (8 bytes per key), which the coordinator reads without a copy.

`HttpCoordinatorClient` sends the per-request calls (`select`, `select_pair`, `finish`, `renew`)
over the coordinator's persistent channel (`coordinator.channel_client`) when the coordinator
offers it — batched per event-loop turn, finishes queued without a round trip — and over HTTP
otherwise (`channel=False`, an older coordinator, or while the channel cannot be reached).
"""
from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

import aiohttp
import msgpack
import orjson

from protocol.failures import Cause
from protocol.coord import (BadRequest, CoordinatorOverloaded, CoordinatorRequestError,
                                CoordinatorUnavailable, NoServerAvailable)
from coordinator.channel_client import ChannelClient, Fallback
from protocol.channel import wire_key as _wire_key
from coordinator.identity import IdentityExhausted

__all__ = [
    "CoordinatorClient",
    "HttpCoordinatorClient",
    "InProcessCoordinatorClient",
    "answer_or_raise",
    "make_client",
]

MSGPACK = "application/msgpack"
_HEADERS = {"Content-Type": MSGPACK, "Accept": MSGPACK}


@runtime_checkable
class CoordinatorClient(Protocol):
    async def select(self, role: str, req_id: int, routing_key: Any = None,
                     exclude: Any = None) -> dict: ...

    async def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                          exclude_gen: Any = None) -> dict: ...

    async def finish(self, role: str, req_id: int, success: bool = True,
                     usage: dict | None = None) -> None: ...

    # Optional: `finish_nowait(role, req_id, success, usage) -> bool` queues the finish without awaiting
    # (True) or declines (False: call `finish`).

    async def renew(self, role: str, req_id: int) -> bool: ...

    async def cluster_info(self) -> dict: ...

    async def lease_identity(self, holder: str, node_id: int | None = None,
                             process_id: int | None = None) -> tuple[int, int]: ...

    async def release_identity(self, holder: str) -> bool: ...

    async def close(self) -> None: ...


def answer_or_raise(url: str, path: str, status: int, obj: Any, raw: bytes) -> Any:
    """The decoded body `obj` of a 200 answer to `path`; for any other status, its typed error.

    `obj` is None when the body was not one the coordinator writes (an error page from a proxy);
    the error message then quotes the start of `raw`. 503 means "no server fits" only for the
    placement calls; elsewhere it is the coordinator failing.
    """
    if status == 200:
        return obj
    msg = obj.get("error") if isinstance(obj, dict) else None
    msg = msg if isinstance(msg, str) else raw[:200].decode("utf-8", "replace")
    if status == 503 and path in ("/select", "/select_pair"):
        raise NoServerAvailable(msg)
    if status == 429:
        ra = obj.get("retry_after") if isinstance(obj, dict) else None
        raise CoordinatorOverloaded(msg, float(ra) if isinstance(ra, (int, float)) else 1.0)
    if 400 <= status < 500:
        raise CoordinatorRequestError(status, msg, obj.get("field") if isinstance(obj, dict) else None)
    raise CoordinatorUnavailable(f"coordinator {url} answered {status} for {path}: {msg}", Cause.UPSTREAM_5XX)


def _excl(v: Any) -> Any:
    if v is None or isinstance(v, (str, list)):
        return v
    return list(v)


class HttpCoordinatorClient:
    """msgpack over HTTP/1.1 keep-alive, unlimited connection pool (a capped pool queues calls
    behind each other: upstream measured hundreds of ms of /select latency from a pool of 100).

    `url` is `http://host:port` or `unix:///path/to/socket`."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, timeout: float | None = None,
                 channel: bool = True, max_pending: int = 4096):
        url = url.rstrip("/")
        if url.startswith("unix:"):
            # unix:///path (ours) and unix:/path (upstream's) name the same socket.
            path = "/" + url[len("unix:"):].lstrip("/")
            if path == "/":
                raise ValueError(f"unix socket URL has no path: {url!r}")
            self._uds: str | None = path
            self.base = "http://localhost"
        elif url.startswith(("http://", "https://")):
            self._uds = None
            self.base = url
        else:
            raise ValueError(f"coordinator URL must be http(s)://host:port or unix:///path, got {url!r}")
        timeout_s = timeout if timeout is not None else timeout_s
        self.url = url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._chan = (ChannelClient(url, timeout_s=timeout_s, max_pending=max_pending,
                                    fallback_finish=self._finish_retrying)
                      if channel and not url.startswith("https://") else None)

    @property
    def channel(self) -> ChannelClient | None:
        return self._chan

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

    async def close(self) -> None:
        if self._chan is not None:
            await self._chan.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "HttpCoordinatorClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = msgpack.packb(body, use_bin_type=True) if body is not None else None
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

    async def select(self, role: str, req_id: int, routing_key: Any = None, exclude: Any = None) -> dict:
        ch = self._chan
        if ch is not None and ch.usable():
            try:
                return await ch.select(role, req_id, routing_key, exclude)
            except Fallback:
                pass
        body = {"role": role, "req_id": req_id}
        if routing_key is not None:
            body["routing_key"] = _wire_key(routing_key)
        if exclude:
            body["exclude"] = _excl(exclude)
        return await self._call("POST", "/select", body)

    async def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                          exclude_gen: Any = None) -> dict:
        ch = self._chan
        if ch is not None and ch.usable():
            try:
                return await ch.select_pair(req_id, routing_key, exclude_ctx, exclude_gen)
            except Fallback:
                pass
        body: dict = {"req_id": req_id}
        if routing_key is not None:
            body["routing_key"] = _wire_key(routing_key)
        if exclude_ctx:
            body["exclude_ctx"] = _excl(exclude_ctx)
        if exclude_gen:
            body["exclude_gen"] = _excl(exclude_gen)
        return await self._call("POST", "/select_pair", body)

    def finish_nowait(self, role: str, req_id: int, success: bool = True,
                      usage: dict | None = None) -> bool:
        """Queue the finish on the channel (True), or decline (False: await `finish`)."""
        ch = self._chan
        return ch is not None and ch.finish(role, req_id, success, usage)

    async def finish(self, role: str, req_id: int, success: bool = True, usage: dict | None = None) -> None:
        """Returns once the coordinator applied it (on the channel: its batch was acknowledged)."""
        ch = self._chan
        if ch is not None and await ch.finish_acked(role, req_id, success, usage):
            return
        body = {"role": role, "req_id": req_id, "success": bool(success)}
        if usage is not None:
            body["usage"] = usage
        await self._call("POST", "/finish", body)

    async def _finish_retrying(self, role: str, req_id: int, success: bool,
                               usage: dict | None = None) -> None:
        """A channel's unacknowledged finish, over HTTP (idempotent, so retried)."""
        body = {"role": role, "req_id": req_id, "success": bool(success)}
        if usage is not None:
            body["usage"] = usage
        delay = 0.05
        for attempt in range(4):
            try:
                await self._call("POST", "/finish", body)
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
        ans = await self._call("POST", "/renew", {"role": role, "req_id": req_id})
        return bool(ans.get("renewed")) if isinstance(ans, dict) else False

    async def cluster_info(self) -> dict:
        return await self._call("GET", "/cluster_info")

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
        except CoordinatorUnavailable:
            return False
        return True

    async def lease_identity(self, holder: str, node_id: int | None = None,
                             process_id: int | None = None) -> tuple[int, int]:
        body: dict = {"holder": holder}
        if node_id is not None and process_id is not None:
            body["node_id"], body["process_id"] = node_id, process_id
        ans = await self._call("POST", "/identity", body)
        return int(ans["node_id"]), int(ans["process_id"])

    async def release_identity(self, holder: str) -> bool:
        ans = await self._call("POST", "/identity/release", {"holder": holder})
        return bool(ans.get("released")) if isinstance(ans, dict) else False


class InProcessCoordinatorClient:
    """The same API on a `Coordinator` in this process: no serialization, no hop. Answers share
    structure with the coordinator's state (e.g. `info.server_info`): treat them as read-only."""

    def __init__(self, coordinator):
        self.coord = coordinator

    async def select(self, role: str, req_id: int, routing_key: Any = None, exclude: Any = None) -> dict:
        try:
            return self.coord.select(role, req_id, routing_key, exclude)
        except BadRequest as exc:
            raise CoordinatorRequestError(400, exc.message, exc.field) from None

    async def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                          exclude_gen: Any = None) -> dict:
        try:
            return self.coord.select_pair(req_id, routing_key, exclude_ctx, exclude_gen)
        except BadRequest as exc:
            raise CoordinatorRequestError(400, exc.message, exc.field) from None

    async def finish(self, role: str, req_id: int, success: bool = True, usage: dict | None = None) -> None:
        try:
            self.coord.finish(role, req_id, success, usage)
        except BadRequest as exc:
            raise CoordinatorRequestError(400, exc.message, exc.field) from None

    async def renew(self, role: str, req_id: int) -> bool:
        try:
            return self.coord.renew(role, req_id)
        except BadRequest as exc:
            raise CoordinatorRequestError(400, exc.message, exc.field) from None

    async def cluster_info(self) -> dict:
        return self.coord.cluster_info()

    async def health(self) -> bool:
        return self.coord.is_ready()

    async def lease_identity(self, holder: str, node_id: int | None = None,
                             process_id: int | None = None) -> tuple[int, int]:
        try:
            ans = self.coord.lease_identity(holder, node_id, process_id)
        except BadRequest as exc:
            raise CoordinatorRequestError(400, exc.message, exc.field) from None
        except IdentityExhausted as exc:
            raise CoordinatorUnavailable(str(exc)) from None
        return ans["node_id"], ans["process_id"]

    async def release_identity(self, holder: str) -> bool:
        return self.coord.release_identity(holder)

    async def close(self) -> None:
        return None


def make_client(target: Any, *, timeout_s: float = 5.0) -> CoordinatorClient:
    """A client for a URL (`http://…`, `unix:///…`) or an in-process `Coordinator`."""
    if isinstance(target, str):
        return HttpCoordinatorClient(target, timeout_s=timeout_s)
    return InProcessCoordinatorClient(target)
