"""The two-leg flow for the vLLM and SGLang leg protocols (fleet/legs/), on the same machinery as the
TensorRT-LLM flow in fleet/flow.py: the same placement (coordinator leases on both roles), the same
`_send` (connect failures and 503s retried elsewhere), the same relay, route receipt, `/finish` and
abort-on-disconnect. `Flow._run` hands a request here once both legs are placed and the servers'
protocol is not TensorRT-LLM's.

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
import random
import time

import msgspec
import orjson

from protocol.coord import NoServerAvailable
from protocol.roles import Mode

from . import legs
from . import metrics as M
from .errors import ApiError
from .legs import sglang as sgl
from .legs import vllm as vl
from .placement import CTX, GEN, Placement

log = logging.getLogger("splitserve.fleet.pd_flow")

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class _Usage(msgspec.Struct):
    usage: dict | None = None


_usage_decoder = msgspec.json.Decoder(_Usage)


def server_protocol(flow, role: str, server: str) -> str:
    grp = flow.config.context_servers if role == CTX else flow.config.generation_servers
    return legs.protocol_of(grp.protocol, flow.placer.server_info(server))


def abort_request(flow, role: str, server: str, rid: int) -> tuple[str | None, dict | None]:
    """(path, body) of the abort call for `rid` on `server`; (None, None) when closing the connection
    is that engine's only cancellation."""
    mod = legs.module(server_protocol(flow, role, server))
    return mod.ABORT_PATH, mod.abort_body(rid)


def request_protocol(flow, ctx: Placement | None, gen: Placement) -> str:
    return server_protocol(flow, GEN, gen.server)


async def run(flow, request, creq, st, ctx: Placement | None, gen: Placement, key, proto: str):
    mod = legs.module(proto)
    if ctx is not None and server_protocol(flow, CTX, ctx.server) != proto:
        if not mod.LOCAL_PREFILL:
            raise ApiError(502, f"context server {ctx.server} does not speak {proto} like generation server "
                                f"{gen.server}, and a {proto} decode server cannot serve a request alone; "
                                f"set context_servers.protocol", code="protocol_mismatch")
        # The KV cannot move between two engine families: serve it on the decode server alone.
        log.warning("request %d: context server %s does not speak %s like generation server %s; "
                    "serving it without a context leg", st.rid, ctx.server, proto, gen.server)
        _drop(flow, st, ctx)
        ctx = None
        st.mode = Mode.NO_KV_TRANSFER
    st.route = {"id": st.rid, "mode": st.mode, "protocol": proto}
    if ctx is None and not mod.LOCAL_PREFILL and not flow.aggregated_only:
        # Its decode servers need a prefill leg: no local prefill, no aggregated fallback.
        try:
            ctx = await flow.placer.place(CTX, st.rid, key, set())
        except NoServerAvailable as e:
            raise ApiError(503, f"no prefill server available ({e}); {proto} decode servers cannot serve "
                                "a request alone", code="no_context_server", retry_after=1) from None
        st.placements.append(ctx)
        flow.placer.track(ctx, +1)
        st.mode = Mode.DISAGGREGATED
    if mod.SEQUENTIAL:
        return await _vllm(flow, request, creq, st, ctx, gen, key)
    return await _sglang(flow, request, creq, st, ctx, gen, key)


def _drop(flow, st, p: Placement) -> None:
    flow.placer.finish(p, True)
    flow.placer.track(p, -1)
    if p in st.placements:
        st.placements.remove(p)


def _fallback_ok(flow, e: ApiError) -> bool:
    return (e.status in (502, 503) and e.code == "upstream_unavailable" and flow.fallback == "aggregate"
            and not flow.placer.healthy_count(CTX))


# --------------------------------------------------------------------------- vLLM

async def _vllm(flow, request, creq, st, ctx, gen, key):
    """The sequential flow (vLLM's legs)."""
    path = PATHS[creq.kind]
    if ctx is None:
        flow._m_place[st.mode].inc()
        return await flow._final_leg(request, creq, st, gen, orjson.dumps(flow._gen_base(creq)), key)
    t = time.perf_counter()
    try:
        resp, ctx = await flow._send(st, CTX, ctx, path, orjson.dumps(vl.prefill_body(creq.body)), key)
    except ApiError as e:
        if not _fallback_ok(flow, e):
            raise
        log.warning("request %d: no prefill server reachable (%s); serving on the decode server",
                    st.rid, e.message)
        st.mode = st.route["mode"] = Mode.AGGREGATE_FALLBACK
        flow._m_place[st.mode].inc()
        return await flow._final_leg(request, creq, st, gen, orjson.dumps(flow._gen_base(creq)), key)
    raw = await flow._read(resp, st, CTX, ctx)
    flow._m_leglat[CTX].observe(time.perf_counter() - t)
    try:
        ans = orjson.loads(raw)
        kv = vl.decode_params(ans)
    except (orjson.JSONDecodeError, vl.BadPrefillAnswer) as e:
        ctx.failed = True
        raise ApiError(502, f"prefill server {ctx.server} returned an invalid answer: {e}",
                       code="upstream_error") from None
    flow._observe_usage(CTX, ctx, ans.get("usage"))
    st.route["context"] = flow._route_of(ctx)
    if kv is None or not kv.get("do_remote_prefill"):
        # No KV connector on that prefill server: the decode server computes the prompt itself.
        st.mode = Mode.NO_KV_TRANSFER
    else:
        st.mode = Mode.DISAGGREGATED
    st.route["mode"] = st.mode
    flow._m_place[st.mode].inc()
    body = vl.decode_body(flow._gen_base(creq), kv)
    return await flow._final_leg(request, creq, st, gen, orjson.dumps(body), key)


