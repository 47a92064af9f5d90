"""Decode rows grouped by table length: each group gathers only its own rows' keys, and grouping
changes no logit and no greedy token."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from protocol.tokenizer import ByteTokenizer
from worker.engine import TorchEngine
from worker.model import LlamaForCausalLM
from worker.presets import build_preset, init_random_weights, preset_config
from worker.requests import EngineRequest, SamplingParams
from worker.runner import Chunk, ModelRunner, plan_decode_groups

BS = 8


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny")


def prompt(n, salt=0):
    return [(i * 29 + salt * 13 + 7) % 250 for i in range(n)]


def grouped_runner(model, num_blocks, **kw):
    r = ModelRunner(model, num_blocks=num_blocks, block_size=BS, **kw)
    r.decode_group_overhead_keys = 0  # split wherever it saves keys: the tiny test contexts are short
    return r


def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


# One long context, two middling ones and several short ones: three groups.
LENGTHS = [9, 300, 5, 70, 12, 3, 64, 17]


def tables_for(lengths, extra=2):
    out, first = [], 0
    for n in lengths:
        nb = (n + extra + BS - 1) // BS
        out.append(list(range(first, first + nb)))
        first += nb
    return out, first


def test_plan_groups_the_long_row_alone():
    plan = plan_decode_groups([2, 3, 2, 512, 1, 3], max_groups=3, overhead_blocks=16)
    assert [g.tolist() for g in plan] == [[3], [1, 5, 0, 2, 4]]
    # Every row exactly once, longest first inside each group.
    assert sorted(np.concatenate(plan).tolist()) == list(range(6))


def test_plan_respects_group_limit_overhead_and_uniform_batches():
    need = [300, 40, 38, 3, 2, 2, 1]
    assert len(plan_decode_groups(need, max_groups=3)) == 3
    two = plan_decode_groups(need, max_groups=2)
    assert len(two) == 2 and two[0].tolist() == [0]
    assert [g.tolist() for g in plan_decode_groups(need, max_groups=1)] == [[0, 1, 2, 3, 4, 5, 6]]
    # A split that saves less than its overhead is not taken.
    assert len(plan_decode_groups([9, 8, 5], overhead_blocks=100)) == 1
    assert len(plan_decode_groups([7, 7, 6, 5, 5])) == 1  # one bucket: nothing to split
    assert [g.tolist() for g in plan_decode_groups([4])] == [[0]]
    # Deterministic: equal inputs give equal plans (tensor-parallel ranks plan independently).
    a = plan_decode_groups(need, 3, 4.0)
    b = plan_decode_groups(list(need), 3, 4.0)
    assert [g.tolist() for g in a] == [g.tolist() for g in b]


@pytest.mark.parametrize("window", [None, 40])
def test_mixed_long_short_decode_equals_each_row_alone(window):
    cfg = dataclasses.replace(preset_config("tiny"), sliding_window=window, name=f"tiny-w{window}")
    model = LlamaForCausalLM(cfg)
    init_random_weights(model)
    tables, nblocks = tables_for(LENGTHS)
    seqs = [prompt(n + 1, salt=i) for i, n in enumerate(LENGTHS)]
    r = grouped_runner(model, nblocks)
    r.step([Chunk(s[:-1], 0, t) for s, t in zip(seqs, tables)])
    mixed = r.step([Chunk(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)])
    stats = r.last_step_stats
    assert stats["decode_rows"] == len(LENGTHS) and stats["decode_groups"] == 3
    # Reference: each row decoded alone, over the same K/V the batch wrote.
    for i, (s, t) in enumerate(zip(seqs, tables)):
        alone = grouped_runner(model, nblocks)
        alone.step([Chunk(s[:-1], 0, t)])
        close(mixed[i], alone.step([Chunk(s[-1:], len(s) - 1, t)])[0])
    # And the old single padded batch agrees too.
    single = grouped_runner(model, nblocks)
    single.max_decode_groups = 1
    single.step([Chunk(s[:-1], 0, t) for s, t in zip(seqs, tables)])
    close(single.step([Chunk(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)]), mixed)
    assert single.last_step_stats["decode_groups"] == 1


def test_grouped_decode_next_to_prefill_chunks_in_one_step(tiny):
    """Decode groups inside a mixed step (prefill chunks first in the flat batch) scatter back right."""
    lengths = [200, 4, 6, 150, 3]
    tables, nblocks = tables_for(lengths + [30, 20])
    seqs = [prompt(n + 1, salt=i) for i, n in enumerate(lengths)]
    fresh, cont = prompt(30, salt=9), prompt(20, salt=8)
    r = grouped_runner(tiny, nblocks)
    r.step([Chunk(s[:-1], 0, t) for s, t in zip(seqs, tables)] + [Chunk(cont[:12], 0, tables[6])])
    # (chunk, tokens before it) in step order: a fresh prompt, decode rows and a prefill continuation.
    work = [(Chunk(fresh, 0, tables[5]), [])]
    work += [(Chunk(s[-1:], len(s) - 1, t), s[:-1]) for s, t in zip(seqs, tables)]
    work.insert(3, (Chunk(cont[12:], 12, tables[6]), cont[:12]))
    out = r.step([c for c, _ in work])
    assert r.last_step_stats["decode_rows"] == 5 and r.last_step_stats["decode_groups"] == 2
    ref = grouped_runner(tiny, nblocks)
    for i, (c, before) in enumerate(work):
        if before:
            ref.step([Chunk(before, 0, c.block_ids)])
        close(out[i], ref.step([c])[0])


def test_gathered_keys_follow_each_rows_own_length(tiny):
    """One long row must not make every short row gather its length."""
    lengths = [500] + [6] * 15
    tables, nblocks = tables_for(lengths)
    seqs = [prompt(n + 1, salt=i) for i, n in enumerate(lengths)]
    r = ModelRunner(tiny, num_blocks=nblocks, block_size=BS)  # default overhead
    single = ModelRunner(tiny, num_blocks=nblocks, block_size=BS)
    single.max_decode_groups = 1
    for run in (r, single):
        run.step([Chunk(s[:-1], 0, t) for s, t in zip(seqs, tables)])
    dec = [Chunk(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)]
    close(r.step(dec), single.step(dec))
    own = sum(-(-(n + 1) // BS) for n in lengths) * BS
    assert r.last_step_stats["decode_context_slots"] == own
    assert r.last_step_stats["decode_groups"] == 2
    assert r.last_step_stats["decode_key_slots"] == own  # exact: each group pads to equal rows
    longest = -(-501 // BS) * BS
    assert single.last_step_stats["decode_key_slots"] == len(lengths) * longest
    assert single.last_step_stats["decode_key_slots"] > 10 * r.last_step_stats["decode_key_slots"]


def test_greedy_tokens_through_engine_unchanged_by_grouping(tiny):
    prompts = [[256] + prompt(n, salt=i) for i, n in enumerate([260, 7, 11, 40, 5])]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    async def generate(groups):
        runner = ModelRunner(tiny, num_blocks=160, block_size=BS)
        runner.max_decode_groups = groups
        runner.decode_group_overhead_keys = 0
        seen: list[int] = []
        step = runner.step

        def counting_step(chunks):
            out = step(chunks)
            seen.append(runner.last_step_stats["decode_groups"])
            return out

        runner.step = counting_step
        engine = TorchEngine(runner, ByteTokenizer(vocab_size=tiny.config.vocab_size))
        await engine.start()
        try:
            async def one(i, p):
                toks = []
                async for ev in await engine.submit(EngineRequest(f"r{i}", p, sp)):
                    toks += ev.token_ids
                return toks
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), max(seen)
        finally:
            await engine.stop()

    grouped, most = asyncio.run(generate(3))
    single, one_group = asyncio.run(generate(1))
    assert most >= 2 and one_group == 1
    assert grouped == single and all(len(t) == 10 for t in grouped)
