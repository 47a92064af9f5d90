"""What a KV-event feed is repaired from, fetched without touching the index: the publisher's
replay buffer over a DEALER socket (`[b"", start_be8]`; replies in either framing end with seq -1
and an empty payload, `protocol.kv_replay`) and the worker's `/kv_snapshot`. The repair itself
(what is cleared, applied and loaded, and when) is `coordinator.kv_sync.FeedSync`'s."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp
import numpy as np
import zmq
import zmq.asyncio

from coordinator.kv_feed import WorkerFeed
from protocol import kv_replay
from protocol.coord import BadRequest, block_keys_array
from router.events import EventDecodeError, decode_zmq

log = logging.getLogger("splitserve.coordinator.kv_ingest")


async def replay(ctx: zmq.asyncio.Context, feed: WorkerFeed, start: int,
                 timeout_s: float, retired: frozenset | set = frozenset()) -> list | None:
    """Batches with seq >= start from the feed's replay endpoint, or None if it did not answer
    completely within ``timeout_s`` (counted on the feed); those of a ``retired`` publisher epoch
    are left out."""
    feed.replays += 1
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out = []
    try:
        sock.connect(feed.replay_endpoint)
        await sock.send_multipart(kv_replay.request_frames(start))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await sock.poll(remaining * 1000, zmq.POLLIN):
                feed.replays_failed += 1
                log.warning("replay from %s (%s) timed out after %.1fs", feed.server,
                            feed.replay_endpoint, timeout_s)
                return None
            tail = kv_replay.reply_tail(await sock.recv_multipart())
            if tail is None:
                feed.decode_errors += 1
                return None
            seq_b, payload = tail
            if seq_b == kv_replay.END_SEQ and not payload:
                return out
            try:
                b = decode_zmq([seq_b, payload], engine=feed.source.engine)
            except (EventDecodeError, ValueError) as exc:
                feed.decode_errors += 1
                log.warning("undecodable replay batch from %s: %s", feed.server, exc)
                return None
            if b.epoch is not None and b.epoch in retired:
                feed.stale_epoch_dropped += 1      # a process that is gone
                continue
            out.append(b)
    finally:
        sock.close(linger=0)


async def fetch_snapshot(http: Callable[[], aiohttp.ClientSession], feed: WorkerFeed,
                         timeout_s: float, block_size: int, key_scheme: str,
                         epoch: str | None = None) -> tuple[np.ndarray, int | None] | None:
    """The worker's `/kv_snapshot` as (block keys, seq), or None (logged) when it cannot be
    fetched, is not keyed as routing keys prompts, or is of another publisher epoch than
    ``epoch`` (when both are known)."""
    url = feed.source.snapshot_url
    try:
        async with http().get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                              headers={"Accept": "application/msgpack"}) as r:
            body = await r.read()
            if r.status != 200:
                log.warning("GET %s answered %d; cannot rebuild from a snapshot", url, r.status)
                return None
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        log.warning("GET %s failed: %s: %s", url, type(exc).__name__, exc)
        return None
    try:
        snap = kv_replay.decode_snapshot(body)
    except kv_replay.SnapshotError as exc:
        log.warning("snapshot of %s from %s unusable: %s", feed.server, url, exc)
        return None
    if snap.epoch is not None and epoch is not None and snap.epoch != epoch:
        log.warning("snapshot of %s is of publisher epoch %s, the feed's is %s; not usable",
                    feed.server, snap.epoch, epoch)
        return None
    bs, ks = snap.block_size, snap.key_scheme
    if bs != block_size or ks != key_scheme:
        log.warning("snapshot of %s is keyed at block size %r / scheme %r, routing uses %d / %s; "
                    "not usable", feed.server, bs, ks, block_size, key_scheme)
        return None
    try:
        keys = block_keys_array(snap.block_keys or [], "block_keys")
    except BadRequest as exc:
        log.warning("snapshot of %s has invalid block keys: %s", feed.server, exc.message)
        return None
    return keys, snap.seq
