"""The HTTP API over real sockets: bodies in msgpack and JSON, 400/404/405/415/503 answers,
placement receipts, /select_pair decisions, readiness, /cluster_info and /metrics."""
from __future__ import annotations

import aiohttp
import msgpack
import numpy as np
import orjson
import pytest

from router.block_keys import block_keys

from .conftest import cfg, wait_for

MP = {"Content-Type": "application/msgpack"}


async def post(session, url, body, *, mp=True, raw: bytes | None = None, headers=None):
    data = raw if raw is not None else (msgpack.packb(body) if mp else orjson.dumps(body))
    h = headers if headers is not None else (MP if mp else {"Content-Type": "application/json"})
    async with session.post(url, data=data, headers=h) as r:
        content = await r.read()
        ctype = r.headers.get("Content-Type", "")
        obj = msgpack.unpackb(content) if "msgpack" in ctype else (orjson.loads(content) if content else None)
        return r.status, obj, ctype


@pytest.fixture(params=["fast", "aiohttp"])
async def cluster(request, workers, coordinator):
    """Two context and two generation servers, served by both HTTP implementations."""
    ctx = [await workers("context") for _ in range(2)]
    gen = [await workers("generation") for _ in range(2)]
    c, s = await coordinator(cfg([w.url for w in ctx], [w.url for w in gen]), http=request.param)
    await wait_for(c.is_ready, what="cluster ready")
    async with aiohttp.ClientSession() as session:
        yield c, s, ctx, gen, session


async def test_select_and_finish_msgpack_and_json(cluster):
    c, s, ctx, gen, session = cluster
    keys = block_keys(list(range(64)), 16)
    st, ans, ctype = await post(session, s.tcp_url + "/select",
                                {"role": "ctx", "req_id": 7, "routing_key": {"block_keys": keys.tobytes(),
                                                                             "num_tokens": 64}})
    assert st == 200 and "msgpack" in ctype
    assert ans["server"] in {w.url for w in ctx} and ans["req_id"] == 7
    info = ans["info"]
    # placement receipt: the policy's explanation plus the server's /server_info
    assert info["policy"] == "kv_cache_aware" and info["chosen"] == ans["server"]
    assert {r["server"] for r in info["candidates"]} == {w.url for w in ctx}
    for row in info["candidates"]:
        assert set(row) >= {"server", "matched_tokens", "load_requests", "load_tokens", "score", "why"}
    assert info["num_tokens"] == 64 and info["server_info"]["role"] == "context"
    assert c.in_flight() == {"context": 1, "generation": 0}

    # The same call in JSON, keys as a list of u64 (big values survive).
    big = [2**64 - 1, 2**63, 5]
    st, ans2, ctype = await post(session, s.tcp_url + "/select",
                                 {"role": "generation", "req_id": 8,
                                  "routing_key": {"block_keys": big, "num_tokens": 48}}, mp=False)
    assert st == 200 and "json" in ctype and ans2["server"] in {w.url for w in gen}
    assert c.in_flight() == {"context": 1, "generation": 1}

    for role, rid, mp in (("ctx", 7, True), ("gen", 8, False)):
        st, body, _ = await post(session, s.tcp_url + "/finish", {"role": role, "req_id": rid, "success": True}, mp=mp)
        assert st == 200 and body == {}
    # idempotent: a repeated finish answers the same and changes nothing
    st, body, _ = await post(session, s.tcp_url + "/finish", {"role": "ctx", "req_id": 7})
    assert st == 200 and body == {}
    assert c.in_flight() == {"context": 0, "generation": 0} and len(c.leases) == 0
    assert c.stats.finish_unknown == 1


