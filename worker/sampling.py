"""Token sampling for the torch engine: greedy, temperature, top-k, top-p, per-request seeds.

Every row is processed on its own with its own ``torch.Generator``, so a request's tokens depend
only on its own logits and seed, never on what else shares the batch.
"""
from __future__ import annotations

import secrets

import torch

from worker.requests import SamplingParams

__all__ = ["make_generator", "sample"]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator for a non-greedy request: seeded from ``params.seed`` or from the OS."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    g.manual_seed(int(seed) & ((1 << 64) - 1))
    return g


def _sample_row(row: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    row = row.float() / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=g).item())


def sample(logits: torch.Tensor, rows: list[tuple[int, SamplingParams, torch.Generator | None]]
           ) -> dict[int, int]:
    """Sample one token for each ``(row, params, generator)``; returns ``{row: token}``."""
    out: dict[int, int] = {}
    greedy = [r for r, p, _ in rows if p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for r, t in zip(greedy, torch.argmax(logits.index_select(0, idx), dim=-1).tolist()):
            out[r] = int(t)
    for r, p, g in rows:
        if not p.greedy:
            out[r] = _sample_row(logits[r], p, g)
    return out
