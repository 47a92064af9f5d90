"""The two-leg flow for the vLLM and SGLang engine protocols (fleet/legs/), on the same machinery as the
TensorRT-LLM flow in fleet/flow.py: the same placement (coordinator leases on both roles), the same
`Flow.send` (connect failures and 503s retried elsewhere), the same relay, route receipt and request
scope (`/finish`, abort-on-disconnect). `Flow._run` hands a request here once both legs are placed
and the servers' protocol is not TensorRT-LLM's.

- vLLM (sequential): prefill leg (`legs.vllm.prefill_body`), then the decode leg with the prefill
  answer's `kv_transfer_params`; a request placed without a prefill leg (conditional
  disaggregation, aggregated fallback) goes to the decode server alone, which vLLM serves locally.
- SGLang (concurrent): both legs at once with one `bootstrap_room`; the decode answer is relayed, the
  prefill answer read to its end in the background. A prefill leg that fails aborts the decode leg
  (a decode would otherwise wait for KV that never comes); a connect failure or 503 on either leg
  aborts the other and retries the pair with the failed server excluded and a fresh room. SGLang
  decode servers cannot serve a request alone, so a request always gets a prefill leg.
"""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import orjson

from protocol.coord import NoServerAvailable
from router.pairing import settle

from . import legs
from . import metrics as M
from protocol.openai import ApiError
from .legs import plan
from .legs import sglang as sgl
from .legs import vllm as vl
from .placement import CTX, GEN, Placement
from .relay import decode_usage

log = logging.getLogger("splitserve.fleet.pd_flow")

PATHS = plan.PATHS


def server_engine_protocol(flow, role: str, server: str) -> str:
    grp = flow.config.context_servers if role == CTX else flow.config.generation_servers
    return legs.engine_protocol_of(grp.protocol, flow.placer.server_info(server))


def abort_request(flow, role: str, server: str, request_id: int) -> tuple[str | None, dict | None]:
    """(path, body) of the abort call for `rid` on `server`; (None, None) when closing the connection
    is that engine's only cancellation."""
    mod = legs.module(server_engine_protocol(flow, role, server))
    return mod.ABORT_PATH, mod.abort_body(request_id)


def request_engine_protocol(flow, ctx: Placement | None, gen: Placement) -> str:
    return server_engine_protocol(flow, GEN, gen.server)


async def run(flow, request, creq, scope, ctx: Placement | None, gen: Placement, key, proto: str):
    mod = legs.module(proto)
    same = ctx is None or server_engine_protocol(flow, CTX, ctx.server) == proto
    if not same:
        if not mod.ALLOWS_LOCAL_PREFILL:
            raise ApiError(502, f"context server {ctx.server} does not speak {proto} like generation server "
                                f"{gen.server}, and a {proto} decode server cannot serve a request alone; "
                                f"set context_servers.protocol", code="protocol_mismatch")
        # The KV cannot move between two engine families: serve it on the decode server alone.
        log.warning("request %d: context server %s does not speak %s like generation server %s; "
                    "serving it without a context leg", scope.request_id, ctx.server, proto, gen.server)
    scope.mode, keep = settle(scope.mode, ctx is not None, same)
    if ctx is not None and not keep:
        scope.release(ctx, True)
        ctx = None
    scope.route = plan.route_start(scope.request_id, scope.mode, None, proto)
    if ctx is None and not mod.ALLOWS_LOCAL_PREFILL and not flow.aggregated_only:
        # Its decode servers need a prefill leg: no local prefill, no aggregated fallback.
        try:
            ctx = await flow.placer.place(CTX, scope.request_id, key, set())
        except NoServerAvailable as e:
            raise ApiError(503, f"no prefill server available ({e}); {proto} decode servers cannot serve "
                                "a request alone", code="no_context_server", retry_after=1) from None
        scope.hold(ctx)
        scope.mode = plan.DISAGGREGATED
    if ctx is None:     # local prefill, fallback, or an aggregated deployment of these servers
        return await flow.plain_leg(request, creq, scope, gen, key)
    if mod.SEQUENTIAL:
        return await _vllm(flow, request, creq, scope, ctx, gen, key)
    return await _sglang(flow, request, creq, scope, ctx, gen, key)


# --------------------------------------------------------------------------- vLLM

async def _vllm(flow, request, creq, scope, ctx, gen, key):
    """The sequential flow (vLLM's legs)."""
    t = time.perf_counter()
    try:
        resp, ctx = await flow.send(scope, CTX, ctx, PATHS[creq.kind], orjson.dumps(vl.prefill_body(creq.body)),
                                    key)
    except ApiError as e:
        if not flow.falls_back(e):
            raise
        log.warning("request %d: no prefill server reachable (%s); serving on the decode server",
                    scope.request_id, e.message)
        scope.mode = scope.route["mode"] = plan.AGGREGATED_FALLBACK
        return await flow.plain_leg(request, creq, scope, gen, key)
    raw = await flow.relay.read(resp, scope, CTX, ctx)
    flow.placer.first_token(ctx)     # prefill done, the KV ready: no longer queued prefill
    flow.relay.leg_latency[CTX].observe(time.perf_counter() - t)
    try:
        ans = orjson.loads(raw)
        kv = vl.decode_params(ans)
    except (orjson.JSONDecodeError, vl.BadPrefillAnswer) as e:
        ctx.failed = True
        raise ApiError(502, f"prefill server {ctx.server} returned an invalid answer: {e}",
                       code="upstream_error") from None
    flow.relay.observe_context(scope, ctx, ans.get("usage"))
    scope.route["context"] = flow.route_of(ctx)
    scope.mode = scope.route["mode"] = vl.mode_of(kv)
    flow.m_place[scope.mode].inc()
    body = vl.decode_body(flow.answer_base(creq), kv)
    return await flow.final_leg(request, creq, scope, gen, orjson.dumps(body), key)


