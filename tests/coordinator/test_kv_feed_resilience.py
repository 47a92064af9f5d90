"""A KV feed survives what a worker (or the network) throws at it, through real ZMQ sockets into a
running coordinator: malformed events (one per failure mode of issue 15: a KeyError-shaped bigram
entry, msgpack nested past the recursion limit, out-of-range token ids, wrong types) are
dropped and counted while the feed goes on; a reader that dies is restarted and reported; an
unreachable publisher is not ready, with the reason, logged once, and recovers by itself."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgpack

from .conftest import FakePublisher, cfg, chain, free_ports, stored, wait_for
from .test_kv_ingest import TOK_A, TOK_B, kv_cluster, matched, publish_until_seen


def _event(**over) -> dict:
    ev = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
          "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
          "lora_name": None}
    ev.update(over)
    return ev


BAD_PAYLOADS = {
    # token_ids as bigram pairs whose second entry is a map: p[0] raised KeyError
    "bigram_map": msgpack.packb([1.0, [_event(token_ids=[[1, 2], {"a": 1}])], 0]),
    # nested past the interpreter's recursion limit: msgspec raised RecursionError
    "deep": b"\x93" + msgpack.packb(1.5) + b"\x91" + b"\x82" + msgpack.packb("type")
            + msgpack.packb("BlockStored") + msgpack.packb("extra_keys") + b"\x91" * 50_000
            + b"\xc0" + b"\x00",
    "token_out_of_range": msgpack.packb([1.0, [_event(token_ids=[2**40] * 16)], 0]),
    "wrong_types": msgpack.packb([1.0, [_event(block_hashes="nope", block_size=[1])], 0]),
    "not_msgpack": b"\xc1\xc1\xc1",
}


async def cluster_info(s) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(s.tcp_url + "/cluster_info") as r:
            assert r.status == 200
            return await r.json()


def kv_row(ci: dict, url: str) -> dict:
    return next(r for r in ci["servers"]["context"] if r["url"] == url)


async def test_bad_events_are_dropped_and_the_feed_goes_on(workers, coordinator, zctx, caplog):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    feed = c.kv.feeds[w.url]
    await publish_until_seen(pub, c, w.url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    for i, (name, payload) in enumerate(BAD_PAYLOADS.items(), 1):
        seq = await pub.send_raw(payload)
        await wait_for(lambda: feed.decode_errors == i, what=f"{name} counted")
        assert feed.last_seq == seq, f"{name}: the bad batch's seq is consumed, not waited for"
        # each valid batch after a bad one still applies, in order
        more = list(range(30_000 + 16 * i, 30_000 + 16 * (i + 1)))
        await pub.publish([stored(more, [900 + i])])
        await wait_for(lambda: matched(c, w.url, more) == 1, what=f"feed alive after {name}")
    assert feed.reader_restarts == 0 and feed.usable
    # the dropped batches may have stored or removed anything: entries were cleared each time
    assert feed.clears["decode_error"] == len(BAD_PAYLOADS) and matched(c, w.url, TOK_A) == 0
    row = kv_row(await cluster_info(s), w.url)
    assert row["kv_ready"] is True and row["kv_events"]["decode_errors"] == len(BAD_PAYLOADS)
    assert row["kv_events"]["reader_restarts"] == 0 and row["kv_events"]["error"] is None
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert 1 <= len(drops) <= len(BAD_PAYLOADS), "rate-limited, one line per burst at most"
    pub.close()


async def test_a_dead_reader_is_restarted_and_reported(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    feed = c.kv.feeds[w.url]
    await publish_until_seen(pub, c, w.url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    sock = feed.sock
    real = sock.recv_multipart
    failed = []

    async def broken(*a, **kw):
        # a fault below the decoder (not a ZMQError the loop retries): the reader task dies
        if not failed:
            failed.append(1)
            raise RuntimeError("injected reader fault")
        return await real(*a, **kw)

    sock.recv_multipart = broken
    await pub.publish([stored(TOK_B, chain(TOK_B, base=500))])   # wakes the reader → it dies
    await wait_for(lambda: feed.reader_restarts == 1, what="reader restarted")
    row = kv_row(await cluster_info(s), w.url)
    assert row["kv_events"]["reader_restarts"] == 1
    async with aiohttp.ClientSession() as http:
        async with http.get(s.tcp_url + "/metrics") as r:
            assert f'splitserve_coordinator_kv_reader_restarts_total{{server="{w.url}"}} 1.0' \
                in await r.text()
    # the restarted reader carries on (what the dead one may have missed is repaired by replay)
    more = list(range(40_000, 40_016))
    await pub.publish([stored(more, [4242])])
    await wait_for(lambda: matched(c, w.url, more) == 1, what="events after the restart")
    await wait_for(lambda: feed.usable, what="ready again")
    pub.close()


async def test_unreachable_publisher_is_not_ready_logged_once_and_recovers(
        workers, coordinator, zctx, caplog):
    caplog.set_level(logging.WARNING, logger="splitserve.coordinator.kv_ingest")
    port = free_ports(1)
    w = await workers("both")
    w.info_status = 404           # a stock engine: its publisher comes from the config
    ep = f"tcp://127.0.0.1:{port}"
    c, s = await coordinator(cfg([w.url], [w.url], extra={}) | {
        "context_servers": {"urls": [w.url], "router": {"type": "kv_cache_aware"},
                            "kv_events": [{"server": w.url, "endpoint": ep,
                                           "topic": "kv-events"}]}})
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.feeds[w.url].connect_failures >= 3,
                   what="connect attempts")
    row = kv_row(await cluster_info(s), w.url)
    ke = row["kv_events"]
    assert row["kv_ready"] is False and ke["ready"] is False and ke["connected"] is False
    assert ep in ke["error"] and "cannot connect" in ke["error"] and ke["connect_failures"] >= 3
    assert ke["origin"] == "config"
    logged = [r for r in caplog.records if "cannot connect" in r.getMessage()]
    assert len(logged) == 1 and ep in logged[0].getMessage() and w.url in logged[0].getMessage()
    async with aiohttp.ClientSession() as http:
        async with http.get(s.tcp_url + "/metrics") as r:
            text = await r.text()
    assert f'splitserve_coordinator_kv_ready{{server="{w.url}"}} 0.0' in text
    assert f'splitserve_coordinator_kv_connect_failures_total{{server="{w.url}"}}' in text
    # the publisher comes up on that port: libzmq's retry (with backoff) connects the feed
    pub = FakePublisher(zctx, port=port, replay=False)
    feed = c.kv.feeds[w.url]
    await wait_for(lambda: feed.usable, timeout=15, what="feed connected")
    for _ in range(200):       # slow joiner: publish until the subscription is in place
        await pub.publish([stored(TOK_A, chain(TOK_A))])
        await asyncio.sleep(0.02)
        if matched(c, w.url, TOK_A) == 4:
            break
    assert matched(c, w.url, TOK_A) == 4
    assert kv_row(await cluster_info(s), w.url)["kv_ready"] is True
    assert len([r for r in caplog.records if "cannot connect" in r.getMessage()]) == 1
    pub.close()


async def test_invalid_endpoint_is_reported_not_raised(workers, coordinator, caplog):
    # What the old SGLang misreading produced: an endpoint ZMQ refuses. attach() raised, and the
    # health tick's gather(return_exceptions=True) dropped the error without a word.
    caplog.set_level(logging.WARNING, logger="splitserve.coordinator.kv_ingest")
    w = await workers("both", kv_events={"publisher": "zmq://nowhere", "topic": "t",
                                         "format": "vllm"})
    c, s = await coordinator(cfg([w.url], [w.url]))
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.feeds[w.url].error, what="error reported")
    feed = c.kv.feeds[w.url]
    assert "cannot connect a SUB socket" in feed.error and not c.kv.kv_ready(w.url)
    assert c.registry.get(w.url).state.value == "healthy", "the server itself stays in service"
    await asyncio.sleep(0.3)     # several health ticks and /server_info re-reads later
    logged = [r.getMessage() for r in caplog.records if "zmq://nowhere" in r.getMessage()]
    assert len(logged) == 1 and w.url in logged[0]
    row = kv_row(await cluster_info(s), w.url)
    assert row["kv_ready"] is False and "zmq://nowhere" in row["kv_events"]["error"]
    assert row["kv_events"]["connect_failures"] == 1
