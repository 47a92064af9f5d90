"""The two-leg disaggregated flow (docs/design.md §5), with the failure semantics of the fleet.

One request = one snowflake id, minted here, used on both legs, in the coordinator and in the logs (a
client's own `disagg_request_id` is only an alias: see `Flow.handle`). Steps:

1. routing key (token ids → block keys) only when a delegated policy needs it;
2. placement (`Placer`); conditional disaggregation comes back from the coordinator as "no context
   leg"; no healthy context server → `no_context_fallback` (aggregate on a generation server, or 503);
3. context leg: the client's body with `stream=false`, `stream_options=null`,
   `disaggregated_params={request_type: context_only, disagg_request_id, schedule_style}`;
4. generation leg only if the context answer's `finish_reason ∈ {length, not_finished}`; it carries the
   context answer's `disaggregated_params` with `request_type: generation_only` and the context
   answer's `prompt_token_ids` relayed as raw JSON bytes (never re-tokenized, never re-parsed: msgspec
   `Raw`); the generation worker emits the first token itself — nothing is prepended here;
5. the generation answer is relayed (SSE events as they arrive).

That is TensorRT-LLM's protocol; servers speaking vLLM's or SGLang's are handed to fleet/pd_flow.py
once placed (docs/protocols.md).

Failure rules (beating upstream, reference §7):
- a connect-level failure (`UpstreamConnectError`) or a worker 503 is retried on a *different*
  server (`exclude`), after a jittered backoff, at most `max_retries` times; the id stays the same
  and the attempt number goes up (header `X-Splitserve-Attempt`);
- a 4xx from a worker is relayed as is, never retried; a failure after a request reached a worker
  (disconnect, timeout, 5xx) is not retried; nothing is retried after bytes went to the client;
- every lease gets exactly one `/finish` (`Placer.finish` is idempotent and sits in `finally`);
- client disconnect (the handler task is cancelled by aiohttp) → every leg still open is aborted at
  once: the upstream connection is closed and the engine's abort (`POST /v1/abort`; per protocol,
  fleet/legs/) is sent to each worker that saw the request (including a finished context leg, whose KV blocks stay pinned for the transfer); no
  further leg is started.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import msgspec
import orjson
from aiohttp import web

from protocol.coord import NoServerAvailable
from protocol.roles import Mode

from . import metrics as M
from . import pd_flow
from .auth import AUTH_HEADER, sign
from .errors import ApiError
from .placement import CTX, GEN, Placement, Placer
from .upstream import Response, UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamTimeout
from .validate import CHAT, ClientRequest

log = logging.getLogger("splitserve.fleet.flow")

PATHS = {CHAT: "/v1/chat/completions", "completion": "/v1/completions"}
NEED_GEN = frozenset({"length", "not_finished"})
SESSION_HEADERS = ("x-session-id", "x-correlation-id", "x-session-affinity", "x-multi-turn-session-id")
ROUTE_HEADER = "x-splitserve-route"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# --------------------------------------------------------------------------- context answer decoding

class _CtxChoice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    disaggregated_params: dict | None = None


class _CtxAnswer(msgspec.Struct):
    choices: list[_CtxChoice] = []
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"")
    usage: dict | None = None


_ctx_decoder = msgspec.json.Decoder(_CtxAnswer)


class _UsageOnly(msgspec.Struct):
    usage: dict | None = None


_usage_decoder = msgspec.json.Decoder(_UsageOnly)


def _cached_tokens(usage: dict | None) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    d = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int((d.get("cached_tokens") if isinstance(d, dict) else 0) or 0)


# --------------------------------------------------------------------------- per-request state

@dataclass(slots=True)
class _State:
    rid: int                        # minted by this fleet process: the id every worker and lease sees
    t0: float
    alias: int | None = None        # the client's disagg_request_id (logs and route header only)
    mode: Mode = Mode.DISAGGREGATED
    placements: list = field(default_factory=list)          # every Placement taken (for /finish)
    open_resp: list = field(default_factory=list)           # upstream Responses not yet done
    touched: list = field(default_factory=list)             # (role, server) that received this request
    done: bool = False
    attempts: dict = field(default_factory=lambda: {CTX: 0, GEN: 0})
    route: dict = field(default_factory=dict)
    bytes_sent: bool = False
    failed: bool = False            # ended with an error event after the stream's headers went out


class Flow:
    def __init__(self, config, placer: Placer, pool: UpstreamPool, ids, keys=None):
        self.config = config
        self.placer = placer
        self.pool = pool
        self.ids = ids                      # snowflake generator: .next_id() -> int
        self.keys = keys                    # routing-key builder (None: no policy needs one)
        self.max_retries = config.max_retries
        self.timeout = config.request_timeout
        self.backoff = config.fleet.retry_backoff_s
        self.schedule = config.schedule_style
        self.fallback = config.no_context_fallback
        self.hmac_key = config.internal_request_auth_key
        self.renew_every = config.leases.effective_renew_interval_s
        self._bg: set[asyncio.Task] = set()
        self.inflight = 0
        self.aliases: set[int] = set()      # client disagg_request_ids of requests in flight
        self._m_place = {m: M.PLACEMENT.labels(m) for m in Mode}
        self.no_transfer: set[str] = set()   # generation servers that answered 501 to generation_only
        self._m_leg = {r: M.LEG_REQUESTS.labels(r) for r in (CTX, GEN)}
        self._m_retry = {r: M.LEG_RETRIES.labels(r) for r in (CTX, GEN)}
        self._m_leglat = {r: M.LEG_LATENCY.labels(r) for r in (CTX, GEN)}
        self._m_tokens: dict = {}
        # No context servers configured (and no dynamic membership): a plain aggregated deployment.
        self.aggregated_only = not config.context_servers.urls and config.disagg_cluster is None

    # ------------------------------------------------------------------ entry point
    async def handle(self, request: web.Request, creq: ClientRequest, alias: int | None,
                     client_params: dict | None, t0: float) -> web.StreamResponse:
        """Serve one request. Its id is always minted here; `alias` is the client's own
        `disagg_request_id`, kept for logs and the route header only (never sent to a worker, never
        an abort or transfer key), and unique among this process's requests in flight."""
        if alias is not None:
            if alias in self.aliases:
                M.DUPLICATE_IDS.inc()
                raise ApiError(409, f"disaggregated_params.disagg_request_id {alias} is already used by a "
                                    f"request in flight; use a unique id per concurrent request",
                               param="disaggregated_params.disagg_request_id", code="duplicate_request_id")
            self.aliases.add(alias)
        st = _State(self.ids.next_id(), t0, alias=alias)
        if alias is not None:
            log.debug("request %d: client request id %d", st.rid, alias)
        ok = False
        try:
            resp = await self._run(request, creq, st, client_params)
            if isinstance(resp, _ReplayStream):
                resp = await resp.send(request)
            ok = not st.failed
            return resp
        except asyncio.CancelledError:
            M.DISCONNECTS.labels("generation" if st.bytes_sent or st.attempts[GEN] else "context").inc()
            log.info("request %d%s: client went away; aborting %d open leg(s)", st.rid,
                     f" (client id {st.alias})" if st.alias is not None else "", len(st.touched))
            raise
        finally:
            for p in st.placements:
                self.placer.track(p, -1)
                # success=false only when the server failed: a client that hung up or sent a bad
                # request must not count toward the server's ejection.
                self.placer.finish(p, not p.failed)
            if not ok:
                self._abort_all(st)
            if alias is not None:
                self.aliases.discard(alias)

    # ------------------------------------------------------------------ aborts
    def _abort_all(self, st: _State) -> None:
        for r in st.open_resp:
            r.abort()
        st.open_resp.clear()
        seen = set()
        for role, server in st.touched:
            if (role, server) in seen:
                continue
            seen.add((role, server))
            self._spawn(self._post_abort(role, server, st.rid))
        st.touched.clear()

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _post_abort(self, role: str, server: str, rid: int, count: bool = True) -> None:
        if count:
            M.ABORTS.labels(role).inc()
        path, body = pd_flow.abort_request(self, role, server, rid)
        if path is None:
            return      # this engine's only cancellation is the closed connection
        try:
            async with asyncio.timeout(2.0):
                r = await self.pool.request(server, path, orjson.dumps(body),
                                            b"X-Request-Id: %d\r\n" % rid)
                try:
                    await r.read()
                finally:
                    r.release()
        except (UpstreamError, TimeoutError) as e:
            log.debug("abort of %d on %s failed: %s", rid, server, e)

    async def drain(self, timeout: float) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=timeout)

    # ------------------------------------------------------------------ routing key
    def _conversation_id(self, request: web.Request, creq: ClientRequest) -> str | None:
        if creq.conversation_id:
            return creq.conversation_id
        h = request.headers
        for name in SESSION_HEADERS:
            v = h.get(name)
            if v:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    # aiohttp keeps undecodable header bytes as surrogates: no valid id to route by
                    raise ApiError(400, f"header {name} must be UTF-8 text, got undecodable bytes",
                                   param=name, code="invalid_value") from None
                return v
        return None

    async def _routing_key(self, request: web.Request, creq: ClientRequest) -> dict | None:
        need = [r for r in (CTX, GEN) if self.placer.needs_key(r)]
        if not need:
            return None
        conv = self._conversation_id(request, creq)
        key: dict = {}
        if conv:
            key["conversation_id"] = conv
        conv_only = all(self.placer.policy[r] == "conversation" for r in need)
        if conv and conv_only:
            return key
        if self.keys is None:
            return key or None
        try:
            keys, n = await self.keys.keys_for(creq, self.placer.routing)
        except ValueError as e:   # ChatTemplateError / TokenizerError: what the worker says too
            param = "messages" if creq.kind == CHAT else "prompt"
            raise ApiError(400, f"cannot tokenize the prompt: {e}", param=param) from None
        key["block_keys"] = keys
        key["num_tokens"] = n
        return key

    # ------------------------------------------------------------------ placement
    async def _place(self, st: _State, key: dict | None) -> tuple[Placement | None, Placement]:
        p = self.placer
        if self.aggregated_only:
            gen = await self._place_gen(st, key)
            ctx = None
            st.mode = Mode.AGGREGATED
        elif p.delegated(CTX) and p.delegated(GEN):
            try:
                ctx, gen, st.mode = await p.place_pair(st.rid, key, set(), set())
            except NoServerAvailable as e:
                code = "no_context_server" if self.fallback == "reject" else "no_server_available"
                raise ApiError(503, f"no server available: {e}", code=code, retry_after=1) from None
        else:
            gen = await self._place_gen(st, key)
            ctx = None
            try:
                ctx = await self._place_ctx(st, key, gen)
            except BaseException:
                p.finish(gen, True)     # unused, not failed
                raise
        for x in (ctx, gen):
            if x is not None:
                st.placements.append(x)
                p.track(x, +1)
        return ctx, gen

    async def _place_ctx(self, st: _State, key: dict | None, gen: Placement) -> Placement | None:
        cd = self.config.conditional_disagg_config
        if cd is not None and key and key.get("num_tokens"):
            matched = gen.predicted_tokens
            if matched > 0 and key["num_tokens"] - matched <= cd.max_local_prefill_length:
                st.mode = Mode.GENERATION_ONLY
                return None
        try:
            return await self.placer.place(CTX, st.rid, key, set())
        except NoServerAvailable as e:
            if self.fallback == "reject":
                raise ApiError(503, f"no healthy context server ({e}) and no_context_fallback is 'reject'",
                               code="no_context_server", retry_after=1) from None
            st.mode = Mode.AGGREGATE_FALLBACK
            return None

    # ------------------------------------------------------------------ one leg, with retries
    def _headers(self, st: _State, role: str) -> bytes:
        return b"X-Request-Id: %d\r\nX-Splitserve-Attempt: %d\r\nX-Splitserve-Role: %s\r\n" % (
            st.rid, st.attempts[role], role.encode())

    async def _send(self, st: _State, role: str, p: Placement, path: str, body: bytes, key: dict | None,
                    extra: bytes = b"", gen_only: bool = False,
                    retries: int | None = None) -> tuple[Response, Placement]:
        """Send a leg; retry connect-level failures and worker 503s on another server (at most
        `retries` times, default `max_retries`; 0 when the caller retries a pair of legs itself).

        Returns the response (status < 400) with its headers read, and the placement finally used.
        """
        max_retries = self.max_retries if retries is None else retries
        tried: set[str] = set()
        while True:
            tried.add(p.server)
            self._m_leg[role].inc()
            st.touched.append((role, p.server))
            err: str
            shedding: bool           # the typed cause of a retryable failure: worker 503, else unreachable
            try:
                resp = await self.pool.request(p.server, path, body, self._headers(st, role) + extra,
                                               timeout=self.timeout)
            except UpstreamConnectError as e:
                st.touched.pop()          # it never reached the worker: nothing to abort there
                p.failed = True
                self.placer.report_failure(role, p.server)
                M.LEG_ERRORS.labels(role, "connect").inc()
                err = f"{role} server {p.server} unreachable: {e.detail}"
                shedding = False
            except UpstreamTimeout:
                p.failed = True
                M.LEG_ERRORS.labels(role, "timeout").inc()
                raise ApiError(504, f"{role} server {p.server} did not answer within {self.timeout:g}s "
                                    f"(request_timeout)", code="upstream_timeout") from None
            except UpstreamError as e:
                p.failed = True
                self.placer.report_failure(role, p.server)
                M.LEG_ERRORS.labels(role, "disconnect").inc()
                raise ApiError(502, f"{role} server {p.server} failed: {e.detail}", code="upstream_error") from None
            else:
                if resp.status < 400:
                    self.placer.report_success(p.server)
                    st.open_resp.append(resp)
                    return resp, p
                data = await self._read(resp, st, role, p)
                if resp.status == 501 and gen_only:
                    raise _NoKvTransfer(p)
                if resp.status != 503:
                    p.failed = resp.status >= 500
                    M.LEG_ERRORS.labels(role, f"http_{resp.status // 100}xx").inc()
                    raise self._relay_error(role, p.server, resp.status, data)
                M.LEG_ERRORS.labels(role, "http_503").inc()
                err = f"{role} server {p.server} is shedding load (503)"
                shedding = True
            # retryable failure: finish this lease (a shedding server is not a failed one), pick another
            self.placer.finish(p, not p.failed)
            if st.attempts[role] >= max_retries:
                raise ApiError(503 if shedding else 502,
                               f"{err}; gave up after {st.attempts[role] + 1} attempt(s)",
                               code="upstream_unavailable", retry_after=1 if shedding else None)
            st.attempts[role] += 1
            self._m_retry[role].inc()
            if self.backoff:
                await asyncio.sleep(self.backoff * (0.5 + random.random()))
            try:
                p2 = await self.placer.place(role, st.rid, key, tried)
            except NoServerAvailable:
                raise ApiError(502, f"{err}; no other {role} server to retry on", code="upstream_unavailable",
                               retry_after=1) from None
            self.placer.track(p, -1)
            st.placements.remove(p) if p in st.placements else None
            st.placements.append(p2)
            self.placer.track(p2, +1)
            p = p2

    async def _read(self, resp: Response, st: _State, role: str, p: Placement) -> bytes:
        try:
            data = await resp.read()
        except UpstreamTimeout:
            resp.abort()
            p.failed = True
            raise ApiError(504, f"{role} server {p.server} did not finish within {self.timeout:g}s",
                           code="upstream_timeout") from None
        except UpstreamError as e:
            resp.abort()
            p.failed = True
            self.placer.report_failure(role, p.server)
            raise ApiError(502, f"{role} server {p.server} failed mid-response: {e.detail}",
                           code="upstream_error") from None
        resp.release()
        if resp in st.open_resp:
            st.open_resp.remove(resp)
        return data

    def _relay_error(self, role: str, server: str, status: int, data: bytes) -> ApiError:
        msg, param, code, typ = None, None, None, None
        try:
            obj = orjson.loads(data)
            e = obj.get("error") if isinstance(obj, dict) else None
            if isinstance(e, dict):
                msg, param, code, typ = e.get("message"), e.get("param"), e.get("code"), e.get("type")
            elif isinstance(e, str):
                msg = e
            elif isinstance(obj, dict) and isinstance(obj.get("message"), str):
                msg = obj["message"]
        except orjson.JSONDecodeError:
            msg = data[:300].decode("utf-8", "replace")
        if 400 <= status < 500:
            return ApiError(status, msg or f"{role} server rejected the request ({status})", param=param,
                            code=code, type_=typ)
        return ApiError(502, f"{role} server {server} answered {status}: {msg or 'no detail'}", code="upstream_error")

    # ------------------------------------------------------------------ the flow
    async def _run(self, request: web.Request, creq: ClientRequest, st: _State, client_params: dict | None):
        key = await self._routing_key(request, creq)
        if client_params is not None:
            # A vetted (HMAC-signed) client request carries its own leg instruction: forward as is.
            p = await self._place_single(st, key)
            st.mode = Mode.AGGREGATED
            body = self._gen_base(creq)
            body["disaggregated_params"] = client_params
            return await self._final_leg(request, creq, st, p, orjson.dumps(body), key, self._sig(client_params))
        ctx, gen = await self._place(st, key)
        proto = pd_flow.request_protocol(self, ctx, gen)
        if proto != "trtllm":
            return await pd_flow.run(self, request, creq, st, ctx, gen, key, proto)
        if ctx is not None and gen.server in self.no_transfer:
            # Known not to receive KV: the context leg would be wasted work.
            self.placer.finish(ctx, True)
            self.placer.track(ctx, -1)
            st.placements.remove(ctx)
            ctx = None
            st.mode = Mode.NO_KV_TRANSFER
        st.route = {"id": st.rid, "mode": st.mode}
        if st.alias is not None:
            st.route["client_request_id"] = st.alias
        if ctx is None:
            self._m_place[st.mode].inc()
            return await self._final_leg(request, creq, st, gen, orjson.dumps(self._gen_base(creq)), key)
        if self.schedule == "generation_first":
            return await self._generation_first(request, creq, st, ctx, gen, key)
        ctx_ans, ctx_raw, ctx = await self._context_leg(creq, st, ctx, key)
        if ctx_ans is None:   # every context server unreachable, fallback says aggregate
            self._m_place[st.mode].inc()
            return await self._final_leg(request, creq, st, gen, orjson.dumps(self._gen_base(creq)), key)
        if not self._needs_gen(ctx_ans):
            st.mode = Mode.CONTEXT_ONLY
            self._m_place["context_only"].inc()
            # The request ended on the context server; the generation lease is unused.
            self.placer.finish(gen, True)
            return self._context_answer(request, creq, st, ctx_raw)
        self._m_place["disaggregated"].inc()
        gen_body, sig = self._gen_body(creq, st, ctx_ans)
        try:
            return await self._final_leg(request, creq, st, gen, gen_body, key, sig, gen_only=True)
        except _NoKvTransfer as e:
            # This generation server cannot receive KV (no transfer agent): serve it aggregated there,
            # and release the context leg's pinned KV now rather than at its pin timeout.
            log.warning("generation server %s cannot receive KV (501 to generation_only); serving its "
                        "requests aggregated", e.placement.server)
            self.no_transfer.add(e.placement.server)
            self._spawn(self._post_abort(CTX, ctx.server, st.rid))
            st.mode = Mode.NO_KV_TRANSFER
            st.route["mode"] = st.mode
            st.route.pop("context", None)
            return await self._final_leg(request, creq, st, e.placement,
                                         orjson.dumps(self._gen_base(creq)), key)

    async def _place_gen(self, st: _State, key: dict | None) -> Placement:
        """A generation server for `st`, or the client's 503 when none is available."""
        try:
            return await self.placer.place(GEN, st.rid, key, set())
        except NoServerAvailable as e:
            raise ApiError(503, f"no generation server available: {e}", code="no_server_available",
                           retry_after=1) from None

    async def _place_single(self, st: _State, key: dict | None) -> Placement:
        p = await self._place_gen(st, key)
        st.placements.append(p)
        self.placer.track(p, +1)
        return p

    def _sig(self, dp: dict) -> bytes:
        if not self.hmac_key:
            return b""
        return b"%s: %s\r\n" % (AUTH_HEADER.encode(), sign(self.hmac_key, dp).encode())

    def _ctx_body(self, creq: ClientRequest, st: _State) -> tuple[bytes, bytes]:
        body = dict(creq.body)
        body["stream"] = False
        body["stream_options"] = None
        dp = {"request_type": "context_only", "disagg_request_id": st.rid, "schedule_style": self.schedule}
        body["disaggregated_params"] = dp
        return orjson.dumps(body), self._sig(dp)

    async def _context_leg(self, creq: ClientRequest, st: _State, ctx: Placement, key: dict | None):
        body, sig = self._ctx_body(creq, st)
        t = time.perf_counter()
        try:
            resp, ctx = await self._send(st, CTX, ctx, PATHS[creq.kind], body, key, sig)
        except ApiError as e:
            if e.status in (502, 503) and e.code == "upstream_unavailable" and self.fallback == "aggregate" \
                    and not self.placer.healthy_count(CTX):
                log.warning("request %d: no context server reachable (%s); serving aggregated", st.rid, e.message)
                st.mode = Mode.AGGREGATE_FALLBACK
                return None, b"", ctx
            raise
        raw = await self._read(resp, st, CTX, ctx)
        self._m_leglat[CTX].observe(time.perf_counter() - t)
        try:
            ans = _ctx_decoder.decode(raw)
        except msgspec.DecodeError as e:
            ctx.failed = True
            raise ApiError(502, f"context server {ctx.server} returned an invalid answer: {e}",
                           code="upstream_error") from None
        if not ans.choices:
            raise ApiError(502, f"context server {ctx.server} returned no choices", code="upstream_error")
        self._observe_usage(CTX, ctx, ans.usage)
        if ans.choices[0].finish_reason in NEED_GEN:
            dp = ans.choices[0].disaggregated_params
            if not isinstance(dp, dict) or dp.get("ctx_request_id") is None:
                raise ApiError(502, f"context server {ctx.server} finished with "
                                    f"{ans.choices[0].finish_reason!r} but without "
                                    f"choices[0].disaggregated_params.ctx_request_id", code="upstream_error")
        st.route["context"] = self._route_of(ctx)
        return ans, raw, ctx

    @staticmethod
    def _needs_gen(ans: _CtxAnswer) -> bool:
        return ans.choices[0].finish_reason in NEED_GEN

    @staticmethod
    def _gen_base(creq: ClientRequest) -> dict:
        """The client's body for the leg that answers. A stream always asks the worker for usage (the
        routing-quality metrics need `cached_tokens`); the relay drops that chunk if the client did
        not ask for it."""
        body = dict(creq.body)
        if creq.stream and not creq.include_usage:
            so = dict(body.get("stream_options") or {})
            so["include_usage"] = True
            body["stream_options"] = so
        return body

    def _gen_body(self, creq: ClientRequest, st: _State, ans: _CtxAnswer) -> tuple[bytes, bytes]:
        body = self._gen_base(creq)
        dp = dict(ans.choices[0].disaggregated_params)
        dp["request_type"] = "generation_only"
        dp.setdefault("disagg_request_id", st.rid)
        dp["schedule_style"] = self.schedule
        if ans.usage is not None:
            dp["ctx_usage"] = ans.usage
        body["disaggregated_params"] = dp
        ids = bytes(ans.prompt_token_ids)
        if ids and ids != b"null":
            frag = orjson.Fragment(ids)
            if creq.kind == CHAT:
                body["prompt_token_ids"] = frag
            else:
                body["prompt"] = frag
                body.pop("prompt_token_ids", None)
        return orjson.dumps(body), self._sig(dp)

    # ------------------------------------------------------------------ generation_first
    async def _generation_first(self, request, creq: ClientRequest, st: _State, ctx: Placement,
                                gen: Placement, key: dict | None):
        info = self.placer.server_info(ctx.server)
        ep = (info.get("disaggregated_params") or {}).get("ctx_info_endpoint") if isinstance(info, dict) else None
        body = self._gen_base(creq)
        dp = {"request_type": "generation_only", "ctx_request_id": st.rid, "disagg_request_id": st.rid,
              "ctx_info_endpoint": ep, "schedule_style": "generation_first"}
        body["disaggregated_params"] = dp
        gen_body, sig = orjson.dumps(body), self._sig(dp)
        # The generation request goes out first so its worker can pull as soon as the context worker
        # publishes; its headers are awaited only after the context leg is answered.
        gen_task = asyncio.get_running_loop().create_task(
            self._send(st, GEN, gen, PATHS[creq.kind], gen_body, key, sig))
        try:
            ctx_ans, ctx_raw, ctx = await self._context_leg(creq, st, ctx, key)
        except BaseException:
            gen_task.cancel()
            await asyncio.gather(gen_task, return_exceptions=True)
            raise
        if ctx_ans is None or not self._needs_gen(ctx_ans):
            gen_task.cancel()
            await asyncio.gather(gen_task, return_exceptions=True)
            for r in st.open_resp:
                r.abort()
            st.open_resp.clear()
            self._spawn(self._post_abort(GEN, gen.server, st.rid))
            self.placer.finish(gen, True)
            if ctx_ans is None:
                raise ApiError(502, "no context server reachable for the generation_first request",
                               code="upstream_unavailable", retry_after=1)
            st.mode = Mode.CONTEXT_ONLY
            self._m_place["context_only"].inc()
            return self._context_answer(request, creq, st, ctx_raw)
        self._m_place["disaggregated"].inc()
        resp, gen = await gen_task
        out = await self._relay(request, creq, st, gen, resp)
        if not st.failed:
            # The generation leg is complete, so it holds the KV: release the context worker's pins now.
            # (A context_first transfer carries the context worker's address and releases them itself; a
            # generation_first one may not, and nothing else would before the pin timeout.)
            self._spawn(self._post_abort(CTX, ctx.server, st.rid, count=False))
        return out

    # ------------------------------------------------------------------ final leg + relay
    async def _final_leg(self, request, creq: ClientRequest, st: _State, gen: Placement, body: bytes,
                         key: dict | None, sig: bytes = b"", gen_only: bool = False):
        resp, gen = await self._send(st, GEN, gen, PATHS[creq.kind], body, key, sig, gen_only)
        return await self._relay(request, creq, st, gen, resp)

    def _route_of(self, p: Placement) -> dict:
        e = p.explanation
        out = {"server": p.server, "policy": p.policy}
        for k in ("matched_tokens", "score", "reason", "load_requests"):
            if k in e:
                out[k] = e[k]
        cands = e.get("candidates")
        if isinstance(cands, list) and cands:
            out["candidates"] = [{k: c.get(k) for k in ("server", "matched_tokens", "load_requests", "score", "why")
                                  if k in c} for c in cands[:4] if isinstance(c, dict)]
        return out

    def _route_header(self, st: _State, gen: Placement) -> str:
        r = st.route or {"id": st.rid, "mode": st.mode}
        if st.alias is not None:
            r["client_request_id"] = st.alias
        r["mode"] = st.mode
        r["generation"] = self._route_of(gen)
        if st.attempts[CTX] or st.attempts[GEN]:
            r["retries"] = {CTX: st.attempts[CTX], GEN: st.attempts[GEN]}
        return orjson.dumps(r).decode()

    def _observe_usage(self, role: str, p: Placement, usage: dict | None) -> None:
        ct = _cached_tokens(usage)
        if ct is None:
            return
        prompt, cached = ct
        p.usage = (prompt, cached)
        k = (role, p.server)
        m = self._m_tokens.get(k)
        if m is None:
            m = self._m_tokens[k] = (M.PROMPT_TOKENS.labels(role, p.server), M.CACHED_TOKENS.labels(role, p.server),
                                     M.PREDICTED_TOKENS.labels(role, p.server))
        m[0].inc(prompt)
        m[1].inc(cached)
        if p.lease:
            m[2].inc(p.predicted_tokens)

    async def _relay(self, request: web.Request, creq: ClientRequest, st: _State, gen: Placement,
                     resp: Response) -> web.StreamResponse:
        route = self._route_header(st, gen)
        t_leg = time.perf_counter()
        if not creq.stream or not resp.content_type.startswith("text/event-stream"):
            data = await self._read(resp, st, GEN, gen)
            self._m_leglat[GEN].observe(time.perf_counter() - t_leg)
            data = self._clean_json(data, GEN, gen)
            now = time.perf_counter()
            M.TTFT.labels(st.mode).observe(now - st.t0)
            M.E2E.labels(st.mode).observe(now - st.t0)
            st.touched.clear()
            return web.Response(body=data, headers={"Content-Type": "application/json", ROUTE_HEADER: route})
        out = web.StreamResponse(status=200, headers={**SSE_HEADERS, ROUTE_HEADER: route})
        await out.prepare(request)
        st.bytes_sent = True
        buf = b""
        last = None
        first = True
        itl = M.ITL
        drop = not creq.include_usage
        try:
            async for chunk in resp.iter_chunks():
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                events, buf = buf[:cut + 2], buf[cut + 2:]
                if b'"kv_transfer_params":{' in events or b'"kv_transfer_params": {' in events:
                    events = pd_flow.strip_stream_kv(events)
                if b'"usage":{' in events or b'"usage": {' in events:
                    events = self._stream_usage(events, gen, drop)
                    if not events:
                        continue
                await out.write(events)
                now = time.perf_counter()
                if first:
                    M.TTFT.labels(st.mode).observe(now - st.t0)
                    first = False
                elif last is not None:
                    itl.observe(now - last)
                last = now
                if self.placer.renew_due(gen, self.renew_every):
                    self.placer.renew(gen)
        except UpstreamTimeout:
            resp.abort()
            gen.failed = True
            M.LEG_ERRORS.labels(GEN, "timeout").inc()
            await self._stream_error(out, ApiError(504, f"generation stream exceeded request_timeout "
                                                        f"({self.timeout:g}s)", code="upstream_timeout"))
            st.failed = True
            return out
        except UpstreamError as e:
            resp.abort()
            gen.failed = True
            self.placer.report_failure(GEN, gen.server)
            M.LEG_ERRORS.labels(GEN, "disconnect").inc()
            await self._stream_error(out, ApiError(502, f"generation server {gen.server} failed mid-stream: "
                                                        f"{e.detail}", code="upstream_error"))
            st.failed = True
            return out
        except ConnectionError:
            # The client is gone (a write failed before aiohttp cancelled the handler).
            raise asyncio.CancelledError() from None
        if buf:
            await out.write(buf)
        resp.release()
        if resp in st.open_resp:
            st.open_resp.remove(resp)
        st.touched.clear()
        self._m_leglat[GEN].observe(time.perf_counter() - t_leg)
        await out.write_eof()
        M.E2E.labels(st.mode).observe(time.perf_counter() - st.t0)
        return out

    async def _stream_error(self, out: web.StreamResponse, err: ApiError) -> None:
        try:
            await out.write(err.sse_event() + b"data: [DONE]\n\n")
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    def _stream_usage(self, events: bytes, gen: Placement, drop: bool) -> bytes:
        """Record the usage chunk's cached tokens; drop that chunk when the client did not ask for it."""
        keep = []
        for ev in events.split(b"\n\n"):
            if not ev:
                continue
            if ev.startswith(b"data: {") and (b'"usage":{' in ev or b'"usage": {' in ev):
                try:
                    u = _usage_decoder.decode(ev[6:])
                except msgspec.DecodeError:
                    u = None
                if u is not None and u.usage:
                    self._observe_usage(GEN, gen, u.usage)
                    if drop and (b'"choices":[]' in ev or b'"choices": []' in ev):
                        continue
            keep.append(ev)
        return b"".join(e + b"\n\n" for e in keep)

    def _clean_json(self, data: bytes, role: str, p: Placement) -> bytes:
        if b"disaggregated_params" not in data and b"prompt_token_ids" not in data \
                and b"kv_transfer_params" not in data:
            try:
                self._observe_usage(role, p, _usage_decoder.decode(data).usage)
            except msgspec.DecodeError:
                pass
            return data
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if isinstance(obj, dict):
            self._observe_usage(role, p, obj.get("usage"))
            obj.pop("prompt_token_ids", None)
            obj.pop("prompt_token_ids_b64", None)
            obj.pop("kv_transfer_params", None)     # a vLLM decode's KV handle: internal
            for c in obj.get("choices") or ():
                if isinstance(c, dict):
                    c.pop("disaggregated_params", None)
        return orjson.dumps(obj)

    def _context_answer(self, request: web.Request, creq: ClientRequest, st: _State, raw: bytes):
        """The context leg already finished the request (e.g. EOS on the first token)."""
        obj = orjson.loads(raw)
        obj.pop("prompt_token_ids", None)
        obj.pop("prompt_token_ids_b64", None)
        for c in obj.get("choices") or ():
            if isinstance(c, dict):
                c.pop("disaggregated_params", None)
        st.touched.clear()
        route = orjson.dumps({**st.route, "mode": Mode.CONTEXT_ONLY}).decode()
        now = time.perf_counter()
        M.TTFT.labels(st.mode).observe(now - st.t0)
        M.E2E.labels(st.mode).observe(now - st.t0)
        if not creq.stream:
            return web.Response(body=orjson.dumps(obj), headers={"Content-Type": "application/json",
                                                                 ROUTE_HEADER: route})
        return _ReplayStream(obj, creq, route)


