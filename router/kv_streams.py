"""Event ordering: the next expected batch seq of each ``(worker, dp_rank)`` event stream.

`StreamOrder` decides what a batch is (the next one, a duplicate, one past a gap, an engine
restart) and moves its stream on once the index applied it; it holds nothing else.

Invariant: a stream's expected seq is set only by `applied` (one past the batch applied) or by
`reset` (a resync), and is absent until either happened (the first batch is taken whatever its
seq).
"""

from __future__ import annotations

__all__ = ["StreamOrder", "StreamVerdict"]


class StreamVerdict:
    """What ``KvIndex.apply_batch`` did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq already applied: ignored
    GAP = "gap"              # seq ahead of the next expected one: NOT applied; replay or resync
    RESTART = "restart"      # seq went back to 0: the engine restarted; slot cleared, then applied


class StreamOrder:
    """Per ``(worker, dp_rank)``: the seq of the next batch to apply."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, int], int] = {}

    def verdict(self, worker: str, dp_rank: int, seq: int, restart_at_zero: bool = True) -> str:
        """APPLIED (apply it), RESTART (clear the slot, then apply it), DUPLICATE or GAP (do not
        apply it). With ``restart_at_zero=False`` a seq-0 batch behind the expected seq is a
        DUPLICATE: for batches that may predate a resync."""
        expected = self._next.get((worker, dp_rank))
        if expected is None or seq == expected:
            return StreamVerdict.APPLIED
        if seq == 0 and expected > 1 and restart_at_zero:
            return StreamVerdict.RESTART
        return StreamVerdict.DUPLICATE if seq < expected else StreamVerdict.GAP

    def applied(self, worker: str, dp_rank: int, seq: int) -> None:
        self._next[(worker, dp_rank)] = seq + 1

    def expected(self, worker: str, dp_rank: int) -> int | None:
        return self._next.get((worker, dp_rank))

    def reset(self, worker: str, dp_rank: int, next_seq: int | None = None) -> None:
        """Forget (``None``) or set the stream's next expected seq."""
        if next_seq is None:
            self._next.pop((worker, dp_rank), None)
        else:
            self._next[(worker, dp_rank)] = next_seq
