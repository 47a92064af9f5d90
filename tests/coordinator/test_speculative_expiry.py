"""The coordinator's maintenance loop expires a backlog of due speculative entries in key-bounded
slices between its ticks (coordinator/service.py `_maintenance`, router/kv_speculation.py), instead
of up to 256 routed prompts in one call once a second: that call held the loop for 15-40 ms at a
time (bench/results/history/coordinator.md, "coordinator · open-loop stall")."""
from __future__ import annotations

import asyncio

from coordinator import service
from router.kv_index import KvIndex

from .conftest import cfg, wait_for


async def test_a_due_backlog_drains_in_bounded_slices_between_ticks(coordinator, monkeypatch):
    calls: list[int] = []
    real = KvIndex.expire_speculative

    def counted(self, now, max_entries=None, max_keys=None):
        n = real(self, now, max_entries, max_keys)
        if max_entries is None:          # the maintenance loop's calls (placements pass 2 entries)
            calls.append(n)
        return n

    monkeypatch.setattr(KvIndex, "expire_speculative", counted)
    c, _ = await coordinator(cfg(), serve=False)
    now = c.clock()
    # 600 routed prompts of 40 keys, all past their deadline: 24,000 keys, > 256 entries
    for i in range(600):
        c.index.add_speculative("http://127.0.0.1:9", range(10**6 + 40 * i, 10**6 + 40 * i + 40),
                                now - 10.0, 1.0)
    assert c.index.speculative_size() == 24_000 and c.index.speculative_due(now)
    for _ in range(200):                 # well inside the first 1 s tick period
        if not c.index.speculative_due(c.clock()):
            break
        await asyncio.sleep(0.01)
    assert c.index.speculative_size() == 0, f"{c.index.speculative_size()} keys left after 2 s"
    assert len(calls) >= 24_000 // (service.SPEC_EXPIRE_KEYS_PER_SLICE + 40)
    assert max(calls) <= service.SPEC_EXPIRE_KEYS_PER_SLICE + 40   # whole entries, one past the cap at most


async def test_second_leg_of_a_pair_sees_what_the_first_legs_expiry_removed(workers, coordinator):
    """Both legs of a `select_pair` read one index walk when nothing changed in between
    (coordinator/service.py `_LoadView.matched_blocks`); the generation leg's speculative insert
    expires due entries, here the context server's own prediction of the prompt, so the context
    leg must walk again and find nothing cached there."""
    from router.block_keys import block_keys

    ctx, gen = await workers("context"), await workers("generation")
    c, _ = await coordinator(cfg([ctx.url], [gen.url]), serve=False)
    await wait_for(c.is_ready)
    keys = block_keys(list(range(5000, 5320)), 16)           # 20 blocks, cached nowhere
    rk = {"block_keys": keys, "num_tokens": 320}
    now = c.clock()
    c.index.add_speculative(ctx.url, keys, now - 10.0, 1.0)  # a prediction already past due
    assert c.index.longest_prefix(keys).get(ctx.url) == 20
    expired = c.index.stats.speculative_expired
    # no await in between: the maintenance loop cannot expire it first
    pair = c.select_pair(1, rk)
    assert pair["generation"]["server"] == gen.url and pair["context"]["server"] == ctx.url
    assert pair["generation"]["info"]["matched_tokens"] == 0
    assert pair["context"]["info"]["matched_tokens"] == 0, "the context leg read a walk from before the expiry"
    assert c.index.stats.speculative_expired == expired + 20     # by the generation leg's insert
    # the same prompt again: both servers now predict all of it from the first pair (the generation
    # leg inserts nothing, so the context leg reads the same walk), and both receipts say so
    pair = c.select_pair(2, rk)
    assert pair["generation"]["info"]["matched_tokens"] == 319
    assert pair["context"]["info"]["matched_tokens"] == 319
    for rid in (1, 2):
        for role in ("context", "generation"):
            assert c.finish(role, rid)
