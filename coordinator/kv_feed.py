"""The data of KV-event feeds: where a server's events come from (`FeedSource`) and one stream's
state and counters (`WorkerFeed`, one per data-parallel rank). Owned by `coordinator.kv_ingest`;
written by its parts (`coordinator.kv_sync.FeedSync`, `coordinator.kv_poll.HttpPoller`)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

log = logging.getLogger("splitserve.coordinator.kv_ingest")


class RateLimitedLog:
    """``log.log`` at most once per ``period_s`` per key (a feed that keeps failing)."""

    def __init__(self, period_s: float = 10.0):
        self.period_s = period_s
        self._last: dict = {}

    def __call__(self, level: int, key, msg: str, *args, **kw) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.period_s:
            self._last[key] = now
            log.log(level, msg, *args, **kw)


@dataclass(frozen=True, slots=True)
class FeedSource:
    """Where one server's events come from.

    `zmq`: `endpoint` is the SUB endpoint of DP rank 0 (rank r: `rank_endpoint(endpoint, r)`), or
    None = the publisher connects to our bound endpoint and is recognised by its (non-empty)
    `topic`. `http_poll`: `endpoint` is the full URL to `POST` (a trtllm-serve
    `/kv_cache_events`), polled every `poll_interval_s`. `origin` says who named the source
    (`config` or the server's `/server_info`), for /cluster_info."""
    endpoint: str | None
    replay_endpoint: str | None = None
    topic: str = ""
    engine: str = "vllm"
    snapshot_url: str | None = None   # full http URL of the worker's /kv_snapshot
    transport: str = "zmq"
    dp_size: int = 1
    poll_interval_s: float = 0.5
    origin: str = "advertised"
    problem: str | None = None   # the source as given cannot work (reported, never guessed at)


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of DP rank `rank`: tcp port + rank (port 0 left alone), `_dp{rank}` appended to
    ipc/inproc paths. This is `ZmqEventPublisher.offset_endpoint_port` of vLLM 0.33
    (`vllm/distributed/kv_events.py`) and SGLang 0.5.23 (`srt/disaggregation/kv_events.py`)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


@dataclass(slots=True, eq=False)
class WorkerFeed:
    server: str
    source: FeedSource
    dp_rank: int = 0
    ranks: list = field(default_factory=list)    # feeds of DP ranks 1.. (rank 0's feed only)
    endpoint: str | None = None                  # this rank's endpoint
    replay_endpoint: str | None = None
    sock: zmq.asyncio.Socket | None = None
    connected: bool | None = None                # None: not known (bound endpoint, not polled yet)
    error: str | None = None                     # why the feed is not delivering, if it is not
    connect_failures: int = 0
    reader_restarts: int = 0
    polls: int = 0
    index: Any = None                            # the KvIndex that holds this stream's position
    ready: bool = False
    repairing: bool = False
    pending: deque = field(default_factory=deque)
    tasks: set = field(default_factory=set)
    repairs_in_a_row: int = 0
    # counters
    batches_applied: int = 0
    events_applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    gaps: int = 0
    replays: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    snapshots: int = 0
    resets: int = 0
    clears: dict = field(default_factory=dict)   # cause -> count
    decode_errors: int = 0
    apply_errors: int = 0
    stale_dropped: int = 0
    # The publisher's incarnation (rank 0's feed holds it for the server): from /server_info or
    # the stream's batches; batches and snapshots of a retired one are rejected.
    epoch: str | None = None
    retired_epochs: set = field(default_factory=set)
    stale_epoch_dropped: int = 0
    epoch_changes: int = 0
    last_ts: float | None = None                 # publisher wall time of the last applied batch
    lag_s: float | None = None                   # apply time - publish time of that batch
    last_applied_mono: float | None = None
    sync_started_mono: float | None = None
    sync_outcome: str = "pending"

    @property
    def last_seq(self) -> int | None:
        """The last applied seq of this rank's stream (-1: nothing published yet, the next batch
        must be seq 0; None: not known, the next batch starts the stream). A view of the index's
        `expected_seq`, the one copy of the ordering state; setting it is `reset_stream`."""
        nxt = self.index.expected_seq(self.server, self.dp_rank)
        return None if nxt is None else nxt - 1

    @last_seq.setter
    def last_seq(self, seq: int | None) -> None:
        self.index.reset_stream(self.server, self.dp_rank, None if seq is None else seq + 1)

    @property
    def usable(self) -> bool:
        """Synced, and not known to be cut off from its publisher."""
        return self.ready and self.error is None and self.connected is not False

    def describe(self, now_mono: float) -> dict:
        d = self._describe(now_mono)
        if self.ranks:
            d["ranks"] = [r._describe(now_mono) for r in self.ranks]
            d["ready"] = d["ready"] and all(r["ready"] for r in d["ranks"])
        return d

    def _describe(self, now_mono: float) -> dict:
        return {
            "dp_rank": self.dp_rank,
            "transport": self.source.transport,
            "origin": self.source.origin,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.source.topic,
            "format": self.source.engine,
            "snapshot": self.source.snapshot_url,
            "ready": self.usable,
            "error": self.error,
            "connected": self.connected,
            "connect_failures": self.connect_failures,
            "reader_restarts": self.reader_restarts,
            "synced": self.ready,
            "sync": self.sync_outcome,
            "repairing": self.repairing,
            "last_seq": self.last_seq,
            "lag_s": None if self.lag_s is None else round(self.lag_s, 6),
            "age_s": None if self.last_applied_mono is None else round(now_mono - self.last_applied_mono, 3),
            "batches_applied": self.batches_applied,
            "events_applied": self.events_applied,
            "blocks_stored": self.blocks_stored,
            "blocks_removed": self.blocks_removed,
            "gaps": self.gaps,
            "replays": {"ok": self.replays_ok, "failed": self.replays_failed},
            "snapshots": self.snapshots,
            "resets": self.resets,
            "epoch": self.epoch,
            "epoch_changes": self.epoch_changes,
            "stale_epoch_dropped": self.stale_epoch_dropped,
            "clears": dict(self.clears),
            "decode_errors": self.decode_errors,
            "apply_errors": self.apply_errors,
        }


def spawn(feed: WorkerFeed, coro) -> asyncio.Task:
    """Run ``coro`` as one of the feed's tasks (cancelled when the feed is detached)."""
    t = asyncio.get_running_loop().create_task(coro)
    feed.tasks.add(t)
    t.add_done_callback(feed.tasks.discard)
    return t