@pytest.mark.parametrize("mp", [True, False])
async def test_bad_bodies_name_the_field(cluster, mp):
    c, s, *_ , session = cluster
    url = s.tcp_url
    cases = [
        ("/select", {"role": "ctx", "req_id": True}, "req_id", "bool"),
        ("/select", {"role": "ctx", "req_id": -1}, "req_id", "unsigned"),
        ("/select", {"role": "leader", "req_id": 1}, "role", "invalid role"),
        ("/select", {"req_id": 1}, "role", "missing"),
        ("/select", {"role": "ctx", "req_id": 1, "bogus": 1}, "bogus", "unknown field"),
        ("/select", {"role": "ctx", "req_id": 1, "routing_key": {"block_keys": [1.5]}},
         "routing_key.block_keys[0]", "float"),
        ("/select", {"role": "ctx", "req_id": 1, "routing_key": {"block_keys": [-3]}},
         "routing_key.block_keys", "unsigned 64-bit"),
        ("/select", {"role": "ctx", "req_id": 1, "routing_key": {"block_keys": [1, 2, 3], "num_tokens": 40}},
         "routing_key.block_keys", "at most 2 full blocks"),
        ("/select", {"role": "ctx", "req_id": 1, "exclude": ["ftp://x"]}, "exclude", "http"),
        ("/finish", {"role": "ctx", "req_id": 1, "success": "yes"}, "success", "bool"),
        ("/finish", {"role": "ctx", "req_id": 1, "usage": {"cached_tokens": -1}},
         "usage.cached_tokens", "non-negative"),
        ("/finish", {"role": "ctx", "req_id": 1, "usage": {"cached": 1}}, "usage.cached",
         "unknown field"),
        ("/select_pair", {"req_id": "one"}, "req_id", "int"),
        ("/register", {"url": "h:1", "role": "boss"}, "role", "invalid role"),
        ("/identity", {"holder": ""}, "holder", "non-empty"),
    ]
    for path, body, field, words in cases:
        st, ans, ctype = await post(session, url + path, body, mp=mp)
        assert st == 400, (path, body, st, ans)
        assert ("msgpack" in ctype) == mp
        assert ans["field"] == field, (body, ans)
        assert words.lower() in ans["error"].lower(), (body, ans)
    if mp:  # binary keys whose length is not a multiple of 8
        st, ans, _ = await post(session, url + "/select",
                                {"role": "ctx", "req_id": 1, "routing_key": {"block_keys": b"\x00" * 12}})
        assert st == 400 and "multiple of 8" in ans["error"] and ans["field"] == "routing_key.block_keys"
    assert c.in_flight() == {"context": 0, "generation": 0}
    assert sum(c.stats.bad_requests.values()) >= len(cases)


