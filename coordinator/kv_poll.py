"""The HTTP-poll transport of the KV-event ingest: TensorRT-LLM's destructive
`POST /kv_cache_events` (route in `tensorrt_llm/serve/openai_server.py`, JSON of
`tensorrt_llm/_utils.py::KVCacheEventSerializer`), polled every `poll_interval_s`. Its batches go
to `coordinator.kv_sync.FeedSync`: the same ordering, gap and clear rules as the ZMQ feed
(`seq` = `event_id`, per attention-DP rank)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp
import orjson

from coordinator.kv_feed import WorkerFeed
from coordinator.kv_sync import FeedSync
from router.events import MAX_PAYLOAD_BYTES, EventDecodeError, decode_trtllm_http

log = logging.getLogger("splitserve.coordinator.kv_ingest")

POLL_BACKOFF_MAX_S = 30.0   # an HTTP feed that keeps failing polls at most this rarely


class HttpPoller:
    """Polls one feed's URL per `run` call; hands what it drains to ``sync``."""

    def __init__(self, http: Callable[[], aiohttp.ClientSession], sync: FeedSync,
                 timeout_s: float):
        self._http = http
        self._sync = sync
        self.timeout_s = timeout_s
        self._warned: set = set()   # (server, url) already logged once

    async def run(self, feed: WorkerFeed) -> None:
        """Drain the server's event buffer every `poll_interval_s` (backing off while it fails).
        The drain is destructive, so a response that cannot be decoded is lost state: handled
        like an undecodable ZMQ batch. Events are split by `attention_dp_rank`, each rank's
        `event_id` sequence ordered on its own."""
        sync = self._sync
        url = feed.endpoint
        interval = feed.source.poll_interval_s
        failures = 0
        while True:
            feed.polls += 1
            err, body = None, b""
            try:
                timeout = aiohttp.ClientTimeout(total=max(2.0, self.timeout_s))
                async with self._http().post(url, timeout=timeout, allow_redirects=False) as r:
                    if r.status != 200:
                        err = f"POST {url} answered {r.status}"
                    else:
                        chunks, size = [], 0
                        async for chunk in r.content.iter_chunked(1 << 16):
                            size += len(chunk)
                            if size > MAX_PAYLOAD_BYTES:
                                err = f"POST {url} returned more than {MAX_PAYLOAD_BYTES} bytes"
                                break
                            chunks.append(chunk)
                        body = b"".join(chunks)
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
                err = f"POST {url} failed: {type(exc).__name__}: {exc}"
            if err is not None:
                failures += 1
                feed.connect_failures += 1
                feed.error = f"{err} (retrying with backoff)"
                if feed.connected is not False:
                    feed.connected = False
                    sync.changed(feed)
                key = (feed.server, url)
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("KV events of %s: %s; retrying with backoff", feed.server, err)
                await asyncio.sleep(min(interval * 2 ** min(failures, 16), POLL_BACKOFF_MAX_S))
                continue
            if failures:
                log.info("KV events of %s: %s answers again after %d failed polls", feed.server,
                         url, failures)
            failures = 0
            if feed.connected is not True or feed.error is not None:
                feed.connected, feed.error = True, None
                sync.changed(feed)
            try:
                batches = decode_trtllm_http(orjson.loads(body))
            except (orjson.JSONDecodeError, EventDecodeError) as exc:
                sync.lost(feed, None, "decode_error", exc)
                await asyncio.sleep(interval)
                continue
            now = time.time()
            for b in batches:
                b.ts = now   # TensorRT-LLM events carry no time; lag is measured from the drain
                target = _rank_feed(feed, b.dp_rank)
                try:
                    sync.ingest(target, b)
                except Exception as exc:  # noqa: BLE001 - one bad event must not stop the feed
                    sync.lost(target, b.seq, "ingest_error", exc)
            await asyncio.sleep(interval)


def _rank_feed(feed: WorkerFeed, rank: int | None) -> WorkerFeed:
    if not rank:
        return feed
    for r in feed.ranks:
        if r.dp_rank == rank:
            return r
    # An attention-DP rank seen for the first time in a polled response: live only (the drain
    # has no replay), ordered by its own event ids.
    r = WorkerFeed(server=feed.server, source=feed.source, dp_rank=rank, endpoint=feed.endpoint,
                   ready=True, sync_outcome="live only", index=feed.index)
    r.last_seq = None
    feed.ranks.append(r)
    return r
