"""KV events over real ZMQ: publisher framing and replay; a running worker's events, decoded by the
router's adapter and applied to the router's KvIndex, reproduce its resident blocks and /kv_snapshot."""
from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from protocol.kv_replay import request_frames as replay_request
from router.events import AllCleared, BlocksRemoved, BlocksStored, decode_zmq
from router.kv_index import KvIndex
from tests.worker.conftest import make_sim_engine, start_server
from worker.kv_events import END_MARKER_SEQ, KvEventPublisher


@pytest.fixture
def actx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def subscribe(actx, endpoint):
    sub = actx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    await asyncio.sleep(0.3)  # PUB/SUB slow joiner: let the subscription reach the publisher
    return sub


async def drain(sub, quiet=0.3):
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(sub.recv_multipart(), quiet))
        except asyncio.TimeoutError:
            return out


async def replay(actx, endpoint, start, delimiter=True):
    d = actx.socket(zmq.DEALER)
    d.connect(endpoint)
    await d.send_multipart(replay_request(start) if delimiter else [start.to_bytes(8, "big")])
    msgs = []
    while True:
        frames = await asyncio.wait_for(d.recv_multipart(), 5)
        msgs.append(frames)
        if frames[-2] == END_MARKER_SEQ:
            break
    d.close(linger=0)
    return msgs


async def test_publisher_framing_seq_and_replay(actx):
    pub = KvEventPublisher(host="127.0.0.1", buffer_steps=3, topic="kv-events")
    try:
        sub = await subscribe(actx, pub.publisher_endpoint)
        batches = [[BlocksStored([i + 1], None if i == 0 else i, list(range(4)), 4, group=0)]
                   for i in range(5)]
        assert pub.last_seq == -1
        for i, evs in enumerate(batches):
            assert pub.publish(evs) == i
        live = await drain(sub)
        assert [f[0] for f in live] == [b"kv-events"] * 5
        assert [int.from_bytes(f[1], "big") for f in live] == [0, 1, 2, 3, 4]
        dec = [decode_zmq(f) for f in live]
        assert [b.events[0].engine_hashes for b in dec] == [[1], [2], [3], [4], [5]]
        raw = msgpack.unpackb(live[0][2])
        assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_hashes"] == [1]
        # the ring keeps the last 3 batches: a replay from 1 starts at 2 (the gap is visible)
        msgs = await replay(actx, pub.replay_endpoint, 1)
        # vLLM 0.33 ZmqEventPublisher._service_replay (vllm/distributed/kv_events.py, vllm-0.33.0
        # wheel): (client_id, b"", topic, seq, payload) per batch, (client_id, b"", b"", END, b"")
        assert [len(m) for m in msgs] == [4] * 4
        assert [m[0] for m in msgs] == [b""] * 4, "a DEALER's delimiter is echoed"
        assert [m[1] for m in msgs] == [b"kv-events"] * 3 + [b""]
        assert [int.from_bytes(m[2], "big", signed=True) for m in msgs] == [2, 3, 4, -1]
        assert msgs[-1] == [b"", b"", END_MARKER_SEQ, b""] and decode_zmq(msgs[-1]).is_replay_end
        assert [m[3] for m in msgs[:-1]] == [f[2] for f in live[2:]], "replayed bytes are the live bytes"
        assert [decode_zmq(m).events for m in msgs[:-1]] == [b.events for b in dec[2:]]
        # every batch carries data_parallel_rank 0, as vLLM's publisher stamps it
        assert [msgpack.unpackb(f[2])[2] for f in live] == [0] * 5
        # the bare [seq_be8] request of docs/worker.md's HTTP contract gets the same frames minus the delimiter
        msgs = await replay(actx, pub.replay_endpoint, 4, delimiter=False)
        assert msgs == [[b"kv-events", (4).to_bytes(8, "big"), live[4][2]], [b"", END_MARKER_SEQ, b""]]
        # a malformed request gets just the end marker
        d = actx.socket(zmq.DEALER)
        d.connect(pub.replay_endpoint)
        await d.send_multipart([b"", b"abc"])
        assert await asyncio.wait_for(d.recv_multipart(), 5) == [b"", b"", END_MARKER_SEQ, b""]
        d.close(linger=0)
        assert pub.replays_served == 2
    finally:
        pub.close()


