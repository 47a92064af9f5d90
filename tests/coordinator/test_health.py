"""Registry and health against live HTTP workers: preparation, ejection and readmission (probes
and reported failures), readiness minimums, dynamic registration with TTL, refusal."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from coordinator.client import HttpCoordinatorClient
from protocol.coord import NoServerAvailable

from .conftest import cfg, wait_for


def state(c, url):
    e = c.registry.get(url)
    return e.state.value if e else None


async def test_static_server_ejected_on_failed_probes_and_readmitted(workers, coordinator):
    ctx = [await workers("context"), await workers("context")]
    gen = await workers("generation")
    c, s = await coordinator(cfg([w.url for w in ctx], [gen.url], threshold=2))
    await wait_for(c.is_ready, what="ready")
    client = HttpCoordinatorClient(s.tcp_url)
    try:
        ctx[0].healthy = False
        await wait_for(lambda: state(c, ctx[0].url) == "unhealthy", what="ejection")
        e = c.registry.get(ctx[0].url)
        assert e.ejections == 1 and "consecutive failed health probes" in e.reason
        assert c.is_ready()  # one healthy context server still meets the minimum of 1
        for i in range(20):  # no traffic goes to the ejected server
            ans = await client.select("context", 1000 + i)
            assert ans["server"] == ctx[1].url
            await client.finish("context", 1000 + i)
        ci = await client.cluster_info()
        assert ci["server_lists"]["context"] == [ctx[1].url]
        ctx[0].healthy = True
        await wait_for(lambda: state(c, ctx[0].url) == "healthy", what="readmission")
        assert c.registry.get(ctx[0].url).readmissions == 1
        seen = set()
        for i in range(10):
            ans = await client.select("context", 2000 + i)
            seen.add(ans["server"])
        assert seen == {w.url for w in ctx}
    finally:
        await client.close()


async def test_readiness_follows_worker_deaths(workers, coordinator):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url], threshold=1))
    await wait_for(c.is_ready)
    async with aiohttp.ClientSession() as session:
        gen.healthy = False
        await wait_for(lambda: not c.is_ready(), what="not ready after the generation server died")
        async with session.get(s.tcp_url + "/health") as r:
            body = await r.json()
            assert r.status == 503 and body["error"] == "need 0/1 healthy generation servers"
        async with session.get(s.tcp_url + "/cluster_info") as r:
            ci = await r.json()
            assert ci["is_ready"] is False and ci["server_lists"]["generation"] == []
            assert ci["servers"]["generation"][0]["state"] == "unhealthy"
        client = HttpCoordinatorClient(s.tcp_url)
        with pytest.raises(NoServerAvailable, match="no healthy generation server"):
            await client.select("gen", 1)
        await client.close()
        gen.healthy = True
        await wait_for(c.is_ready, what="ready again")
        async with session.get(s.tcp_url + "/health") as r:
            assert r.status == 200


async def test_minimal_instances_from_disagg_cluster(workers, coordinator):
    ctx = [await workers("context") for _ in range(2)]
    gen = await workers("generation")
    c, s = await coordinator(cfg([w.url for w in ctx], [gen.url], minimal=(2, 1), threshold=1))
    await wait_for(c.is_ready)
    ctx[1].healthy = False
    await wait_for(lambda: not c.is_ready())
    assert c.not_ready_reason() == "need 1/2 healthy context servers"


async def test_reported_failures_eject_and_successes_reset(workers, coordinator):
    ctx = [await workers("context"), await workers("context")]
    gen = await workers("generation")
    # probes every 0.3s so the ejection window is observable
    c, s = await coordinator(cfg([w.url for w in ctx], [gen.url], threshold=3, interval=0.3))
    await wait_for(c.is_ready)
    client = HttpCoordinatorClient(s.tcp_url)
    target = ctx[0].url
    rid = 0

    async def fail_on(url, success):
        nonlocal rid
        rid += 1
        ans = await client.select("ctx", rid, exclude=[w.url for w in ctx if w.url != url])
        assert ans["server"] == url
        await client.finish("ctx", rid, success=success)

    await fail_on(target, False)
    await fail_on(target, False)
    await fail_on(target, True)          # a success resets the count
    await fail_on(target, False)
    await fail_on(target, False)
    assert state(c, target) == "healthy"
    await fail_on(target, False)         # third consecutive failure: ejected
    assert state(c, target) == "unhealthy"
    assert "consecutive failed requests reported by the fleet" in c.registry.get(target).reason
    # the server answers its probes, so it is readmitted after the ejection period
    await wait_for(lambda: state(c, target) == "healthy", timeout=5, what="readmission")
    # a repeated finish of an already finished lease does not count again
    e = c.registry.get(target)
    before = e.passive_failures
    await client.finish("ctx", rid, success=False)
    assert e.passive_failures == before
    await client.close()
    assert c.in_flight()["context"] == 0


async def test_registration_ttl_heartbeat_and_deregistration(workers, coordinator, caplog):
    static_gen = await workers("generation")
    dyn = await workers("context")
    c, s = await coordinator(cfg([], [static_gen.url], minimal=(1, 1)))
    assert not c.is_ready()
    async with aiohttp.ClientSession() as session:
        # JSON, as the worker's self-registration sends it
        async with session.post(s.tcp_url + "/register",
                                json={"url": dyn.url, "role": "context", "ttl_s": 0.6}) as r:
            reg = await r.json()
        # the cluster's disagg_cluster.heartbeat_interval_sec (0.1) when below ttl / 3 (0.2)
        assert r.status == 200 and reg["ttl_s"] == 0.6 and reg["heartbeat_interval_s"] == 0.1
        await wait_for(c.is_ready, what="registered server prepared")
        assert state(c, dyn.url) == "healthy" and c.registry.get(dyn.url).source == "registered"
        # heartbeats keep it
        for _ in range(6):
            async with session.post(s.tcp_url + "/heartbeat",
                                    json={"url": dyn.url, "role": "context", "ttl_s": 0.6}) as r:
                assert r.status == 200
            await asyncio.sleep(0.15)
        assert state(c, dyn.url) == "healthy"
        # silence: the registration expires, the server disappears, readiness drops
        with caplog.at_level(logging.WARNING, logger="splitserve.coordinator.registry"):
            await wait_for(lambda: state(c, dyn.url) is None, timeout=3, what="TTL expiry")
        assert "registration of " + dyn.url + " expired" in caplog.text
        assert not c.is_ready() and c.registry.registrations_expired == 1
        # a heartbeat without a role for an unknown server is 404; with its role it re-registers
        async with session.post(s.tcp_url + "/heartbeat", json={"url": dyn.url}) as r:
            assert r.status == 404 and "register it first" in (await r.json())["error"]
        async with session.post(s.tcp_url + "/heartbeat", json={"url": dyn.url, "role": "context", "ttl_s": 30}) as r:
            assert r.status == 200
        await wait_for(c.is_ready, what="re-registered")
        async with session.post(s.tcp_url + "/deregister", json={"url": dyn.url, "role": "context"}) as r:
            assert (await r.json()) == {"removed": True}
        assert state(c, dyn.url) is None and not c.is_ready()
        # static servers cannot be deregistered
        async with session.post(s.tcp_url + "/deregister", json={"url": static_gen.url}) as r:
            assert (await r.json()) == {"removed": False}
        assert state(c, static_gen.url) == "healthy"


async def test_registered_server_that_dies_is_ejected_then_expires(workers, coordinator):
    gen = await workers("generation")
    dyn = await workers("context")
    c, s = await coordinator(cfg([], [gen.url], threshold=1))
    c.register(dyn.url, "context", ttl_s=0.5)
    await wait_for(lambda: state(c, dyn.url) == "healthy")
    await dyn.stop()
    await wait_for(lambda: state(c, dyn.url) == "unhealthy", what="ejected (connection refused)")
    assert "GET /health failed" in c.registry.get(dyn.url).last_error
    await wait_for(lambda: state(c, dyn.url) is None, what="expired")


async def test_incompatible_servers_are_refused_and_shown(workers, coordinator, caplog):
    good = await workers("both")
    bad_bs = await workers("context", block_size=24)
    bad_scheme = await workers("context", key_scheme="sha256_v9")
    wrong_role = await workers("generation")
    multiple = await workers("context", block_size=64)       # a multiple of 16: accepted
    foreign = await workers("context", key_scheme=None)      # states no scheme: accepted
    with caplog.at_level(logging.ERROR, logger="splitserve.coordinator.registry"):
        c, s = await coordinator(cfg([good.url, bad_bs.url, bad_scheme.url, wrong_role.url, multiple.url,
                                      foreign.url], [good.url]))
        await wait_for(lambda: state(c, bad_bs.url) == "refused" and state(c, wrong_role.url) == "refused")
    assert f"refusing server {bad_bs.url}: block size 24 cannot map onto the routing block size 16" in caplog.text
    ci = c.cluster_info()
    by_url = {r["url"]: r for r in ci["servers"]["context"]}
    assert by_url[bad_bs.url]["state"] == "refused" and not by_url[bad_bs.url]["healthy"]
    assert "key scheme 'sha256_v9' differs" in by_url[bad_scheme.url]["reason"]
    assert "configured as context but /server_info says role=generation" in by_url[wrong_role.url]["reason"]
    assert by_url[multiple.url]["state"] == "healthy" and by_url[foreign.url]["state"] == "healthy"
    assert set(ci["server_lists"]["context"]) == {good.url, multiple.url, foreign.url}
    # fixing the worker admits it on the next tick
    bad_bs.info["block_size"] = 32
    await wait_for(lambda: state(c, bad_bs.url) == "healthy", what="admitted after the fix")
    # the refusal was logged once, not every tick
    assert caplog.text.count(f"refusing server {bad_bs.url}") == 1


async def test_server_without_server_info_is_admitted_when_healthy(workers, coordinator):
    w = await workers("context")
    w.info_status = 404          # a stock engine
    gen = await workers("generation")
    c, s = await coordinator(cfg([w.url], [gen.url]))
    await wait_for(lambda: state(c, w.url) == "healthy")
    assert c.registry.get(w.url).server_info == {}
    w2 = await workers("context")
    w2.info_status = 500
    c.register(w2.url, "context", 30)
    await wait_for(lambda: "answered 500" in (c.registry.get(w2.url).reason or ""))
    assert state(c, w2.url) == "pending"


async def test_readiness_minimums_without_disagg_cluster(workers, coordinator):
    from coordinator.service import Coordinator
    gen = await workers("generation")
    # an aggregated cluster lists generation servers only: ready with them alone
    c, s = await coordinator(cfg([], [gen.url]))
    await wait_for(c.is_ready, what="aggregated cluster ready")
    assert c.minimal == {"context": 0, "generation": 1}
    # ... unless context legs must not be skipped
    c2 = Coordinator(cfg([], [gen.url], extra={"no_context_fallback": "reject"}))
    assert c2.minimal == {"context": 1, "generation": 1}
    # nothing listed: every server registers, one of each is needed
    assert Coordinator(cfg([], [])).minimal == {"context": 1, "generation": 1}
    assert Coordinator(cfg([gen.url], [gen.url])).minimal == {"context": 1, "generation": 1}


async def test_a_check_that_raises_is_logged_with_the_server_not_swallowed(workers, caplog):
    """The gather(..., return_exceptions=True) of a tick used to drop such errors silently."""
    from coordinator.health import HealthMonitor
    from coordinator.registry import Registry

    w = await workers("both")
    reg = Registry(block_size=16, key_scheme="xxh3_chain_v1", failure_threshold=2,
                   min_ejection_s=0.05, default_ttl_s=30.0)
    reg.add_static(w.url, "context", 0.0)
    calls = []

    def broken_hook(entry, info):
        calls.append(entry.url)
        raise RuntimeError("subscribing failed")

    mon = HealthMonitor(reg, interval_s=0.05, timeout_s=1.0, on_prepared=broken_hook)
    with caplog.at_level(logging.ERROR, logger="splitserve.coordinator.health"):
        await mon.start()
        try:
            await wait_for(lambda: mon.check_errors >= 3, what="repeated failing checks")
        finally:
            await mon.stop()
    msgs = [r.getMessage() for r in caplog.records if "subscribing failed" in r.getMessage()]
    assert calls and msgs and w.url in msgs[0]
    assert len(msgs) == 1, "logged once per server per 30 s, counted every time"


async def test_a_tick_spreads_its_probes_over_the_interval():
    """Each server is checked once per interval, but a tick's checks start spread over half of it
    (coordinator/health.py `SPREAD`): before, all of them left in one burst (their answers arrived
    within a few ms of each other), and the coordinator took every answer in one event-loop stall."""
    from aiohttp import web

    from coordinator.health import HealthMonitor
    from coordinator.registry import Registry
    from splitserve_testing import free_port

    loop = asyncio.get_running_loop()
    hits: dict[str, list[float]] = {}
    runners, urls = [], []
    for _ in range(8):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        seen = hits.setdefault(url, [])

        async def health(request, seen=seen):
            seen.append(loop.time())
            return web.Response(text="ok")

        async def info(request, seen=seen):
            seen.append(loop.time())
            return web.json_response({})
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/server_info", info)
        r = web.AppRunner(app)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", port).start()
        runners.append(r)
        urls.append(url)
    reg = Registry(block_size=16, key_scheme="xxh3_chain_v1", failure_threshold=2,
                   min_ejection_s=0.05, default_ttl_s=30.0)
    for u in urls:
        reg.add_static(u, "both", 0.0)
    interval = 0.4
    mon = HealthMonitor(reg, interval_s=interval, timeout_s=1.0, on_prepared=lambda e, i: None)
    try:
        await mon.start()             # the first tick prepares everyone at once
        for u in urls:
            hits[u].clear()
        await asyncio.sleep(interval * 3.6)
    finally:
        await mon.stop()
        for r in runners:
            await r.cleanup()
    counts = [len(hits[u]) for u in urls]   # checks (/health or /server_info) after start-up
    assert min(counts) >= 2 and max(counts) - min(counts) <= 1, counts   # once per interval each
    # the probes of one tick: the k-th of every server; their starts span the spread, in steps
    for k in range(min(counts)):
        starts = sorted(hits[u][k] for u in urls)
        span = starts[-1] - starts[0]
        # spread over 0.2 s in steps of 25 ms (a burst spans under a millisecond)
        assert span > 0.1, (k, span)
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert min(gaps) > 0.002, (k, gaps)


async def test_workers_heartbeat_at_the_clusters_interval(workers, coordinator):
    """disagg_cluster.heartbeat_interval_sec is not accepted and ignored (issue 39): a worker
    registering with a long TTL heartbeats at the period the coordinator's answer names."""
    from worker.registration import CoordinatorRegistration
    dyn = await workers("context")
    c, s = await coordinator(cfg([], [], minimal=(1, 0)))
    reg = CoordinatorRegistration(s.tcp_url, url=dyn.url, role="context", ttl_s=30.0)
    await reg.start()
    try:
        await wait_for(lambda: reg.heartbeats >= 3, timeout=5, what="heartbeats every 0.1 s, not 10 s")
        assert reg.period == 0.1
    finally:
        await reg.stop()
