"""Repair and rebuild for `coordinator.kv_ingest.KvIngest` (a mixin): make a feed's entries
complete as of some seq (initial sync, after a restart, after a gap), by replay over a DEALER
socket (`[b"", start_be8]`; replies in either framing end with seq -1 and an empty payload) or from
the worker's `/kv_snapshot`, then resume the live stream."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import zmq

from coordinator.kv_feed import WorkerFeed
from protocol import kv_replay
from protocol.coord import BadRequest, block_keys_array
from router.events import EventDecodeError, decode_zmq

log = logging.getLogger("splitserve.coordinator.kv_ingest")

MAX_REPAIRS_IN_A_ROW = 3
# Keys per slice of a snapshot load: ~5 ms of CPU each, so /select keeps being served while a
# 50k-block snapshot loads (in one piece it stalled the event loop for ~50 ms).
SNAPSHOT_SLICE = 8192


class RepairMixin:
    def _start_rebuild(self, feed: WorkerFeed, cause: str) -> None:
        if feed.repairing:
            return
        feed.repairing = True
        feed.sync_started_mono = time.monotonic()
        self._spawn(feed, self._rebuild(feed, cause))

    async def _rebuild(self, feed: WorkerFeed, cause: str) -> None:
        """Make the feed's entries complete as of some seq, then resume the live stream."""
        try:
            outcome = "live only"
            if feed.source.snapshot_url and await self._load_snapshot(feed):
                outcome = "snapshot"
            elif feed.replay_endpoint:
                batches = await self._replay(feed, 0)
                if batches is None:
                    outcome = "replay unavailable"
                else:
                    self._clear(feed, feed.server, f"rebuild_{cause}")
                    # The first replayed batch starts the stream (older history may be evicted);
                    # the index skips any that does not follow. An empty answer from seq 0 means
                    # nothing was published yet: the next live batch must be seq 0, and anything
                    # later is a gap to repair.
                    feed.last_seq = None
                    for b in batches:
                        self._apply(feed, b)
                    if feed.last_seq is None:
                        feed.last_seq = -1
                    if batches and batches[0].seq > 0:
                        outcome = f"replay from seq {batches[0].seq} (older history evicted)"
                    else:
                        outcome = "replay"
            feed.sync_outcome = outcome
            if outcome not in ("snapshot", "replay", "live only"):
                log.warning("KV index of %s rebuilt partially (%s); it fills from live events",
                            feed.server, outcome)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("rebuilding the KV index of %s failed", feed.server)
            feed.sync_outcome = "failed"
        finally:
            was_ready, feed.ready = feed.ready, True
            feed.repairing = False
        if not was_ready:
            self._changed(feed)
        self._drain(feed)

    async def _repair_gap(self, feed: WorkerFeed, start: int) -> None:
        feed.repairs_in_a_row += 1
        try:
            batches = None
            if feed.replay_endpoint and feed.repairs_in_a_row <= MAX_REPAIRS_IN_A_ROW:
                batches = await self._replay(feed, start)
            if batches is not None:
                wanted = [b for b in batches if b.seq >= start]
                if wanted and wanted[0].seq == start:
                    feed.replays_ok += 1
                    for b in wanted:
                        self._apply(feed, b)   # the index skips any that does not follow
                    return
                feed.replays_failed += 1
                log.warning("replay from %s started at seq %s, not %d: history evicted; clearing",
                            feed.server, wanted[0].seq if wanted else None, start)
            # Unrepairable: the entries may hold removed blocks or miss stored ones.
            self._clear(feed, feed.server, "gap_unrepaired")
            feed.last_seq = None
            # A snapshot makes them complete again, unless repairs keep failing in a row (then
            # the stream restarts from the next batch rather than loop on a lagging snapshot).
            if feed.source.snapshot_url and feed.repairs_in_a_row <= MAX_REPAIRS_IN_A_ROW:
                await self._load_snapshot(feed)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("repairing the KV-event gap of %s failed", feed.server)
            self._clear(feed, feed.server, "gap_unrepaired")
            feed.last_seq = None
        finally:
            feed.repairing = False
        self._drain(feed)

    async def _replay(self, feed: WorkerFeed, start: int) -> list | None:
        """Batches with seq >= start from the publisher's replay buffer, or None if it did not
        answer completely within `replay_timeout_s`."""
        feed.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out = []
        try:
            sock.connect(feed.replay_endpoint)
            await sock.send_multipart(kv_replay.request_frames(start))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.replay_timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(remaining * 1000, zmq.POLLIN):
                    feed.replays_failed += 1
                    log.warning("replay from %s (%s) timed out after %.1fs", feed.server,
                                feed.replay_endpoint, self.replay_timeout_s)
                    return None
                tail = kv_replay.reply_tail(await sock.recv_multipart())
                if tail is None:
                    feed.decode_errors += 1
                    return None
                seq_b, payload = tail
                if seq_b == kv_replay.END_SEQ and not payload:
                    return out
                try:
                    out.append(decode_zmq([seq_b, payload], engine=feed.source.engine))
                except (EventDecodeError, ValueError) as exc:
                    feed.decode_errors += 1
                    log.warning("undecodable replay batch from %s: %s", feed.server, exc)
                    return None
        finally:
            sock.close(linger=0)

    async def _load_snapshot(self, feed: WorkerFeed) -> bool:
        """Replace the feed's entries with the worker's `/kv_snapshot`; False if unusable."""
        if self._http is None:
            return False
        url = feed.source.snapshot_url
        try:
            async with self._http().get(url, timeout=aiohttp.ClientTimeout(total=self.rebuild_timeout_s),
                                        headers={"Accept": "application/msgpack"}) as r:
                body = await r.read()
                if r.status != 200:
                    log.warning("GET %s answered %d; cannot rebuild from a snapshot", url, r.status)
                    return False
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            log.warning("GET %s failed: %s: %s", url, type(exc).__name__, exc)
            return False
        try:
            snap = kv_replay.decode_snapshot(body)
        except kv_replay.SnapshotError as exc:
            log.warning("snapshot of %s from %s unusable: %s", feed.server, url, exc)
            return False
        bs, ks, seq = snap.block_size, snap.key_scheme, snap.seq
        if bs != self.block_size or ks != self.key_scheme:
            log.warning("snapshot of %s is keyed at block size %r / scheme %r, routing uses %d / %s; "
                        "not usable", feed.server, bs, ks, self.block_size, self.key_scheme)
            return False
        try:
            keys = block_keys_array(snap.block_keys or [], "block_keys")
        except BadRequest as exc:
            log.warning("snapshot of %s has invalid block keys: %s", feed.server, exc.message)
            return False
        self._clear(feed, feed.server, "snapshot_reload")
        clears = sum(feed.clears.values())
        step = SNAPSHOT_SLICE
        self.index.load_snapshot(feed.server, keys[:step])
        for start in range(step, keys.size, step):
            # Live batches stay buffered meanwhile (the feed is repairing); selects may add
            # speculative entries, which the appended keys confirm like events would.
            await asyncio.sleep(0)
            if not self._attached(feed) or sum(feed.clears.values()) != clears:
                log.warning("KV index of %s was cleared or detached while its snapshot loaded; "
                            "snapshot abandoned", feed.server)
                return False
            self.index.load_snapshot(feed.server, keys[start:start + step], append=True)
        feed.snapshots += 1
        feed.blocks_stored += int(keys.size)
        # seq -1: nothing published yet, so the next live batch must be seq 0.
        feed.last_seq = None if seq is None else seq
        return True
