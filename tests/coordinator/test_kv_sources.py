"""Where a server's KV events come from, as each engine publishes them, through real sockets.

SGLang's `/server_info` descriptor is the one `describe_kv_events_publisher` builds in
sglang-0.5.23 (`sglang/srt/runtime_context.py`, put under `kv_events` by
`sglang/srt/utils/common.py::build_server_info`): `publisher` is the publisher *kind* ("zmq"), the
endpoint is `endpoint_host` + `endpoint_port_base` (+ dp rank), replay likewise from
`replay_endpoint_port_base`; SGLang's `ZmqEventPublisher.offset_endpoint_port` (same file family,
`srt/disaggregation/kv_events.py`) binds rank r at base + r, and its batches carry the rank as
`attn_dp_rank`.
"""
from __future__ import annotations

import asyncio

import pytest

from coordinator.config import ConfigError, load_config
from coordinator.kv_sources import advertised_source

from .conftest import FakePublisher, cfg, chain, free_ports, stored, wait_for
from .test_kv_ingest import TOK_A, TOK_B, matched

SGLANG_DESCRIPTOR = {   # describe_kv_events_publisher's shape, sglang-0.5.23
    "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
    "block_size": 16, "dp_size": 2, "replay_endpoint_port_base": 5558}


def test_sglang_descriptor_is_read_as_sglang_writes_it():
    src = advertised_source({"kv_events": SGLANG_DESCRIPTOR}, "http://10.0.0.7:30000",
                            snapshot_ok=True)
    assert src.problem is None
    assert (src.endpoint, src.replay_endpoint) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert src.engine == "sglang" and src.dp_size == 2 and src.topic == ""
    concrete = dict(SGLANG_DESCRIPTOR, endpoint_host="[fd00::5]", dp_size=1)
    del concrete["replay_endpoint_port_base"]        # present only for a tcp replay endpoint
    src = advertised_source({"kv_events": concrete}, "http://10.0.0.7:30000", snapshot_ok=True)
    assert src.endpoint == "tcp://[fd00::5]:5557" and src.replay_endpoint is None
    # SGLang reports "no publisher" as a null descriptor
    assert advertised_source({"kv_events": None}, "http://h:1", snapshot_ok=True) is None


@pytest.mark.parametrize("kv, why", [
    (dict(SGLANG_DESCRIPTOR, publisher="null"), "only 'zmq' publishes"),
    (dict(SGLANG_DESCRIPTOR, endpoint_port_base=0), "endpoint_port_base"),
    ({"publisher": "tcp://h:1", "topic": "t"}, "kv_events.format"),
    ({"endpoint": "tcp://h:1"}, "unrecognised descriptor"),
])
def test_descriptors_that_cannot_work_are_reported_not_guessed(kv, why):
    src = advertised_source({"kv_events": kv}, "http://h:1", snapshot_ok=True)
    assert src.problem and why in src.problem


async def test_sglang_dp2_server_subscribed_per_rank(workers, coordinator, zctx):
    base, rbase = free_ports(2), free_ports(2)
    pubs = [FakePublisher(zctx, topic="", port=base + r, replay_port=rbase + r, dp_rank=r)
            for r in range(2)]
    w = await workers("both", kv_events=dict(SGLANG_DESCRIPTOR, endpoint_port_base=base,
                                             replay_endpoint_port_base=rbase))
    c, s = await coordinator(cfg([w.url], [w.url]))
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="both ranks ready")
    feed = c.kv.feeds[w.url]
    assert feed.endpoint == f"tcp://127.0.0.1:{base}" and feed.source.engine == "sglang"
    assert [r.endpoint for r in feed.ranks] == [f"tcp://127.0.0.1:{base + 1}"]
    assert [r.replay_endpoint for r in feed.ranks] == [f"tcp://127.0.0.1:{rbase + 1}"]
    # signed int64 hashes, as SGLang sends them; rank 1's blocks land in rank 1's slot
    await pubs[0].publish([stored(TOK_A, [-(2**63) + 1, -2, -3, -4])])
    await pubs[1].publish([stored(TOK_B, [-11, -12])])
    await wait_for(lambda: matched(c, w.url, TOK_A) == 4 and matched(c, w.url, TOK_B) == 2,
                   what="events of both ranks")   # the first may come by replay (slow joiner)
    assert c.index.keys_of(w.url, 1) and c.index.keys_of(w.url, 0)
    assert not (c.index.keys_of(w.url, 0) & c.index.keys_of(w.url, 1))
    ke = c.cluster_info()["servers"]["context"][0]["kv_events"]
    assert ke["format"] == "sglang" and ke["ranks"][0]["dp_rank"] == 1 and ke["ready"] is True
    for p in pubs:
        p.close()


