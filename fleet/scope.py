"""One request's scope: the leases it holds and the legs it opened, ended in one place.

`with RequestScope(flow, t0, alias) as scope:` (a plain context manager: entering and leaving never
await, so no coroutine per request for either) mints the request's id (and claims the client's
alias, 409 when it is in flight already); leaving the block, on every path — an answer, an error,
the client hanging up at any await point (fleet/http_server.py cancels the request's task) —
- finishes every lease still held, exactly once (`Placer.finish` is idempotent), `success=false` only
  when the server failed (a client that hung up or sent a bad request does not count toward its
  ejection);
- unless the request completed, closes every upstream response still open and sends the engine's
  abort to each server that saw the request (a finished context leg included: its KV blocks stay
  pinned for the transfer). Aborts are background tasks of the flow (`Flow.drain` waits for them).

The flows never finish a lease or abort a leg by hand: they tell the scope what happened (`hold`,
`release`, `sent`, `opened`, `closed`, `settled`) and ask it for early ends (`abort_legs_now`,
`abort_on`, `abort_open`).
"""
from __future__ import annotations

import asyncio
import logging
import time

from . import metrics as M
from protocol.openai import ApiError
from .placement import CTX, GEN, Placement

log = logging.getLogger("splitserve.fleet.flow")


class RequestScope:
    __slots__ = ("flow", "placer", "request_id", "t0", "alias", "mode", "route", "attempts", "bytes_sent",
                 "failed", "placements", "open_resp", "touched", "gen_sent_at", "trace",
                 "context_usage", "x_request_id")

    def __init__(self, flow, t0: float, alias: int | None = None, request_id: int = 0,
                 x_request_id: str | None = None):
        self.flow = flow                # spawn(), post_abort(), aliases, ids
        self.placer = flow.placer
        self.request_id = request_id    # minted on entry unless given: the id every worker and lease sees
        self.x_request_id = x_request_id    # the answer's X-Request-Id: the client's (sanitised), else request_id
        self.t0 = t0
        self.alias = alias              # the client's disagg_request_id (logs and route header only)
        self.mode = "disaggregated"
        self.route: dict = {}
        self.attempts = {CTX: 0, GEN: 0}
        self.gen_sent_at = 0.0          # when the generation leg's last attempt was sent (its latency)
        self.bytes_sent = False
        self.failed = False             # ended with an error event after the stream's headers went out
        self.context_usage: tuple | None = None   # (prompt, cached) the context leg reported
        self.placements: list[Placement] = []   # leases held (finished on exit)
        self.open_resp: list = []       # upstream responses not yet read to their end
        self.touched: list = []         # (role, server) that received this request (aborted on exit)
        self.trace = None               # fleet/tracing.py's RequestTrace when tracing is on

    # ------------------------------------------------------------------ entry / exit
    def __enter__(self) -> "RequestScope":
        alias = self.alias
        if alias is not None:
            if alias in self.flow.aliases:
                M.DUPLICATE_IDS.inc()
                raise ApiError(409, f"disaggregated_params.disagg_request_id {alias} is already used by a "
                                    f"request in flight; use a unique id per concurrent request",
                               param="disaggregated_params.disagg_request_id", code="duplicate_request_id")
            self.flow.aliases.add(alias)
        if not self.request_id:
            self.request_id = self.flow.ids.next_id()
        if self.x_request_id is None:
            self.x_request_id = str(self.request_id)
        if alias is not None:
            log.debug("request %d: client request id %d", self.request_id, alias)
        return self

    def __exit__(self, et, exc, tb) -> bool:
        try:
            if et is not None and issubclass(et, asyncio.CancelledError):
                M.DISCONNECTS.labels("generation" if self.bytes_sent or self.attempts[GEN] else "context").inc()
                log.info("request %d%s: client went away; aborting %d open leg(s)", self.request_id,
                         f" (client id {self.alias})" if self.alias is not None else "", len(self.touched))
        finally:
            placer = self.placer
            for p in self.placements:
                placer.track(p, -1)
                placer.finish(p, not p.failed)
            self.placements.clear()
            if et is not None or self.failed:
                self.abort_legs()
            if self.alias is not None:
                self.flow.aliases.discard(self.alias)
        return False

    # the same as an asynchronous context manager (`async with`)
    async def __aenter__(self) -> "RequestScope":
        return self.__enter__()

    async def __aexit__(self, et, exc, tb) -> bool:
        return self.__exit__(et, exc, tb)

    # ------------------------------------------------------------------ leases
    def hold(self, p: Placement) -> None:
        """A lease taken for this request: counted in the local in-flight load until it ends."""
        self.placements.append(p)
        self.placer.track(p, +1)

    def release(self, p: Placement, success: bool | None = None) -> None:
        """End a lease before the request ends (unused, or retried elsewhere); `success` defaults to
        whether the server did not fail."""
        self.placer.finish(p, (not p.failed) if success is None else success)
        if p in self.placements:
            self.placements.remove(p)
            self.placer.track(p, -1)

    # ------------------------------------------------------------------ legs
    def sent(self, role: str, server: str) -> None:
        self.touched.append((role, server))
        if role == GEN:
            self.gen_sent_at = time.perf_counter()

    def unsent(self) -> None:
        """The last leg sent never reached its worker (connect failure): nothing to abort there."""
        self.touched.pop()

    def opened(self, resp) -> None:
        self.open_resp.append(resp)

    def closed(self, resp) -> None:
        if resp in self.open_resp:
            self.open_resp.remove(resp)

    def is_open(self, resp) -> bool:
        return resp in self.open_resp

    def settled(self) -> None:
        """The answer is complete: no worker holds anything of this request to abort."""
        self.touched.clear()

    # ------------------------------------------------------------------ aborts
    def _close_open(self) -> None:
        for r in self.open_resp:
            r.abort()
        self.open_resp.clear()

    def abort_legs(self) -> None:
        """Close every open response; abort the request on every server that saw it (background)."""
        self._close_open()
        seen = set()
        for role, server in self.touched:
            if (role, server) not in seen:
                seen.add((role, server))
                self.abort_on(role, server)
        self.touched.clear()

    async def abort_legs_now(self) -> None:
        """Like `abort_legs`, awaiting each engine's abort (a retried SGLang pair must never meet a
        leftover leg of the previous attempt)."""
        self._close_open()
        seen = set(self.touched)
        self.touched.clear()
        flow = self.flow
        await asyncio.gather(*(flow.post_abort(role, server, self.request_id) for role, server in seen))

    def abort_role(self, role: str, server: str) -> None:
        """Close the open responses and abort the request on one server (a generation_first leg
        that the context answer made unnecessary)."""
        self._close_open()
        self.abort_on(role, server)

    def abort_on(self, role: str, server: str, count: bool = True) -> None:
        """Send the engine's abort for this request to `server` in the background (also how a
        finished context leg's pinned KV is released early; `count=False` keeps that out of the
        aborts metric)."""
        self.flow.spawn(self.flow.post_abort(role, server, self.request_id, count))

    async def abort_open(self, resp, role: str, server: str) -> None:
        """Abort one leg if its response is still open (not done, not aborted with the client)."""
        if resp in self.open_resp:
            resp.abort()
            await self.flow.post_abort(role, server, self.request_id)
