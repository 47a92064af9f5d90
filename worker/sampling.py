"""Token sampling for the torch engine: greedy, temperature, top-k, top-p, per-request seeds.

Every row draws from its own ``torch.Generator``, and every batched operation acts on each row alone,
so a request's tokens depend only on its own logits and seed, never on what else shares the batch.
"""
from __future__ import annotations

import secrets

import torch

from worker.requests import SamplingParams

__all__ = ["make_generator", "sample", "sample_reference", "sample_tokens"]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator for a non-greedy request: seeded from ``params.seed`` or from the OS."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    g.manual_seed(int(seed) & ((1 << 64) - 1))
    return g


def _sample_row(row: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """One row on its own (the reference :func:`sample` is tested and benchmarked against)."""
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


def sample_reference(logits: torch.Tensor, rows: list[tuple[int, SamplingParams, torch.Generator | None]]
                     ) -> dict[int, int]:
    """:func:`sample` one row at a time (torch.multinomial per row, a device sync per row)."""
    out = _greedy(logits, rows)
    for r, p, g in rows:
        if not p.greedy:
            out[r] = _sample_row(logits[r], p, g)
    return out


def _greedy(logits: torch.Tensor, rows) -> dict[int, int]:
    greedy = [r for r, p, _ in rows if p.greedy]
    if not greedy:
        return {}
    idx = torch.tensor(greedy, device=logits.device)
    return {r: int(t) for r, t in zip(greedy, torch.argmax(logits.index_select(0, idx), dim=-1).tolist())}


def _to_device(values, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A small host list on ``dev`` without waiting for the device (a pageable copy synchronises the
    stream; a pinned one is queued behind the work already there)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def sample(logits: torch.Tensor, rows: list[tuple[int, SamplingParams, torch.Generator | None]]
           ) -> dict[int, int]:
    """Sample one token for each ``(row, params, generator)``; returns ``{row: token}``.

    All sampled rows go through one batched pass (temperature, top-k, top-p, softmax, inverse-CDF
    draw) and one device→host copy: a 128k-token vocabulary sorted and drawn row by row cost ~10
    kernels and a sync per row. Each row's uniform draw comes from its own generator, and the
    batched operations act on each row alone, so a token still depends only on its row's logits and
    seed, never on the batch (tests/worker/test_sampling.py)."""
    if not rows:
        return {}
    toks = sample_tokens(logits, rows).tolist()
    return {r: int(toks[r]) for r, _, _ in rows}


def sample_tokens(logits: torch.Tensor, rows: list[tuple[int, SamplingParams, torch.Generator | None]]
                  ) -> torch.Tensor:
    """:func:`sample` left on the device: int64 ``[len(logits)]`` whose entry ``r`` is row ``r``'s token
    for every sampled row (other entries are the row's argmax, meaningless). Queues work only — no
    device→host copy, no wait — so an async step loop can feed these tokens to the next step on the
    device (worker/runner.py ``feed_tokens``) while copying them to the host in the background."""
    dev = logits.device
    out = torch.argmax(logits, dim=-1)
    rest = [(r, p, g) for r, p, g in rows if not p.greedy]
    if not rest:
        return out
    vocab = logits.shape[1]
    ridx = _to_device([r for r, _, _ in rest], torch.int64, dev)
    x = logits.index_select(0, ridx).float()
    x = x / _to_device([p.temperature for _, p, _ in rest], torch.float32, dev)[:, None]
    ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for _, p, _ in rest]
    if any(ks):
        kmax = max(ks)
        vals = torch.topk(x, kmax, dim=-1).values
        kth = vals.gather(1, _to_device([max(k, 1) - 1 for k in ks], torch.int64, dev)[:, None])
        kth = torch.where(_to_device(ks, torch.int64, dev)[:, None] > 0, kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    tops = [p.top_p for _, p, _ in rest]
    if any(t < 1.0 for t in tops):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # A row without top-p gets a threshold no mass reaches (its rows keep every token).
        top = _to_device([t if t < 1.0 else 2.0 for t in tops], torch.float32, dev)[:, None]
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    # fp64 cumulative mass: u·total then stays strictly below the total (u < 1), which fp32 rounding
    # could reach, so the draw below always lands on a kept token.
    cdf = torch.cumsum(torch.softmax(x, dim=-1).double(), dim=-1)
    u = torch.cat([torch.rand(1, generator=g, device=dev) for _, _, g in rest]).double()
    # The first token whose cumulative mass exceeds u·total: never a zero-probability token (right=True
    # skips the flat stretch a masked token leaves).
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    return out.index_copy(0, ridx, tok[:, 0])
