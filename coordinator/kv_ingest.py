"""KV-event ingestion: ZMQ subscriptions feeding the KV index, with gap repair and rebuilds.

One `WorkerFeed` per server with an event source. Invariants:
- Batches of a feed are applied strictly in `seq` order, each at most once, on the event loop
  (the index has a single writer; `/select` reads it between batches, never mid-batch). The
  ordering state and verdicts are the router's (`KvIndex.apply_batch` / `expected_seq` /
  `reset_stream`, one stream per server and DP rank); this module keeps the sockets, the repair
  buffer, replay and snapshots.
- While a feed repairs (replay or snapshot in flight) its live batches are buffered, then drained
  through the same ordering rules.
- A gap is repaired by replay over a DEALER socket from `last + 1`; if replay is unavailable, times
  out, or starts after the requested seq (the publisher's buffer moved on), the server's entries are
  cleared (and rebuilt from `/kv_snapshot` when the server offers one). A seq at or below the last
  applied one means the publisher restarted: clear, then rebuild.
- A feed counts as ready for kv-aware placement once its initial rebuild finished or gave up
  (bounded by the replay / rebuild timeouts).
- Nothing here blocks: sockets are zmq.asyncio, HTTP is aiohttp, and every wait has a timeout.
- One bad message never stops a feed: any failure to decode or apply it is counted, logged
  (rate-limited) and handled as a lost batch (entries cleared, rebuilt from a snapshot when there
  is one); a reader that dies anyway is restarted with backoff and counted (`reader_restarts`).
- A feed that cannot connect is not ready (`kv_ready` false, `error` says why, shown in
  /cluster_info); the failure is logged once per endpoint, counted, and retried with backoff
  (ZMQ's reconnect interval, doubling to `RECONNECT_MAX_MS`; HTTP polls back off the same way).
- Transports: `zmq` (SUB per data-parallel rank: port base + rank, as vLLM and SGLang bind), or
  `http_poll` (TensorRT-LLM's destructive `POST /kv_cache_events`, `seq` = `event_id` per
  attention-DP rank). Both go through the same ordering, gap and clear rules.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from coordinator.kv_feed import FeedSource, WorkerFeed, rank_endpoint
from coordinator.kv_poll import HttpPollMixin
from coordinator.kv_repair import RepairMixin
from router.events import (MAX_PAYLOAD_BYTES, AllCleared, BlocksRemoved, BlocksStored,
                           EventDecodeError, decode_zmq)
from router.kv_index import StreamVerdict

log = logging.getLogger("splitserve.coordinator.kv_ingest")

MAX_PENDING = 100_000
RECONNECT_MS = 100          # first ZMQ reconnect interval; libzmq doubles it up to the max
RECONNECT_MAX_MS = 5000
READER_BACKOFF_MAX_S = 5.0
TRANSPORTS = ("zmq", "http_poll")


class _RateLimitedLog:
    def __init__(self, period_s: float = 10.0):
        self.period_s = period_s
        self._last: dict = {}

    def __call__(self, level: int, key, msg: str, *args, **kw) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.period_s:
            self._last[key] = now
            log.log(level, msg, *args, **kw)


class KvIngest(HttpPollMixin, RepairMixin):
    """Owns the ZMQ context and one feed per server. `index` is the router's `KvIndex`."""

    def __init__(self, index, *, block_size: int, key_scheme: str, replay_timeout_s: float,
                 rebuild_timeout_s: float, bind_endpoint: str | None = None,
                 http: Callable[[], aiohttp.ClientSession] | None = None,
                 on_ready: Callable[[str], None] | None = None):
        self.index = index
        self._on_ready = on_ready
        self.block_size = block_size
        self.key_scheme = key_scheme
        self.replay_timeout_s = replay_timeout_s
        self.rebuild_timeout_s = rebuild_timeout_s
        self.bind_endpoint = bind_endpoint
        self._http = http
        self.ctx: zmq.asyncio.Context | None = None
        self.feeds: dict[str, WorkerFeed] = {}
        self._by_topic: dict[bytes, WorkerFeed] = {}
        self._bound: zmq.asyncio.Socket | None = None
        self._bound_task: asyncio.Task | None = None
        self.bound_endpoint: str | None = None  # resolved (port 0 → real port)
        self.unknown_topic = 0
        self.bound_reader_restarts = 0
        self._rl = _RateLimitedLog()
        self._warned: set = set()   # (server, endpoint, reason) already logged once

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        if self.bind_endpoint:
            s = self._sub_socket()
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.bind(self.bind_endpoint)
            self.bound_endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bound = s
            self._bound_task = asyncio.create_task(
                self._supervised(None, "the bound endpoint",
                                 lambda: self._recv_loop(s, self._on_bound_frames, "the bound endpoint")),
                name="kv-ingest-bound")
            log.info("KV-event ingest bound at %s", self.bound_endpoint)

    async def stop(self) -> None:
        tasks = [t for f in self._all_feeds() for t in f.tasks]
        for server in list(self.feeds):
            self.detach(server, remove=False)
        if self._bound_task is not None:
            self._bound_task.cancel()
            tasks.append(self._bound_task)
            self._bound_task = None
        # Let cancelled readers and repairs run their cleanup (closing DEALER sockets) first:
        # a context cannot terminate while any of its sockets is open.
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._bound is not None:
            self._bound.close(linger=0)
            self._bound = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None

    def _all_feeds(self):
        for f in self.feeds.values():
            yield f
            yield from f.ranks

    def _sub_socket(self) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.LINGER, 0)
        # A peer sending a frame larger than any event batch is dropped by libzmq, not buffered.
        s.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 64)
        s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        return s

    # ---- membership -------------------------------------------------------------------------
    def attach(self, server: str, source: FeedSource) -> WorkerFeed:
        """Subscribe to a server's events and rebuild its index entries (idempotent per source).
        Never raises for a bad source: the feed then reports why it is not ready."""
        if self.ctx is None:
            raise RuntimeError("KvIngest.start() has not been called")
        cur = self.feeds.get(server)
        if cur is not None:
            if cur.source == source:
                return cur
            log.info("KV-event source of %s changed; resubscribing", server)
            self.detach(server, remove=False)
            self.index.clear_worker(server)
        feed = self._new_feed(server, source, 0)
        if source.transport == "zmq":
            feed.ranks = [self._new_feed(server, source, r) for r in range(1, max(1, source.dp_size))]
        self.feeds[server] = feed
        for f in (feed, *feed.ranks):
            self._open(f)
        return feed

    def _new_feed(self, server: str, source: FeedSource, rank: int) -> WorkerFeed:
        ep = source.endpoint if source.transport != "zmq" else rank_endpoint(source.endpoint, rank)
        feed = WorkerFeed(server=server, source=source, dp_rank=rank, endpoint=ep,
                          replay_endpoint=rank_endpoint(source.replay_endpoint, rank), index=self.index)
        feed.last_seq = None   # a new subscription starts its stream afresh
        return feed

    def _open(self, feed: WorkerFeed) -> None:
        src = feed.source
        if src.problem:
            self._connect_failed(feed, src.problem)
            return
        if src.transport == "http_poll":
            if self._http is None:
                feed.error = "no HTTP session to poll with"
                return
            self._spawn(feed, self._supervised(feed, feed.server, lambda: self._poll_loop(feed)))
            self._start_rebuild(feed, "initial")
            return
        if feed.endpoint:
            s = self._sub_socket()
            s.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
            # The monitor must exist before connect(), or the CONNECTED event can be missed.
            mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
                                       | zmq.EVENT_DISCONNECTED)
            try:
                s.connect(feed.endpoint)
            except zmq.ZMQError as exc:
                s.disable_monitor()
                mon.close(linger=0)
                s.close(linger=0)
                self._connect_failed(feed, f"cannot connect a SUB socket to {feed.endpoint!r}: {exc}")
                return
            feed.sock = s
            feed.connected = False
            self._spawn(feed, self._monitor(feed, s, mon))
            self._spawn(feed, self._supervised(
                feed, feed.server, lambda: self._recv_loop(s, lambda fr: self._on_frames(feed, fr),
                                                           feed.server)))
        elif src.topic:
            if self._bound is None:
                self._connect_failed(feed, f"publishes to topic {src.topic!r} on the coordinator's "
                                     "bound endpoint, but coordinator.event_ingest.bind_endpoint is "
                                     "not configured")
                return
            self._by_topic[src.topic.encode()] = feed
        else:
            self._connect_failed(feed, "KV-event source has neither an endpoint nor a topic")
            return
        self._start_rebuild(feed, "initial")

    def _connect_failed(self, feed: WorkerFeed, reason: str) -> None:
        """A source that cannot work as given: not ready, logged once, visible. Re-read from
        /server_info (or a config reload) replaces it."""
        feed.connect_failures += 1
        feed.error = reason
        feed.connected = False
        key = (feed.server, feed.endpoint, reason)
        if key not in self._warned:
            self._warned.add(key)
            log.warning("KV events of %s (rank %d, endpoint %s): %s", feed.server, feed.dp_rank,
                        feed.endpoint, reason)

    def detach(self, server: str, remove: bool = True) -> None:
        feed = self.feeds.pop(server, None)
        if feed is None:
            if remove:
                self.index.remove_worker(server)
            return
        for f in (feed, *feed.ranks):
            for t in list(f.tasks):
                t.cancel()
            if f.sock is not None:
                f.sock.close(linger=0)
                f.sock = None
        if feed.source.topic and self._by_topic.get(feed.source.topic.encode()) is feed:
            del self._by_topic[feed.source.topic.encode()]
        if remove:
            self.index.remove_worker(server)

    def resync(self, server: str, cause: str) -> None:
        """Forget a server's entries and rebuild them (e.g. the worker process was replaced)."""
        feed = self.feeds.get(server)
        self._clear(feed, server, cause, all_ranks=True)
        if feed is not None:
            for f in (feed, *feed.ranks):
                f.last_seq = None
                f.ready = False
                f.pending.clear()
            if self._on_ready is not None:
                self._on_ready(server)
            for f in (feed, *feed.ranks):
                self._start_rebuild(f, cause)

    def kv_ready(self, server: str) -> bool:
        feed = self.feeds.get(server)
        return True if feed is None else feed.usable and all(r.usable for r in feed.ranks)

    # ---- live path --------------------------------------------------------------------------
    def _spawn(self, feed: WorkerFeed, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        feed.tasks.add(t)
        t.add_done_callback(feed.tasks.discard)
        return t

    async def _supervised(self, feed: WorkerFeed | None, where: str, run) -> None:
        """Run a reader (`run()` → coroutine) until it returns; if it dies, count it, report it,
        forget what the lost messages may have changed, and start it again with backoff."""
        backoff = 0.05
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a reader must outlive its bugs
                if feed is None:
                    self.bound_reader_restarts += 1
                else:
                    feed.reader_restarts += 1
                    msg = f"reader restarted after {type(exc).__name__}: {exc}"
                    feed.error = msg
                    self._clear(feed, feed.server, "reader_restart")
                    feed.last_seq = None
                    self._changed(feed)
                self._rl(logging.ERROR, ("reader", where),
                         "KV-event reader of %s died (%s: %s); restarting in %.2fs", where,
                         type(exc).__name__, exc, backoff, exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, READER_BACKOFF_MAX_S)
                if feed is not None and feed.error == msg:
                    feed.error = None
                    self._changed(feed)

    async def _monitor(self, feed: WorkerFeed, sock: zmq.asyncio.Socket, mon) -> None:
        """Track the SUB connection: a publisher that cannot be reached is reported (once per
        endpoint), counted, and retried by libzmq with backoff."""
        try:
            while True:
                ev = await recv_monitor_message(mon)
                kind = ev["event"]
                if kind == zmq.EVENT_CONNECTED:
                    if feed.connect_failures:
                        log.info("KV events of %s: connected to %s after %d failed attempts",
                                 feed.server, feed.endpoint, feed.connect_failures)
                    feed.connected, feed.error = True, None
                    self._changed(feed)
                elif kind == zmq.EVENT_CONNECT_RETRIED:
                    feed.connect_failures += 1
                    feed.connected = False
                    feed.error = (f"cannot connect to {feed.endpoint} (attempt "
                                  f"{feed.connect_failures}; retrying every <= "
                                  f"{RECONNECT_MAX_MS / 1000:g}s)")
                    if feed.connect_failures == 1:
                        self._changed(feed)
                    key = (feed.server, feed.endpoint, "connect")
                    if key not in self._warned:
                        self._warned.add(key)
                        log.warning("KV events of %s: cannot connect to %s; retrying with backoff",
                                    feed.server, feed.endpoint)
                elif kind == zmq.EVENT_DISCONNECTED:
                    feed.connected = False
                    feed.error = f"disconnected from {feed.endpoint}; reconnecting"
                    self._changed(feed)
                    self._rl(logging.WARNING, ("disconnect", feed.server),
                             "KV events of %s: disconnected from %s", feed.server, feed.endpoint)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)

    async def _recv_loop(self, sock, handle, where: str) -> None:
        """Hand every multipart message of ``sock`` to ``handle`` until the socket is closed;
        transient ZMQ errors are logged (rate-limited) and retried, never fatal."""
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self._rl(logging.WARNING, ("recv", where), "KV events from %s: %s", where, exc)
                await asyncio.sleep(0.1)
                continue
            handle(frames)

    def _on_bound_frames(self, frames: list[bytes]) -> None:
        feed = self._by_topic.get(frames[0]) if len(frames) == 3 else None
        if feed is None:
            self.unknown_topic += 1
            self._rl(logging.WARNING, ("topic", frames[0] if frames else b""),
                     "KV events on the bound endpoint with unknown topic %r dropped",
                     frames[0][:64] if frames else b"")
            return
        self._on_frames(feed, frames)

    def _on_frames(self, feed: WorkerFeed, frames: list[bytes]) -> None:
        try:
            batch = decode_zmq(frames, engine=feed.source.engine)
        except Exception as exc:  # noqa: BLE001 - decode_zmq raises EventDecodeError; anything else is a bug, contained too
            seq = int.from_bytes(frames[-2], "big") \
                if len(frames) >= 2 and len(frames[-2]) == 8 else None
            self._lost(feed, seq, "decode_error", exc)
            return
        try:
            self._ingest(feed, batch, front=False)
        except Exception as exc:  # noqa: BLE001 - the ordering logic must not kill the reader
            self._lost(feed, batch.seq, "ingest_error", exc)

    def _lost(self, feed: WorkerFeed, seq: int | None, cause: str, exc: BaseException) -> None:
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
        self._clear(feed, feed.server, cause)
        feed.last_seq = seq
        if feed.source.snapshot_url:
            self._start_rebuild(feed, cause)

    def _ingest(self, feed: WorkerFeed, batch, front: bool) -> None:
        """Apply, buffer, or repair around one batch; the ordering is the index's
        (`KvIndex.apply_batch`). `front` marks a batch drained from the repair buffer (it goes
        back to the front if another repair starts)."""
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
            self._clear(feed, feed.server, "seq_reset")
            feed.last_seq = None
            self._buffer(feed, batch, front)
            self._start_rebuild(feed, "seq_reset")
            return
        feed.gaps += 1
        self._rl(logging.WARNING, ("gap", feed.server), "KV-event gap from %s: expected seq %d, got %d",
                 feed.server, last + 1, batch.seq)
        self._buffer(feed, batch, front)
        feed.repairing = True
        self._spawn(feed, self._repair_gap(feed, last + 1))

    def _buffer(self, feed: WorkerFeed, batch, front: bool) -> None:
        if len(feed.pending) >= MAX_PENDING:
            feed.pending.clear()
            self._clear(feed, feed.server, "buffer_overflow")
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

    def _clear(self, feed: WorkerFeed | None, server: str, cause: str,
               all_ranks: bool = False) -> None:
        """Forget what one stream told us: its DP rank's entries when the server publishes per
        rank (the other ranks' streams are intact), else all of the server's."""
        primary = self.feeds.get(server)
        if feed is not None and not all_ranks and primary is not None and primary.ranks:
            self.index.apply(server, AllCleared(None), feed.dp_rank)
        else:
            self.index.clear_worker(server)
        if feed is not None:
            feed.clears[cause] = feed.clears.get(cause, 0) + 1

    def _drain(self, feed: WorkerFeed) -> None:
        while feed.pending and not feed.repairing:
            self._ingest(feed, feed.pending.popleft(), front=True)


def _n_blocks(ev) -> int:
    hashes = getattr(ev, "engine_hashes", None)
    if hashes is None:
        hashes = getattr(ev, "block_hashes", ())
    return len(hashes)