async def test_worker_events_rebuild_its_resident_set_in_the_router_index(actx, http):
    engine = make_sim_engine(num_blocks=12, block_size=4)
    srv, url = await start_server(engine)
    try:
        info = await (await http.get(url + "/server_info")).json()
        ke = info["kv_events"]
        assert ke["format"] == "vllm" and ke["topic"] == "kv-events"
        sub = await subscribe(actx, ke["publisher"])
        # enough distinct prompts through 12 blocks to store, evict and re-store
        for i in range(6):
            body = {"prompt": [256] + [(i * 5 + j) % 50 + 60 for j in range(17)],
                    "max_tokens": 6, "temperature": 0}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        frames = await drain(sub)
        batches = [decode_zmq(f) for f in frames]
        assert [b.seq for b in batches] == list(range(len(batches)))
        kinds = {type(e) for b in batches for e in b.events}
        assert BlocksStored in kinds and BlocksRemoved in kinds
        index = KvIndex(block_size=4)
        for b in batches:
            assert index.apply_batch("w", b) == "applied"
        resident = set(engine.pool.resident_keys())
        assert index.keys_of("w") == resident and len(resident) > 0
        async with http.get(url + "/kv_snapshot") as r:
            assert r.headers["Content-Type"] == "application/msgpack"
            snap = msgpack.unpackb(await r.read())
        assert snap["seq"] == batches[-1].seq and snap["block_size"] == 4
        assert snap["key_scheme"] == "xxh3_chain_v1" and set(snap["block_keys"]) == resident
        # a subscriber that missed everything after seq 1 catches up by replay
        late = KvIndex(block_size=4)
        for b in batches[:2]:
            late.apply_batch("w", b)
        for m in await replay(actx, ke["replay"], late.expected_seq("w")):
            b = decode_zmq(m)
            if not b.is_replay_end:
                assert late.apply_batch("w", b) == "applied"
        assert late.keys_of("w") == resident
        # a coordinator that restarts loads the snapshot and continues from seq + 1
        fresh = KvIndex(block_size=4)
        fresh.load_snapshot("w", snap["block_keys"])
        fresh.reset_stream("w", next_seq=snap["seq"] + 1)
        async with http.post(url + "/reset_prefix_cache") as r:
            assert (await r.json()) == {"cleared": True}
        after = [decode_zmq(f) for f in await drain(sub)]
        assert any(isinstance(e, AllCleared) for b in after for e in b.events)
        for b in after:
            assert fresh.apply_batch("w", b) == "applied"
            index.apply_batch("w", b)
        assert fresh.keys_of("w") == index.keys_of("w") == set(engine.pool.resident_keys()) == set()
    finally:
        await srv.stop()


async def test_publisher_epoch_and_idle_heartbeat(actx):
    """The recovery shape (vLLM PR #57789, SGLang RFC #33394): every batch carries the publisher's
    epoch after dp_rank; an idle publisher sends empty, numbered heartbeat batches. vLLM's own
    batch struct (vllm 0.33 `vllm/distributed/kv_events.py` `EventBatch`: array_like,
    omit_defaults, no forbid_unknown_fields; restated in docs/reference/kv_events.md §2.1) decodes
    the payload and skips the epoch."""
    import msgspec

    class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    pub = KvEventPublisher(host="127.0.0.1", epoch="start-1", heartbeat_s=0.05)
    try:
        sub = await subscribe(actx, pub.publisher_endpoint)
        pub.publish([AllCleared(None)])
        assert pub.heartbeat() is None          # something went out just now
        await asyncio.sleep(0.06)
        assert pub.heartbeat() == 1             # idle: an empty batch, seq 1
        msgs = await drain(sub)
        batches = [decode_zmq(m) for m in msgs]
        assert [b.seq for b in batches] == [0, 1] and [b.epoch for b in batches] == ["start-1"] * 2
        assert batches[1].events == []
        v = msgspec.msgpack.decode(msgs[0][2], type=VllmEventBatch)
        assert v.data_parallel_rank == 0 and len(v.events) == 1
    finally:
        pub.close()
