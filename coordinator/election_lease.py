"""Lease elections of the serving coordinator replica, where the deployment already runs a lease
store (docs/failover.md "Lease backends"): a `coordination.k8s.io` Lease through the official
`kubernetes` client, or an etcd key on an etcd lease (`protocol.etcd_store`).

`LeaseElection` is the `coordinator.election.Election` of both: every `renew_s` the holder renews
its lease and the others campaign (take the lease when it is free or expired); the holder serves,
and the others refuse placements naming it (`serving_url`: the holder identity is the replica's
URL from `coordinator.replicas`, so the fleet's `ReplicaClient` follows it). A holder that cannot
renew stops serving at once (it may have lost the lease). Takeover after a holder's death takes
the lease's duration (Kubernetes: whole seconds; etcd: its TTL, at least etcd's minimum), not
the ordered list's one probe: the standby cannot tell a dead holder from a slow one sooner.

Backends (`LeaseBackend`): `campaign(me)` → the holder after trying to take the lease, `renew(me)`
→ still the holder, `resign(me)` → let go (a clean stop hands over at once).
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Protocol

log = logging.getLogger("splitserve.coordinator.election")


class LeaseBackend(Protocol):
    async def campaign(self, me: str) -> str | None: ...

    async def renew(self, me: str) -> bool: ...

    async def resign(self, me: str) -> None: ...

    async def close(self) -> None: ...


class LeaseElection:
    def __init__(self, backend: LeaseBackend, me: str, *, renew_s: float = 0.5, name: str = "lease"):
        self.backend = backend
        self.me = me
        self.renew_s = renew_s
        self.name = name
        self.serving = False
        self.serving_url: str | None = None
        self.takeovers = 0
        self.errors = 0
        self.changed_at = time.monotonic()
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        await self._round()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="lease-election")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.serving:
            self.serving = False
            try:
                await self.backend.resign(self.me)
            except Exception as e:   # the lease then expires on its own
                log.warning("resigning the %s lease failed: %s", self.name, e)
        await self.backend.close()

    def kick(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.renew_s)
            except TimeoutError:
                pass
            self._wake.clear()
            await self._round()

    async def _round(self) -> None:
        try:
            if self.serving:
                held = await self.backend.renew(self.me)
                holder = self.me if held else await self.backend.campaign(self.me)
            else:
                holder = await self.backend.campaign(self.me)
        except asyncio.CancelledError:
            raise
        except Exception as e:   # the store is unreachable: a holder must not go on serving
            self.errors += 1
            if self.serving:
                log.warning("%s lease store unreachable (%s): no longer serving", self.name, e)
                self.serving, self.changed_at = False, time.monotonic()
            return
        serving = holder == self.me
        if serving != self.serving:
            self.changed_at = time.monotonic()
            if serving:
                self.takeovers += 1
                log.warning("coordinator %s holds the %s lease: serving placements now", self.me, self.name)
            else:
                log.warning("coordinator %s lost the %s lease to %s", self.me, self.name, holder)
        self.serving = serving
        self.serving_url = None if serving else holder

    def describe(self) -> dict:
        return {"backend": self.name, "me": self.me, "serving": self.serving,
                "serving_url": self.serving_url, "takeovers": self.takeovers, "errors": self.errors,
                "since_s": round(time.monotonic() - self.changed_at, 3)}


class K8sLeaseBackend:
    """A `coordination.k8s.io/v1` Lease (`namespace`/`name`) through the official `kubernetes`
    client (`CoordinationV1Api`, its blocking calls run in a thread). As client-go's
    leaderelection (`tools/leaderelection/leaderelection.go`) does, expiry is judged by this
    process's own clock from when it last saw the record change, never by comparing the
    record's `renewTime` with the local clock (clock skew between nodes); an update carries the
    `resourceVersion` read, so two campaigners cannot both win (the API answers 409)."""

    def __init__(self, api_client, namespace: str, name: str, duration_s: int):
        from kubernetes import client as k8s
        self._k8s = k8s
        self.api = k8s.CoordinationV1Api(api_client)
        self.api_client = api_client
        self.namespace, self.name = namespace, name
        self.duration_s = max(1, int(-(-duration_s // 1)))     # the API's unit: whole seconds
        self._seen: tuple | None = None      # (holder, renewTime, transitions) last read
        self._seen_at = 0.0

    def _now(self):
        return dt.datetime.now(dt.timezone.utc)

    async def _call(self, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))

    async def _read(self):
        from kubernetes.client.rest import ApiException
        try:
            lease = await self._call(self.api.read_namespaced_lease, self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        spec = lease.spec
        seen = (spec.holder_identity, spec.renew_time, spec.lease_transitions)
        if seen != self._seen:
            self._seen, self._seen_at = seen, time.monotonic()
        return lease

    def _expired(self) -> bool:
        return time.monotonic() - self._seen_at > self.duration_s

    def _spec(self, me: str, transitions: int, acquired=None):
        now = self._now()
        return self._k8s.V1LeaseSpec(holder_identity=me, lease_duration_seconds=self.duration_s,
                                     acquire_time=acquired or now, renew_time=now,
                                     lease_transitions=transitions)

    async def campaign(self, me: str) -> str | None:
        from kubernetes.client.rest import ApiException
        lease = await self._read()
        if lease is None:
            body = self._k8s.V1Lease(metadata=self._k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
                                     spec=self._spec(me, 0))
            try:
                await self._call(self.api.create_namespaced_lease, self.namespace, body)
                return me
            except ApiException as e:
                if e.status != 409:
                    raise
                lease = await self._read()      # another replica created it first
                return lease.spec.holder_identity if lease is not None else None
        holder = lease.spec.holder_identity
        if holder == me:
            return me if await self.renew(me) else (await self._read()).spec.holder_identity
        if holder and not self._expired():
            return holder
        lease.spec = self._spec(me, (lease.spec.lease_transitions or 0) + 1)
        try:     # the metadata's resourceVersion makes this a compare-and-swap
            await self._call(self.api.replace_namespaced_lease, self.name, self.namespace, lease)
        except ApiException as e:
            if e.status != 409:
                raise
            lease = await self._read()
            return lease.spec.holder_identity if lease is not None else None
        return me

    async def renew(self, me: str) -> bool:
        from kubernetes.client.rest import ApiException
        lease = await self._read()
        if lease is None or lease.spec.holder_identity != me:
            return False
        lease.spec = self._spec(me, lease.spec.lease_transitions or 0, lease.spec.acquire_time)
        try:
            await self._call(self.api.replace_namespaced_lease, self.name, self.namespace, lease)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    async def resign(self, me: str) -> None:
        lease = await self._read()
        if lease is not None and lease.spec.holder_identity == me:
            lease.spec.holder_identity = None
            await self._call(self.api.replace_namespaced_lease, self.name, self.namespace, lease)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.api_client.close)


class EtcdLeaseBackend:
    """An etcd key held on an etcd lease (`protocol.etcd_store.EtcdStore`): the holder created the
    key with `put_if_absent` on its lease and keeps the lease alive; when it dies the lease
    expires after `ttl_s` and etcd deletes the key, and the next campaigner creates it. A clean
    resign revokes the lease: the key goes at once."""

    def __init__(self, store, key: str, ttl_s: float):
        self.store, self.key, self.ttl_s = store, key, ttl_s
        self.lease_id: int | None = None

    async def campaign(self, me: str) -> str | None:
        if self.lease_id is not None and await self.renew(me):
            return me
        lease = await self.store.grant(self.ttl_s)
        if await self.store.put_if_absent(self.key, me, lease):
            self.lease_id = lease
            return me
        await self.store.revoke(lease)
        v = await self.store.get(self.key)
        return v.decode() if v is not None else None

    async def renew(self, me: str) -> bool:
        if self.lease_id is None:
            return False
        if await self.store.keepalive(self.lease_id) <= 0:
            self.lease_id = None
            return False
        v = await self.store.get(self.key)
        return v is not None and v.decode() == me

    async def resign(self, me: str) -> None:
        if self.lease_id is not None:
            lease, self.lease_id = self.lease_id, None
            await self.store.revoke(lease)

    async def close(self) -> None:
        await self.store.close()


SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def lease_election(cfg, me: str) -> LeaseElection:
    """The lease election `cfg.coordinator.election` names, for the replica at URL `me`."""
    co = cfg.coordinator
    if co.election == "kubernetes":
        from kubernetes import client, config
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        ns = co.election_namespace
        if ns is None:
            try:
                with open(SA_NAMESPACE) as f:
                    ns = f.read().strip() or "default"
            except OSError:
                ns = "default"
        backend = K8sLeaseBackend(client.ApiClient(), ns, co.election_lease_name, co.election_lease_s)
        return LeaseElection(backend, me, renew_s=co.election_renew_s, name="kubernetes")
    dc = cfg.disagg_cluster
    if dc is None or not dc.cluster_uri.startswith("etcd://"):
        raise ValueError("coordinator.election: etcd needs disagg_cluster.cluster_uri etcd://...")
    from protocol.etcd_store import EtcdStore
    key = f"/splitserve/{dc.cluster_name or 'default'}/{co.election_lease_name}"
    return LeaseElection(EtcdLeaseBackend(EtcdStore(dc.cluster_uri), key, co.election_lease_s), me,
                         renew_s=co.election_renew_s, name="etcd")
