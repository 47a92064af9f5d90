"""``round_robin`` and ``load_balancing``: the policies that read only load, never the KV index
(router/policy_base.py has the records and the interface)."""

from __future__ import annotations

import random

from .policy_base import Candidate, Decision, Policy, _healthy, _loads, _row

__all__ = ["RoundRobinPolicy", "LoadBalancingPolicy"]


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, block_size: int = 16):
        super().__init__(block_size)
        self._cursor = 0

    def select(self, candidates, key, view) -> Decision:
        ok, rows = _healthy(self.name, candidates)
        chosen = ok[self._cursor % len(ok)]
        self._cursor += 1
        for c in ok:
            rows.append(_row(c.server, 0, view.requests(c.server), view.tokens(c.server), None,
                             "chosen: next in turn" if c is chosen else "not its turn"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server,
            "reason": "round robin", "num_tokens": key.num_tokens if key else 0,
            "matched_tokens": 0})


class LoadBalancingPolicy(Policy):
    """Least in-flight requests (or tokens), ties in turn; optionally power-of-two choices."""

    name = "load_balancing"

    def __init__(self, block_size: int = 16, use_tokens: bool = False,
                 power_of_two_choices: bool = False, seed: int | None = None):
        super().__init__(block_size)
        self.use_tokens = use_tokens
        self.power_of_two_choices = power_of_two_choices
        self._rng = random.Random(seed)
        self._cursor = 0

    def describe(self) -> dict:
        return {"type": self.name, "use_tokens": self.use_tokens,
                "power_of_two_choices": self.power_of_two_choices}

    def _pick(self, ok: list[Candidate], view) -> tuple[Candidate, dict, str]:
        loads = dict(zip((c.server for c in ok), _loads(view, [c.server for c in ok])))
        metric = (lambda s: loads[s][1]) if self.use_tokens else (lambda s: loads[s][0])
        unit = "tokens" if self.use_tokens else "requests"
        if self.power_of_two_choices and len(ok) > 2:
            a, b = self._rng.sample(ok, 2)
            chosen = a if metric(a.server) <= metric(b.server) else b
            return chosen, loads, f"power of two choices: {a.server} vs {b.server} by {unit}"
        best = min(metric(c.server) for c in ok)
        tied = [c for c in ok if metric(c.server) == best]
        chosen = tied[self._cursor % len(tied)]
        self._cursor += 1
        reason = f"least in-flight {unit}" + (f" (tie of {len(tied)}, in turn)" if len(tied) > 1 else "")
        return chosen, loads, reason

    def select(self, candidates, key, view) -> Decision:
        ok, rows = _healthy(self.name, candidates)
        chosen, loads, reason = self._pick(ok, view)
        for c in ok:
            req, tok = loads[c.server]
            rows.append(_row(c.server, 0, req, tok, tok if self.use_tokens else req,
                             "chosen" if c is chosen else "more loaded or not sampled"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server, "reason": reason,
            "num_tokens": key.num_tokens if key else 0, "matched_tokens": 0})