async def test_malformed_payloads_and_media_types(cluster):
    c, s, *_, session = cluster
    st, ans, _ = await post(session, s.tcp_url + "/select", None, raw=b"\xc1\x00", headers=MP)
    assert st == 400 and "malformed msgpack" in ans["error"]
    st, ans, ctype = await post(session, s.tcp_url + "/select", None, raw=b"{not json",
                                headers={"Content-Type": "application/json"})
    assert st == 400 and "malformed JSON" in ans["error"] and "json" in ctype
    st, ans, _ = await post(session, s.tcp_url + "/select", None, raw=b"", headers=MP)
    assert st == 400 and "empty request body" in ans["error"]
    st, ans, _ = await post(session, s.tcp_url + "/select", None, raw=b"role=ctx",
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert st == 415 and "application/msgpack" in ans["error"]
    # no Content-Type: JSON is recognised by its first byte, anything else is msgpack
    st, ans, ctype = await post(session, s.tcp_url + "/select", None,
                                raw=b'{"role": "ctx", "req_id": 3}', headers={})
    assert st == 200 and "json" in ctype
    st, ans, ctype = await post(session, s.tcp_url + "/select", None,
                                raw=msgpack.packb({"role": "ctx", "req_id": 3}), headers={})
    assert st == 200 and "msgpack" in ctype and c.stats.leases_replaced == 1
    async with session.get(s.tcp_url + "/nope") as r:
        assert r.status == 404 and "no endpoint /nope" in (await r.json())["error"]
    async with session.get(s.tcp_url + "/select") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"
        assert "use POST" in (await r.json())["error"]


async def test_no_server_available_is_503_with_reason(cluster):
    c, s, ctx, gen, session = cluster
    st, ans, _ = await post(session, s.tcp_url + "/select",
                            {"role": "ctx", "req_id": 1, "exclude": [w.url for w in ctx]})
    assert st == 503 and "no healthy context server left after excluding" in ans["error"]
    # the upstream spelling `exclude_server` with a bare host:port works too
    st, ans, _ = await post(session, s.tcp_url + "/select",
                            {"role": "gen", "req_id": 1, "exclude_server": gen[0].url.split("//")[1]},
                            mp=False)
    assert st == 200 and ans["server"] == gen[1].url
    assert c.stats.select_rejected[("context", "all_excluded")] == 1


async def test_select_pair_modes(workers, coordinator):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url], extra={
        "conditional_disagg_config": {"max_local_prefill_length": 32}}))
    await wait_for(c.is_ready)
    tokens = list(range(100, 100 + 256))
    keys = block_keys(tokens, 16)
    c.index.load_snapshot(gen.url, keys[:14].tolist())   # gen caches 224 of 256 tokens
    async with aiohttp.ClientSession() as session:
        st, ans, _ = await post(session, s.tcp_url + "/select_pair",
                                {"req_id": 11, "routing_key": {"block_keys": keys.tobytes(), "num_tokens": 256}})
        assert st == 200
        assert ans["mode"] == "generation_only" and ans["context"] is None
        assert "32 <= max_local_prefill_length 32" in ans["reason"]
        assert ans["generation"]["server"] == gen.url and ans["generation"]["info"]["matched_tokens"] == 224
        st, ans, _ = await post(session, s.tcp_url + "/select_pair",
                                {"req_id": 12, "routing_key": {"block_keys": block_keys(list(range(256)), 16).tobytes(),
                                                               "num_tokens": 256}})
        assert st == 200 and ans["mode"] == "disaggregated"
        assert ans["context"]["server"] == ctx.url and ans["generation"]["server"] == gen.url
        assert c.in_flight() == {"context": 1, "generation": 2}
        # no context server left: default no_context_fallback=aggregate serves on gen alone
        st, ans, _ = await post(session, s.tcp_url + "/select_pair", {"req_id": 13, "exclude_ctx": [ctx.url]})
        assert st == 200 and ans["mode"] == "aggregate_fallback" and ans["context"] is None
        assert "no healthy context server left" in ans["reason"]
        for role, rid in (("gen", 11), ("ctx", 12), ("gen", 12), ("gen", 13)):
            await post(session, s.tcp_url + "/finish", {"role": role, "req_id": rid})
    assert c.in_flight() == {"context": 0, "generation": 0}
    assert c.stats.pair_modes == {"generation_only": 1, "disaggregated": 1, "aggregate_fallback": 1}


async def test_select_pair_reject_releases_the_generation_lease(workers, coordinator):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url], extra={"no_context_fallback": "reject"}))
    await wait_for(c.is_ready)
    async with aiohttp.ClientSession() as session:
        st, ans, _ = await post(session, s.tcp_url + "/select_pair", {"req_id": 5, "exclude_ctx": ctx.url})
        assert st == 503 and "context" in ans["error"]
    assert c.in_flight() == {"context": 0, "generation": 0} and len(c.leases) == 0


async def test_renew_and_unknown_lease(cluster):
    c, s, *_, session = cluster
    await post(session, s.tcp_url + "/select", {"role": "gen", "req_id": 99})
    st, ans, _ = await post(session, s.tcp_url + "/renew", {"role": "generation", "req_id": 99})
    assert st == 200 and ans == {"renewed": True}
    st, ans, _ = await post(session, s.tcp_url + "/renew", {"role": "generation", "req_id": 100})
    assert st == 200 and ans == {"renewed": False}
    assert c.stats.renewed == 1 and c.stats.renew_unknown == 1


