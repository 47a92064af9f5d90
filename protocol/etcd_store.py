"""The etcd v3 client of every side: what membership needs (workers register on a lease,
`worker/registration.py`; the coordinator lists and watches, `coordinator/etcd_membership.py`) and
what a leader election needs (`put_if_absent` on a lease). On `aetcd` 1.0.0 (asyncio, gRPC),
measured here against Debian's etcd-server 3.4.23 with protobuf 7.36 and grpcio 1.85 on Python 3.11.

One `EtcdStore` per process; endpoints from `etcd://h1:2379,etcd://h2:2379` (upstream's form,
`protocol.cluster_store.etcd_endpoints`). A call that fails for want of a server (connection refused,
timeout, unavailable) raises `EtcdUnavailable` and moves the store to the next endpoint for the next
call; other etcd errors (a compacted revision, a bad argument) pass through as `aetcd` raises them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import aetcd
import aetcd.exceptions as etcd_errors
from aetcd import transactions as txn

from protocol.cluster_store import etcd_endpoints

log = logging.getLogger("splitserve.etcd")

__all__ = ["EtcdStore", "EtcdUnavailable", "StoreEvent", "RevisionCompacted"]

RevisionCompacted = etcd_errors.RevisionCompactedError
_UNAVAILABLE = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
                etcd_errors.InternalError, asyncio.TimeoutError, OSError)


class EtcdUnavailable(ConnectionError):
    """No etcd endpoint answered (an OSError: callers that report a failed listen or connect at
    start report this the same way)."""


@dataclass(frozen=True, slots=True)
class StoreEvent:
    kind: str          # "put" | "delete"
    key: str
    value: bytes       # b"" for a delete
    revision: int      # the key's mod revision (the revision of this change)


class EtcdStore:
    def __init__(self, uri: str, *, timeout_s: float = 5.0):
        self.uri = uri
        self.endpoints = etcd_endpoints(uri)
        self.timeout_s = timeout_s
        self._i = 0
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> str:
        h, p = self.endpoints[self._i]
        return f"{h}:{p}"

    def _c(self) -> aetcd.Client:
        if self._client is None:
            h, p = self.endpoints[self._i]
            # gRPC's own timeout is an int of seconds in aetcd; calls are bounded by wait_for too.
            self._client = aetcd.Client(host=h, port=p, timeout=max(1, round(self.timeout_s)))
        return self._client

    async def _rotate(self) -> None:
        c, self._client = self._client, None
        self._i = (self._i + 1) % len(self.endpoints)
        if c is not None:
            try:
                await c.close()
            except Exception:  # a broken channel may fail to close; it is dropped either way
                pass

    async def _call(self, what: str, make):
        try:
            return await asyncio.wait_for(make(self._c()), self.timeout_s)
        except _UNAVAILABLE as e:
            at = self.endpoint
            await self._rotate()
            raise EtcdUnavailable(f"etcd {at}: {what} failed: {e or type(e).__name__}") from None

    async def connect(self, deadline_s: float) -> None:
        """Wait until an endpoint answers, trying them in turn; EtcdUnavailable after
        `deadline_s` seconds naming every endpoint tried and the last error."""
        end = time.monotonic() + deadline_s
        pause = 0.1
        while True:
            try:
                await self._call("status", lambda c: c.status())
                return
            except EtcdUnavailable as e:
                if time.monotonic() + pause > end:
                    tried = ", ".join(f"{h}:{p}" for h, p in self.endpoints)
                    raise EtcdUnavailable(f"no etcd endpoint of {self.uri!r} answered within "
                                          f"{deadline_s:g}s (tried {tried}; last: {e})") from None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)

    async def close(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            await c.close()

    # ---- keys -----------------------------------------------------------------------------------
    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        """(the store's revision at the read, {key: value}) for every key under `prefix`."""
        r = await self._call("get_prefix", lambda c: c.get_prefix(prefix.encode()))
        return r.header.revision, {kv.key.decode(): kv.value for kv in r}

    async def put(self, key: str, value: str | bytes, lease_id: int | None = None) -> None:
        v = value.encode() if isinstance(value, str) else value
        await self._call("put", lambda c: c.put(key.encode(), v, lease=lease_id))

    async def put_if_absent(self, key: str, value: str | bytes,
                            lease_id: int | None = None) -> bool:
        """Create `key` only if it does not exist (the building block of an election)."""
        k = key.encode()
        v = value.encode() if isinstance(value, str) else value
        ok, _ = await self._call("put_if_absent", lambda c: c.transaction(
            compare=[txn.Version(k) == 0], success=[txn.Put(k, v, lease=lease_id)], failure=[]))
        return bool(ok)

    async def get(self, key: str) -> bytes | None:
        r = await self._call("get", lambda c: c.get(key.encode()))
        return None if r is None else r.value

    async def delete(self, key: str) -> bool:
        r = await self._call("delete", lambda c: c.delete(key.encode()))
        return bool(r and r.deleted)

    # ---- leases ---------------------------------------------------------------------------------
    async def grant(self, ttl_s: float) -> int:
        """A new lease of `ttl_s` (rounded up to whole seconds, etcd's unit); its id."""
        lease = await self._call("lease grant", lambda c: c.lease(max(1, int(-(-ttl_s // 1)))))
        return lease.id

    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; its remaining TTL in seconds (0: it has expired, its keys are gone)."""
        r = await self._call("lease keepalive", lambda c: c.refresh_lease(lease_id))
        return int(r.TTL) if r is not None else 0

    async def revoke(self, lease_id: int) -> None:
        await self._call("lease revoke", lambda c: c.revoke_lease(lease_id))

    # ---- watch ----------------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[StoreEvent]:
        """Every change under `prefix` from `start_revision` on, in order. Ends by raising
        EtcdUnavailable when the server goes away, RevisionCompacted when the revision is gone."""
        try:
            w = await asyncio.wait_for(self._c().watch_prefix(
                prefix.encode(), start_revision=start_revision), self.timeout_s)
        except _UNAVAILABLE as e:
            at = self.endpoint
            await self._rotate()
            raise EtcdUnavailable(f"etcd {at}: watch failed: {e or type(e).__name__}") from None
        try:
            async for ev in w:
                yield StoreEvent("put" if ev.kind == "PUT" else "delete", ev.kv.key.decode(),
                                 ev.kv.value or b"", ev.kv.mod_revision)
        except _UNAVAILABLE + (etcd_errors.ClientError,) as e:
            if isinstance(e, RevisionCompacted):
                raise
            at = self.endpoint
            await self._rotate()
            raise EtcdUnavailable(f"etcd {at}: watch ended: {e or type(e).__name__}") from None
        finally:
            try:
                await w.cancel()
            except Exception:  # the channel may already be gone
                pass
        # The server closed the stream without an error: treat it as losing the server.
        raise EtcdUnavailable(f"etcd {self.endpoint}: watch stream closed")
