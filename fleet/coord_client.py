"""The fleet's client of a coordinator in another process.

`/select`, `/select_pair`, `/finish` and `/renew` run on every request. By default they go over
the coordinator's persistent channel (`coordinator.channel_client`: one connection per fleet
process, calls of one event-loop turn batched into one frame, finishes coalesced and
acknowledged per batch). When the coordinator does not offer it, or it cannot be reached, they go
over `PoolTransport`: `fleet.upstream.UpstreamPool` (asyncio protocols + httptools, TCP or Unix
socket, msgpack bodies), several times cheaper in CPU than an aiohttp ClientSession call.
Everything else (`/cluster_info`, identity leases) uses `coordinator.client.HttpTransport`'s
aiohttp session. Bodies, answers and errors are the one codec's (coordinator/client_codec.py:
`NoServerAvailable`, `CoordinatorOverloaded`, `CoordinatorRequestError`, `CoordinatorUnavailable`).
"""
from __future__ import annotations

from typing import Any

import msgpack

from coordinator import client_codec as codec
from coordinator.client import HttpCoordinatorClient, HttpTransport
from protocol.failures import Cause
from protocol.coord import CoordinatorUnavailable

from .upstream import UpstreamError, UpstreamPool, UpstreamTimeout

_MSGPACK = b"application/msgpack"
_ACCEPT = b"Accept: application/msgpack\r\n"


def _origin(url: str) -> str:
    url = url.rstrip("/")
    if url.startswith("unix:"):
        return "unix://" + "/" + url[len("unix:"):].lstrip("/")
    return url


class PoolTransport:
    """The per-request calls over the fleet's upstream pool; the others over aiohttp."""
    inline = False

    def __init__(self, url: str, timeout_s: float):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._origin = _origin(url)
        self._pool = UpstreamPool(connect_timeout=timeout_s, idle_timeout=30.0)
        self._rest = HttpTransport(url, timeout_s)

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        if method != "POST" or path not in codec.HOT:
            return await self._rest.call(method, path, body)
        data = codec.encode(body)
        try:
            r = await self._pool.request(self._origin, path, data, _ACCEPT, timeout=self.timeout_s,
                                         content_type=_MSGPACK)
            try:
                raw = await r.read()
            finally:
                r.release()
        except UpstreamTimeout:
            raise CoordinatorUnavailable(f"coordinator {self.url} did not answer {path} within "
                                         f"{self.timeout_s:g}s", Cause.TIMEOUT) from None
        except UpstreamError as e:
            raise CoordinatorUnavailable(f"coordinator {self.url} unreachable for {path}: {e.detail}",
                                         e.cause) from None
        status = r.status
        try:
            obj = msgpack.unpackb(raw, raw=False) if "msgpack" in r.content_type else None
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            obj = None
        return codec.answer_or_raise(self.url, path, status, obj, raw)

    async def close(self) -> None:
        await self._rest.close()
        await self._pool.close()


class FleetCoordinatorClient(HttpCoordinatorClient):
    def __init__(self, url: str, *, timeout: float = 5.0, channel: bool = True,
                 max_pending: int = 4096):
        super().__init__(url, timeout=timeout, channel=channel, max_pending=max_pending,
                         transport=PoolTransport(url, timeout))
        self.timeout_s = timeout
