"""`/cluster_info` and `/metrics` come from one snapshot (coordinator/snapshot.py): over real
sockets, with leases taken on real workers, both report the same readiness, in-flight leases per
role, per-server load and KV-index sizes; and the lease counts are the lease table's own."""
from __future__ import annotations

import aiohttp
import msgpack
from prometheus_client.parser import text_string_to_metric_families

from .conftest import cfg, wait_for

MP = {"Content-Type": "application/msgpack"}


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def _views(session, url):
    async with session.get(url + "/cluster_info") as r:
        ci = await r.json()
    async with session.get(url + "/metrics") as r:
        m = _samples(await r.text())
    return ci, m


def _agree(ci: dict, m: dict) -> None:
    p = "splitserve_coordinator_"
    assert m[(p + "ready", ())] == (1.0 if ci["is_ready"] else 0.0)
    for role, n in ci["leases"]["in_flight"].items():
        assert m[(p + "leases_in_flight", (("role", role),))] == n
    assert m[(p + "kv_index_size", ())] == ci["kv_index"]["size"]
    for role in ("context", "generation"):
        for row in ci["servers"][role]:
            lab = (("server", row["url"]),)
            assert m[(p + "server_load_requests", lab)] == row["load"]["requests"]
            assert m[(p + "server_load_tokens", lab)] == row["load"]["tokens"]
            assert m[(p + "kv_index_blocks", lab)] == row["kv_index_blocks"]
            assert m[(p + "kv_ready", lab)] == (1.0 if row["kv_ready"] else 0.0)


async def test_cluster_info_and_metrics_agree(workers, coordinator):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url], ctx_router="load_balancing",
                                 gen_router="load_balancing"))
    async with aiohttp.ClientSession() as session:
        url = s.tcp_url
        ci, m = await _views(session, url)
        _agree(ci, m)
        await wait_for(c.is_ready, what="cluster ready")
        for i in range(5):
            body = {"req_id": 100 + i, "routing_key": {"num_tokens": 32 + i}}
            async with session.post(url + "/select_pair", data=msgpack.packb(body), headers=MP) as r:
                assert r.status == 200
        async with session.post(url + "/finish", data=msgpack.packb({"role": "gen", "req_id": 100}),
                                headers=MP) as r:
            assert r.status == 200
        ci, m = await _views(session, url)
        assert ci["is_ready"] and ci["leases"]["in_flight"] == {"context": 5, "generation": 4}
        assert ci["leases"]["in_flight"] == {r: c.leases.count(r) for r in ("context", "generation")}
        row = ci["servers"]["context"][0]
        tok = sum(32 + i for i in range(5))     # all in prefill: no first token reported
        assert row["load"] == {"requests": 5, "tokens": tok, "queued_prefill_tokens": tok,
                               "prefilling": 5, "decoding": 0, "decoding_tokens": 0}
        _agree(ci, m)
        # the worker goes away: both views drop readiness together
        await ctx.stop()
        await wait_for(lambda: not c.is_ready(), what="context server ejected")
        ci, m = await _views(session, url)
        assert not ci["is_ready"]
        _agree(ci, m)


async def test_the_scaling_signal_per_role(workers, coordinator):
    """`role_queued_prefill_tokens` sums the servers' queued prefill of a role (what /cluster_info
    shows per server); `role_kv_occupancy` is index blocks over the capacity the servers report."""
    ctx_a, ctx_b = await workers("context"), await workers("context")
    gen = await workers("generation")
    for w in (ctx_a, ctx_b):
        w.info["kv_capacity_blocks"] = 100
    c, s = await coordinator(cfg([ctx_a.url, ctx_b.url], [gen.url], ctx_router="load_balancing",
                                 gen_router="load_balancing"))
    p = "splitserve_coordinator_"
    async with aiohttp.ClientSession() as session:
        url = s.tcp_url
        await wait_for(c.is_ready, what="cluster ready")
        for i in range(4):
            body = {"req_id": 200 + i, "routing_key": {"num_tokens": 40 + i}}
            async with session.post(url + "/select_pair", data=msgpack.packb(body), headers=MP) as r:
                assert r.status == 200
        ci, m = await _views(session, url)
        queued = sum(row["load"]["queued_prefill_tokens"] for row in ci["servers"]["context"])
        assert queued == sum(40 + i for i in range(4))
        assert m[(p + "role_queued_prefill_tokens", (("role", "context"),))] == queued
        # both context servers report a capacity and hold no index entries yet; the generation
        # server reports none, so its role has no occupancy sample
        assert m[(p + "role_kv_occupancy", (("role", "context"),))] == 0.0
        assert (p + "role_kv_occupancy", (("role", "generation"),)) not in m
        # a finished lease is no longer queued prefill
        async with session.post(url + "/finish", data=msgpack.packb(
                {"role": "ctx", "req_id": 200}), headers=MP) as r:
            assert r.status == 200
        ci, m = await _views(session, url)
        assert m[(p + "role_queued_prefill_tokens", (("role", "context"),))] == queued - 40