# --------------------------------------------------------------------------- SGLang

async def _sglang(flow, request, creq, scope, ctx, gen, key):
    """The concurrent flow (SGLang's legs)."""
    path = PATHS[creq.kind]
    scope.mode = scope.route["mode"] = plan.DISAGGREGATED
    base = flow.answer_base(creq)
    # The room is the request's snowflake (< 2**63); an id from elsewhere gets a fresh one.
    room = sgl.room_of(scope.request_id if 0 <= scope.request_id < 1 << sgl.ROOM_BITS else flow.ids.next_id())
    tried = {CTX: set(), GEN: set()}
    while True:
        port = sgl.bootstrap_port(flow.config.context_servers.bootstrap_port,
                                  flow.placer.server_info(ctx.server))
        body = orjson.dumps(sgl.leg_body(base, sgl.bootstrap_host(ctx.server), port, room, scope.request_id))
        tried[CTX].add(ctx.server)
        tried[GEN].add(gen.server)
        t = time.perf_counter()
        tasks = {CTX: asyncio.ensure_future(flow.send(scope, CTX, ctx, path, body, key, retries=0)),
                 GEN: asyncio.ensure_future(flow.send(scope, GEN, gen, path, body, key, retries=0))}
        try:
            await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for tk in tasks.values():
                tk.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            raise
        if not any(tk.done() and not tk.cancelled() and tk.exception() is not None for tk in tasks.values()):
            break
        # One leg failed: the other must not wait at the bootstrap server for it.
        for tk in tasks.values():
            if not tk.done():
                tk.cancel()
        res = await asyncio.gather(*tasks.values(), return_exceptions=True)
        await scope.abort_legs_now()
        errs = {r: x for r, x in zip(tasks, res)
                if isinstance(x, BaseException) and not isinstance(x, asyncio.CancelledError)}
        for x in errs.values():
            if not isinstance(x, ApiError):
                raise x
        retry = [r for r, x in errs.items() if x.code == "upstream_unavailable"]
        if len(retry) != len(errs) or any(scope.attempts[r] >= flow.max_retries for r in retry):
            raise next(iter(errs.values()))
        for role in retry:
            scope.attempts[role] += 1
            flow.m_retry[role].inc()
        await flow.backoff_sleep(max(scope.attempts[r] for r in retry))
        for role in retry:
            old = ctx if role == CTX else gen
            try:
                new = await flow.placer.place(role, scope.request_id, key, tried[role])
            except NoServerAvailable:
                raise ApiError(502, f"{role} server {old.server} unavailable; no other {role} server "
                                    f"to retry on", code="upstream_unavailable", retry_after=1) from None
            scope.release(old)      # already finished by `send`; no longer counted here
            scope.hold(new)
            if role == CTX:
                ctx = new
            else:
                gen = new
        # A fresh room: the aborted legs' room may still be known to a bootstrap server.
        room = sgl.room_of(flow.ids.next_id())
    (ctx_resp, ctx), (gen_resp, gen) = tasks[CTX].result(), tasks[GEN].result()
    scope.route["context"] = flow.route_of(ctx)
    scope.route["bootstrap_room"] = room
    flow.m_place[plan.DISAGGREGATED].inc()
    flow.spawn(_drain_prefill(flow, scope, ctx, ctx_resp, gen, gen_resp, t))
    return await flow.answer(request, creq, scope, gen, gen_resp)


async def _drain_prefill(flow, scope, ctx, resp, gen, gen_resp, t0: float) -> None:
    try:
        raw = await flow.relay.read(resp, scope, CTX, ctx)
        flow.placer.first_token(ctx)
    except ApiError as e:
        # The prefill died after answering: its KV will never reach the decode server.
        log.warning("request %d: prefill leg on %s failed after its headers (%s); aborting the decode leg",
                    scope.request_id, ctx.server, e.message)
        await scope.abort_open(gen_resp, GEN, gen.server)   # unless already done or aborted
        return
    flow.relay.leg_latency[CTX].observe(time.perf_counter() - t0)
    if raw[:1] == b"{":     # a JSON answer (a streamed one's usage is not needed: the decode's counts)
        try:
            flow.relay.observe_usage(CTX, ctx, decode_usage(raw))
        except msgspec.DecodeError:
            M.LEG_ERRORS.labels(CTX, "invalid_answer").inc()
