"""The coordinator channel client's two timers (coordinator/channel_client.py), against a raw channel
server on loopback that accepts the upgrade and then answers only when told to:

- a batch's calls unanswered past `timeout_s` fail with CoordinatorUnavailable (cause TIMEOUT),
  each batch at its own deadline, and an answered batch never expires later;
- queued finishes ride on the next call's batch, or leave alone `finish_delay_s` after the oldest
  of them was queued.

Both are one re-armed timer each (no call_later + cancel per batch or per finish), so these check
that the deadlines are still the per-batch and per-finish ones.
"""
from __future__ import annotations

import asyncio

import pytest

from coordinator.channel_client import ChannelClient
from protocol import channel as cw
from protocol.coord import CoordinatorUnavailable
from protocol.failures import Cause


class _Server:
    """Records every batch (arrival time, decoded calls and finishes); answers a batch's calls
    with a generic lease when `answer` is set."""

    def __init__(self):
        self.batches: list[tuple[float, list, list]] = []
        self.answer = False
        self.got = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(cw.UPGRADE_ANSWER)
        loop = asyncio.get_running_loop()
        try:
            while True:
                head = await reader.readexactly(4)
                payload = await reader.readexactly(cw.HEADER.unpack(head)[0])
                b = cw.decode_batch(payload)
                calls = [cw.decode_call(c) for c in b.calls]
                fins = [cw.decode_finish(f) for f in b.finishes]
                self.batches.append((loop.time(), calls, fins))
                self.got.set()
                if self.answer:
                    res = [cw.Result(c.id, cw.OK, {"server": "http://w", "req_id": c.req_id, "info": {}})
                           for c in calls]
                    writer.write(cw.frame(cw.Replies(b.seq, res)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def channel_server():
    srv = _Server()
    s = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    yield srv, f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}"
    s.close()


async def test_unanswered_batches_expire_each_at_its_own_deadline(channel_server):
    srv, url = channel_server
    cl = ChannelClient(url, timeout_s=0.3)
    loop = asyncio.get_running_loop()
    try:
        assert await cl.connect()
        srv.answer = True
        assert (await cl.select("generation", 1))["server"] == "http://w"   # answered: never expires
        srv.answer = False
        t0 = loop.time()
        first = asyncio.ensure_future(cl.select("generation", 2))
        await asyncio.sleep(0.15)
        second = asyncio.ensure_future(cl.select("context", 3))
        with pytest.raises(CoordinatorUnavailable, match="did not answer") as e:
            await first
        t_first = loop.time() - t0
        assert e.value.cause is Cause.TIMEOUT
        assert not second.done()
        with pytest.raises(CoordinatorUnavailable, match="did not answer"):
            await second
        t_second = loop.time() - t0
        assert 0.28 <= t_first < 0.42 and 0.43 <= t_second < 0.6, (t_first, t_second)
        assert len(srv.batches) == 3 and not cl._deadlines      # nothing left to expire
    finally:
        await cl.close()


async def test_finishes_ride_on_calls_or_leave_after_the_delay(channel_server):
    srv, url = channel_server
    srv.answer = True
    cl = ChannelClient(url, timeout_s=2.0, finish_delay_s=0.05)
    loop = asyncio.get_running_loop()
    try:
        assert await cl.connect()
        # alone: both leave in one batch, finish_delay_s after the first was queued
        t0 = loop.time()
        assert cl.finish("context", 10) and cl.finish("generation", 10)
        await asyncio.wait_for(srv.got.wait(), 2)
        t, calls, fins = srv.batches[-1]
        assert not calls and [(f.role, f.req_id) for f in fins] == [("context", 10), ("generation", 10)]
        assert 0.045 <= t - t0 < 0.2, t - t0
        # a finish queued late in the previous delay still gets its own full delay
        srv.got.clear()
        await asyncio.sleep(0.03)
        t1 = loop.time()
        assert cl.finish("context", 11)
        await asyncio.wait_for(srv.got.wait(), 2)
        assert 0.045 <= srv.batches[-1][0] - t1 < 0.2
        # with a call right after: one batch carries both, before the delay
        srv.got.clear()
        t2 = loop.time()
        assert cl.finish("generation", 11)
        assert (await cl.select("generation", 12))["req_id"] == 12
        t, calls, fins = srv.batches[-1]
        assert [c.req_id for c in calls] == [12] and [(f.role, f.req_id) for f in fins] == [("generation", 11)]
        assert t - t2 < 0.045
        # the timer set for that finish is still pending: a finish queued now must not leave with it
        srv.got.clear()
        await asyncio.sleep(0.02)
        t3 = loop.time()
        assert cl.finish("context", 13)
        await asyncio.wait_for(srv.got.wait(), 2)
        t, calls, fins = srv.batches[-1]
        assert not calls and [f.req_id for f in fins] == [13]
        assert 0.045 <= t - t3 < 0.2, t - t3
        await asyncio.sleep(0.1)
        assert len(srv.batches) == 4
    finally:
        await cl.close()
