"""The fleet's client of a coordinator in another process: the hot calls on the fleet's own HTTP pool.

`/select`, `/select_pair`, `/finish` and `/renew` run on every request, so they go over
`fleet.upstream.UpstreamPool` (asyncio protocols + httptools, TCP or Unix socket, msgpack bodies):
several times cheaper in CPU than an aiohttp ClientSession call. Everything else (`/cluster_info`,
identity leases) is delegated to `coordinator.client.HttpCoordinatorClient`. Answers and errors are
the same as that client's (`NoServerAvailable`, `CoordinatorRequestError`, `CoordinatorUnavailable`).
"""
from __future__ import annotations

from typing import Any

import msgpack

from coordinator.client import HttpCoordinatorClient, answer_or_raise
from coordinator.errors import CoordinatorUnavailable

from .upstream import UpstreamError, UpstreamPool, UpstreamTimeout

_MSGPACK = b"application/msgpack"
_ACCEPT = b"Accept: application/msgpack\r\n"


def _origin(url: str) -> str:
    url = url.rstrip("/")
    if url.startswith("unix:"):
        return "unix://" + "/" + url[len("unix:"):].lstrip("/")
    return url


class FleetCoordinatorClient:
    def __init__(self, url: str, *, timeout: float = 5.0):
        self.url = url
        self.timeout = timeout
        self._origin = _origin(url)
        self._slow = HttpCoordinatorClient(url, timeout=timeout)
        self._pool = UpstreamPool(connect_timeout=timeout, idle_timeout=30.0)

    async def _call(self, path: str, body: dict) -> Any:
        data = msgpack.packb(body, use_bin_type=True)
        try:
            r = await self._pool.request(self._origin, path, data, _ACCEPT, timeout=self.timeout,
                                         content_type=_MSGPACK)
            try:
                raw = await r.read()
            finally:
                r.release()
        except UpstreamTimeout:
            raise CoordinatorUnavailable(f"coordinator {self.url} did not answer {path} within "
                                         f"{self.timeout:g}s") from None
        except UpstreamError as e:
            raise CoordinatorUnavailable(f"coordinator {self.url} unreachable for {path}: {e.detail}") from None
        status = r.status
        try:
            obj = msgpack.unpackb(raw, raw=False) if "msgpack" in r.content_type else None
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            obj = None
        return answer_or_raise(self.url, path, status, obj, raw)

    async def select(self, role: str, req_id: int, routing_key: Any = None, exclude: Any = None) -> dict:
        body: dict = {"role": role, "req_id": req_id}
        if routing_key is not None:
            body["routing_key"] = routing_key
        if exclude:
            body["exclude"] = list(exclude)
        return await self._call("/select", body)

    async def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                          exclude_gen: Any = None) -> dict:
        body: dict = {"req_id": req_id}
        if routing_key is not None:
            body["routing_key"] = routing_key
        if exclude_ctx:
            body["exclude_ctx"] = list(exclude_ctx)
        if exclude_gen:
            body["exclude_gen"] = list(exclude_gen)
        return await self._call("/select_pair", body)

    async def finish(self, role: str, req_id: int, success: bool = True, usage: dict | None = None) -> None:
        body = {"role": role, "req_id": req_id, "success": bool(success)}
        if usage is not None:
            body["usage"] = usage
        await self._call("/finish", body)

    async def renew(self, role: str, req_id: int) -> bool:
        ans = await self._call("/renew", {"role": role, "req_id": req_id})
        return bool(ans.get("renewed")) if isinstance(ans, dict) else False

    async def cluster_info(self) -> dict:
        return await self._slow.cluster_info()

    async def health(self) -> bool:
        return await self._slow.health()

    async def lease_identity(self, holder: str, node_id: int | None = None,
                             process_id: int | None = None) -> tuple[int, int]:
        return await self._slow.lease_identity(holder, node_id, process_id)

    async def release_identity(self, holder: str) -> bool:
        return await self._slow.release_identity(holder)

    async def close(self) -> None:
        await self._pool.close()
        await self._slow.close()
