"""``round_robin`` and ``load_balancing``: the policies that read only load, never the KV index
(router/policy_base.py has the records and the interface).

Each choice is written once, in ``pick``: the coordinator's ``select`` explains it, and a fleet
process calls the same ``pick`` over its own server list (fleet/placement.py: ``round_robin``, and
least-loaded while the coordinator is unreachable)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from .policy_base import (Candidate, Decision, Policy, explain_row, healthy_candidates,
                          server_loads)

__all__ = ["RoundRobinPolicy", "LoadBalancingPolicy"]


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, block_size: int = 16, start: int = 0):
        super().__init__(block_size)
        self._cursor = start

    def pick(self, n: int) -> int:
        """The index of the next of `n` candidates in turn."""
        i = self._cursor % n
        self._cursor += 1
        return i

    def select(self, candidates, key, view) -> Decision:
        ok, rows = healthy_candidates(self.name, candidates)
        chosen = ok[self.pick(len(ok))]
        for c in ok:
            rows.append(explain_row(c.server, 0, view.requests(c.server), view.tokens(c.server),
                                    None, "chosen: next in turn" if c is chosen else "not its turn"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server,
            "reason": "round robin", "num_tokens": key.num_tokens if key else 0,
            "matched_tokens": 0})


class LoadBalancingPolicy(Policy):
    """Least in-flight requests (or tokens), ties in turn; optionally power-of-two choices."""

    name = "load_balancing"

    def __init__(self, block_size: int = 16, use_tokens: bool = False,
                 power_of_two_choices: bool = False, seed: int | None = None, start: int = 0):
        super().__init__(block_size)
        self.use_tokens = use_tokens
        self.power_of_two_choices = power_of_two_choices
        self._rng = random.Random(seed)
        self._cursor = start

    def describe(self) -> dict:
        return {"type": self.name, "use_tokens": self.use_tokens,
                "power_of_two_choices": self.power_of_two_choices}

    def pick(self, load: Sequence[int]) -> int:
        """The index of the least loaded of the candidates whose loads (the metric this policy
        reads: requests or tokens) are `load`."""
        return self._choose(load)[0]

    def _choose(self, load: Sequence[int]) -> tuple[int, tuple[int, int] | None, int]:
        """(chosen index, the sampled pair under power of two choices, how many tied)."""
        n = len(load)
        if self.power_of_two_choices and n > 2:
            a, b = self._rng.sample(range(n), 2)
            return (a if load[a] <= load[b] else b), (a, b), 1
        best = min(load)
        tied = [i for i in range(n) if load[i] == best]
        i = tied[self._cursor % len(tied)]
        self._cursor += 1
        return i, None, len(tied)

    def _pick(self, ok: list[Candidate], view) -> tuple[Candidate, dict, str]:
        loads = dict(zip((c.server for c in ok), server_loads(view, [c.server for c in ok])))
        m = 1 if self.use_tokens else 0
        unit = "tokens" if self.use_tokens else "requests"
        i, sampled, tied = self._choose([loads[c.server][m] for c in ok])
        if sampled is not None:
            a, b = ok[sampled[0]], ok[sampled[1]]
            return ok[i], loads, f"power of two choices: {a.server} vs {b.server} by {unit}"
        reason = f"least in-flight {unit}" + (f" (tie of {tied}, in turn)" if tied > 1 else "")
        return ok[i], loads, reason

    def select(self, candidates, key, view) -> Decision:
        ok, rows = healthy_candidates(self.name, candidates)
        chosen, loads, reason = self._pick(ok, view)
        for c in ok:
            req, tok = loads[c.server]
            rows.append(explain_row(c.server, 0, req, tok, tok if self.use_tokens else req,
                                    "chosen" if c is chosen else "more loaded or not sampled"))
        return Decision(chosen.server, {
            "policy": self.name, "candidates": rows, "chosen": chosen.server, "reason": reason,
            "num_tokens": key.num_tokens if key else 0, "matched_tokens": 0})