class _NoKvTransfer(Exception):
    """A generation server answered 501 to a generation_only request: it has no KV transfer agent."""

    def __init__(self, placement: Placement):
        super().__init__(placement.server)
        self.placement = placement


class _ReplayStream:
    """A complete answer replayed as SSE chunks (a streaming request the context leg finished)."""

    def __init__(self, obj: dict, creq: ClientRequest, route: str):
        self.obj, self.creq, self.route = obj, creq, route

    async def send(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={**SSE_HEADERS, ROUTE_HEADER: self.route})
        await out.prepare(request)
        o = self.obj
        chat = self.creq.kind == CHAT
        base = {"id": o.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
                "created": o.get("created"), "model": o.get("model")}
        for c in o.get("choices") or ():
            if chat:
                msg = c.get("message") or {}
                delta = {"role": msg.get("role", "assistant"), "content": msg.get("content") or ""}
                ch = {"index": c.get("index", 0), "delta": delta, "finish_reason": c.get("finish_reason")}
            else:
                ch = {"index": c.get("index", 0), "text": c.get("text") or "", "logprobs": c.get("logprobs"),
                      "finish_reason": c.get("finish_reason")}
            await out.write(b"data: " + orjson.dumps({**base, "choices": [ch]}) + b"\n\n")
        if self.creq.include_usage and o.get("usage") is not None:
            await out.write(b"data: " + orjson.dumps({**base, "choices": [], "usage": o["usage"]}) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
