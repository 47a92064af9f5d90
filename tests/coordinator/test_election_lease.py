"""The lease elections of the serving coordinator replica (coordinator/election_lease.py,
docs/failover.md "Lease backends"):

- `coordination.k8s.io/v1` Lease through the official `kubernetes` client, against a real HTTP
  server speaking the subset of the API it uses (GET / POST / PUT of one Lease, `resourceVersion`
  compare-and-swap answered 409 on a stale write, as the API server does: Kubernetes API
  concepts, "Resource versions" / optimistic concurrency). No real API server runs here: what this
  does not cover is anything the subset leaves out (admission, RBAC, watch).
- an etcd key on an etcd lease, against a real etcd (Debian's etcd-server, as tests/coordinator/
  test_etcd.py).

Each: one replica serves and the other names it; the holder dying (no resign) hands the lease
over after its duration; a clean stop hands it over at once; at no time do both serve."""
from __future__ import annotations

import asyncio
import datetime as dt
import json
import time

import pytest
from aiohttp import web

from coordinator.election_lease import EtcdLeaseBackend, K8sLeaseBackend, LeaseElection
from splitserve_testing.etcd import ETCD_MISSING, EtcdServer

A, B = "http://coord-0:8001", "http://coord-1:8001"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


class FakeLeaseApi:
    """One namespace's Leases, stored as the JSON the API server returns."""

    def __init__(self):
        self.leases: dict[str, dict] = {}
        self.rv = 0
        self.conflicts = 0

    def _store(self, ns: str, body: dict) -> dict:
        self.rv += 1
        body = dict(body, apiVersion="coordination.k8s.io/v1", kind="Lease")
        body["metadata"] = dict(body.get("metadata") or {}, namespace=ns, resourceVersion=str(self.rv))
        self.leases[body["metadata"]["name"]] = body
        return body

    @staticmethod
    def _status(code: int, reason: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": reason, "code": code}, status=code)

    async def get(self, r: web.Request) -> web.Response:
        lease = self.leases.get(r.match_info["name"])
        return web.json_response(lease) if lease else self._status(404, "NotFound")

    async def create(self, r: web.Request) -> web.Response:
        body = await r.json()
        if body["metadata"]["name"] in self.leases:
            return self._status(409, "AlreadyExists")
        return web.json_response(self._store(r.match_info["ns"], body), status=201)

    async def replace(self, r: web.Request) -> web.Response:
        body = await r.json()
        cur = self.leases.get(r.match_info["name"])
        if cur is None:
            return self._status(404, "NotFound")
        if body["metadata"].get("resourceVersion") != cur["metadata"]["resourceVersion"]:
            self.conflicts += 1
            return self._status(409, "Conflict")
        return web.json_response(self._store(r.match_info["ns"], body))

    def app(self) -> web.Application:
        app = web.Application()
        base = LEASES.replace("{ns}", "{ns}")
        app.router.add_get(base + "/{name}", self.get)
        app.router.add_post(base, self.create)
        app.router.add_put(base + "/{name}", self.replace)
        return app


async def _k8s_pair(duration_s: int):
    from kubernetes import client
    api = FakeLeaseApi()
    runner = web.AppRunner(api.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]

    def backend():
        conf = client.Configuration(host=f"http://127.0.0.1:{port}")
        return K8sLeaseBackend(client.ApiClient(conf), "llm", "splitserve-coordinator", duration_s)
    return api, runner, backend


async def _both_never_serve(a: LeaseElection, b: LeaseElection, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert not (a.serving and b.serving), "two replicas serving at once"
        await asyncio.sleep(0.02)


async def _until(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def _handover(make_backend, duration_s: float) -> None:
    a = LeaseElection(make_backend(), A, renew_s=0.2, name="test")
    await a.start()
    b = LeaseElection(make_backend(), B, renew_s=0.2, name="test")
    await b.start()
    assert a.serving and not b.serving and b.serving_url == A
    await _both_never_serve(a, b, 1.0)
    # the holder dies: no resign, its renewals stop
    a._task.cancel()
    await asyncio.gather(a._task, return_exceptions=True)
    a.serving = False
    took = await _until(lambda: b.serving, duration_s + 3, "the standby to take the lease")
    assert took >= duration_s * 0.5, f"took the lease after {took:.2f}s: before it expired"
    assert b.serving_url is None
    # a new replica defers to the holder; a clean stop hands over at once
    c = LeaseElection(make_backend(), A, renew_s=0.2, name="test")
    await c.start()
    assert not c.serving and c.serving_url == B
    await b.stop()
    took = await _until(lambda: c.serving, 2.0, "the handover after a clean stop")
    assert took < 1.5
    await c.stop()
    await a.backend.close()


async def test_kubernetes_lease_election():
    api, runner, backend = await _k8s_pair(duration_s=1)
    try:
        await _handover(backend, 1.0)
        lease = api.leases["splitserve-coordinator"]
        assert lease["spec"]["leaseDurationSeconds"] == 1 and lease["spec"]["leaseTransitions"] >= 2
    finally:
        await runner.cleanup()


async def test_kubernetes_lease_compare_and_swap():
    """Two campaigners on one expired lease: the API's 409 lets exactly one win."""
    api, runner, backend = await _k8s_pair(duration_s=1)
    try:
        now = dt.datetime.now(dt.timezone.utc).isoformat()
        api._store("llm", {"metadata": {"name": "splitserve-coordinator"},
                           "spec": {"holderIdentity": "http://gone:1", "leaseDurationSeconds": 1,
                                    "renewTime": now, "leaseTransitions": 0}})
        x, y = backend(), backend()
        for b in (x, y):
            await b._read()
            b._seen_at -= 5       # both saw the record unchanged for longer than its duration
        got = await asyncio.gather(x.campaign(A), y.campaign(B))
        assert sorted(got) in ([A, A], [B, B]), got
        assert api.conflicts == 1
        assert json.loads(json.dumps(api.leases["splitserve-coordinator"]))["spec"]["holderIdentity"] == got[0]
        await x.close()
        await y.close()
    finally:
        await runner.cleanup()


@pytest.mark.skipif(ETCD_MISSING is not None, reason=ETCD_MISSING or "")
async def test_etcd_lease_election(tmp_path):
    from protocol.etcd_store import EtcdStore
    etcd = await asyncio.get_running_loop().run_in_executor(None, EtcdServer.start_in, tmp_path)
    try:
        await _handover(lambda: EtcdLeaseBackend(EtcdStore(etcd.uri), "/splitserve/t/leader", 2.0), 2.0)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, etcd.stop)


@pytest.mark.skipif(ETCD_MISSING is not None, reason=ETCD_MISSING or "")
async def test_coordinators_elect_through_etcd(tmp_path, coordinator):
    """`coordinator.election: etcd` end to end: two coordinators, one serving; the other refuses
    a placement naming it (the fleet follows that), and serves once the first stops."""
    from protocol.coord import NotServing
    etcd = await asyncio.get_running_loop().run_in_executor(None, EtcdServer.start_in, tmp_path)
    try:
        def cfg(i: int) -> dict:
            return {"disagg_cluster": {"cluster_uri": etcd.uri, "cluster_name": "el",
                                       "minimal_instances": {"context_servers": 0, "generation_servers": 0}},
                    "coordinator": {"replicas": [A, B], "replica_index": i, "election": "etcd",
                                    "election_lease_s": 2, "election_renew_s": 0.2}}
        c0, _ = await coordinator(cfg(0), serve=False)
        c1, _ = await coordinator(cfg(1), serve=False)
        assert c0.election.serving and not c1.election.serving
        with pytest.raises(NotServing) as e:
            c1.select("generation", 1 << 41)
        assert e.value.serving == A and c1.replica_info()["backend"] == "etcd"
        await c0.stop()
        await _until(lambda: c1.election.serving, 3.0, "the second coordinator to serve")
    finally:
        await asyncio.get_running_loop().run_in_executor(None, etcd.stop)
