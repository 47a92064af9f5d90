"""The scheduler's table of live requests (``RequestTable``): each unfinished ``Seq`` by its id, and
every name a client may abort it by (request id, aliases, a context leg's ``ctx_request_id``)."""
from __future__ import annotations

from typing import Iterable, Iterator

from worker.sequence import Seq

__all__ = ["RequestTable"]


class RequestTable:
    """Live sequences and the names that reach them.

    Invariants: a sequence is present from ``add`` until ``remove``; each name maps to the non-empty
    set of ids of live sequences registered under it (several requests may share an alias), and a
    removed sequence is reachable by none of its names. Sequence ids are unique (``add`` refuses a
    duplicate)."""

    __slots__ = ("_seqs", "_names", "_by_name")

    def __init__(self) -> None:
        self._seqs: dict[str, Seq] = {}
        self._names: dict[str, frozenset[str]] = {}  # seq id -> the names it was registered under
        self._by_name: dict[str, set[str]] = {}      # name -> ids of live sequences

    def add(self, seq: Seq, names: Iterable) -> None:
        """Register ``seq`` under its own id and ``names``."""
        if seq.id in self._seqs:
            raise ValueError(f"request id {seq.id!r} is already live")
        self._seqs[seq.id] = seq
        own = frozenset({str(seq.id), *(str(a) for a in names)})
        self._names[seq.id] = own
        for a in own:
            self._by_name.setdefault(a, set()).add(seq.id)

    def remove(self, seq: Seq) -> None:
        """Forget ``seq`` and every name it holds alone; no-op when it is not live."""
        if self._seqs.pop(seq.id, None) is None:
            return
        for a in self._names.pop(seq.id):
            ids = self._by_name.get(a)
            if ids is not None:
                ids.discard(seq.id)
                if not ids:
                    del self._by_name[a]

    def get(self, sid: str) -> Seq | None:
        return self._seqs.get(sid)

    def named(self, name) -> list[str]:
        """Ids of the live sequences ``name`` reaches (a copy: safe to finish them while iterating)."""
        return list(self._by_name.get(str(name), ()))

    def ids(self) -> list[str]:
        return list(self._seqs)

    def __contains__(self, sid: object) -> bool:
        return sid in self._seqs

    def __iter__(self) -> Iterator[Seq]:
        return iter(list(self._seqs.values()))

    def __len__(self) -> int:
        return len(self._seqs)