async def test_health_cluster_info_metrics(cluster):
    c, s, ctx, gen, session = cluster
    async with session.get(s.tcp_url + "/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ready"
    async with session.get(s.tcp_url + "/cluster_info") as r:
        assert r.status == 200 and "json" in r.headers["Content-Type"]
        ci = await r.json()
    assert ci["is_ready"] is True and ci["not_ready_reason"] is None
    assert set(ci["server_lists"]["context"]) == {w.url for w in ctx}
    assert ci["routing"] == {"block_size": 16, "key_scheme": "xxh3_chain_v1", "namespace": None, "ns_seed": 0}
    row = ci["servers"]["generation"][0]
    assert row["state"] == "healthy" and row["load"] == {
        "requests": 0, "tokens": 0, "queued_prefill_tokens": 0, "prefilling": 0, "decoding": 0,
        "decoding_tokens": 0}
    assert row["kv_index_blocks"] == 0 and row["kv_ready"] is True and row["server_info"]["role"] == "generation"
    async with session.get(s.tcp_url + "/cluster_info", headers={"Accept": "application/msgpack"}) as r:
        assert msgpack.unpackb(await r.read())["is_ready"] is True
    await post(session, s.tcp_url + "/select", {"role": "ctx", "req_id": 1})
    async with session.get(s.tcp_url + "/metrics") as r:
        text = await r.text()
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert "splitserve_coordinator_ready 1.0" in text
    assert 'splitserve_coordinator_select_total{role="context"} 1.0' in text
    assert 'splitserve_coordinator_leases_in_flight{role="context"} 1.0' in text
    assert "splitserve_coordinator_select_seconds_bucket" in text
    for w in ctx:
        assert f'splitserve_coordinator_server_healthy{{server="{w.url}"}} 1.0' in text


async def test_unix_socket_serves_the_same_api(workers, coordinator, tmp_path):
    w = await workers("both")
    sock = str(tmp_path / "c.sock")
    c, s = await coordinator(cfg([w.url], [w.url]), uds=sock)
    await wait_for(c.is_ready)
    assert s.uds_url == f"unix://{sock}"
    conn = aiohttp.UnixConnector(path=sock)
    async with aiohttp.ClientSession(connector=conn) as session:
        st, ans, _ = await post(session, "http://localhost/select",
                                {"role": "ctx", "req_id": 1, "routing_key": {"block_keys": np.arange(3, dtype="<u8").tobytes(),
                                                                             "num_tokens": 50}})
        assert st == 200 and ans["server"] == w.url
        st, ans, _ = await post(session, "http://localhost/finish", {"role": "ctx", "req_id": 1})
        assert st == 200
    assert c.in_flight()["context"] == 0


async def test_identity_leases(cluster):
    c, s, *_, session = cluster
    pairs = set()
    for i in range(70):
        st, ans, _ = await post(session, s.tcp_url + "/identity", {"holder": f"fleet-{i}"})
        assert st == 200 and ans["ttl_s"] == c.identities.ttl_s
        pairs.add((ans["node_id"], ans["process_id"]))
    assert len(pairs) == 70
    st, again, _ = await post(session, s.tcp_url + "/identity", {"holder": "fleet-3"})
    assert (again["node_id"], again["process_id"]) in pairs  # renewal keeps the pair
    st, ans, _ = await post(session, s.tcp_url + "/identity/release", {"holder": "fleet-3"})
    assert ans == {"released": True}
    st, ans, _ = await post(session, s.tcp_url + "/identity/release", {"holder": "fleet-3"})
    assert ans == {"released": False}
    # a restarted coordinator honours a preferred free pair
    st, ans, _ = await post(session, s.tcp_url + "/identity", {"holder": "x", "node_id": 200, "process_id": 7})
    assert (ans["node_id"], ans["process_id"]) == (200, 7)
    st, ans, _ = await post(session, s.tcp_url + "/identity", {"holder": "y", "node_id": 200, "process_id": 7})
    assert (ans["node_id"], ans["process_id"]) != (200, 7)
    st, ans, _ = await post(session, s.tcp_url + "/identity", {"holder": "z", "node_id": 300, "process_id": 7})
    assert st == 400 and "out of range" in ans["error"]
