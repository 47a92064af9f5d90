"""`KvIndex.apply_batch`'s stream options the coordinator's KV ingest uses (coordinator/kv_ingest.py):
the stream's rank for batches that name none, and seq 0 behind the expected seq as a duplicate
(a batch buffered while a snapshot loaded) instead of a restart."""
from __future__ import annotations

from router.events import BlocksStored, EventBatch
from router.kv_index import KvIndex, StreamVerdict

TOKS = list(range(100, 132))


def _stored(h: int, toks: list[int]) -> BlocksStored:
    return BlocksStored(engine_hashes=[h], parent_engine_hash=None, token_ids=toks, engine_block_size=16)


def test_rank_of_a_batch_without_one():
    idx = KvIndex(block_size=16)
    b = EventBatch(0, 0.0, None, [_stored(1, TOKS[:16])])
    assert idx.apply_batch("w", b, 3) == StreamVerdict.APPLIED
    assert idx.expected_seq("w", 3) == 1 and idx.expected_seq("w", 0) is None
    # a batch naming its rank keeps it
    assert idx.apply_batch("w", EventBatch(0, 0.0, 2, []), 3) == StreamVerdict.APPLIED
    assert idx.expected_seq("w", 2) == 1 and idx.expected_seq("w", 3) == 1


def test_seq_zero_behind_the_stream_is_a_duplicate_when_asked():
    idx = KvIndex(block_size=16)
    idx.apply_batch("w", EventBatch(0, 0.0, 0, [_stored(1, TOKS[:16])]))
    idx.reset_stream("w", 0, 6)       # a snapshot taken at seq 5
    late = EventBatch(0, 0.0, 0, [_stored(2, TOKS[16:32])])
    assert idx.apply_batch("w", late, restart_at_zero=False) == StreamVerdict.DUPLICATE
    assert idx.expected_seq("w") == 6 and idx.worker_size("w") == 1
    # the default reads it as an engine restart: cleared, then applied
    assert idx.apply_batch("w", late) == StreamVerdict.RESTART
    assert idx.expected_seq("w") == 1
