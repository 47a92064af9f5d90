"""The coordinator's maintenance loop expires a backlog of due speculative entries in key-bounded
slices between its ticks (coordinator/service.py `_maintenance`, router/kv_speculation.py), instead
of up to 256 routed prompts in one call once a second: that call held the loop for 15-40 ms at a
time (bench/RESULTS.md, "coordinator · open-loop stall")."""
from __future__ import annotations

import asyncio

from coordinator import service
from router.kv_index import KvIndex

from .conftest import cfg


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
