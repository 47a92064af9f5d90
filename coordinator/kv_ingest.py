"""KV-event ingestion: the feeds of every server with an event source, over ZMQ or HTTP polls.

`KvIngest` owns the ZMQ context and sockets, the table of attached feeds (`WorkerFeed`, one per
server and DP rank) and their readers; it hands every decoded batch to `FeedSync`
(coordinator/kv_sync.py: ordering, buffering, gap repair and rebuilds, the invariants of the
entries) and runs `HttpPoller` (coordinator/kv_poll.py) for HTTP sources. Invariants here:
- Nothing blocks: sockets are zmq.asyncio, HTTP is aiohttp, and every wait has a timeout.
- A reader that dies is restarted with backoff and counted (`reader_restarts`); what its lost
  messages may have changed is cleared first.
- A feed that cannot connect is not ready (`kv_ready` false, `error` says why, shown in
  /cluster_info); the failure is logged once per endpoint, counted, and retried with backoff
  (ZMQ's reconnect interval, doubling to `RECONNECT_MAX_MS`; HTTP polls back off the same way).
- Epochs (docs/failover.md "Worker restarts"): `fence` retires a server's publisher epoch,
  adopts the new one and rebuilds; `FeedSync` rejects what a retired epoch still sends and calls
  `on_epoch` for a new one seen on the stream. A feed that disconnects calls `on_disconnect` (the
  coordinator re-reads the server's `/server_info` at once: a restart?).
- Transports: `zmq` (SUB per data-parallel rank: port base + rank, as vLLM and SGLang bind), or
  `http_poll` (TensorRT-LLM's destructive `POST /kv_cache_events`, `seq` = `event_id` per
  attention-DP rank). Both go through the same ordering, gap and clear rules.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from coordinator.kv_feed import FeedSource, RateLimitedLog, WorkerFeed, rank_endpoint, spawn
from coordinator.kv_poll import HttpPoller
from coordinator.kv_sync import FeedSync
from router.events import MAX_PAYLOAD_BYTES, decode_zmq

__all__ = ["FeedSource", "KvIngest"]

log = logging.getLogger("splitserve.coordinator.kv_ingest")

RECONNECT_MS = 100          # first ZMQ reconnect interval; libzmq doubles it up to the max
RECONNECT_MAX_MS = 5000
READER_BACKOFF_MAX_S = 5.0
TRANSPORTS = ("zmq", "http_poll")


class KvIngest:
    """Owns the ZMQ context and one feed per server. `index` is the router's `KvIndex`."""

    def __init__(self, index, *, block_size: int, key_scheme: str, replay_timeout_s: float,
                 rebuild_timeout_s: float, bind_endpoint: str | None = None,
                 http: Callable[[], aiohttp.ClientSession] | None = None,
                 on_ready: Callable[[str], None] | None = None,
                 on_restart: Callable[[str, str], None] | None = None,
                 on_disconnect: Callable[[str], None] | None = None):
        self.index = index
        self._on_ready = on_ready
        self.on_restart = on_restart
        self.on_disconnect = on_disconnect
        self.bind_endpoint = bind_endpoint
        self.ctx: zmq.asyncio.Context | None = None
        self.feeds: dict[str, WorkerFeed] = {}
        self._sync = FeedSync(index, self.feeds, block_size=block_size, key_scheme=key_scheme,
                              replay_timeout_s=replay_timeout_s,
                              rebuild_timeout_s=rebuild_timeout_s, http=http, on_ready=on_ready,
                              on_epoch=self._new_epoch, on_restart=on_restart)
        self._poller = HttpPoller(http, self._sync, replay_timeout_s) if http is not None else None
        self._by_topic: dict[bytes, WorkerFeed] = {}
        self._bound: zmq.asyncio.Socket | None = None
        self._bound_task: asyncio.Task | None = None
        self.bound_endpoint: str | None = None  # resolved (port 0 → real port)
        self.unknown_topic = 0
        self.bound_reader_restarts = 0
        self._rl = RateLimitedLog()
        self._warned: set = set()   # (server, endpoint, reason) already logged once

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self.ctx = self._sync.ctx = zmq.asyncio.Context()
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
            self.ctx = self._sync.ctx = None

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
            if self._poller is None:
                feed.error = "no HTTP session to poll with"
                return
            spawn(feed, self._supervised(feed, feed.server, lambda: self._poller.run(feed)))
            self._sync.start_rebuild(feed, "initial")
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
            spawn(feed, self._monitor(feed, s, mon))
            spawn(feed, self._supervised(
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
        self._sync.start_rebuild(feed, "initial")

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
        self._sync.clear(feed, server, cause, all_ranks=True)
        if feed is not None:
            for f in (feed, *feed.ranks):
                f.last_seq = None
                f.ready = False
                f.pending.clear()
            if self._on_ready is not None:
                self._on_ready(server)
            for f in (feed, *feed.ranks):
                self._sync.start_rebuild(f, cause)

    def epoch(self, server: str) -> str | None:
        feed = self.feeds.get(server)
        return feed.epoch if feed is not None else None

    def set_epoch(self, server: str, epoch: str | None) -> None:
        """The epoch the server advertises (`/server_info`), adopted when the feed knows none."""
        feed = self.feeds.get(server)
        if feed is not None and epoch and feed.epoch is None:
            feed.epoch = epoch

    def fence(self, server: str, epoch: str | None, cause: str) -> None:
        """The server's process was replaced: retire its previous epoch (what it still sends is
        dropped), adopt `epoch`, forget its entries and rebuild them."""
        feed = self.feeds.get(server)
        if feed is None:
            self.index.clear_worker(server)
            return
        if feed.epoch is not None and feed.epoch != epoch:
            feed.retired_epochs.add(feed.epoch)
        feed.epoch = epoch
        feed.epoch_changes += 1
        self.resync(server, cause)

    def _new_epoch(self, server: str, epoch: str) -> None:
        """A new publisher epoch on the stream, before `/server_info` said so."""
        if self.on_restart is not None:
            self.on_restart(server, "epoch_change")
        self.fence(server, epoch, "epoch_change")

    def kv_ready(self, server: str) -> bool:
        feed = self.feeds.get(server)
        return True if feed is None else feed.usable and all(r.usable for r in feed.ranks)

    # ---- readers ---------------------------------------------------------------------------
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
                    self._sync.clear(feed, feed.server, "reader_restart")
                    feed.last_seq = None
                    self._sync.changed(feed)
                self._rl(logging.ERROR, ("reader", where),
                         "KV-event reader of %s died (%s: %s); restarting in %.2fs", where,
                         type(exc).__name__, exc, backoff, exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, READER_BACKOFF_MAX_S)
                if feed is not None and feed.error == msg:
                    feed.error = None
                    self._sync.changed(feed)

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
                    self._sync.changed(feed)
                elif kind == zmq.EVENT_CONNECT_RETRIED:
                    feed.connect_failures += 1
                    feed.connected = False
                    feed.error = (f"cannot connect to {feed.endpoint} (attempt "
                                  f"{feed.connect_failures}; retrying every <= "
                                  f"{RECONNECT_MAX_MS / 1000:g}s)")
                    if feed.connect_failures == 1:
                        self._sync.changed(feed)
                    key = (feed.server, feed.endpoint, "connect")
                    if key not in self._warned:
                        self._warned.add(key)
                        log.warning("KV events of %s: cannot connect to %s; retrying with backoff",
                                    feed.server, feed.endpoint)
                elif kind == zmq.EVENT_DISCONNECTED:
                    feed.connected = False
                    feed.error = f"disconnected from {feed.endpoint}; reconnecting"
                    self._sync.changed(feed)
                    self._rl(logging.WARNING, ("disconnect", feed.server),
                             "KV events of %s: disconnected from %s", feed.server, feed.endpoint)
                    if self.on_disconnect is not None:
                        self.on_disconnect(feed.server)
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
            self._sync.lost(feed, seq, "decode_error", exc)
            return
        try:
            self._sync.ingest(feed, batch)
        except Exception as exc:  # noqa: BLE001 - the ordering logic must not kill the reader
            self._sync.lost(feed, batch.seq, "ingest_error", exc)
