"""worker/sampling.py: the batched sampler against exact probabilities and against itself in other
batches (a token depends only on its row's logits and seed)."""
from __future__ import annotations

import math

import torch

from worker.requests import SamplingParams
from worker.sampling import make_generator, sample, sample_reference


def exact_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """What temperature, top-k then top-p leave of one row, computed in fp64 from the definitions."""
    x = row.double() / p.temperature
    if p.top_k and p.top_k < x.numel():
        x = torch.where(x >= torch.topk(x, p.top_k).values[-1], x, -math.inf)
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[before < p.top_p]] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
          SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, top_k=5, top_p=0.6)]


def test_frequencies_match_the_exact_distribution():
    """4,000 seeded draws per parameter set over an 8-token row: every frequency within 4.5 standard
    errors of its probability, and no draw of a token the masks removed."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0]])
    n = 4000
    for p in PARAMS:
        counts = torch.zeros(8)
        for seed in range(n):
            q = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seed)
            counts[sample(logits, [(0, q, make_generator(q, logits.device))])[0]] += 1
        want = exact_probs(logits[0], p).float()
        assert (counts[want == 0] == 0).all(), (p, counts, want)
        se = (want * (1 - want) / n).sqrt().clamp(min=1e-3)
        assert ((counts / n - want).abs() <= 4.5 * se).all(), (p, counts / n, want)


def test_a_rows_token_does_not_depend_on_its_batch():
    """The same row and seed sampled alone, among other rows, at another position in the batch and
    next to greedy rows gives the same token, for every parameter set."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * 3
    for i, p in enumerate(PARAMS):
        q = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=100 + i)
        alone = sample(logits[2:3], [(0, q, make_generator(q, logits.device))])[0]
        others = [(r, SamplingParams(temperature=0.5 + r / 10, top_k=r, seed=r),) for r in (0, 1, 4)]
        rows = [(r, sp, make_generator(sp, logits.device)) for r, sp in others]
        rows.insert(1, (2, q, make_generator(q, logits.device)))
        rows.append((5, SamplingParams(temperature=0.0), None))
        assert sample(logits, rows)[2] == alone
        assert sample(logits.flip(0), [(3, q, make_generator(q, logits.device))])[3] == alone


def test_greedy_and_top_k_1_are_argmax_and_the_reference_agrees_on_them():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    rows = [(0, SamplingParams(temperature=0.0), None), (1, SamplingParams(top_k=1, seed=3), None),
            (3, SamplingParams(temperature=0.0), None)]
    want = logits.argmax(-1).tolist()
    assert sample(logits, rows) == {0: want[0], 1: want[1], 3: want[3]} == sample_reference(logits, rows)


def test_reference_sampler_follows_the_same_distribution():
    """sample_reference (one multinomial per row) is what bench/worker/worker.py --sampling compares against:
    it draws from the same distribution (frequencies agree with the exact one)."""
    logits = torch.tensor([[0.3, 1.2, -0.4, 2.0, 0.0]])
    p = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    n = 3000
    counts = torch.zeros(5)
    for seed in range(n):
        q = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seed)
        counts[sample_reference(logits, [(0, q, make_generator(q, logits.device))])[0]] += 1
    want = exact_probs(logits[0], p).float()
    se = (want * (1 - want) / n).sqrt().clamp(min=1e-3)
    assert (counts[want == 0] == 0).all() and ((counts / n - want).abs() <= 4.5 * se).all()
