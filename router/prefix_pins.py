"""Implicit sessions for ``kv_cache_aware``: which server the latest placement of a prompt prefix
went to, remembered past its cache.

The KV index says where a prefix *is cached*; this says where its prefix tree *lives*. They
differ once a server's LRU evicted a tree (or the index's capacity model predicts it did): the
index then matches nothing anywhere and the tree's next request goes wherever load sends it, is
computed again there, and the tree ends up split over servers, each holding a copy. The
``conversation`` policy keeps a tree on its server whatever its cache holds, and on the Mooncake
trace it cached more than ``kv_cache_aware`` for that reason (docs/routing.md, "What the benchmark
says"). ``kv_cache_aware`` credits the pinned prefix in its time cost instead (router/policy_kv.py),
so load still decides against it.

Marks are the prompt's block keys at every ``stride``-th position for its first ``NEAR`` marks
(``stride - 1``, ``2 * stride - 1``, ...), then every ``FAR * stride``-th: a long prompt's depth
is known to a few percent with a handful of marks (a 4k-token prompt at 16-token blocks and stride
8: 14 marks, not 32). Keys are chained (a key names its whole prefix), so the marks registered for
one prompt are a prefix of its marks, and the deepest registered mark of a prompt is found by a
binary search. A placement pins every mark of its prompt to the server it chose (``find``, then
``put``): the prefix tree goes with its latest request.

Bound: marks go into a current generation of at most ``max_marks / 2``; a new mark past that
starts a new generation and drops the one before (lookups read both). The tables are
router/_prefix_pins.c where it built (``NATIVE``; the Python recipe cost ~11k instructions per
placement, ~9% of a 4k-token select; the native one is two calls, ``credit`` (``find`` and
the credit's comparisons, ``session_credit``) and ``put``), else
the same recipe over two dicts below (``PyPinTable``); tests/router/test_prefix_pins.py checks
the two against each other.

Pure and synchronous; single writer.
"""

from __future__ import annotations

from operator import countOf

import numpy as np

try:    # router/_prefix_pins.c, built by setup.py
    from ._prefix_pins import PinTable as _NativeTable
except ImportError:     # no C compiler at install time: the recipe below
    _NativeTable = None

NATIVE = _NativeTable is not None

__all__ = ["NATIVE", "NEAR", "FAR", "PrefixPins", "count", "position", "session_credit"]

# the first NEAR marks every stride keys, then every FAR * stride keys
NEAR = 8
FAR = 4


def count(stride: int, n: int) -> int:
    """How many marks a prompt of ``n`` block keys has."""
    near = NEAR * stride
    return n // stride if n < near else NEAR + (n - near) // (FAR * stride)


def position(stride: int, j: int) -> int:
    """The key position of a prompt's ``j``-th mark (1-based)."""
    return j * stride - 1 if j <= NEAR else (NEAR + (j - NEAR) * FAR) * stride - 1


class PyPinTable:
    """router/_prefix_pins.c's `PinTable` as Python: marks -> server in two generations."""

    def __init__(self, stride: int, near: int, far: int, limit: int):
        assert (near, far) == (NEAR, FAR)
        self.stride, self.limit = stride, limit
        self.cur: dict[int, int] = {}
        self.old: dict[int, int] = {}
        self.marks: list[int] = []
        self.names: list[str | None] = []       # id -> server (None: it left)
        self.ids: dict[str, int] = {}           # server -> id

    def _get(self, k: int) -> int:
        i = self.cur.get(k)
        return i if i is not None else self.old.get(k, -1)

    def find(self, keys) -> tuple[str | None, int]:
        st = self.stride
        hi = count(st, len(keys))
        # ints as u64s, as the native table reads them (an int64 array's negative values too)
        rows = keys if type(keys) is list else np.asarray(keys).view(np.uint64)
        self.marks = marks = [int(rows[position(st, j)]) for j in range(1, hi + 1)]
        if any(not 0 <= k < 1 << 64 for k in marks):
            raise OverflowError("find: block keys must be u64 ints")
        lo = 0
        if hi:
            if self._get(marks[-1]) >= 0:
                lo = hi
            else:
                hi -= 1
                while lo < hi:
                    mid = (lo + hi + 1) >> 1
                    if self._get(marks[mid - 1]) >= 0:
                        lo = mid
                    else:
                        hi = mid - 1
        s = self.names[self._get(marks[lo - 1])] if lo else None
        return (s, position(st, lo) + 1) if s is not None else (None, 0)

    def credit(self, keys, matched, block_size, cap, num_tokens, weight, bonus):
        return session_credit(self.find(keys), matched, block_size, cap, num_tokens, weight, bonus)

    def put(self, server: str) -> None:
        i = self.ids.get(server)
        if i is None:
            i = self.ids[server] = len(self.names)
            self.names.append(server)
        for k in self.marks:
            cur = self.cur
            if k not in cur and len(cur) >= self.limit:
                self.old, self.cur = cur, {}
                cur = self.cur
            cur[k] = i

    def remove_server(self, server: str) -> None:
        i = self.ids.pop(server, None)
        if i is not None:
            self.names[i] = None

    def __len__(self) -> int:
        return len(self.cur) + len(self.old)


def session_credit(found, matched, block_size: int, cap: int, num_tokens: int, weight, bonus):
    """kv_cache_aware's implicit-session credit (router/policy_kv.py `select`) on ``found``, a
    `find`'s ``(server, block keys covered)``: ``(server, bonus)``, the bonus ``bonus`` where the
    server holds more of the prompt than every other server's match in ``matched`` (the index's
    server -> blocks): its match alone deepest, or its registered prefix (capped at ``cap``
    tokens) deeper than every match; else 0.0. Plus ``weight`` x (registered - matched there) /
    ``num_tokens`` where the registered prefix is deeper than the match. ``bonus`` unchanged
    with no server or no tokens. The recipe of the native tables' ``credit`` (one call:
    router/_prefix_pins.c), and what the policy uses where ``matched`` is not a dict of ints."""
    server, held = found
    if server is None or not num_tokens:
        return server, bonus
    held *= block_size
    mb = matched.get(server, 0)
    mt = mb * block_size
    if held > cap:
        held = cap
    # C-level calls: no per-server loop
    top = max(matched.values()) if matched else 0
    if not (mb == top and mb and countOf(matched.values(), top) == 1) and held <= top * block_size:
        bonus = 0.0
    if held > mt:
        bonus += weight * (held - mt) / num_tokens
    return server, bonus


def PrefixPins(stride: int, max_marks: int, native: bool | None = None):
    """A table of prompt prefixes -> the server of their latest placement, ``max_marks`` marks at
    most: ``find(keys) -> (server, block keys covered)`` (``(None, 0)``: none registered), or
    ``credit(keys, matched, ...)`` (`session_credit` after `find`, one call), then
    ``put(server)``, the server the placement of the prompt ``find`` read last chose;
    ``remove_server(server)``. router/_prefix_pins.c where it built (``native`` None), else
    ``PyPinTable``."""
    if type(stride) is not int or stride < 1:
        raise ValueError(f"stride must be a positive int, found {stride!r}")
    if type(max_marks) is not int or max_marks < 2:
        raise ValueError(f"max_marks must be an int >= 2, found {max_marks!r}")
    table = _NativeTable if (NATIVE if native is None else native) else PyPinTable
    return table(stride, NEAR, FAR, max_marks // 2)
