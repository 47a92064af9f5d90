"""The coordinator's end of the fleet channel (frames in `protocol.channel`).

A connection arrives as HTTP (`coordinator.http`), asks for `GET /channel` with the channel's
`Upgrade` token, gets `101` and is handed to a `ChannelConn`. Each `Batch` is answered by one
`Replies` frame computed synchronously (no task, no await): every finish of the batch, then every
call — a finish cannot be for a lease a call of the same batch takes (that answer has not reached
the client yet), while a call may follow a finish of the same key (a retry re-placing a leg). All
replies produced by one `data_received` go out in one write.

Overload: a batch carries the client's send time (its own monotonic clock). The server keeps the
smallest (arrival - sent) seen on the connection — the clocks' offset plus the unloaded transit —
and treats anything above it as time spent queued (in socket buffers or behind a busy event
loop). A placement queued longer than `max_queue_delay_s` is shed with 429 and `retry_after`, no
lease taken, at a cost of microseconds, so a saturated coordinator drains its backlog instead of
answering everything late. Finishes and renews are never shed: they free capacity.
`LoopWatch` gives the HTTP API the same decision from the event loop's own lateness.
"""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from protocol import channel as cw
from coordinator import checks
from protocol import coord as wire
from protocol.coord import BadRequest, NoServerAvailable, NotServing

log = logging.getLogger("splitserve.coordinator.channel")

_RETRY_AFTER_S = 1
_NONE = checks.exclusions(None, "exclude")    # the shared empty exclusion set


class ChannelStats:
    __slots__ = ("connections", "opened", "batches", "calls", "finishes", "shed", "bad_frames",
                 "bad_calls")

    def __init__(self):
        self.connections = 0
        self.opened = 0
        self.batches = 0
        self.calls = 0
        self.finishes = 0
        self.shed = 0
        self.bad_frames = 0
        self.bad_calls = 0