# --------------------------------------------------------------------------- SGLang

async def _sglang(flow, request, creq, st, ctx, gen, key):
    """The concurrent flow (SGLang's legs)."""
    path = PATHS[creq.kind]
    if ctx is None:     # aggregated deployment: SGLang servers without PD
        flow._m_place[st.mode].inc()
        return await flow._final_leg(request, creq, st, gen, orjson.dumps(flow._gen_base(creq)), key)
    st.mode = st.route["mode"] = Mode.DISAGGREGATED
    base = flow._gen_base(creq)
    # The room is the request's snowflake (< 2**63); an id from elsewhere gets a fresh one.
    room = sgl.room_of(st.rid if 0 <= st.rid < 1 << sgl.ROOM_BITS else flow.ids.next_id())
    tried = {CTX: set(), GEN: set()}
    while True:
        port = sgl.bootstrap_port(flow.config.context_servers.bootstrap_port,
                                  flow.placer.server_info(ctx.server))
        body = orjson.dumps(sgl.leg_body(base, sgl.bootstrap_host(ctx.server), port, room, st.rid))
        tried[CTX].add(ctx.server)
        tried[GEN].add(gen.server)
        t = time.perf_counter()
        tasks = {CTX: asyncio.ensure_future(flow._send(st, CTX, ctx, path, body, key, retries=0)),
                 GEN: asyncio.ensure_future(flow._send(st, GEN, gen, path, body, key, retries=0))}
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
        await _abort_pair(flow, st)
        errs = {r: x for r, x in zip(tasks, res)
                if isinstance(x, BaseException) and not isinstance(x, asyncio.CancelledError)}
        for x in errs.values():
            if not isinstance(x, ApiError):
                raise x
        retry = [r for r, x in errs.items() if x.code == "upstream_unavailable"]
        if len(retry) != len(errs) or any(st.attempts[r] >= flow.max_retries for r in retry):
            raise next(iter(errs.values()))
        for role in retry:
            st.attempts[role] += 1
            flow._m_retry[role].inc()
        if flow.backoff:
            await asyncio.sleep(flow.backoff * (0.5 + random.random()))
        for role in retry:
            old = ctx if role == CTX else gen
            try:
                new = await flow.placer.place(role, st.rid, key, tried[role])
            except NoServerAvailable:
                raise ApiError(502, f"{role} server {old.server} unavailable; no other {role} server "
                                    f"to retry on", code="upstream_unavailable", retry_after=1) from None
            flow.placer.track(old, -1)
            if old in st.placements:
                st.placements.remove(old)
            st.placements.append(new)
            flow.placer.track(new, +1)
            if role == CTX:
                ctx = new
            else:
                gen = new
        # A fresh room: the aborted legs' room may still be known to a bootstrap server.
        room = sgl.room_of(flow.ids.next_id())
    (ctx_resp, ctx), (gen_resp, gen) = tasks[CTX].result(), tasks[GEN].result()
    st.route["context"] = flow._route_of(ctx)
    st.route["bootstrap_room"] = room
    flow._m_place["disaggregated"].inc()
    flow._spawn(_drain_prefill(flow, st, ctx, ctx_resp, gen, gen_resp, t))
    return await flow._relay(request, creq, st, gen, gen_resp)


async def _abort_pair(flow, st) -> None:
    """Abort whatever either leg started (open connections closed, each engine's abort call awaited,
    so a retried pair never meets a leftover one)."""
    for r in st.open_resp:
        r.abort()
    st.open_resp.clear()
    seen = set(st.touched)
    st.touched.clear()
    await asyncio.gather(*(flow._post_abort(role, server, st.rid) for role, server in seen))


async def _drain_prefill(flow, st, ctx, resp, gen, gen_resp, t0: float) -> None:
    try:
        raw = await flow._read(resp, st, CTX, ctx)
    except ApiError as e:
        # The prefill died after answering: its KV will never reach the decode server.
        log.warning("request %d: prefill leg on %s failed after its headers (%s); aborting the decode leg",
                    st.rid, ctx.server, e.message)
        if gen_resp in st.open_resp:   # still relaying, and not already aborted with the client
            gen_resp.abort()
            await flow._post_abort(GEN, gen.server, st.rid)
        return
    flow._m_leglat[CTX].observe(time.perf_counter() - t0)
    if raw[:1] == b"{":     # a JSON answer (a streamed one's usage is not needed: the decode's counts)
        try:
            flow._observe_usage(CTX, ctx, _usage_decoder.decode(raw).usage)
        except msgspec.DecodeError:
            M.LEG_ERRORS.labels(CTX, "invalid_answer").inc()


def strip_stream_kv(events: bytes) -> bytes:
    """SSE events without `kv_transfer_params` (vLLM puts the decode side's KV handle on a stream's
    final chunk; it is internal, like `disaggregated_params`)."""
    out = []
    for ev in events.split(b"\n\n"):
        if not ev:
            continue
        if ev.startswith(b"data: {") and b'"kv_transfer_params"' in ev:
            try:
                obj = orjson.loads(ev[6:])
            except orjson.JSONDecodeError:
                out.append(ev)
                continue
            if isinstance(obj, dict):
                obj.pop("kv_transfer_params", None)
                ev = b"data: " + orjson.dumps(obj)
        out.append(ev)
    return b"".join(e + b"\n\n" for e in out)
