"""KV-event ingestion over real ZMQ: vLLM map and legacy batches, gaps repaired by replay, replay
too late or unavailable (clear), publisher restarts, initial rebuild (replay or snapshot), the
bound endpoint, restart detection, the empty-index warning, and /select never waiting on events."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from coordinator.client import HttpCoordinatorClient
from router.block_keys import block_keys

from .conftest import FakePublisher, cfg, chain, cleared, keys_of, removed, stored, wait_for

TOK_A = list(range(1000, 1000 + 64))     # 4 blocks
TOK_B = list(range(5000, 5000 + 32))     # 2 blocks


def matched(c, url, tokens) -> int:
    return c.index.longest_prefix(keys_of(tokens), [url])[url]


async def kv_cluster(workers, coordinator, pub, *, snapshot=False, warm=True, **kw):
    w = await workers("both", kv_events=pub.kv_events(snapshot=snapshot))
    c, s = await coordinator(cfg([w.url], [w.url], **kw))
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="feed ready")
    if warm:
        # ZMQ's slow joiner: until the SUB connection is up, live batches vanish. A publisher
        # without replay can never recover those, so establish the stream with empty batches.
        feed = c.kv.feeds[w.url]
        for _ in range(500):
            await pub.publish([])
            await asyncio.sleep(0.01)
            if feed.batches_applied:
                break
        await wait_for(lambda: feed.last_seq == pub.seq - 1 and not feed.repairing, what="stream up")
    return w, c, s


async def publish_until_seen(pub, c, url, events, tokens, blocks):
    """The first live batches may race the SUB connection (ZMQ slow joiner): the gap/replay
    machinery recovers them, which these waits also prove."""
    await pub.publish(events)
    await wait_for(lambda: matched(c, url, tokens) == blocks, what=f"{blocks} blocks of {tokens[:2]}…")


@pytest.mark.parametrize("legacy", [False, True], ids=["map", "legacy"])
async def test_live_events_map_and_legacy(workers, coordinator, zctx, legacy):
    pub = FakePublisher(zctx, legacy=legacy)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    url = w.url
    ha = chain(TOK_A)
    await publish_until_seen(pub, c, url, [stored(TOK_A, ha)], TOK_A, 4)
    # a child block chained from the parent's engine hash
    more = list(range(9000, 9016))
    await pub.publish([stored(more, [77], parent=ha[-1])])
    await wait_for(lambda: matched(c, url, TOK_A + more) == 5)
    await pub.publish([removed([77]), stored(TOK_B, chain(TOK_B, base=500))])
    await wait_for(lambda: matched(c, url, TOK_B) == 2)
    assert matched(c, url, TOK_A + more) == 4
    # the placement receipt shows the cache hit
    client = HttpCoordinatorClient(s.tcp_url)
    ans = await client.select("ctx", 1, {"block_keys": block_keys(TOK_A, 16), "num_tokens": 64})
    assert ans["info"]["matched_tokens"] == 63          # capped at num_tokens - 1
    await client.finish("ctx", 1)
    await client.close()
    await pub.publish([cleared()])
    await wait_for(lambda: c.index.worker_size(url) == 0, what="AllBlocksCleared applied")
    feed = c.kv.feeds[url]
    assert feed.events_applied >= 5 and feed.blocks_stored >= 7 and feed.blocks_removed == 1
    assert feed.lag_s is not None and feed.lag_s < 5
    ci = c.cluster_info()["servers"]["context"][0]
    assert ci["kv_events"]["last_seq"] == pub.seq - 1 and ci["kv_ready"] is True
    pub.close()


async def test_gap_repaired_by_replay(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    url = w.url
    await publish_until_seen(pub, c, url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    feed = c.kv.feeds[url]
    last = feed.last_seq
    gaps0, ok0 = feed.gaps, feed.replays_ok
    dropped = await pub.publish([stored(TOK_B, chain(TOK_B, base=500))], deliver=False)
    await pub.publish([removed([chain(TOK_A)[-1]])])
    await wait_for(lambda: matched(c, url, TOK_B) == 2, what="the dropped batch, replayed")
    assert matched(c, url, TOK_A) == 3
    assert feed.gaps == gaps0 + 1 and feed.replays_ok == ok0 + 1
    assert dropped == last + 1 and pub.replay_requests[-1] == dropped
    assert feed.last_seq == pub.seq - 1 and not feed.clears.get("gap_unrepaired")
    pub.close()


async def test_gap_after_history_evicted_clears_the_server(workers, coordinator, zctx, caplog):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    url = w.url
    await publish_until_seen(pub, c, url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    feed = c.kv.feeds[url]
    await pub.publish([removed([chain(TOK_A)[-1]])], deliver=False)   # lost, and then evicted
    pub.evict(keep_from=pub.seq)
    with caplog.at_level(logging.WARNING, logger="splitserve.coordinator.kv_ingest"):
        await pub.publish([stored(TOK_B, chain(TOK_B, base=500))])
        await wait_for(lambda: feed.clears.get("gap_unrepaired") == 1, what="clear after a late replay")
    assert "history evicted; clearing" in caplog.text
    # the stale entries are gone; what arrived after the gap is applied
    await wait_for(lambda: matched(c, url, TOK_B) == 2)
    assert matched(c, url, TOK_A) == 0 and feed.replays_failed >= 1
    pub.close()


async def test_gap_without_replay_clears(workers, coordinator, zctx):
    pub = FakePublisher(zctx, replay=False)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    url = w.url
    await publish_until_seen(pub, c, url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    await pub.publish([stored(TOK_B, chain(TOK_B, base=500))], deliver=False)
    await pub.publish([stored(list(range(7000, 7016)), [9])])
    feed = c.kv.feeds[url]
    await wait_for(lambda: feed.clears.get("gap_unrepaired") == 1)
    await wait_for(lambda: matched(c, url, list(range(7000, 7016))) == 1)
    assert matched(c, url, TOK_A) == 0 and matched(c, url, TOK_B) == 0
    pub.close()


async def test_publisher_restart_with_seq_zero_clears_and_rebuilds(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    url = w.url
    await publish_until_seen(pub, c, url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    await pub.publish([stored(list(range(7000, 7016)), [9])])
    await pub.publish([stored(list(range(7100, 7116)), [10])])
    feed = c.kv.feeds[url]
    await wait_for(lambda: feed.last_seq == pub.seq - 1)
    pub.restart()                      # the engine restarted: empty cache, seq from 0
    await pub.publish([stored(TOK_B, chain(TOK_B, base=500))])
    await wait_for(lambda: feed.clears.get("seq_reset") == 1, what="reset detected")
    await wait_for(lambda: matched(c, url, TOK_B) == 2)
    assert matched(c, url, TOK_A) == 0 and feed.resets == 1
    assert feed.last_seq == 0
    pub.close()


async def test_new_publisher_epoch_fences_the_old_one(workers, coordinator, zctx):
    """Epochs (docs/failover.md "Worker restarts"): a batch of a new epoch drops the server's
    entries and leases at once; a later batch of the retired epoch is rejected."""
    pub = FakePublisher(zctx)
    pub.epoch = "epoch-a"
    w, c, s = await kv_cluster(workers, coordinator, pub)
    url = w.url
    await publish_until_seen(pub, c, url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    feed = c.kv.feeds[url]
    assert feed.epoch == "epoch-a"
    c.select("generation", 1 << 41, {"block_keys": keys_of(TOK_A), "num_tokens": 64})
    assert c.leases.requests(url) == 1
    pub.restart()               # a new process: empty cache, seq from 0, a new epoch
    pub.epoch = "epoch-b"
    await pub.publish([stored(TOK_B, chain(TOK_B, base=500))])
    await wait_for(lambda: feed.epoch == "epoch-b" and matched(c, url, TOK_B) == 2, what="epoch b")
    assert matched(c, url, TOK_A) == 0 and c.leases.requests(url) == 0
    assert feed.clears.get("epoch_change") == 1 and c.stats.restarts == {"epoch_change": 1}
    pub.epoch = "epoch-a"       # a straggler of the dead process
    await pub.publish([stored(TOK_A, chain(TOK_A))])
    await wait_for(lambda: feed.stale_epoch_dropped == 1, what="the old epoch's batch dropped")
    assert matched(c, url, TOK_A) == 0
    pub.close()


async def test_initial_rebuild_from_replay_before_ready(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    # history published before the coordinator exists (nobody subscribed: only the buffer has it)
    await pub.publish([stored(TOK_A, chain(TOK_A))], deliver=False)
    await pub.publish([stored(TOK_B, chain(TOK_B, base=500))], deliver=False)
    await pub.publish([removed([chain(TOK_B, base=500)[-1]])], deliver=False)
    w, c, s = await kv_cluster(workers, coordinator, pub, warm=False)
    feed = c.kv.feeds[w.url]
    # ready implies rebuilt
    assert feed.sync_outcome == "replay" and pub.replay_requests[0] == 0
    assert matched(c, w.url, TOK_A) == 4 and matched(c, w.url, TOK_B) == 1
    await pub.publish([stored(list(range(7000, 7016)), [9])])
    await wait_for(lambda: matched(c, w.url, list(range(7000, 7016))) == 1)
    pub.close()


async def test_initial_rebuild_from_snapshot_then_live(workers, coordinator, zctx):
    pub = FakePublisher(zctx, replay=False)
    for _ in range(3):   # seq 0..2 happened before; the snapshot reflects them
        await pub.publish([stored(list(range(7000, 7016)), [9])], deliver=False)
    keys_a = keys_of(TOK_A)
    w = await workers("both", kv_events=pub.kv_events(snapshot=True))
    w.snapshot = {"seq": 2, "block_size": 16, "key_scheme": "xxh3_chain_v1", "block_keys": keys_a}
    c, s = await coordinator(cfg([w.url], [w.url]))
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url))
    feed = c.kv.feeds[w.url]
    assert feed.sync_outcome == "snapshot" and w.snapshot_calls == 1
    assert matched(c, w.url, TOK_A) == 4 and feed.last_seq == 2
    await pub.publish([stored(TOK_B, [31, 32])])          # seq 3 follows the snapshot
    await wait_for(lambda: matched(c, w.url, TOK_B) == 2)
    assert feed.gaps == 0
    pub.close()


async def test_large_snapshot_loads_in_slices_with_the_loop_served_between(
        workers, coordinator, zctx, monkeypatch):
    from coordinator import kv_sync
    from router.kv_index import KvIndex

    monkeypatch.setattr(kv_sync, "SNAPSHOT_SLICE", 16)
    ticks = 0
    calls = []   # (append, ticks of the loop so far)
    real = KvIndex.load_snapshot

    def recording(self, worker, keys, dp_rank=0, *, append=False):
        calls.append((append, ticks))
        return real(self, worker, keys, dp_rank, append=append)

    monkeypatch.setattr(KvIndex, "load_snapshot", recording)

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.create_task(ticker())
    try:
        pub = FakePublisher(zctx, replay=False)
        toks = list(range(20_000, 20_000 + 16 * 100))        # 100 blocks: 7 slices of 16
        w = await workers("both", kv_events=pub.kv_events(snapshot=True))
        w.snapshot = {"seq": -1, "block_size": 16, "key_scheme": "xxh3_chain_v1",
                      "block_keys": keys_of(toks)}
        c, s = await coordinator(cfg([w.url], [w.url]))
        await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url))
        feed = c.kv.feeds[w.url]
        assert feed.sync_outcome == "snapshot" and feed.snapshots == 1
        assert matched(c, w.url, toks) == 100 and c.index.worker_size(w.url) == 100
        assert [a for a, _ in calls] == [False] + [True] * 6
        assert all(t1 > t0 for (_, t0), (_, t1) in zip(calls, calls[1:]))
        assert c.index.stats.snapshots == 1
        pub.close()
    finally:
        tick_task.cancel()


async def test_snapshot_repairs_an_unreplayable_gap(workers, coordinator, zctx):
    pub = FakePublisher(zctx, replay=False)
    w = await workers("both", kv_events=pub.kv_events(snapshot=True))
    w.snapshot = {"seq": -1, "block_size": 16, "key_scheme": "xxh3_chain_v1", "block_keys": []}
    c, s = await coordinator(cfg([w.url], [w.url]))
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url))
    await publish_until_seen(pub, c, w.url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    await pub.publish([stored(TOK_B, [31, 32])], deliver=False)
    # the worker's resident set now: A and B; the snapshot is as of the lost batch
    w.snapshot = {"seq": pub.seq - 1, "block_size": 16, "key_scheme": "xxh3_chain_v1",
                  "block_keys": keys_of(TOK_A) + keys_of(TOK_B)}
    await pub.publish([removed([31 + 1])])   # B's second block evicted (our hashes are keys; 32 is not)
    feed = c.kv.feeds[w.url]
    await wait_for(lambda: feed.clears.get("gap_unrepaired") == 1 and feed.snapshots == 2)
    await wait_for(lambda: matched(c, w.url, TOK_B) == 2)
    assert matched(c, w.url, TOK_A) == 4
    pub.close()


async def test_bound_endpoint_routes_by_topic(workers, coordinator, zctx, caplog):
    w = await workers("both", kv_events={"publisher": None, "topic": "kv@pod-a@tiny", "format": "vllm"})
    c, s = await coordinator(cfg([w.url], [w.url], event_ingest={"bind_endpoint": "tcp://127.0.0.1:0"}))
    await wait_for(lambda: w.url in c.kv.feeds)
    ep = c.kv.bound_endpoint
    assert ep.startswith("tcp://127.0.0.1:")
    pub = FakePublisher(zctx, topic="kv@pod-a@tiny", replay=False, connect_to=ep)
    stranger = FakePublisher(zctx, topic="kv@pod-z@tiny", replay=False, connect_to=ep)
    deadline = time.monotonic() + 5
    while matched(c, w.url, TOK_A) < 4 and time.monotonic() < deadline:
        # connect-side publishers lose messages until the connection is up: keep sending
        pub.restart()
        await pub.publish([stored(TOK_A, chain(TOK_A))])
        await stranger.publish([stored(TOK_B, [1, 2])])
        await asyncio.sleep(0.05)
    assert matched(c, w.url, TOK_A) == 4 and matched(c, w.url, TOK_B) == 0
    assert c.kv.unknown_topic >= 1
    pub.close()
    stranger.close()


async def test_worker_restart_detected_by_worker_id(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub, threshold=1)
    await publish_until_seen(pub, c, w.url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    # the process behind the url is replaced: health drops, then a new worker id appears
    w.healthy = False
    await wait_for(lambda: c.registry.get(w.url).state.value == "unhealthy")
    pub.restart()
    w.info["worker_id"] = "replacement"
    w.healthy = True
    await wait_for(lambda: c.registry.get(w.url).state.value == "healthy")
    feed = c.kv.feeds[w.url]
    await wait_for(lambda: feed.clears.get("worker_restart") == 1)
    assert matched(c, w.url, TOK_A) == 0
    pub.close()


async def test_undecodable_batch_is_counted_and_clears(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub)
    await publish_until_seen(pub, c, w.url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    await pub.pub.send_multipart([pub.topic, pub.seq.to_bytes(8, "big"), b"\x93\xc1garbage"])
    pub.seq += 1
    feed = c.kv.feeds[w.url]
    await wait_for(lambda: feed.decode_errors == 1)
    assert feed.clears.get("decode_error") == 1 and matched(c, w.url, TOK_A) == 0
    await pub.publish([stored(TOK_B, [3, 4])])
    await wait_for(lambda: matched(c, w.url, TOK_B) == 2)
    pub.close()


async def test_empty_index_under_kv_traffic_warns(workers, coordinator, zctx, caplog):
    silent = FakePublisher(zctx)    # subscribed, but never publishes
    w = await workers("context", kv_events=silent.kv_events())
    plain = await workers("context")  # advertises no publisher at all
    gen = await workers("generation")
    from coordinator.listeners import CoordinatorServer
    from coordinator.service import Coordinator
    c = Coordinator(cfg([w.url, plain.url], [gen.url]))
    c.empty_index_grace_s = 0.2
    c.empty_index_check_s = 0.05
    s = CoordinatorServer(c, port=0)
    await s.start()
    try:
        await wait_for(c.is_ready)
        client = HttpCoordinatorClient(s.tcp_url)
        keys = block_keys(TOK_A, 16)
        with caplog.at_level(logging.WARNING, logger="splitserve.coordinator"):
            for i in range(40):
                # alternate: speculative entries would otherwise pin all traffic to one server
                other = (w.url, plain.url)[i % 2]
                await client.select("ctx", i, {"block_keys": keys, "num_tokens": 64}, exclude=[other])
                await client.finish("ctx", i)
                await asyncio.sleep(0.02)
            await wait_for(lambda: c.empty_index_servers == {w.url, plain.url}, what="both flagged")
        assert "kv_cache_aware routing is degrading to load-only" in caplog.text
        assert "advertises no KV-event publisher" in caplog.text
        assert c.stats.empty_index_warnings == 2
        async with aiohttp.ClientSession() as session:
            async with session.get(s.tcp_url + "/metrics") as r:
                text = await r.text()
        assert f'splitserve_coordinator_kv_index_empty_under_traffic{{server="{w.url}"}} 1.0' in text
        assert "splitserve_coordinator_kv_empty_index_warnings_total 2.0" in text
        # events arrive: the flag clears
        for _ in range(100):
            silent.restart()
            await silent.publish([stored(TOK_A, chain(TOK_A))])
            if c.index.worker_size(w.url):
                break
            await asyncio.sleep(0.05)
        await client.select("ctx", 999, {"block_keys": keys, "num_tokens": 64})
        await wait_for(lambda: w.url not in c.empty_index_servers, what="flag cleared")
        await client.close()
    finally:
        await s.stop()
        silent.close()


async def test_select_does_not_wait_for_a_slow_replay(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, pub, event_ingest={"replay_timeout_s": 8.0})
    await publish_until_seen(pub, c, w.url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    pub.replay_delay = 3.0
    await pub.publish([stored(TOK_B, [3, 4])], deliver=False)
    await pub.publish([stored(list(range(7000, 7016)), [9])])
    feed = c.kv.feeds[w.url]
    await wait_for(lambda: feed.repairing, what="repair in flight")
    client = HttpCoordinatorClient(s.tcp_url)
    t0 = time.perf_counter()
    for i in range(20):
        await client.select("ctx", i, {"block_keys": block_keys(TOK_A, 16), "num_tokens": 64})
        await client.finish("ctx", i)
    elapsed = time.perf_counter() - t0
    assert feed.repairing, "the replay should still be in flight"
    assert elapsed < 2.0, f"selects waited on the replay ({elapsed:.2f}s)"
    await wait_for(lambda: matched(c, w.url, TOK_B) == 2, timeout=5)
    await client.close()
    pub.close()


async def test_healthy_worker_restarted_between_probes_is_resubscribed(workers, coordinator, zctx):
    old = FakePublisher(zctx)
    w, c, s = await kv_cluster(workers, coordinator, old)
    c.health.info_refresh_s = 0.1
    await publish_until_seen(old, c, w.url, [stored(TOK_A, chain(TOK_A))], TOK_A, 4)
    # the process was replaced without a failed probe: new worker id, new publisher ports
    new = FakePublisher(zctx)
    w.info["kv_events"] = new.kv_events()
    w.info["worker_id"] = "replacement"
    await wait_for(lambda: c.kv.feeds.get(w.url) is not None
                   and c.kv.feeds[w.url].source.endpoint == new.endpoint, what="resubscribed")
    assert matched(c, w.url, TOK_A) == 0
    await new.publish([stored(TOK_B, chain(TOK_B, base=500))])
    await wait_for(lambda: matched(c, w.url, TOK_B) == 2, what="events from the new publisher")
    assert c.registry.get(w.url).healthy
    old.close()
    new.close()


async def test_sglang_signed_hashes_and_config_sourced_publisher(workers, coordinator, zctx):
    """A stock engine without /server_info: its publisher comes from the config (`kv_events`);
    SGLang sends signed int64 hashes in the legacy array layout."""
    pub = FakePublisher(zctx, legacy=True)
    w = await workers("both")
    w.info_status = 404
    c, s = await coordinator(cfg([w.url], [w.url], extra={}) | {
        "context_servers": {"urls": [w.url], "router": {"type": "kv_cache_aware"},
                            "kv_events": [{"server": w.url, "endpoint": pub.endpoint,
                                           "replay_endpoint": pub.replay_endpoint,
                                           "topic": "kv-events", "engine": "sglang"}]}})
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="feed from config")
    feed = c.kv.feeds[w.url]
    assert feed.source.engine == "sglang" and c.registry.get(w.url).server_info == {}
    signed = [-(2**63) + 5, -42, -7, -1]
    await pub.publish([stored(TOK_A, signed)])
    await wait_for(lambda: matched(c, w.url, TOK_A) == 4, what="signed-hash stores applied")
    await pub.publish([removed([-1])])
    await wait_for(lambda: matched(c, w.url, TOK_A) == 3, what="removal by signed hash")
    pub.close()
