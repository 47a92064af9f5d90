"""A placement over the fleet channel whose caller goes away never leaves a lease behind — without
the fleet's `Placer._leased` Task + shield around it (fleet/placement.py skips it on a connected
channel): the channel client ends the lease itself, at whatever point the caller was cancelled.

Against a real coordinator on a Unix socket; leases read from the coordinator's own state.
"""
from __future__ import annotations

import asyncio

from coordinator.client import HttpCoordinatorClient

from .conftest import cfg, wait_for


def _leases(c) -> int:
    return sum(c.in_flight().values())


async def _setup(workers, coordinator, tmp_path):
    ctx = await workers("context")
    gen = await workers("generation")
    c, s = await coordinator(cfg([ctx.url], [gen.url]), uds=str(tmp_path / "c.sock"))
    await wait_for(c.is_ready)
    cl = HttpCoordinatorClient(s.uds_url, timeout=5.0)
    await cl.select("gen", 1)          # connects the channel
    await cl.finish("gen", 1)
    assert cl.channel.connected
    return c, s, cl


async def test_cancelled_before_the_answer(workers, coordinator, tmp_path):
    c, s, cl = await _setup(workers, coordinator, tmp_path)
    orphans = []
    cl.channel.on_abandoned = lambda: orphans.append(1)
    try:
        tasks = [asyncio.get_running_loop().create_task(cl.select_pair(100 + i)) for i in range(8)]
        await asyncio.sleep(0)          # the calls are registered and flushed, not yet answered
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: _leases(c) == 0, what="abandoned placements finished")
        assert len(orphans) == 8
        assert cl.channel.stats["abandoned_leases_finished"] == 16     # both legs of each pair
    finally:
        await cl.close()


async def test_cancelled_after_the_answer_arrived_but_before_resuming(workers, coordinator, tmp_path):
    c, s, cl = await _setup(workers, coordinator, tmp_path)
    ch = cl.channel
    task = None
    orig = ch._on_replies

    def on_replies(r):
        orig(r)               # resolves the caller's future...
        if task is not None and not task.done():
            task.cancel()     # ...and the caller is cancelled before it runs again
    ch._on_replies = on_replies
    try:
        task = asyncio.get_running_loop().create_task(cl.select_pair(200))
        res = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(res[0], asyncio.CancelledError)
        await wait_for(lambda: _leases(c) == 0, what="the answered-but-abandoned pair finished")
        assert ch.stats["abandoned_leases_finished"] == 2
    finally:
        ch._on_replies = orig
        await cl.close()


async def test_connection_lost_with_an_abandoned_placement(workers, coordinator, tmp_path):
    c, s, cl = await _setup(workers, coordinator, tmp_path)
    ch = cl.channel
    try:
        ch._proto.transport.pause_reading()     # the answer is written but never read here
        task = asyncio.get_running_loop().create_task(cl.select_pair(300))
        await wait_for(lambda: _leases(c) == 2, what="the coordinator leased both legs")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ch._proto.transport.abort()             # the answer is lost with the connection
        await wait_for(lambda: _leases(c) == 0, what="the lost placement's leases finished")
        assert ch.stats["resent_finishes"] == 2
        assert sum(c.cluster_info()["leases"]["expired_total"].values()) == 0   # by /finish, not expiry
    finally:
        await cl.close()
