"""`FeedSync` (coordinator/kv_sync.py) alone: the feeds' ordering, repair buffer and gap rules
into a real `KvIndex`, fed decoded batches directly (no sockets: the transports that hand it
batches are tested end to end in test_kv_ingest.py and test_kv_http_poll.py). A replay that
cannot be had (no replay endpoint) leaves the unrepairable-gap path: entries cleared, the stream
restarting at the next batch."""
from __future__ import annotations

import asyncio

from coordinator.kv_feed import FeedSource, WorkerFeed
from coordinator.kv_sync import FeedSync
from router.block_keys import block_keys_list
from router.events import BlocksStored, EventBatch
from router.kv_index import KvIndex

B = 16
TOKS = list(range(1000, 1000 + 8 * B))
KEYS = block_keys_list(TOKS, B)


def _batch(seq: int, i: int) -> EventBatch:
    """The i-th block of TOKS, stored as our workers publish it (engine hash == key)."""
    parent = KEYS[i - 1] if i else None
    return EventBatch(seq, 0.0, None, [BlocksStored([KEYS[i]], parent, TOKS[i * B:(i + 1) * B], B)])


def _setup():
    index = KvIndex(B)
    feeds: dict[str, WorkerFeed] = {}
    ready: list[str] = []
    sync = FeedSync(index, feeds, block_size=B, key_scheme="xxh3", replay_timeout_s=1.0,
                    rebuild_timeout_s=1.0, http=None, on_ready=ready.append)
    feed = WorkerFeed(server="http://w", source=FeedSource(endpoint=None), index=index, ready=True)
    feeds["http://w"] = feed
    return index, sync, feed, ready


async def _settled(feed: WorkerFeed) -> None:
    while feed.tasks:
        await asyncio.gather(*list(feed.tasks))


async def test_batches_apply_in_order_and_duplicates_of_a_repair_are_dropped():
    index, sync, feed, _ = _setup()
    for seq in range(3):
        sync.ingest(feed, _batch(seq, seq))
    assert feed.last_seq == 2 and index.longest_prefix(KEYS) == {"http://w": 3}
    assert feed.batches_applied == 3 and feed.blocks_stored == 3
    # while a repair runs, batches wait in the buffer; drained, an old one is stale, not a reset
    feed.repairing = True
    sync.ingest(feed, _batch(3, 3))
    sync.ingest(feed, _batch(1, 1))
    assert list(b.seq for b in feed.pending) == [3, 1] and feed.last_seq == 2
    feed.repairing = False
    sync.drain(feed)        # what the repair does when it ends
    assert feed.last_seq == 3 and feed.stale_dropped == 1 and feed.resets == 0
    assert index.longest_prefix(KEYS) == {"http://w": 4}


async def test_an_unrepairable_gap_clears_and_restarts_the_stream():
    index, sync, feed, _ = _setup()
    sync.ingest(feed, _batch(0, 0))
    sync.ingest(feed, _batch(1, 1))
    sync.ingest(feed, _batch(5, 0))         # seqs 2-4 lost; no replay endpoint, no snapshot
    assert feed.gaps == 1 and feed.repairing
    await _settled(feed)
    assert not feed.repairing and feed.clears == {"gap_unrepaired": 1}
    # the buffered batch restarted the stream after the clear
    assert feed.last_seq == 5 and index.keys_of("http://w") == {KEYS[0]}
    assert index.longest_prefix(KEYS) == {"http://w": 1}


async def test_a_live_seq_going_back_is_a_publisher_restart():
    index, sync, feed, ready = _setup()
    for seq in range(3):
        sync.ingest(feed, _batch(seq, seq))
    sync.ingest(feed, _batch(0, 0))         # a new publisher incarnation
    assert feed.resets == 1 and feed.clears["seq_reset"] == 1
    await _settled(feed)
    assert feed.sync_outcome == "live only" and feed.last_seq == 0
    assert index.keys_of("http://w") == {KEYS[0]}
    assert ready == []                      # it was ready before: no change to announce


async def test_a_lost_batch_clears_the_rank_of_a_per_rank_server_only():
    index, sync, feed, _ = _setup()
    rank1 = WorkerFeed(server="http://w", source=feed.source, dp_rank=1, index=index, ready=True)
    feed.ranks.append(rank1)
    sync.ingest(feed, _batch(0, 0))
    sync.ingest(rank1, _batch(0, 1))
    sync.lost(rank1, 1, "decode_error", ValueError("bad bytes"))
    assert rank1.decode_errors == 1 and rank1.clears == {"decode_error": 1}
    assert index.keys_of("http://w", 0) == {KEYS[0]} and index.keys_of("http://w", 1) == set()
    assert rank1.last_seq == 1      # the stream goes on with the next batch
    # a detached feed's usability changes are not announced
    assert sync.attached(rank1) and not sync.attached(WorkerFeed("http://x", feed.source))
