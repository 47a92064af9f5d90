"""The fleet's end of the coordinator channel: one persistent, pipelined connection per process.

Calls made during one event-loop turn (by any number of requests) leave as one `Batch`, together
with every lease end queued since the last flush; the coordinator answers each batch with one
`Replies` (frames in `protocol.channel`). Invariants:
- Bounded: at most `max_pending` calls unanswered; beyond, a placement fails at once with
  `CoordinatorOverloaded` (the fleet answers 503 + Retry-After) instead of queueing without limit.
- Every call answers within `timeout_s`, else `CoordinatorUnavailable` (the fleet falls back to
  local placement, as for an unreachable coordinator). A select answered after its caller gave
  up still took a lease: it is finished here when the late answer arrives, so no lease is lost.
- Finishes are queued without awaiting and ride on the next batch of calls, or leave on their own
  after `finish_delay_s` (2 ms) when no call comes first: under load a lease end costs no frame,
  write or reply of its own (bench/results/history/fleet.md, "fleet CPU per request"). Each leaves exactly once
  per batch and stays owned by the client until its batch is acknowledged. When the connection drops first, the unacknowledged
  ones are re-sent on the next connection, or handed to `fallback_finish` (the HTTP API) when the
  coordinator cannot be reached over the channel; a repeated finish is idempotent there.
- First-token reports (`first_token`: the leg's first token arrived, a context leg answered) are
  queued like finishes and ride the same batches, each sent once; one queued when the connection
  drops is dropped (the coordinator then ends the lease's prefill phase at its prefill TTL or the
  finish), never re-sent late.
- Not offered (an older coordinator, `--http aiohttp`, `coordinator.channel: false`): `usable()`
  turns False and the caller uses HTTP; the offer is re-checked every `retry_s`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Awaitable, Callable

from protocol import channel as cw
from coordinator import client_codec as codec
from router.policy_kv import explain as explain_kv
from protocol import coord as wire
from protocol.failures import Cause
from protocol.coord import BadRequest, CoordinatorOverloaded, CoordinatorUnavailable

log = logging.getLogger("splitserve.coordinator.channel")

FallbackFinish = Callable[[str, int, bool, "dict | None"], Awaitable[None]]


class _Proto(asyncio.Protocol):
    """The socket: the HTTP upgrade handshake, then length-prefixed frames."""

    def __init__(self, owner: "ChannelClient"):
        self.owner = owner
        self.transport = None
        self.buf = bytearray()
        self.framed = False
        self.handshake: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(cw.upgrade_request())

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.framed:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self._answer(f"no HTTP answer head within {len(buf)} bytes")
                return
            head = bytes(buf[:end])
            del buf[:end + 4]
            status = head[9:12]
            if status != b"101":
                self._answer(head.split(b"\r\n", 1)[0].decode("latin-1", "replace"))
                return
            self.framed = True
            if not self.handshake.done():
                self.handshake.set_result(None)
        try:
            payloads = cw.split_frames(buf)
        except cw.FrameTooLarge as exc:
            self.owner._lost(self, str(exc))
            self.transport.close()
            return
        for p in payloads:
            try:
                r = cw.decode_replies(p)
            except Exception as exc:    # msgspec errors: a coordinator bug; the batch is lost
                self.owner._lost(self, f"malformed reply frame: {exc}")
                self.transport.close()
                return
            self.owner._on_replies(r)

    def _answer(self, line: str) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(_NotOffered(line))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(CoordinatorUnavailable(f"connection closed: {exc}"))
        self.owner._lost(self, f"connection closed: {exc or 'by the coordinator'}")


class _NotOffered(Exception):
    pass


class ChannelClient:
    def __init__(self, url: str, *, timeout_s: float = 5.0, max_pending: int = 4096,
                 retry_s: float = 5.0, fallback_finish: FallbackFinish | None = None,
                 finish_delay_s: float = 0.002):
        url = url.rstrip("/")
        if url.startswith("unix:"):
            self._uds: str | None = "/" + url[len("unix:"):].lstrip("/")
            self._host = None
        elif url.startswith("http://"):
            self._uds = None
            hp = url[len("http://"):].split("/", 1)[0]
            host, _, port = hp.rpartition(":")
            self._host = (host.strip("[]") or "127.0.0.1", int(port or 80))
        else:
            raise ValueError(f"coordinator channel needs http://host:port or unix:///path, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.retry_s = retry_s
        self.fallback_finish = fallback_finish
        self.finish_delay_s = finish_delay_s
        self._proto: _Proto | None = None
        self._connecting: asyncio.Future | None = None
        self._down_until = 0.0          # no channel (not offered / unreachable) until then
        self._down_reason = ""
        self._id = 0
        self._seq = 0
        self._calls: list = []
        self._fins: list[cw.Finish] = []
        self._started: list[cw.FirstToken] = []
        self._fin_waiters: list[asyncio.Future] = []   # `await finish()` callers of queued finishes
        self._scheduled = False
        # Timers re-armed, never cancelled (a call_later + cancel costs ~2.3 µs, and under load
        # every request queues finishes and most batches carry calls):
        self._fin_timer: asyncio.TimerHandle | None = None   # a flush of finishes alone, if no call
        self._fins_since: float | None = None   # loop time the oldest finish not yet sent was queued
        self._deadlines: collections.deque[tuple[float, int]] = collections.deque()   # (due, seq) of
        self._expiry_timer: asyncio.TimerHandle | None = None   # batches with calls, oldest first
        self._loop: asyncio.AbstractEventLoop | None = None     # the connection's loop
        self._waiting: dict[int, tuple[asyncio.Future, Any]] = {}
        self._unacked: dict[int, tuple[list[int], list[cw.Finish], asyncio.TimerHandle | None,
                                       list[asyncio.Future]]] = {}
        self._abandoned: dict[int, Any] = {}
        # called once per placement whose caller was cancelled while waiting (the fleet counts them)
        self.on_abandoned: Callable[[], None] | None = None
        self._bg: set[asyncio.Task] = set()
        self._closed = False
        self.offered: bool | None = None     # None: not asked yet
        self.stats = {"batches": 0, "calls": 0, "finishes": 0, "resent_finishes": 0,
                      "http_finishes": 0, "abandoned_leases_finished": 0, "shed_pending": 0,
                      "reconnects": 0, "first_tokens": 0, "first_tokens_dropped": 0}

    # ---- connection ---------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """A call made now goes over the channel, with no await before it is registered: a caller
        cancelled from then on leaves its lease to `_on_replies` (no wrapper needed around it)."""
        return self._proto is not None and not self._closed

    def usable(self) -> bool:
        """Connected, or worth trying to connect (not known to be unavailable right now)."""
        return not self._closed and (self._proto is not None or time.monotonic() >= self._down_until)

    async def connect(self) -> bool:
        """Connected to the channel (True), or it is not available now (False: use HTTP)."""
        if self._proto is not None:
            return True
        if self._closed or time.monotonic() < self._down_until:
            return False
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_future()
            t = asyncio.get_running_loop().create_task(self._open())
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)
        return await asyncio.shield(self._connecting)

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        ok = False
        proto = None
        try:
            async with asyncio.timeout(min(self.timeout_s, 5.0)):
                if self._uds is not None:
                    _, proto = await loop.create_unix_connection(lambda: _Proto(self), self._uds)
                else:
                    _, proto = await loop.create_connection(lambda: _Proto(self), *self._host)
                await proto.handshake
            ok = True
        except _NotOffered as exc:
            self.offered = False
            self._down(f"the coordinator does not offer the channel ({exc})")
        except (OSError, TimeoutError, CoordinatorUnavailable) as exc:
            self._down(f"channel to {self.url} unavailable: {type(exc).__name__}: {exc}")
        if ok:
            self.offered = True
            self._loop = loop
            self._proto = proto
            if self.stats["batches"]:
                self.stats["reconnects"] += 1
            if self._calls or self._fins:
                self._schedule()
        elif proto is not None and proto.transport is not None:
            proto.transport.close()
        fut, self._connecting = self._connecting, None
        if fut is not None and not fut.done():
            fut.set_result(ok)
        if not ok and self._fins:
            self._fins_to_http(self._fins)
            self._fins = []

    def _down(self, why: str) -> None:
        if why != self._down_reason:
            log.info("%s; using the HTTP API for %gs", why, self.retry_s)
        self._down_reason = why
        self._down_until = time.monotonic() + self.retry_s

    def _lost(self, proto: _Proto, why: str) -> None:
        if self._proto is not proto:
            return
        self._proto = None
        if not self._closed:
            log.warning("coordinator channel to %s lost: %s", self.url, why)
        # Calls in flight: their callers fail over (an answer may never come). Their finishes:
        # owned until acknowledged, so re-sent.
        err = CoordinatorUnavailable(f"coordinator channel to {self.url} lost: {why}", Cause.PEER_LOST)
        resend: list[cw.Finish] = []
        waiters: list[asyncio.Future] = []
        for seq, (ids, fins, timer, fw) in self._unacked.items():
            if timer is not None:
                timer.cancel()
            resend += fins
            waiters += fw
            for i in ids:
                w = self._waiting.pop(i, None)
                if w is not None and not w[0].done():
                    w[0].set_exception(err)
        self._unacked.clear()
        self._deadlines.clear()
        # A placement whose caller is gone and whose answer is lost may still have leased: end
        # whatever it may have taken (a finish of a lease never created is a no-op).
        for call in self._abandoned.values():
            if type(call) is cw.Select:
                resend.append(cw.Finish(call.role, call.req_id, True))
            elif type(call) is cw.SelectPair:
                resend += [cw.Finish("context", call.req_id, True), cw.Finish("generation", call.req_id, True)]
        self._abandoned.clear()
        for fut, _call in self._waiting.values():
            if not fut.done():
                fut.set_exception(err)
        self._waiting.clear()
        self._calls = []
        if self._started:     # not re-sent: the coordinator's prefill TTL or the finish acts
            self.stats["first_tokens_dropped"] += len(self._started)
            self._started = []
        if resend:
            self.stats["resent_finishes"] += len(resend)
            self._fins = resend + self._fins
            self._fin_waiters = waiters + self._fin_waiters
        if self._fins and not self._closed:
            t = asyncio.get_running_loop().create_task(self._reconnect_for_finishes())
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    async def _reconnect_for_finishes(self) -> None:
        await asyncio.sleep(0.05)
        if self._fins and not await self.connect() and self._fins:
            self._fins_to_http(self._fins)
            self._fins = []

    def _fins_to_http(self, fins: list[cw.Finish]) -> None:
        self._fins_since = None        # the caller empties the queue
        waiters, self._fin_waiters = self._fin_waiters, []
        for f in waiters:    # handed over: the HTTP path retries them on its own
            if not f.done():
                f.set_result(None)
        if self.fallback_finish is None:
            log.warning("%d lease end(s) could not be sent: no channel and no HTTP fallback; the "
                        "coordinator expires them", len(fins))
            return
        self.stats["http_finishes"] += len(fins)
        for f in fins:
            t = asyncio.get_running_loop().create_task(
                self.fallback_finish(f.role, f.req_id, f.success, f.usage))
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    # ---- calls --------------------------------------------------------------------------------
    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush)

    def _schedule_finishes(self) -> None:
        """Finishes leave with the next flush, or `finish_delay_s` after the oldest was queued."""
        loop = self._loop
        if self._fins_since is None:
            self._fins_since = loop.time()
        if not self._scheduled and self._fin_timer is None:
            self._fin_timer = loop.call_at(self._fins_since + self.finish_delay_s, self._finishes_due)

    def _finishes_due(self) -> None:
        self._fin_timer = None
        since = self._fins_since
        if since is None or not (self._fins or self._started) or self._proto is None:
            return      # flushed meanwhile, or the connection is gone (_lost owns them)
        due = since + self.finish_delay_s
        if self._loop.time() < due - 1e-4:      # newer finishes than those this timer was set for
            self._fin_timer = self._loop.call_at(due, self._finishes_due)
            return
        self._flush()

    def _flush(self) -> None:
        self._scheduled = False
        proto = self._proto
        if proto is None or proto.transport is None or not (self._calls or self._fins or self._started):
            return
        self._seq += 1
        seq = self._seq
        calls, fins, fw, started = self._calls, self._fins, self._fin_waiters, self._started
        self._calls, self._fins, self._fin_waiters = [], [], []
        if started:
            self._started = []
            self.stats["first_tokens"] += len(started)
        self._fins_since = None
        ids = [c.id for c in calls]
        if ids:
            due = self._loop.time() + self.timeout_s
            self._deadlines.append((due, seq))
            if self._expiry_timer is None:
                self._expiry_timer = self._loop.call_at(due, self._expire_due)
        self._unacked[seq] = (ids, fins, None, fw)
        self.stats["batches"] += 1
        self.stats["calls"] += len(calls)
        self.stats["finishes"] += len(fins)
        proto.transport.write(cw.batch_frame(seq, time.monotonic(), calls, fins, started))

    def _expire_due(self) -> None:
        """The batches whose calls are past `timeout_s` unanswered (acknowledged ones leave the
        deque at their reply, or here when they reach its front)."""
        self._expiry_timer = None
        dq, unacked = self._deadlines, self._unacked
        now = self._loop.time()
        while dq:
            due, seq = dq[0]
            if seq not in unacked:
                dq.popleft()
                continue
            if due > now:
                self._expiry_timer = self._loop.call_at(due, self._expire_due)
                return
            dq.popleft()
            self._expire(seq)

    def _expire(self, seq: int) -> None:
        ent = self._unacked.get(seq)
        if ent is None:
            return
        err = None
        for i in ent[0]:
            w = self._waiting.pop(i, None)
            if w is None:
                continue
            fut, call = w
            if err is None:
                err = CoordinatorUnavailable(f"coordinator {self.url} did not answer within "
                                             f"{self.timeout_s:g}s (channel)", Cause.TIMEOUT)
            self._abandoned[i] = call
            if not fut.done():
                fut.set_exception(err)

    def _on_replies(self, r: cw.Replies) -> None:
        unacked = self._unacked
        ent = unacked.pop(r.seq, None)
        if ent is not None:
            for f in ent[3]:
                if not f.done():
                    f.set_result(None)
            dq = self._deadlines
            while dq and dq[0][1] not in unacked:     # answered: no longer due to expire
                dq.popleft()
        waiting = self._waiting
        for res in r.results:
            w = waiting.pop(res.id, None)
            if w is None:
                call = self._abandoned.pop(res.id, None)
                if call is not None and res.status == cw.OK:
                    self._finish_abandoned(call, res.body)
                continue
            fut = w[0]
            if fut.done():
                if res.status == cw.OK:
                    self._finish_abandoned(w[1], res.body)   # its caller was cancelled
                continue
            if res.status == cw.OK:
                fut.set_result(res.body)
            else:
                fut.set_exception(_error(self.url, w[1], res.status, res.body))

    def _finish_abandoned(self, call: Any, body: Any) -> None:
        """A placement nobody waits for any more: end the lease(s) it took."""
        if type(call) is cw.Renew or not isinstance(body, dict):
            return
        if type(call) is cw.Select:
            roles = (call.role,)
        else:
            roles = tuple(r for r in ("context", "generation") if body.get(r))
        for role in roles:
            self.stats["abandoned_leases_finished"] += 1
            self.finish(role, call.req_id, True)

    async def _call(self, make) -> Any:
        if self._proto is None and not await self.connect():
            raise _Fallback()
        if len(self._waiting) >= self.max_pending:
            self.stats["shed_pending"] += 1
            raise CoordinatorOverloaded(f"{len(self._waiting)} coordinator calls of this fleet process "
                                        f"are unanswered (fleet.coordinator_max_pending "
                                        f"{self.max_pending}); retry shortly")
        self._id += 1
        call = make(self._id)
        fut = self._loop.create_future()
        self._waiting[call.id] = (fut, call)
        self._calls.append(call)
        self._schedule()
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller went away: a late placement answer is finished by _on_replies.
            w = self._waiting.pop(call.id, None)
            if w is not None:
                self._abandoned[call.id] = call
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                # answered, but cancelled before this caller resumed: the lease is ours to end
                self._finish_abandoned(call, fut.result())
            else:
                raise
            if self.on_abandoned is not None and type(call) is not cw.Renew:
                self.on_abandoned()
            raise

    async def select(self, role: str, req_id: int, routing_key: Any = None, exclude: Any = None) -> dict:
        return _expanded(await self._select(role, req_id, routing_key, exclude))

    async def select_answer(self, role: str, req_id: int, routing_key: Any = None,
                            exclude: Any = None) -> wire.SelectAnswer:
        """`select`'s answer as `protocol.coord.SelectAnswer` (`BadAnswer` when it does not fit),
        checked before the kv explanation is built: `msgspec.convert` walks every value of `info`,
        and a two-candidate pair's built records cost it 4.1 µs against 1.8 for their numbers (2-core
        box, timeit)."""
        ans = wire.as_answer(wire.SelectAnswer, await self._select(role, req_id, routing_key, exclude),
                             "/select")
        ans.info = _expanded_info(ans.info)
        return ans

    async def select_pair(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                          exclude_gen: Any = None) -> dict:
        ans = await self._select_pair(req_id, routing_key, exclude_ctx, exclude_gen)
        if isinstance(ans, dict):
            for leg in ("context", "generation"):
                if ans.get(leg):
                    _expanded(ans[leg])
        return ans

    async def select_pair_answer(self, req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                                 exclude_gen: Any = None) -> wire.SelectPairAnswer:
        """`select_pair`'s answer as `protocol.coord.SelectPairAnswer`, checked before the kv
        explanations are built (as `select_answer`)."""
        pair = wire.as_answer(wire.SelectPairAnswer,
                              await self._select_pair(req_id, routing_key, exclude_ctx, exclude_gen),
                              "/select_pair")
        for leg in (pair.context, pair.generation):
            if leg is not None:
                leg.info = _expanded_info(leg.info)
        return pair

    def _select(self, role: Any, req_id: Any, routing_key: Any, exclude: Any) -> Awaitable[Any]:
        role = _role(role)
        _req_id(req_id)
        rk = cw.wire_key(routing_key) if routing_key is not None else None
        ex = list(exclude) if exclude else None
        return self._call(lambda i: cw.Select(i, role, req_id, rk, ex))

    def _select_pair(self, req_id: Any, routing_key: Any, exclude_ctx: Any,
                     exclude_gen: Any) -> Awaitable[Any]:
        _req_id(req_id)
        rk = cw.wire_key(routing_key) if routing_key is not None else None
        ec = list(exclude_ctx) if exclude_ctx else None
        eg = list(exclude_gen) if exclude_gen else None
        return self._call(lambda i: cw.SelectPair(i, req_id, rk, ec, eg))

    async def renew(self, role: str, req_id: int) -> bool:
        role = _role(role)
        _req_id(req_id)
        ans = await self._call(lambda i: cw.Renew(i, role, req_id))
        return bool(ans.get("renewed")) if isinstance(ans, dict) else False

    def finish(self, role: str, req_id: int, success: bool = True, usage: dict | None = None) -> bool:
        """Queue a lease end; False when the channel is not usable (the caller sends it by HTTP)."""
        if self._closed or (self._proto is None and self._connecting is None):
            return False
        canon = wire.ROLES.get(role) if isinstance(role, str) else None
        if canon is None or type(req_id) is not int or not 0 <= req_id <= wire.U64_MAX \
                or type(success) is not bool:
            return False    # the HTTP API answers it with its 400 naming the field
        if usage is not None and not _plain_usage(usage):
            try:
                wire.finish_usage(usage)
            except BadRequest:
                return False
        self._fins.append(cw.Finish(canon, req_id, success, usage))
        if self._proto is not None:
            self._schedule_finishes()
        return True

    def first_token(self, role: str, req_id: int) -> bool:
        """Queue a first-token report (no answer; idempotent at the coordinator); False when the
        channel is not connected (the caller may use the HTTP API, or let the prefill TTL act)."""
        if self._closed or self._proto is None:
            return False
        canon = wire.ROLES.get(role) if isinstance(role, str) else None
        if canon is None or type(req_id) is not int or not 0 <= req_id <= wire.U64_MAX:
            return False
        self._started.append(cw.FirstToken(canon, req_id))
        self._schedule_finishes()
        return True

    async def finish_acked(self, role: str, req_id: int, success: bool = True,
                           usage: dict | None = None) -> bool:
        """Like `finish`, then wait until the coordinator acknowledged it (or it was handed to the
        HTTP fallback); False when the channel is not usable (the caller sends it by HTTP)."""
        if not self.finish(role, req_id, success, usage):
            return False
        if self._proto is not None:
            self._schedule()     # awaited: no reason to wait for a call to ride on
        fut = asyncio.get_running_loop().create_future()
        self._fin_waiters.append(fut)
        await fut
        return True

    async def close(self, timeout: float = 2.0) -> None:
        """Send queued finishes, wait (bounded) for their acknowledgement, then close."""
        if self._proto is not None and (self._fins or self._unacked):
            self._flush()
            deadline = time.monotonic() + timeout
            while self._unacked and self._proto is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        self._closed = True
        for t in (self._fin_timer, self._expiry_timer):
            if t is not None:
                t.cancel()
        self._fin_timer = self._expiry_timer = None
        for f in self._fin_waiters:
            if not f.done():
                f.set_result(None)
        for ent in self._unacked.values():
            for f in ent[3]:
                if not f.done():
                    f.set_result(None)
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
        for t in list(self._bg):
            if not t.done():
                t.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)


def _plain_usage(u: Any) -> bool:
    """The usage the fleet sends (exactly the three fields, non-negative ints): valid for
    `protocol.coord.finish_usage` without running it (1.6 µs, twice per two-leg request); anything
    else goes through it."""
    if type(u) is not dict or len(u) != 3:
        return False
    p, c, d = u.get("prompt_tokens"), u.get("cached_tokens"), u.get("predicted_tokens")
    return type(p) is int and type(c) is int and type(d) is int and p >= 0 and c >= 0 and d >= 0


def _role(role: Any) -> str:
    try:
        return wire.parse_role(role) if isinstance(role, str) else wire.parse_role(str(role))
    except BadRequest as exc:
        raise codec.rejected(exc) from None


def _req_id(req_id: Any) -> None:
    try:
        wire.check_req_id(req_id)
    except BadRequest as exc:
        raise codec.rejected(exc) from None


class _Fallback(Exception):
    """The channel is not available for this call: send it over HTTP."""


_PATHS = {cw.Select: codec.SELECT, cw.SelectPair: codec.SELECT_PAIR, cw.Renew: codec.RENEW}


def _expanded(leg: Any) -> Any:
    """A leg's answer with its `kv_cache_aware` explanation rebuilt from the numbers the channel
    carried (`info["kv"]`, protocol/channel.py `KvChoice`): the HTTP API's `info`, less
    `server_info`. Raises `BadAnswer` when they do not fit the schema."""
    info = leg.get("info") if isinstance(leg, dict) else None
    if isinstance(info, dict):
        leg["info"] = _expanded_info(info)
    return leg


def _expanded_info(info: dict) -> dict:
    """`info` itself, or the explanation built from its `info["kv"]` with the rest of `info` added."""
    if "kv" not in info:
        return info
    kv = info.pop("kv")
    try:
        # positional, not msgspec.convert: the fleet's own coordinator sent it, and a
        # validating convert cost a fifth of the expansion; a shape it does not have fails here
        full = explain_kv(cw.KvChoice(*kv))
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
        raise wire.BadAnswer("coordinator channel", f"a kv_cache_aware placement's numbers "
                             f"(info.kv) do not fit protocol.channel.KvChoice: {exc!r}") from None
    full.update(info)
    return full


def _error(url: str, call: Any, status: int, body: Any) -> Exception:
    """A reply's typed error: the same codec as an HTTP answer to the same call."""
    return codec.error_of(url, _PATHS[type(call)], status, body, repr(body).encode())


Fallback = _Fallback