class LoopWatch:
    """How late the event loop runs its timers: a tick every `interval_s`; `lag(now)` is how far
    past its due time the next tick already is (0 while the loop keeps up). `saturated(now, s)`
    also needs the previous tick to have been late by `s`: one pause of the whole process (the
    OS ran something else) makes one late tick, a loop that cannot keep up makes them in a row."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.last = time.monotonic()
        self.last_late = 0.0          # how late the previous tick ran
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.last = time.monotonic()
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        self.last_late = max(0.0, now - self.last - self.interval_s)
        self.last = now
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def lag(self, now: float) -> float:
        return max(0.0, now - self.last - self.interval_s)

    def saturated(self, now: float, limit_s: float) -> bool:
        return self.last_late > limit_s and self.lag(now) > limit_s

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class ChannelServer:
    """Shared state of every channel connection of one coordinator."""

    def __init__(self, coord, *, max_queue_delay_s: float):
        self.coord = coord
        self.max_queue_delay_s = max_queue_delay_s
        self.stats = ChannelStats()
        self.conns: set[ChannelConn] = set()

    def protocol(self) -> "ChannelConn":
        return ChannelConn(self)

    def close(self) -> None:
        for c in list(self.conns):
            c.close()

    # ---- one batch ------------------------------------------------------------------------------
    def run_batch(self, b: cw.DecodedBatch | cw.Batch, since: float) -> cw.Replies:
        """Answer one batch. `since`: when it would have arrived unloaded (this process's
        monotonic clock); a placement is shed once now - since exceeds `max_queue_delay_s`, which
        also covers the calls queued behind earlier ones of the same batch."""
        coord = self.coord
        st = self.stats
        st.batches += 1
        limit = since + self.max_queue_delay_s
        mono = time.monotonic
        finishes, calls, results = self._items(b)
        # First-token reports, then finishes: a leg's first token came before its end (both may
        # ride one batch). Finishes before calls: none can be for a lease taken by a call of the
        # same batch (its answer has not reached the client), while a call may follow a finish of
        # the same key (a retry).
        started = b.started
        if started:
            if type(b) is not cw.DecodedBatch:
                started = self._started(started)
            coord.leases_first_tokens(started)
        for f in finishes:
            # Role, id and flag were checked by the frame schema; the usage numbers' bounds are not.
            try:
                usage = wire.finish_usage(f.usage)
            except BadRequest as exc:    # e.g. usage numbers out of range: the lease still ends
                st.bad_calls += 1
                log.warning("finish on the channel: %s; ending the lease without its usage", exc)
                usage = None
            coord.end_lease(f.role, f.req_id, f.success, usage)
        for call in calls:
            t = type(call)
            if t is cw.Renew:
                results.append(cw.Result(call.id, cw.OK,
                                         {"renewed": coord.renew_lease(call.role, call.req_id)}))
                continue
            now = mono()
            if now > limit:
                st.shed += 1
                results.append(cw.Result(call.id, cw.OVERLOADED, {
                    "error": f"coordinator overloaded: the placement waited {(now - since) * 1e3:.1f} "
                             f"ms (max_queue_delay_s {self.max_queue_delay_s:g})",
                    "retry_after": _RETRY_AFTER_S}))
                continue
            try:
                key = checks.routing_key(call.routing_key, coord.block_size)
                if t is cw.Select:
                    ex = call.exclude
                    ans = coord.place(call.role, call.req_id, key,
                                      _NONE if ex is None else checks.exclusions(ex, "exclude"),
                                      server_info=False)
                else:
                    ex, eg = call.exclude_ctx, call.exclude_gen
                    ans = coord.place_pair(call.req_id, key,
                                           _NONE if ex is None else checks.exclusions(ex, "exclude_ctx"),
                                           _NONE if eg is None else checks.exclusions(eg, "exclude_gen"),
                                           server_info=False)
                results.append(cw.Result(call.id, cw.OK, ans))
            except NotServing as exc:
                results.append(cw.Result(call.id, cw.NOT_SERVING, exc.to_body()))
            except NoServerAvailable as exc:
                r = getattr(exc, "reason", None)
                results.append(cw.Result(call.id, cw.UNAVAILABLE,
                                         {"error": r if isinstance(r, str) and r else str(exc)}))
            except BadRequest as exc:
                name = "select" if t is cw.Select else "select_pair"
                coord.stats.bad_requests[name] = coord.stats.bad_requests.get(name, 0) + 1
                results.append(cw.Result(call.id, cw.BAD_REQUEST, exc.to_body()))
        return cw.Replies(b.seq, results)

    def _started(self, raws: list) -> list:
        out = []
        for raw in raws:
            try:
                out.append(cw.decode_started(raw))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.stats.bad_calls += 1
                log.warning("ignored a malformed first-token report on the channel: %s", exc)
        return out

    def _items(self, b: cw.DecodedBatch | cw.Batch) -> tuple[list, list, list]:
        """(finishes, calls, answers to malformed calls) of a batch: as decoded with the frame
        (`cw.decode_frame`), or decoded one by one when an item did not fit the schema, a malformed
        finish ignored and a malformed call answered 400 on its own (when its id is readable)."""
        st = self.stats
        st.finishes += len(b.finishes)
        st.calls += len(b.calls)
        if type(b) is cw.DecodedBatch:
            return b.finishes, b.calls, []
        finishes, calls, bad = [], [], []
        for raw in b.finishes:
            try:
                finishes.append(cw.decode_finish(raw))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                st.bad_calls += 1
                log.warning("ignored a malformed finish on the channel: %s", exc)
        for raw in b.calls:
            try:
                calls.append(cw.decode_call(raw))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                st.bad_calls += 1
                cid = cw.call_id(raw)
                if cid is not None:
                    bad.append(cw.Result(cid, cw.BAD_REQUEST,
                                         {"error": f"malformed channel call: {exc}", "field": None}))
        return finishes, calls, bad


class ChannelConn(asyncio.Protocol):
    """One fleet process's channel, after the HTTP upgrade."""

    __slots__ = ("srv", "transport", "buf", "offset")

    def __init__(self, srv: ChannelServer):
        self.srv = srv
        self.transport = None
        self.buf = bytearray()
        self.offset: float | None = None    # min(arrival - sent): clock offset + unloaded transit

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.srv.conns.add(self)
        self.srv.stats.connections += 1
        self.srv.stats.opened += 1

    def connection_lost(self, exc) -> None:
        if self in self.srv.conns:
            self.srv.conns.discard(self)
            self.srv.stats.connections -= 1
        self.transport = None

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        try:
            payloads = cw.split_frames(buf)
        except cw.FrameTooLarge as exc:
            self._fatal(str(exc))
            return
        if not payloads:
            return
        out = []
        srv = self.srv
        for p in payloads:
            try:
                b = cw.decode_frame(p)
            except Exception as exc:   # msgspec.ValidationError / DecodeError: a client bug
                # The batch cannot be answered call by call (its ids are unreadable): the client
                # fails its pending calls and re-sends its finishes on a new connection.
                self._fatal(f"malformed channel frame: {exc}")
                return
            now = time.monotonic()
            since = now
            if b.sent is not None:
                d = now - b.sent
                off = self.offset
                if off is None or d < off:
                    self.offset = off = d
                since = b.sent + off
            try:
                out.append(cw.frame(srv.run_batch(b, since)))
            except Exception:   # a bug must cost this connection, not the loop
                log.exception("coordinator channel failed on a batch")
                self._fatal("internal error in the coordinator")
                return
        if self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _fatal(self, why: str) -> None:
        self.srv.stats.bad_frames += 1
        log.warning("closing a fleet channel: %s", why)
        if self.transport is not None:
            self.transport.close()
            self.transport = None


__all__ = ["ChannelServer", "ChannelConn", "LoopWatch"]
