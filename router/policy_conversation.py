"""``conversation``: requests of one conversation (explicit id, or an implicit session found by its
prompt prefix) stay on one server while it is healthy (router/policy_base.py has the records and the
interface)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


from .policy_base import Decision, PinLru, Policy, explain_row, healthy_candidates, key_count
from .policy_load import LoadBalancingPolicy

__all__ = ["ConversationPolicy"]


class _PrefixSessions:
    """Implicit sessions: canonical keys at every ``stride``-th block (and a session's last
    block) map to the session that registered them. Keys are chained, so membership at stride
    positions is monotone along a prompt and the deepest match is a binary search."""

    def __init__(self, stride: int, max_sessions: int):
        self.stride = stride
        self.max_sessions = max_sessions
        self._by_key: dict[int, str] = {}
        self._sessions: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def match(self, keys: list[int]) -> tuple[str | None, int]:
        """(session id, matched blocks) of the deepest registered prefix of ``keys``."""
        by_key = self._by_key
        st = self.stride
        lo, hi = 0, len(keys) // st  # stride positions st*i - 1 for i in 1..hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid * st - 1] in by_key:
                lo = mid
            else:
                hi = mid - 1
        best, depth = (by_key[keys[lo * st - 1]], lo * st) if lo else (None, 0)
        # session ends (registered last blocks) between stride positions
        for q in range(lo * st, min(len(keys), (lo + 1) * st)):
            sid = by_key.get(keys[q])
            if sid is not None:
                best, depth = sid, q + 1
        return best, depth

    def register(self, sid: str, server: str, keys: list[int]) -> None:
        st = self.stride
        marks = [keys[i] for i in range(st - 1, len(keys), st)]
        if keys and (len(keys) % st):
            marks.append(keys[-1])
        old = self._sessions.pop(sid, None)
        if old is not None:
            for k in old[1]:
                if self._by_key.get(k) == sid:
                    del self._by_key[k]
        for k in marks:
            self._by_key[k] = sid
        self._sessions[sid] = (server, marks)
        while len(self._sessions) > self.max_sessions:
            old_sid, (_, old_marks) = self._sessions.popitem(last=False)
            for k in old_marks:
                if self._by_key.get(k) == old_sid:
                    del self._by_key[k]

    def server_of(self, sid: str) -> str | None:
        v = self._sessions.get(sid)
        if v is None:
            return None
        self._sessions.move_to_end(sid)
        return v[0]

    def remove_server(self, server: str) -> None:
        for sid in [s for s, (srv, _) in self._sessions.items() if srv == server]:
            _, marks = self._sessions.pop(sid)
            for k in marks:
                if self._by_key.get(k) == sid:
                    del self._by_key[k]

    def __len__(self) -> int:
        return len(self._sessions)


class ConversationPolicy(Policy):
    """Sticky sessions: an explicit conversation id stays on its server while that server is a
    healthy candidate; without an id, a prompt whose prefix covers ``match_threshold`` of an
    earlier session's prefix continues that session. New sessions go to the least loaded."""

    name = "conversation"

    def __init__(self, block_size: int = 16, *, match_threshold: float = 0.75,
                 max_sessions: int = 100_000, implicit_sessions: bool = True,
                 tokens_per_block: int = 128, use_tokens: bool = False):
        super().__init__(block_size)
        self.match_threshold = match_threshold
        self.implicit_sessions = implicit_sessions
        self.use_tokens = use_tokens
        self._pins = PinLru(max_sessions)
        self._implicit = _PrefixSessions(max(1, tokens_per_block // block_size), max_sessions)
        self._lb = LoadBalancingPolicy(block_size, use_tokens=use_tokens)
        self._counter = 0

    @property
    def needs_block_keys(self) -> bool:
        return self.implicit_sessions

    def describe(self) -> dict:
        return {"type": self.name, "match_threshold": self.match_threshold,
                "implicit_sessions": self.implicit_sessions, "use_tokens": self.use_tokens,
                "sessions": len(self._pins), "implicit": len(self._implicit)}

    def remove_server(self, server: str) -> None:
        self._pins.remove_server(server)
        self._implicit.remove_server(server)

    def select(self, candidates, key, view) -> Decision:
        ok, rows = healthy_candidates(self.name, candidates)
        by_server = {c.server: c for c in ok}
        conv = key.conversation_id if key is not None else None
        keys = key.block_keys if key is not None else None
        if isinstance(keys, np.ndarray):
            keys = keys.tolist()
        nk = key_count(keys)
        num_tokens = key.num_tokens if key is not None and key.num_tokens else nk * self.block_size
        session, chosen, reason, matched = conv, None, "", 0
        if conv:
            pinned = self._pins.get(conv)
            if pinned in by_server:
                chosen, reason = by_server[pinned], "sticky: conversation pinned here"
            else:
                reason = ("pinned server unavailable: re-pinned to least loaded" if pinned
                          else "new conversation: least loaded")
        elif self.implicit_sessions and nk:
            sid, depth = self._implicit.match(keys)
            matched = min(depth * self.block_size, num_tokens)
            server = self._implicit.server_of(sid) if sid else None
            if sid and num_tokens and matched / num_tokens >= self.match_threshold \
                    and server in by_server:
                session, chosen = sid, by_server[server]
                reason = f"implicit session {sid}: {matched}/{num_tokens} prompt tokens match"
            else:
                self._counter += 1
                session = f"implicit-{self._counter}"
                reason = "new implicit session: least loaded"
        else:
            reason = "no conversation id: least loaded"
        if chosen is None:
            chosen, _, _ = self._lb._pick(ok, view)
        if conv:
            self._pins.put(conv, chosen.server)
        elif session and nk:
            self._implicit.register(session, chosen.server, keys)
        for c in ok:
            rows.append(explain_row(c.server, matched if c is chosen else 0,
                                    view.requests(c.server), view.tokens(c.server), None,
                                    "chosen" if c is chosen else "not the session's server"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server, "reason": reason,
            "num_tokens": num_tokens, "matched_tokens": matched, "conversation": session})
