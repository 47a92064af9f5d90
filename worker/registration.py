"""Self-registration with a coordinator (``--coordinator-url``), TTL-based.

``POST /register {url, role, ttl_s, worker_id}`` at start, ``POST /heartbeat`` with the same body every
``ttl_s / 3`` or the answer's ``heartbeat_interval_s`` when shorter (the cluster's
``disagg_cluster.heartbeat_interval_sec``), ``POST /deregister {url, role}`` on shutdown. The coordinator may be down or
restart at any time: failures are logged (once per outage), retried on the next tick, and a
heartbeat the coordinator does not recognise (404/410) re-registers. The worker never fails
because of the coordinator.
"""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from protocol.tasks import cancel_and_wait

log = logging.getLogger("splitserve.worker.registration")

__all__ = ["CoordinatorRegistration", "Registrations"]


class Registrations:
    """The same registration with each of several coordinator replicas (docs/failover.md)."""

    def __init__(self, regs: list):
        self.regs = regs

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.regs))

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.regs), return_exceptions=True)


class CoordinatorRegistration:
    def __init__(self, coordinator_url: str, *, url: str, role: str, ttl_s: float = 30.0,
                 worker_id: str | None = None, request_timeout_s: float = 5.0):
        if ttl_s <= 0:
            raise ValueError(f"register ttl must be > 0 s, got {ttl_s}")
        self.coordinator_url = coordinator_url.rstrip("/")
        self.url = url
        self.role = role
        self.worker_id = worker_id
        self.ttl_s = float(ttl_s)
        self._timeout = aiohttp.ClientTimeout(total=min(request_timeout_s, self.ttl_s / 3))
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self.registered = False
        self.heartbeats = 0
        self._down = False
        self.period = self.ttl_s / 3

    def _body(self) -> dict:
        body = {"url": self.url, "role": self.role, "ttl_s": self.ttl_s}
        if self.worker_id is not None:
            body["worker_id"] = self.worker_id
        return body

    async def _post(self, path: str, body: dict) -> int:
        async with self._session.post(self.coordinator_url + path, json=body) as r:
            raw = await r.read()
            if path in ("/register", "/heartbeat") and 200 <= r.status < 300:
                try:
                    every = float(json.loads(raw).get("heartbeat_interval_s") or 0)
                except (ValueError, TypeError, AttributeError):
                    every = 0.0
                if 0 < every < self.ttl_s / 3:
                    self.period = every
            return r.status

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        self._task = asyncio.create_task(self._run(), name="coordinator-registration")

    async def _run(self) -> None:
        while True:
            try:
                if not self.registered:
                    st = await self._post("/register", self._body())
                    self.registered = 200 <= st < 300
                    if self.registered:
                        log.info("registered %s (%s) with coordinator %s", self.url, self.role,
                                 self.coordinator_url)
                    else:
                        log.warning("coordinator %s refused registration: HTTP %d",
                                    self.coordinator_url, st)
                else:
                    st = await self._post("/heartbeat", self._body())
                    if st in (404, 410):  # the coordinator forgot us (restart): register again
                        self.registered = False
                        continue
                    if 200 <= st < 300:
                        self.heartbeats += 1
                    else:
                        log.warning("heartbeat to %s: HTTP %d", self.coordinator_url, st)
                if self._down:
                    log.info("coordinator %s reachable again", self.coordinator_url)
                    self._down = False
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                if not self._down:
                    log.warning("coordinator %s unreachable (%s); retrying every %.1fs",
                                self.coordinator_url, e or type(e).__name__, self.period)
                    self._down = True
                self.registered = False
            await asyncio.sleep(self.period)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self._session is not None:
            if self.registered:
                try:
                    await self._post("/deregister", {"url": self.url, "role": self.role})
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    log.info("deregistration from %s failed: %s", self.coordinator_url, e)
            self.registered = False
            await self._session.close()


class EtcdRegistration:
    """Registration in etcd (`--cluster-uri etcd://…`), as TensorRT-LLM's `DisaggClusterWorker`
    does it (protocol/cluster_store.py): one key per served role on a lease of `ttl_s`, refreshed
    every `ttl_s / 3`. A lease that ran out (etcd unreachable for longer than the TTL) is replaced
    and the keys written again; on stop the lease is revoked, which deletes the keys at once. As
    with the coordinator, the worker never fails because of etcd."""

    def __init__(self, cluster_uri: str, cluster_name: str, *, host: str, port: int, role: str,
                 worker_id: str, ttl_s: float = 10.0):
        from protocol.cluster_store import WorkerRecord, encode_worker, worker_key
        from protocol.etcd_store import EtcdStore
        if ttl_s <= 0:
            raise ValueError(f"register ttl must be > 0 s, got {ttl_s}")
        roles = ("context", "generation") if role == "both" else (role,)
        self.keys = {
            worker_key(cluster_name, worker_id if len(roles) == 1 else f"{worker_id}/{r}"):
            encode_worker(WorkerRecord(worker_id=worker_id, host=host, port=port, role=r))
            for r in roles}
        self.ttl_s = float(ttl_s)
        self.store = EtcdStore(cluster_uri, timeout_s=min(5.0, self.ttl_s / 3))
        self.lease_id: int | None = None
        self.registered = False
        self.heartbeats = 0
        self._down = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="etcd-registration")

    async def _register(self) -> None:
        self.lease_id = await self.store.grant(self.ttl_s)
        for k, v in self.keys.items():
            await self.store.put(k, v, lease_id=self.lease_id)
        self.registered = True
        log.info("registered in etcd %s as %s (lease %x, ttl %.0fs)", self.store.endpoint,
                 ", ".join(self.keys), self.lease_id, self.ttl_s)

    async def _run(self) -> None:
        from protocol.etcd_store import EtcdUnavailable
        period = self.ttl_s / 3
        while True:
            try:
                if not self.registered:
                    await self._register()
                elif await self.store.keepalive(self.lease_id) <= 0:
                    log.warning("etcd lease %x expired; registering again", self.lease_id)
                    self.registered = False
                    continue
                else:
                    self.heartbeats += 1
                if self._down:
                    log.info("etcd %s reachable again", self.store.endpoint)
                    self._down = False
            except asyncio.CancelledError:
                raise
            except EtcdUnavailable as e:
                if not self._down:
                    log.warning("%s; retrying every %.1fs", e, period)
                    self._down = True
            await asyncio.sleep(period)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self.registered and self.lease_id is not None:
            try:
                await self.store.revoke(self.lease_id)
                log.info("deregistered from etcd (lease %x revoked)", self.lease_id)
            except Exception as e:  # the lease runs out by itself anyway
                log.info("etcd deregistration failed (%s); the lease expires in %.0fs", e,
                         self.ttl_s)
        self.registered = False
        await self.store.close()
