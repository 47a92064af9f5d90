"""`protocol.tasks.cancel_and_wait`: what the stop() methods of the worker and the fleet rely on.

The task's own end is swallowed (its cancellation, or an exception it raises on the way out), and
the waiting caller's own cancellation is not: the old inline copies (`try: await t / except
(CancelledError, Exception): pass`) swallowed that too.
"""
from __future__ import annotations

import asyncio
import gc

import pytest

from protocol.tasks import cancel_and_wait


async def test_cancels_and_waits_for_every_task_and_skips_none():
    ended = []

    async def sleeper(name):
        try:
            await asyncio.sleep(60)
        finally:
            ended.append(name)

    a, b = asyncio.create_task(sleeper("a")), asyncio.create_task(sleeper("b"))
    await asyncio.sleep(0)
    await cancel_and_wait(a, None, b)
    assert sorted(ended) == ["a", "b"] and a.cancelled() and b.cancelled()
    await cancel_and_wait(None)
    await cancel_and_wait()
    await cancel_and_wait(a)      # already finished: nothing to do


async def test_swallows_an_exception_the_task_raises_on_the_way_out_and_retrieves_it():
    unretrieved = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))

    async def fails_when_cancelled():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed")

    async def already_failed():
        raise ValueError("died early")

    t1 = asyncio.create_task(fails_when_cancelled())
    t2 = asyncio.create_task(already_failed())
    await asyncio.sleep(0)
    await cancel_and_wait(t1, t2)
    assert isinstance(t1.exception(), RuntimeError) and isinstance(t2.exception(), ValueError)
    del t1, t2
    gc.collect()
    assert unretrieved == []


async def test_the_callers_own_cancellation_propagates():
    release = asyncio.Event()

    async def slow_to_stop():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await release.wait()     # a cleanup that takes a while
            raise

    inner = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0.01)
    assert not stopper.done()
    stopper.cancel()                 # the caller of stop() is itself cancelled
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert stopper.cancelled()
    release.set()
    await asyncio.wait([inner])
    assert inner.cancelled()
