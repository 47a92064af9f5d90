"""Dynamic membership from etcd (`disagg_cluster.cluster_uri: etcd://…`), as TensorRT-LLM's
`DisaggClusterManager` does it (tensorrt_llm/serve/disagg_auto_scaling.py at commit
00184339b1f79ac2514a08751805b342c6b44fd8): workers put a key on a lease under
`/trtllm-disagg/<cluster_name>/workers/` (protocol/cluster_store.py), the coordinator lists the
prefix and watches it; a key that appears registers its server, one that disappears (deleted on
shutdown, or its lease ran out) removes it.

Unlike upstream, the watch starts at the revision right after the listing, so a worker that
registers in between is not missed (upstream notes that gap in `watch_workers`). When etcd goes
away the servers already known stay (the coordinator still probes their health); once it answers
again the prefix is listed afresh and the registry reconciled with it before watching again.
"""
from __future__ import annotations

import asyncio
import logging

from protocol.etcd_store import EtcdStore, EtcdUnavailable, RevisionCompacted, StoreEvent
from protocol.cluster_store import decode_worker, worker_prefix

log = logging.getLogger("splitserve.coordinator.etcd")

__all__ = ["EtcdMembership"]

RETRY_MAX_S = 5.0


class EtcdMembership:
    def __init__(self, coord, uri: str, cluster_name: str, *, start_timeout_s: float):
        self.coord = coord
        self.store = EtcdStore(uri)
        self.prefix = worker_prefix(cluster_name)
        self.start_timeout_s = start_timeout_s
        self._keys: dict[str, tuple[str, str]] = {}     # etcd key -> (server url, role)
        self._task: asyncio.Task | None = None
        self.revision = 0
        self.connected = False
        self.resyncs = 0

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """List the registered workers; raises EtcdUnavailable naming the endpoints when etcd
        does not answer within the start timeout (rather than serving with no membership)."""
        try:
            await self.store.connect(self.start_timeout_s)
            await self._resync()
        except EtcdUnavailable as e:
            await self.store.close()
            raise EtcdUnavailable(f"disagg_cluster.cluster_uri: {e}") from None
        log.info("etcd membership: %d worker key(s) under %s on %s (revision %d)",
                 len(self._keys), self.prefix, self.store.endpoint, self.revision)
        self._task = asyncio.create_task(self._run(), name="etcd-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.store.close()

    def describe(self) -> dict:
        return {"store": "etcd", "endpoint": self.store.endpoint, "prefix": self.prefix,
                "connected": self.connected, "revision": self.revision,
                "workers": len(self._keys), "resyncs": self.resyncs}

    # ---- the watch ------------------------------------------------------------------------------
    async def _run(self) -> None:
        pause = 0.2
        while True:
            if not self.connected:
                # Watching resumes only from a fresh listing: keys deleted while the watch was
                # down (leases that ran out) are then removed here too.
                try:
                    await self._resync()
                except EtcdUnavailable:
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, RETRY_MAX_S)
                    continue
                log.info("etcd membership: watching %s again on %s (revision %d, %d workers)",
                         self.prefix, self.store.endpoint, self.revision, len(self._keys))
            try:
                async for ev in self.store.watch_prefix(self.prefix, self.revision + 1):
                    self._apply(ev)
                    pause = 0.2
            except asyncio.CancelledError:
                raise
            except RevisionCompacted:
                log.warning("etcd revision %d was compacted; listing %s again", self.revision + 1,
                            self.prefix)
            except EtcdUnavailable as e:
                log.warning("etcd membership: %s; keeping the %d known server(s), retrying",
                            e, len(self._keys))
            except Exception:
                log.exception("etcd membership watch failed; listing %s again", self.prefix)
            self.connected = False
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)

    async def _resync(self) -> None:
        """List the prefix and make the registry match it (servers whose key vanished while the
        watch was down are removed; new ones registered)."""
        rev, kvs = await self.store.get_prefix(self.prefix)
        for key in [k for k in self._keys if k not in kvs]:
            self._drop(key)
        for key, value in kvs.items():
            self._put(key, value)
        self.revision = rev
        self.connected = True
        self.resyncs += 1

    def _apply(self, ev: StoreEvent) -> None:
        if ev.kind == "put":
            self._put(ev.key, ev.value)
        else:
            self._drop(ev.key)
        self.revision = max(self.revision, ev.revision)

    def _put(self, key: str, value: bytes) -> None:
        try:
            rec = decode_worker(value)
        except ValueError as e:
            log.warning("etcd key %s ignored: %s", key, e)
            self._drop(key)
            return
        old = self._keys.get(key)
        if old == (rec.url, rec.role):
            return
        if old is not None:
            self._drop(key)
        self._keys[key] = (rec.url, rec.role)
        self._sync_url(rec.url)

    def _drop(self, key: str) -> None:
        old = self._keys.pop(key, None)
        if old is not None:
            self._sync_url(old[0])

    def _sync_url(self, url: str) -> None:
        """Register `url` with the union of the roles its keys name, or remove it when none do."""
        roles = {role for u, role in self._keys.values() if u == url}
        if not roles:
            if self.coord.deregister(url):
                log.info("etcd: %s removed (its key is gone)", url)
            return
        role = roles.pop() if len(roles) == 1 else "both"
        # No worker id: the server's own /server_info tells it, and a restart behind the same url
        # writes a new key anyway.
        self.coord.register(url, role, source="etcd")
