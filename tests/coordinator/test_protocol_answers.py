"""Every coordinator answer against its `protocol.coord` struct, over real sockets.

A real coordinator (fast HTTP server, and its channel through `HttpCoordinatorClient`) answers
`/select`, `/select_pair` (all three modes), `/renew`, `/cluster_info` (with configured and
registered servers, KV feeds and load); each raw body, msgpack and JSON, is decoded into its struct
and encoded back. The result must equal the body exactly: a field the coordinator emits that the
struct does not name would be dropped, a field the struct names that the coordinator does not emit
would be added — either fails here.
"""
from __future__ import annotations

import aiohttp
import msgpack
import msgspec
import orjson
import pytest

from coordinator.client import HttpCoordinatorClient
from protocol.coord import (ClusterInfo, RenewAnswer, SelectAnswer, SelectPairAnswer, as_answer,
                            decode_answer)
from protocol.failures import BadAnswer
from protocol.roles import Mode
from router.block_keys import block_keys

from .conftest import cfg, wait_for


async def _raw(session, method: str, url: str, body=None, mp: bool = True) -> bytes:
    h = {"Accept": "application/msgpack" if mp else "application/json"}
    data = None
    if body is not None:
        # block keys as bytes: msgpack bin, or base64 in JSON (the API accepts both)
        data = msgpack.packb(body) if mp else msgspec.json.encode(body)
        h["Content-Type"] = "application/msgpack" if mp else "application/json"
    async with session.request(method, url, data=data, headers=h) as r:
        assert r.status == 200, await r.text()
        assert ("msgpack" in r.headers["Content-Type"]) == mp
        return await r.read()


def _roundtrip(schema, raw: bytes, mp: bool):
    """Decode `raw` into `schema`, encode it again, and require nothing changed."""
    plain = msgpack.unpackb(raw) if mp else orjson.loads(raw)
    typed = decode_answer(schema, raw, mp)
    assert msgspec.to_builtins(typed) == plain
    # the dict form the Python API and the channel hand over decodes to the same struct
    assert as_answer(schema, plain) == typed
    return typed


@pytest.mark.parametrize("mp", [True, False], ids=["msgpack", "json"])
async def test_every_answer_fits_its_struct_exactly(workers, coordinator, mp):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url], extra={
        "conditional_disagg_config": {"max_local_prefill_length": 32}}))
    late = await workers("generation")
    await wait_for(c.is_ready, what="cluster ready")
    tokens = list(range(500, 500 + 256))
    keys = block_keys(tokens, 16)
    c.index.load_snapshot(gen.url, keys[:14].tolist())     # gen caches 224 of 256 tokens
    base = s.tcp_url
    async with aiohttp.ClientSession() as session:
        # a registered (not configured) server adds `registration` to its entry
        await _raw(session, "POST", base + "/register", {"url": late.url, "role": "generation",
                                                         "ttl_s": 30.0}, mp)
        await wait_for(lambda: c.registry.get(late.url) is not None
                       and c.registry.get(late.url).healthy, what="registered server healthy")
        one = _roundtrip(SelectAnswer, await _raw(session, "POST", base + "/select", {
            "role": "ctx", "req_id": 1, "routing_key": {"block_keys": keys.tobytes(), "num_tokens": 256}}, mp), mp)
        assert one.server == ctx.url and one.req_id == 1 and one.info["policy"] == "kv_cache_aware"

        local = _roundtrip(SelectPairAnswer, await _raw(session, "POST", base + "/select_pair", {
            "req_id": 2, "routing_key": {"block_keys": keys.tobytes(), "num_tokens": 256},
            "exclude_gen": [late.url]}, mp), mp)
        assert local.mode is Mode.LOCAL_PREFILL and local.context is None
        assert local.generation.matched_tokens == 224

        other = block_keys(list(range(256)), 16)
        pair = _roundtrip(SelectPairAnswer, await _raw(session, "POST", base + "/select_pair", {
            "req_id": 3, "routing_key": {"block_keys": other.tobytes(), "num_tokens": 256}}, mp), mp)
        assert pair.mode is Mode.DISAGGREGATED and pair.context.server == ctx.url

        alone = _roundtrip(SelectPairAnswer, await _raw(session, "POST", base + "/select_pair", {
            "req_id": 4, "exclude_ctx": [ctx.url]}, mp), mp)
        assert alone.mode is Mode.AGGREGATE_FALLBACK and alone.context is None and alone.reason

        assert _roundtrip(RenewAnswer, await _raw(session, "POST", base + "/renew",
                                                  {"role": "ctx", "req_id": 1}, mp), mp).renewed is True
        assert _roundtrip(RenewAnswer, await _raw(session, "POST", base + "/renew",
                                                  {"role": "ctx", "req_id": 999}, mp), mp).renewed is False

        ci = _roundtrip(ClusterInfo, await _raw(session, "GET", base + "/cluster_info", None, mp), mp)
        assert ci.is_ready and ci.routing.block_size == 16
        urls = {v.url: v for v in ci.servers.context + ci.servers.generation}
        assert set(urls) == {ctx.url, gen.url, late.url}
        assert urls[late.url].registration is not msgspec.UNSET      # registered: described
        assert urls[ctx.url].registration is msgspec.UNSET           # configured: absent
        # leases: req 1 (/select) and req 3's context leg
        assert urls[ctx.url].load.requests == 2 and urls[gen.url].kv_index_blocks == 14


async def test_channel_answers_fit_the_same_structs(workers, coordinator):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url]))
    await wait_for(c.is_ready, what="cluster ready")
    client = HttpCoordinatorClient(s.tcp_url)
    try:
        keys = block_keys(list(range(64)), 16)
        ans = await client.select("gen", 5, {"block_keys": keys, "num_tokens": 64})
        assert client._chan is not None and client._chan.usable()   # it went over the channel
        sel = as_answer(SelectAnswer, ans)
        assert msgspec.to_builtins(sel) == msgspec.to_builtins(ans)
        pair = as_answer(SelectPairAnswer, await client.select_pair(6, {"block_keys": keys, "num_tokens": 64}))
        assert pair.mode is Mode.DISAGGREGATED and pair.context.server == ctx.url
        ci = as_answer(ClusterInfo, await client.cluster_info())
        assert {v.url for v in ci.servers.generation} == {gen.url}
    finally:
        await client.close()


def test_an_answer_that_breaks_the_contract_is_a_typed_bad_answer():
    gen = {"server": "http://g:1", "req_id": 1, "info": {}}
    for bad, why in (({"generation": gen, "context": None, "mode": "local_prefill"}, "local_prefill"),
                     ({"generation": gen, "context": None, "mode": "context_only"}, "not a placement mode"),
                     ({"generation": gen, "context": None, "mode": "disaggregated"}, "no context leg"),
                     ({"generation": {"server": 3, "req_id": 1}}, "$.generation.server")):
        with pytest.raises(BadAnswer) as e:
            as_answer(SelectPairAnswer, bad)
        assert why in str(e.value) and e.value.cause == "bad_answer"
