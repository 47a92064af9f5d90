"""`disagg_cluster.cluster_uri: etcd://…` against a real etcd (Debian's etcd-server on loopback,
started here): our worker registers on a lease, a key written the way TensorRT-LLM's worker writes
it is picked up too, the coordinator follows puts, deletes and expired leases, keeps its servers
through an etcd outage and resumes watching after it; a cluster whose etcd never answers does not
start.

Upstream's layout and value: NVIDIA/TensorRT-LLM tensorrt_llm/serve/disagg_auto_scaling.py at commit
00184339b1f79ac2514a08751805b342c6b44fd8 (`get_worker_key`, `WorkerInfo`, `register_worker`: a
JSON `{"worker_id", "host", "port", "role"}` with `ServerRole.CONTEXT = 0 / GENERATION = 1` from
tensorrt_llm/llmapi/disagg_utils.py) on an `inactive_timeout_sec` lease (cluster_storage.py at
commit 057d4a79ef0b7075dc4ce394007aa9aa9127742d, `Etcd3ClusterStorage.set`).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve_testing.etcd import ETCD_MISSING, EtcdServer

from .conftest import wait_for

pytestmark = pytest.mark.skipif(ETCD_MISSING is not None, reason=ETCD_MISSING or "")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def etcd(tmp_path):
    s = EtcdServer.start_in(tmp_path / "etcd")
    yield s
    s.stop()


def etcd_cfg(uri: str, name: str = "c1", **extra) -> dict:
    return {"disagg_cluster": {"cluster_uri": uri, "cluster_name": name,
                               "minimal_instances": {"context_servers": 1, "generation_servers": 1}},
            "coordinator": {"health_check_interval_s": 0.1, "health_failure_threshold": 1,
                            "server_info_timeout_s": 1.0},
            "server_start_timeout": 10, **extra}


async def start_worker(uri: str, role: str, ttl: float, name: str = "c1"):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "splitserve_cli", "worker", "--engine", "sim", "--model", "tiny",
        "--role", role, "--port", "0", "--num-blocks", "256", "--cluster-uri", uri,
        "--cluster-name", name, "--register-ttl", str(ttl), "--drain-timeout", "1",
        "--log-level", "WARNING", cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = ""
    while not line.startswith("splitserve worker ready at "):
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line:
            raise AssertionError(f"worker exited: {(await proc.stderr.read()).decode()[-2000:]}")
    return proc, line.split()[4]


async def stop(proc, sig):
    if proc.returncode is None:
        proc.send_signal(sig)
        await asyncio.wait_for(proc.wait(), 30)


async def test_leased_keys_register_servers_and_their_end_removes_them(etcd, coordinator, workers):
    from protocol.etcd_store import EtcdStore

    # A generation server registered the way a trtllm-serve worker does, before the coordinator
    # starts (found by the listing, not the watch).
    gen = await workers("generation")
    host, port = gen.url.removeprefix("http://").rsplit(":", 1)
    store = EtcdStore(etcd.uri)
    await store.connect(10)
    lease = await store.grant(30)
    await store.put("/trtllm-disagg/c1/workers/GENERATION-upstream-1",
                    json.dumps({"worker_id": "GENERATION-upstream-1", "host": host,
                                "port": int(port), "role": 1}), lease_id=lease)
    # Another cluster's key under a longer name must not leak into this one.
    await store.put("/trtllm-disagg/c10/workers/x",
                    json.dumps({"worker_id": "x", "host": "127.0.0.1", "port": 9, "role": 0}))
    c, _ = await coordinator(etcd_cfg(etcd.uri), serve=False)
    assert list(c.registry.servers) == [gen.url]

    (graceful, g_url), (killed, k_url) = await asyncio.gather(
        start_worker(etcd.uri, "context", ttl=30), start_worker(etcd.uri, "context", ttl=2))
    try:
        await wait_for(lambda: all(c.registry.get(u) is not None and c.registry.get(u).healthy
                                   for u in (gen.url, g_url, k_url)),
                       timeout=30, what="three servers registered through etcd and healthy")
        assert c.registry.get(g_url).roles == ("context",)
        assert c.registry.get(gen.url).roles == ("generation",)
        assert {e.source for e in c.registry.servers.values()} == {"etcd"}
        assert c.is_ready()
        info = c.cluster_info()
        assert info["membership"]["connected"] and info["membership"]["workers"] == 3
        assert info["membership"]["prefix"] == "/trtllm-disagg/c1/workers/"

        # SIGTERM: the worker revokes its lease while draining; gone well before its 30 s TTL.
        t0 = time.monotonic()
        await stop(graceful, signal.SIGTERM)
        await wait_for(lambda: c.registry.get(g_url) is None, timeout=10,
                       what="the drained worker's key deleted")
        assert time.monotonic() - t0 < 10

        # SIGKILL: nothing is revoked; the 2 s lease runs out and etcd deletes the key.
        await stop(killed, signal.SIGKILL)
        await wait_for(lambda: c.registry.get(k_url) is None, timeout=15,
                       what="the killed worker's lease expired")

        # The upstream-style worker's lease revoked: removed too.
        await store.revoke(lease)
        await wait_for(lambda: c.registry.get(gen.url) is None, timeout=5,
                       what="the upstream key removed")
        assert not c.is_ready()
    finally:
        for p in (graceful, killed):
            if p.returncode is None:
                p.kill()
                await p.wait()
        await store.close()


async def test_an_etcd_outage_keeps_the_servers_and_the_watch_resumes(etcd, coordinator, workers):
    from protocol.etcd_store import EtcdStore

    async def put(store, w, role):
        host, port = w.url.removeprefix("http://").rsplit(":", 1)
        await store.put(f"/trtllm-disagg/c1/workers/{role}-{port}",
                        json.dumps({"worker_id": port, "host": host, "port": int(port),
                                    "role": role}))

    a, b = await workers("context"), await workers("generation")
    store = EtcdStore(etcd.uri)
    await store.connect(10)
    await put(store, a, 0)
    c, _ = await coordinator(etcd_cfg(etcd.uri), serve=False)
    assert a.url in c.registry.servers

    etcd.stop()
    await wait_for(lambda: not c.membership.connected, timeout=10, what="the outage noticed")
    await asyncio.sleep(0.5)
    assert a.url in c.registry.servers          # known servers stay while etcd is away

    etcd.start()
    await wait_for(lambda: c.membership.connected, timeout=20, what="watching again")
    assert c.membership.resyncs >= 2
    await store.connect(10)
    await put(store, b, 1)
    await wait_for(lambda: b.url in c.registry.servers, timeout=10,
                   what="a key put after the outage seen")
    await store.close()


def test_serve_exits_when_its_etcd_never_answers(tmp_path):
    from splitserve_testing import clean_env, free_port_pair
    port = free_port_pair()
    dead = free_port_pair()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"port: {port}\nserver_start_timeout: 1\n"
                   f"disagg_cluster: {{cluster_uri: 'etcd://127.0.0.1:{dead}'}}\n")
    r = subprocess.run([sys.executable, "-m", "splitserve_cli", "serve", "-c", str(cfg)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=clean_env())
    assert r.returncode != 0
    assert f"no etcd endpoint of 'etcd://127.0.0.1:{dead}' answered within 1s" in r.stderr
    assert "Traceback" not in r.stderr


async def test_a_worker_of_both_roles_writes_a_key_per_role(etcd, coordinator, workers):
    """Upstream's value names one role: a worker serving both writes two keys on its lease; the
    coordinator joins them into one server of both roles, removed when the lease is revoked."""
    from protocol.etcd_store import EtcdStore
    from worker.registration import EtcdRegistration

    w = await workers("both")
    host, port = w.url.removeprefix("http://").rsplit(":", 1)
    c, _ = await coordinator(etcd_cfg(etcd.uri), serve=False)
    reg = EtcdRegistration(etcd.uri, "c1", host=host, port=int(port), role="both",
                           worker_id="w-both", ttl_s=5)
    await reg.start()
    try:
        await wait_for(lambda: c.registry.get(w.url) is not None
                       and c.registry.get(w.url).roles == ("context", "generation"),
                       timeout=10, what="registered in both roles")
        store = EtcdStore(etcd.uri)
        await store.connect(5)
        _, kvs = await store.get_prefix("/trtllm-disagg/c1/workers/")
        assert sorted(kvs) == ["/trtllm-disagg/c1/workers/w-both/context",
                               "/trtllm-disagg/c1/workers/w-both/generation"]
        assert sorted(json.loads(v)["role"] for v in kvs.values()) == [0, 1]
        await store.close()
    finally:
        await reg.stop()
    await wait_for(lambda: c.registry.get(w.url) is None, timeout=5, what="removed on revoke")
