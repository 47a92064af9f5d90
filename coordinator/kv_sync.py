"""Keeping each KV-event feed's index entries in step with its stream: batches applied in seq
order, buffered while a repair runs, gaps repaired by replay, lost state rebuilt from a snapshot.

`FeedSync` is the state machine over `WorkerFeed`s that `coordinator.kv_ingest.KvIngest` (ZMQ)
and `coordinator.kv_poll.HttpPoller` (HTTP) hand their decoded batches to. Invariants:
- Batches of a feed are applied strictly in `seq` order, each at most once, on the event loop
  (the index has a single writer; `/select` reads it between batches, never mid-batch). The
  ordering state and verdicts are the router's (`KvIndex.apply_batch` / `expected_seq` /
  `reset_stream`, one stream per server and DP rank).
- While a feed repairs (replay or snapshot in flight) its live batches are buffered (at most
  `MAX_PENDING`), then drained through the same ordering rules.
- A gap is repaired by replay from `last + 1`; if replay is unavailable, times out, or starts
  after the requested seq (the publisher's buffer moved on), the server's entries are cleared
  (and rebuilt from `/kv_snapshot` when the server offers one). A live seq at or below the last
  applied one means the publisher restarted: clear, then rebuild (`on_restart` is told).
- A batch of a retired publisher epoch (a process that is gone) is dropped; one of a new epoch
  is handed to `on_epoch` (the ingest fences the server) and then buffered for the rebuild.
- One bad batch never stops a feed: it is counted, logged (rate-limited) and handled as lost
  (entries cleared, rebuilt from a snapshot when there is one).
- A feed counts as ready once its initial rebuild finished or gave up (bounded by the replay /
  rebuild timeouts).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp
import zmq.asyncio

from coordinator.kv_feed import RateLimitedLog, WorkerFeed, spawn
from coordinator.kv_repair import fetch_snapshot, replay
from router.events import AllCleared, BlocksRemoved, BlocksStored, EventDecodeError
from router.kv_index import StreamVerdict

log = logging.getLogger("splitserve.coordinator.kv_ingest")

MAX_PENDING = 100_000
MAX_REPAIRS_IN_A_ROW = 3
# Keys per slice of a snapshot load: ~5 ms of CPU each, so /select keeps being served while a
# 50k-block snapshot loads (in one piece it stalled the event loop for ~50 ms).
SNAPSHOT_SLICE = 8192


class FeedSync:
    """Applies, buffers and repairs the feeds' batches into ``index``. ``feeds`` is the ingest's
    table of attached feeds (read here, never written); ``on_ready(server)`` is told when a
    feed's usability changed."""

    def __init__(self, index, feeds: dict[str, WorkerFeed], *, block_size: int, key_scheme: str,
                 replay_timeout_s: float, rebuild_timeout_s: float,
                 http: Callable[[], aiohttp.ClientSession] | None,
                 on_ready: Callable[[str], None] | None,
                 on_epoch: Callable[[str, str], None] | None = None,
                 on_restart: Callable[[str, str], None] | None = None):
        self.index = index
        self._on_epoch = on_epoch
        self._on_restart = on_restart
        self._feeds = feeds
        self._on_ready = on_ready
        self._http = http
        self.block_size = block_size
        self.key_scheme = key_scheme
        self.replay_timeout_s = replay_timeout_s
        self.rebuild_timeout_s = rebuild_timeout_s
        self.ctx: zmq.asyncio.Context | None = None     # the ingest's, while it runs (replay)
        self._rl = RateLimitedLog()

    # ---- feed status ------------------------------------------------------------------------
    def attached(self, feed: WorkerFeed) -> bool:
        primary = self._feeds.get(feed.server)
        return primary is feed or (primary is not None and feed in primary.ranks)

    def changed(self, feed: WorkerFeed) -> None:
        """The feed's usability changed: placement candidates must be recomputed."""
        if self._on_ready is not None and self.attached(feed):
            self._on_ready(feed.server)

    def _retired(self, feed: WorkerFeed) -> set:
        return (self._feeds.get(feed.server) or feed).retired_epochs

    # ---- live path --------------------------------------------------------------------------
    def ingest(self, feed: WorkerFeed, batch, front: bool = False) -> None:
        """Apply, buffer, or repair around one batch; the ordering is the index's
        (`KvIndex.apply_batch`). `front` marks a batch drained from the repair buffer (it goes
        back to the front if another repair starts)."""
        ep = batch.epoch
        if ep is not None:
            primary = self._feeds.get(feed.server) or feed
            if ep != primary.epoch:
                if ep in primary.retired_epochs:
                    feed.stale_epoch_dropped += 1     # sent by a process that is gone
                    return
                if primary.epoch is None or self._on_epoch is None:
                    primary.epoch = ep
                else:
                    log.warning("KV events of %s: publisher epoch %s -> %s: a new process; its "
                                "entries are dropped and rebuilt", feed.server, primary.epoch, ep)
                    self._on_epoch(feed.server, ep)
                    self._buffer(feed, batch, False)
                    return
        if feed.repairing:
            self._buffer(feed, batch, front)
            return
        last = feed.last_seq
        verdict = self._apply(feed, batch)
        if verdict == StreamVerdict.APPLIED:
            return
        if verdict == StreamVerdict.DUPLICATE:
            if front:
                # Received while repairing and already covered by the replay or snapshot.
                feed.stale_dropped += 1
                return
            # PUB/SUB delivers in order, so a smaller live seq is a new publisher incarnation.
            feed.resets += 1
            log.warning("KV-event seq of %s went from %d to %d: publisher restarted; rebuilding",
                        feed.server, last, batch.seq)
            if self._on_restart is not None:
                self._on_restart(feed.server, "seq_reset")
            self.clear(feed, feed.server, "seq_reset")
            feed.last_seq = None
            self._buffer(feed, batch, front)
            self.start_rebuild(feed, "seq_reset")
            return
        feed.gaps += 1
        self._rl(logging.WARNING, ("gap", feed.server), "KV-event gap from %s: expected seq %d, got %d",
                 feed.server, last + 1, batch.seq)
        self._buffer(feed, batch, front)
        feed.repairing = True
        spawn(feed, self._repair_gap(feed, last + 1))

    def lost(self, feed: WorkerFeed, seq: int | None, cause: str, exc: BaseException) -> None:
        """A batch that could not be used: handled as an unrepairable gap at `seq` (replaying the
        same bytes would fail the same way). The entries may miss its stores or hold its
        removals, so they are cleared and rebuilt from a snapshot when there is one; the stream
        continues with the next batch."""
        if cause == "decode_error":
            feed.decode_errors += 1
        else:
            feed.apply_errors += 1
        reason = exc.reason if isinstance(exc, EventDecodeError) else f"{type(exc).__name__}: {exc}"
        self._rl(logging.WARNING, (cause, feed.server),
                 "KV-event batch %s from %s dropped (%s); clearing its entries", seq, feed.server,
                 reason[:300])
        if feed.repairing:
            return  # the repair's replay or snapshot supersedes this batch or fails loudly
        self.clear(feed, feed.server, cause)
        feed.last_seq = seq
        if feed.source.snapshot_url:
            self.start_rebuild(feed, cause)

    def clear(self, feed: WorkerFeed | None, server: str, cause: str,
              all_ranks: bool = False) -> None:
        """Forget what one stream told us: its DP rank's entries when the server publishes per
        rank (the other ranks' streams are intact), else all of the server's."""
        primary = self._feeds.get(server)
        if feed is not None and not all_ranks and primary is not None and primary.ranks:
            self.index.apply(server, AllCleared(None), feed.dp_rank)
        else:
            self.index.clear_worker(server)
        if feed is not None:
            feed.clears[cause] = feed.clears.get(cause, 0) + 1

    def _buffer(self, feed: WorkerFeed, batch, front: bool) -> None:
        if len(feed.pending) >= MAX_PENDING:
            feed.pending.clear()
            self.clear(feed, feed.server, "buffer_overflow")
            feed.last_seq = None
            self._rl(logging.ERROR, ("overflow", feed.server),
                     "KV events of %s overflowed the repair buffer; entries cleared", feed.server)
        if front:
            feed.pending.appendleft(batch)
        else:
            feed.pending.append(batch)

    def _apply(self, feed: WorkerFeed, batch) -> str:
        """`KvIndex.apply_batch` on this feed's stream, and the feed's counters when it applied.
        A seq at or below the last applied one is never a restart to the index (it is a
        duplicate): the caller decides, since only it knows whether the batch is live."""
        verdict = self.index.apply_batch(feed.server, batch, feed.dp_rank, restart_at_zero=False)
        if verdict != StreamVerdict.APPLIED:
            return verdict
        for ev in batch.events:
            if isinstance(ev, BlocksStored):
                feed.blocks_stored += _n_blocks(ev)
            elif isinstance(ev, BlocksRemoved):
                feed.blocks_removed += _n_blocks(ev)
            elif isinstance(ev, AllCleared):
                feed.clears["all_cleared_event"] = feed.clears.get("all_cleared_event", 0) + 1
        feed.events_applied += len(batch.events)
        feed.batches_applied += 1
        feed.repairs_in_a_row = 0
        if batch.ts is not None:
            feed.last_ts = batch.ts
            feed.lag_s = max(0.0, time.time() - batch.ts)
        feed.last_applied_mono = time.monotonic()
        return verdict

    def drain(self, feed: WorkerFeed) -> None:
        """Ingest the buffered batches (a repair ended), until one starts another repair."""
        while feed.pending and not feed.repairing:
            self.ingest(feed, feed.pending.popleft(), front=True)

    # ---- repair -----------------------------------------------------------------------------
    def start_rebuild(self, feed: WorkerFeed, cause: str) -> None:
        if feed.repairing:
            return
        feed.repairing = True
        feed.sync_started_mono = time.monotonic()
        spawn(feed, self._rebuild(feed, cause))

    async def _rebuild(self, feed: WorkerFeed, cause: str) -> None:
        """Make the feed's entries complete as of some seq, then resume the live stream."""
        try:
            outcome = "live only"
            if feed.source.snapshot_url and await self._load_snapshot(feed):
                outcome = "snapshot"
            elif feed.replay_endpoint:
                batches = await replay(self.ctx, feed, 0, self.replay_timeout_s, self._retired(feed))
                if batches is None:
                    outcome = "replay unavailable"
                else:
                    self.clear(feed, feed.server, f"rebuild_{cause}")
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
            self.changed(feed)
        self.drain(feed)

    async def _repair_gap(self, feed: WorkerFeed, start: int) -> None:
        feed.repairs_in_a_row += 1
        try:
            batches = None
            if feed.replay_endpoint and feed.repairs_in_a_row <= MAX_REPAIRS_IN_A_ROW:
                batches = await replay(self.ctx, feed, start, self.replay_timeout_s,
                                      self._retired(feed))
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
            self.clear(feed, feed.server, "gap_unrepaired")
            feed.last_seq = None
            # A snapshot makes them complete again, unless repairs keep failing in a row (then
            # the stream restarts from the next batch rather than loop on a lagging snapshot).
            if feed.source.snapshot_url and feed.repairs_in_a_row <= MAX_REPAIRS_IN_A_ROW:
                await self._load_snapshot(feed)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("repairing the KV-event gap of %s failed", feed.server)
            self.clear(feed, feed.server, "gap_unrepaired")
            feed.last_seq = None
        finally:
            feed.repairing = False
        self.drain(feed)

    async def _load_snapshot(self, feed: WorkerFeed) -> bool:
        """Replace the feed's entries with the worker's `/kv_snapshot`; False if unusable."""
        if self._http is None:
            return False
        got = await fetch_snapshot(self._http, feed, self.rebuild_timeout_s, self.block_size,
                                   self.key_scheme, (self._feeds.get(feed.server) or feed).epoch)
        if got is None:
            return False
        keys, seq = got
        self.clear(feed, feed.server, "snapshot_reload")
        clears = sum(feed.clears.values())
        step = SNAPSHOT_SLICE
        self.index.load_snapshot(feed.server, keys[:step])
        for start in range(step, keys.size, step):
            # Live batches stay buffered meanwhile (the feed is repairing); selects may add
            # speculative entries, which the appended keys confirm like events would.
            await asyncio.sleep(0)
            if not self.attached(feed) or sum(feed.clears.values()) != clears:
                log.warning("KV index of %s was cleared or detached while its snapshot loaded; "
                            "snapshot abandoned", feed.server)
                return False
            self.index.load_snapshot(feed.server, keys[start:start + step], append=True)
        feed.snapshots += 1
        feed.blocks_stored += int(keys.size)
        # seq -1: nothing published yet, so the next live batch must be seq 0.
        feed.last_seq = None if seq is None else seq
        return True


def _n_blocks(ev) -> int:
    hashes = getattr(ev, "engine_hashes", None)
    if hashes is None:
        hashes = getattr(ev, "block_hashes", ())
    return len(hashes)