async def test_static_entry_wins_over_the_advertised_descriptor(workers, coordinator, zctx):
    pub = FakePublisher(zctx)
    dead = free_ports(1)
    w = await workers("both", kv_events=dict(SGLANG_DESCRIPTOR, endpoint_port_base=dead, dp_size=1))
    c, s = await coordinator(cfg([w.url], [w.url], extra={}) | {
        "context_servers": {"urls": [w.url], "router": {"type": "kv_cache_aware"},
                            "kv_events": [{"server": w.url, "endpoint": pub.endpoint,
                                           "replay_endpoint": pub.replay_endpoint,
                                           "topic": "kv-events", "engine": "sglang"}]}})
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="static feed")
    feed = c.kv.feeds[w.url]
    assert feed.source.origin == "config" and feed.endpoint == pub.endpoint
    await pub.publish([stored(TOK_A, chain(TOK_A))])
    await wait_for(lambda: matched(c, w.url, TOK_A) == 4)
    pub.close()


async def test_static_server_publishing_to_the_bound_endpoint(workers, coordinator, zctx):
    """A stock vLLM in connect mode (`--kv-events-config '{"endpoint": "tcp://coord:5557", ...}'`
    connects its PUB socket): the config names only its topic."""
    w = await workers("both")
    w.info_status = 404
    c, s = await coordinator(cfg([w.url], [w.url], event_ingest={"bind_endpoint": "tcp://127.0.0.1:0"},
                                 extra={}) | {
        "context_servers": {"urls": [w.url], "router": {"type": "kv_cache_aware"},
                            "kv_events": [{"server": w.url, "topic": "kv@pod-b@m"}]}})
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="topic feed")
    pub = FakePublisher(zctx, topic="kv@pod-b@m", replay=False, connect_to=c.kv.bound_endpoint)
    for _ in range(200):
        pub.restart()
        await pub.publish([stored(TOK_A, chain(TOK_A))])
        await asyncio.sleep(0.02)
        if matched(c, w.url, TOK_A) == 4:
            break
    assert matched(c, w.url, TOK_A) == 4
    assert c.kv.feeds[w.url].endpoint is None and c.kv.feeds[w.url].source.origin == "config"
    pub.close()


def test_config_for_the_bound_endpoint_and_http_poll():
    base = {"context_servers": {"urls": ["h:1"], "kv_events": [{"server": "h:1", "topic": "t"}]}}
    with pytest.raises(ConfigError) as e:
        load_config(base)
    assert e.value.path == "context_servers.kv_events[0].endpoint" and "bind_endpoint" in e.value.message
    ok = load_config(base | {"coordinator": {"event_ingest": {"bind_endpoint": "tcp://127.0.0.1:5557"}}})
    assert ok.context_servers.kv_events[0].endpoint is None
    with pytest.raises(ConfigError, match="non-empty topic"):
        load_config({"context_servers": {"urls": ["h:1"], "kv_events": [{"server": "h:1"}]}})
    poll = load_config({"context_servers": {"urls": ["h:1"], "kv_events": [
        {"server": "h:1", "transport": "http_poll", "engine": "trtllm", "poll_interval_s": 0.2}]}})
    assert poll.context_servers.kv_events[0].transport == "http_poll"
    with pytest.raises(ConfigError, match="expected 'trtllm'"):
        load_config({"context_servers": {"urls": ["h:1"], "kv_events": [
            {"server": "h:1", "transport": "http_poll"}]}})
    with pytest.raises(ConfigError, match="http"):
        load_config({"context_servers": {"urls": ["h:1"], "kv_events": [
            {"server": "h:1", "transport": "http_poll", "engine": "trtllm",
             "endpoint": "tcp://h:2"}]}})


async def test_an_unrepairable_gap_on_one_rank_clears_only_that_rank(workers, coordinator, zctx):
    base, rbase = free_ports(2), free_ports(2)
    pubs = [FakePublisher(zctx, topic="", port=base + r, replay_port=rbase + r, dp_rank=r)
            for r in range(2)]
    w = await workers("both", kv_events=dict(SGLANG_DESCRIPTOR, endpoint_port_base=base,
                                             replay_endpoint_port_base=rbase))
    c, s = await coordinator(cfg([w.url], [w.url]))
    await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="both ranks ready")
    await pubs[0].publish([stored(TOK_A, [-1, -2, -3, -4])])
    await pubs[1].publish([stored(TOK_B, [-11, -12])])
    await wait_for(lambda: matched(c, w.url, TOK_A) == 4 and matched(c, w.url, TOK_B) == 2)
    # rank 1 loses a batch its publisher no longer holds: rank 1 is cleared, rank 0 is not
    await pubs[1].publish([stored(list(range(7000, 7016)), [-13])], deliver=False)
    pubs[1].evict(keep_from=pubs[1].seq)
    await pubs[1].publish([stored(list(range(8000, 8016)), [-14])])
    r1 = c.kv.feeds[w.url].ranks[0]
    await wait_for(lambda: r1.clears.get("gap_unrepaired") == 1, what="rank 1 gap")
    await wait_for(lambda: matched(c, w.url, list(range(8000, 8016))) == 1, what="rank 1 goes on")
    assert matched(c, w.url, TOK_B) == 0 and matched(c, w.url, TOK_A) == 4
    assert "gap_unrepaired" not in c.kv.feeds[w.url].clears
    for p in pubs:
        p.close()
