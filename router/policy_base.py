"""What every routing policy shares: the candidate, routing-key and decision records, the load
view, the healthy-candidate filter, the conversation-pin LRU and the ``Policy`` interface
(router/policies.py holds the policies and ``make_policy``).

``Policy.select(candidates, key, view) -> Decision``; the explanation record is
``{"policy", "candidates": [{"server", "matched_tokens", "load_requests", "load_tokens",
"score", "why"}], "chosen", "reason", "num_tokens", "matched_tokens"}`` (plus policy-specific
keys such as ``"conversation"``). ``score`` is a cost where lower wins (``kv_cache_aware``), the
load metric (``load_balancing``), or None where no score applies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from protocol.failures import NoServerAvailable


# eq=False: a candidate equals only itself. kv_cache_aware keeps what it derived from the last
# candidate list while the list's elements are the same (router/policy_kv.py); compared by value,
# a rebuilt list of equal candidates (the coordinator rebuilds them when a server's state changes)
# cost a field-by-field compare, `info` dicts included, of every candidate on every placement from
# then on: 22% of the coordinator's samples (bench/results/history/coordinator.md "coordinator · owner table").
@dataclass(frozen=True, slots=True, eq=False)
class Candidate:
    server: str
    healthy: bool = True
    info: dict = field(default_factory=dict)
    # The server's block keys are known not to match ours (the coordinator's key parity probe):
    # its index matches mean nothing, so kv_cache_aware neither trusts nor penalises them.
    kv_unknown: bool = False


@dataclass(slots=True)
class RoutingKey:
    block_keys: np.ndarray | list | None = None
    num_tokens: int = 0
    conversation_id: str | None = None


class LoadView(Protocol):
    def requests(self, server: str) -> int: ...

    def tokens(self, server: str) -> int: ...

    def matched_blocks(self, keys) -> dict[str, int]: ...


class Decision:
    """A policy's choice. ``explanation`` is the record above; a policy may leave the inputs it
    was decided from in ``choice`` (``kv_cache_aware``: ``protocol.channel.KvChoice``) with an
    ``explain`` function instead, and the record is built on first read: the fleet channel sends
    the inputs and its client builds the record (coordinator/channel_client.py).
    ``matched_blocks``: leading prompt blocks the KV index holds for the chosen server
    (speculation included), uncapped: what the coordinator's speculative insert skips. None when
    the policy did not read the index or the server's match is unknown (`Candidate.kv_unknown`).
    ``predicted_s``: the chosen server's estimated time to first token (0.0: the policy has no
    estimate), ``uncached``: the prompt tokens it must compute (None: unknown, all of them).
    ``learn_s``: the estimate the policy's ``observe_ttft`` compares the leg's first-token report
    with (0.0: it would learn nothing from that report, which the coordinator then does not pass
    on; None given: ``predicted_s``)."""

    __slots__ = ("server", "_explanation", "matched_blocks", "choice", "_explain", "predicted_s",
                 "uncached", "learn_s")

    def __init__(self, server: str, explanation: dict | None = None, matched_blocks: int | None = None,
                 choice: Any = None, explain: Any = None, predicted_s: float = 0.0,
                 uncached: int | None = None, learn_s: float | None = None):
        self.server = server
        self._explanation = explanation
        self.matched_blocks = matched_blocks
        self.choice = choice
        self._explain = explain
        self.predicted_s = predicted_s
        self.uncached = uncached
        self.learn_s = predicted_s if learn_s is None else learn_s

    @property
    def explanation(self) -> dict:
        e = self._explanation
        if e is None:
            e = self._explanation = self._explain(self.choice) if self._explain is not None else {}
        return e

    def __repr__(self) -> str:
        return f"Decision({self.server!r}, matched_blocks={self.matched_blocks!r})"


class IndexLoadView:
    """A LoadView over a ``KvIndex`` and a ``LeaseTable`` (what the coordinator holds)."""

    def __init__(self, index, leases):
        self.index = index
        self.leases = leases

    def requests(self, server: str) -> int:
        return self.leases.requests(server)

    def tokens(self, server: str) -> int:
        return self.leases.tokens(server)

    def matched_blocks(self, keys) -> dict[str, int]:
        return self.index.longest_prefix(keys)

    def loads(self, servers: Sequence[str]) -> list[tuple[int, int]]:
        """(requests, tokens) per server in one call (the hot path of every select)."""
        return self.leases.loads_for(servers)

    def phases(self, servers: Sequence[str]) -> list[tuple[int, int, int]]:
        """(queued prefill tokens, leases in prefill, their tokens) per server."""
        return self.leases.phases_for(servers)

    def lease_states(self) -> dict:
        """The lease table's per-server map (``LeaseTable.states``), which kv_cache_aware's
        native core reads directly."""
        return self.leases.states()


def server_loads(view, servers: Sequence[str]) -> list[tuple[int, int]]:
    """(requests, tokens) per server: the view's bulk call where it has one (one call per
    select), else two calls per server (a LoadView of its own)."""
    bulk = getattr(view, "loads", None)
    if bulk is not None:
        return bulk(servers)
    return [(view.requests(s), view.tokens(s)) for s in servers]


def key_count(keys) -> int:
    """Block keys of a routing key (None: the request carried none)."""
    return 0 if keys is None else len(keys)


def healthy_candidates(policy: str, candidates: Sequence[Candidate]
                       ) -> tuple[list[Candidate], list[dict]]:
    """Healthy candidates (first occurrence of each server) and rows for the rest."""
    if candidates and False not in [c.healthy for c in candidates] and \
            len({c.server for c in candidates}) == len(candidates):
        return list(candidates), []
    seen = set()
    ok, rows = [], []
    for c in candidates:
        if c.server in seen:
            continue
        seen.add(c.server)
        if c.healthy:
            ok.append(c)
        else:
            rows.append({"server": c.server, "matched_tokens": 0, "load_requests": None,
                         "load_tokens": None, "score": None, "why": "unhealthy"})
    if not ok:
        raise NoServerAvailable(
            f"{policy}: no healthy server among {len(seen)} candidate(s)" if seen
            else f"{policy}: no candidate servers")
    return ok, rows


def explain_row(server: str, matched: int, req: int, tok: int, score, why: str) -> dict:
    """One candidate's row of a decision's explanation."""
    return {"server": server, "matched_tokens": matched, "load_requests": req,
            "load_tokens": tok, "score": score, "why": why}


class PinLru:
    """Bounded conversation -> server pins with a reverse index for server departures."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._map: OrderedDict[str, str] = OrderedDict()
        self._by_server: dict[str, set[str]] = {}

    def get(self, key: str) -> str | None:
        server = self._map.get(key)
        if server is not None:
            self._map.move_to_end(key)
        return server

    def put(self, key: str, server: str) -> None:
        old = self._map.get(key)
        if old is not None and old != server:
            self._by_server[old].discard(key)
        self._map[key] = server
        self._map.move_to_end(key)
        self._by_server.setdefault(server, set()).add(key)
        while len(self._map) > self.max_entries:
            k, s = self._map.popitem(last=False)
            self._by_server[s].discard(k)

    def remove_server(self, server: str) -> list[str]:
        keys = self._by_server.pop(server, set())
        for k in keys:
            self._map.pop(k, None)
        return list(keys)

    def __len__(self) -> int:
        return len(self._map)


class Policy(ABC):
    name: str = ""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.passthrough: dict[str, Any] = {}  # upstream args another component consumes

    @abstractmethod
    def select(self, candidates: Sequence[Candidate], key: RoutingKey | None,
               view: LoadView) -> Decision: ...

    def remove_server(self, server: str) -> None:
        """Forget per-server state (conversation pins) when a server leaves the cluster."""

    @property
    def needs_block_keys(self) -> bool:
        return False

    def describe(self) -> dict:
        return {"type": self.name}
