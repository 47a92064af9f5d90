"""The two-leg disaggregated flow (docs/design.md §5), with the failure semantics of the fleet.

One request = one snowflake id, minted by its `RequestScope` (fleet/scope.py), used on both legs, in
the coordinator and in the logs (a client's own `disagg_request_id` is only an alias). Steps:

1. routing key (token ids → block keys) only when a delegated policy needs it;
2. placement (`Placer`) by the pairing rules (router/pairing.py): conditional disaggregation ("no
   context leg"), and `no_context_fallback` when no context server fits (aggregate on a generation
   server, or 503);
3. context leg, then a generation leg only if the context answer asks for one; the bodies are
   TensorRT-LLM's (fleet/legs/trtllm.py), the mode and route receipt fleet/legs/plan.py's;
4. the generation answer is relayed (fleet/relay.py: SSE events as they arrive).

That is TensorRT-LLM's protocol; servers speaking vLLM's or SGLang's are handed to fleet/pd_flow.py
once placed (docs/protocols.md).

Failure rules (beating upstream, reference §7):
- a connect-level failure (`UpstreamConnectError`) or a worker answer in `fleet.retry_on_status`
  (default 503; 408, 429 and any 5xx can be added) is retried on a *different* server (`exclude`),
  after a jittered exponential backoff (`retry_backoff_s` × `retry_backoff_multiplier`^n, capped at
  `retry_backoff_max_s`), at most `max_retries` times; the id stays the same and the attempt number
  goes up (header `X-Splitserve-Attempt`);
- another 4xx from a worker is relayed as is, never retried; a disconnect or timeout after a request
  reached a worker, or a 5xx not listed, is not retried; nothing is retried after bytes went to the
  client;
- every lease gets exactly one `/finish`, and a client that hangs up (the handler task is cancelled
  by fleet/http_server.py) has every leg still open aborted at once: both by leaving the request's scope
  (fleet/scope.py); no further leg is started.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time

import orjson
from protocol.coord import NoServerAvailable
from router.pairing import NoContextServer, settle

from . import metrics as M
from . import pd_flow
from .auth import AUTH_HEADER, sign
from protocol.openai import ApiError
from .legs import plan
from .legs import trtllm as trt
from .placement import CTX, GEN, Placement, Placer
from .http_messages import FleetRequest
from .relay import ReplayStream, Relay, worker_error
from .scope import RequestScope
from .upstream import Response, UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamTimeout
from .validate import CHAT, ClientRequest

log = logging.getLogger("splitserve.fleet.flow")

PATHS = plan.PATHS
SESSION_HEADERS = ("x-session-id", "x-correlation-id", "x-session-affinity", "x-multi-turn-session-id")


class Flow:
    def __init__(self, config, placer: Placer, pool: UpstreamPool, ids, keys=None):
        self.config = config
        self.placer = placer
        self.pool = pool
        self.ids = ids                      # snowflake generator: .next_id() -> int
        self.keys = keys                    # routing-key builder (None: no policy needs one)
        self.max_retries = config.max_retries
        self.timeout = config.request_timeout
        fc = config.fleet
        self.backoff = fc.retry_backoff_s
        self.backoff_mult = fc.retry_backoff_multiplier
        self.backoff_max = fc.retry_backoff_max_s
        self.retry_statuses = frozenset(fc.retry_on_status)
        self.schedule = config.schedule_style
        self.rules = placer.rules           # the pairing rules (router/pairing.py)
        # both legs in one placement: both roles delegated (the coordinator's) or both round robin
        self._pairs = placer.delegated(CTX) == placer.delegated(GEN)
        self.hmac_key = config.internal_request_auth_key
        self.route_detail = config.fleet.route_header    # off | short | full
        self.relay = Relay(placer, self.timeout, config.leases.effective_renew_interval_s)
        self._bg: set[asyncio.Task] = set()
        self.inflight = 0
        self.aliases: set[int] = set()      # client disagg_request_ids of requests in flight
        self.m_place = {m: M.PLACEMENT.labels(m) for m in plan.MODES}
        self.no_transfer: set[str] = set()   # generation servers that answered 501 to generation_only
        self._m_leg = {r: M.LEG_REQUESTS.labels(r) for r in (CTX, GEN)}
        self.m_retry = {r: M.LEG_RETRIES.labels(r) for r in (CTX, GEN)}
        self.aggregated_only = config.aggregated_only   # a plain aggregated deployment
        self._key_roles: list[str] | None = None   # roles whose policy needs a routing key
        self._conv_only = False
        self.tracing = None                 # fleet/tracing.py's FleetTracing (otlp_config), or None

    # ------------------------------------------------------------------ entry point
    async def handle(self, request: FleetRequest, creq: ClientRequest, alias: int | None,
                     client_params: dict | None, t0: float, request_id: int = 0, x_request_id: str | None = None):
        """Serve one request. `alias` is the client's own `disagg_request_id`, kept for logs and the
        route header only (never sent to a worker, never an abort or transfer key), and unique among
        this process's requests in flight."""
        with RequestScope(self, t0, alias, request_id, x_request_id) as scope:
            if self.tracing is None:
                return await self._serve(request, creq, scope, client_params)
            scope.trace = tr = self.tracing.start(request, scope)
            try:
                resp = await self._serve(request, creq, scope, client_params)
            except BaseException as e:
                tr.end(scope, e)
                raise
            tr.end(scope, None, getattr(resp, "status", None))
            return resp

    async def _serve(self, request: FleetRequest, creq: ClientRequest, scope: RequestScope,
                     client_params: dict | None):
        resp = await self._run(request, creq, scope, client_params)
        if isinstance(resp, ReplayStream):
            resp = await resp.send(request)
        return resp

    # ------------------------------------------------------------------ background aborts
    def spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def post_abort(self, role: str, server: str, request_id: int, count: bool = True) -> None:
        if count:
            M.ABORTS.labels(role).inc()
        path, body = pd_flow.abort_request(self, role, server, request_id)
        if path is None:
            return      # this engine's only cancellation is the closed connection
        try:
            async with asyncio.timeout(2.0):
                r = await self.pool.request(server, path, orjson.dumps(body),
                                            b"X-Request-Id: %d\r\n" % request_id)
                try:
                    await r.read()
                finally:
                    r.release()
        except (UpstreamError, TimeoutError) as e:
            log.debug("abort of %d on %s failed: %s", request_id, server, e)

    async def drain(self, timeout: float) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=timeout)

    # ------------------------------------------------------------------ routing key
    def _conversation_id(self, request: FleetRequest, creq: ClientRequest) -> str | None:
        if creq.conversation_id:
            return creq.conversation_id
        h = request.headers
        for name in SESSION_HEADERS:
            v = h.get(name)
            if v:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    # the server keeps undecodable header bytes as surrogates: no valid id to route by
                    raise ApiError(400, f"header {name} must be UTF-8 text, got undecodable bytes",
                                   param=name, code="invalid_value") from None
                return v
        return None

    async def _routing_key(self, request: FleetRequest, creq: ClientRequest) -> dict | None:
        need = self._key_roles
        if need is None:   # the policies are the config's: decided once
            need = self._key_roles = [r for r in (CTX, GEN) if self.placer.needs_key(r)]
            self._conv_only = all(self.placer.policy[r] == "conversation" for r in need)
        if not need:
            return None
        conv = self._conversation_id(request, creq)
        key: dict = {}
        if conv:
            key["conversation_id"] = conv
            if self._conv_only:
                return key
        if self.keys is None:
            return key or None
        try:
            got = self.keys.keys_now(creq, self.placer.routing)     # inline: no coroutine
            keys, n = got if got is not None else await self.keys.keys_for(creq, self.placer.routing)
        except ValueError as e:   # ChatTemplateError / TokenizerError: what the worker says too
            param = "messages" if creq.kind == CHAT else "prompt"
            raise ApiError(400, f"cannot tokenize the prompt: {e}", param=param) from None
        key["block_keys"] = keys
        key["num_tokens"] = n
        return key

    # ------------------------------------------------------------------ placement
    async def _place(self, scope: RequestScope, key: dict | None) -> tuple[Placement | None, Placement]:
        p = self.placer
        if self.aggregated_only:
            scope.mode = plan.AGGREGATED
            return None, await self.place_gen(scope, key)
        if self._pairs:
            # one call places both legs: the coordinator's, or the same rules over the local list
            try:
                ctx, gen, scope.mode = await p.place_pair(scope.request_id, key, set(), set())
            except NoContextServer as e:
                raise _no_context(e) from None
            except NoServerAvailable as e:
                if not p.delegated(GEN):
                    raise ApiError(503, f"no generation server available: {e}", code="no_server_available",
                                   retry_after=1) from None
                # the coordinator's refusal over a wire does not say which leg found no server
                code = "no_context_server" if self.rules.rejects else "no_server_available"
                raise ApiError(503, f"no server available: {e}", code=code, retry_after=1) from None
            scope.hold(gen)
        else:
            gen = await self.place_gen(scope, key)
            ctx = await self._place_ctx(scope, key, gen)
        if ctx is not None:
            scope.hold(ctx)
        return ctx, gen

    async def place_gen(self, scope: RequestScope, key: dict | None) -> Placement:
        """A generation server for the request (held by its scope), or the client's 503."""
        try:
            gen = await self.placer.place(GEN, scope.request_id, key, set())
        except NoServerAvailable as e:
            raise ApiError(503, f"no generation server available: {e}", code="no_server_available",
                           retry_after=1) from None
        scope.hold(gen)
        return gen

    async def _place_ctx(self, scope: RequestScope, key: dict | None, gen: Placement) -> Placement | None:
        """The context leg when the two roles are placed one by one (one round robin, one delegated),
        by the pairing rules `pairing.pair` applies to a pair."""
        if key and self.rules.local_prefill(key.get("num_tokens"), gen.predicted_tokens) is not None:
            scope.mode = plan.LOCAL_PREFILL
            return None
        try:
            return await self.placer.place(CTX, scope.request_id, key, set())
        except NoServerAvailable as e:
            try:
                self.rules.without_context(e)
            except NoContextServer as rejected:
                raise _no_context(rejected) from None
            scope.mode = plan.AGGREGATED_FALLBACK
            return None

    # ------------------------------------------------------------------ one leg, with retries
    def _headers(self, scope: RequestScope, role: str, server: str) -> bytes:
        h = b"X-Request-Id: %d\r\nX-Splitserve-Attempt: %d\r\nX-Splitserve-Role: %s\r\n" % (
            scope.request_id, scope.attempts[role], role.encode())
        if scope.trace is not None:
            h += scope.trace.leg(role, server, scope.attempts[role])
        return h

    async def send(self, scope: RequestScope, role: str, p: Placement, path: str, body: bytes,
                   key: dict | None, extra: bytes = b"", gen_only: bool = False,
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
            scope.sent(role, p.server)
            err: str
            shedding: bool           # the typed cause of a retryable failure: worker 503, else unreachable
            try:
                resp = await self.pool.request(p.server, path, body, self._headers(scope, role, p.server) + extra,
                                               timeout=self.timeout)
            except UpstreamConnectError as e:
                scope.unsent()            # it never reached the worker: nothing to abort there
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
                    scope.opened(resp)
                    return resp, p
                data = await self.relay.read(resp, scope, role, p)
                st = resp.status
                if st == 501 and gen_only:
                    raise _NoKvTransfer(p)
                M.LEG_ERRORS.labels(role, "http_503" if st == 503 else f"http_{st // 100}xx").inc()
                if st not in self.retry_statuses:
                    p.failed = st >= 500
                    raise worker_error(role, p.server, st, data)
                # fleet.retry_on_status: 429 and 503 say "busy, try elsewhere"; the others are
                # failures of this server (its breaker counts them).
                shedding = st in (429, 503)
                if shedding:
                    err = f"{role} server {p.server} is shedding load ({st})"
                else:
                    p.failed = True
                    self.placer.report_failure(role, p.server)
                    err = f"{role} server {p.server} answered {st}"
            # retryable failure: end this lease (a shedding server is not a failed one), pick another
            scope.release(p)
            if scope.attempts[role] >= max_retries:
                raise ApiError(503 if shedding else 502,
                               f"{err}; gave up after {scope.attempts[role] + 1} attempt(s)",
                               code="upstream_unavailable", retry_after=1 if shedding else None)
            scope.attempts[role] += 1
            self.m_retry[role].inc()
            await self.backoff_sleep(scope.attempts[role])
            try:
                p = await self.placer.place(role, scope.request_id, key, tried)
            except NoServerAvailable:
                raise ApiError(502, f"{err}; no other {role} server to retry on", code="upstream_unavailable",
                               retry_after=1) from None
            scope.hold(p)

    async def backoff_sleep(self, attempt: int = 1) -> None:
        """The pause before retry number `attempt` (1 = the first): exponential, capped, jittered."""
        if self.backoff:
            pause = min(self.backoff_max, self.backoff * self.backoff_mult ** (attempt - 1))
            await asyncio.sleep(pause * (0.5 + random.random()))

    def falls_back(self, e: ApiError) -> bool:
        """No context server reachable and the config says serve aggregated."""
        return (plan.context_unreachable(e.status, e.code)
                and self.rules.aggregates_after_context_loss(self.placer.healthy_count(CTX)))

    # ------------------------------------------------------------------ the flow
    async def _run(self, request: FleetRequest, creq: ClientRequest, scope: RequestScope,
                   client_params: dict | None):
        key = await self._routing_key(request, creq) if self._key_roles != [] else None
        if client_params is not None:
            # A vetted (HMAC-signed) client request carries its own leg instruction: forward as is.
            p = await self.place_gen(scope, key)
            scope.mode = plan.AGGREGATED
            body = plan.with_params(self.answer_base(creq), client_params)
            return await self.final_leg(request, creq, scope, p, orjson.dumps(body), key, self._sig(client_params))
        if scope.trace is None:
            ctx, gen = await self._place(scope, key)
        else:
            ctx, gen = await scope.trace.placement(scope, self._place(scope, key))
        proto = pd_flow.request_engine_protocol(self, ctx, gen)
        if proto != "trtllm":
            return await pd_flow.run(self, request, creq, scope, ctx, gen, key, proto)
        scope.mode, keep = settle(scope.mode, ctx is not None, gen.server not in self.no_transfer)
        if ctx is not None and not keep:
            scope.release(ctx, True)
            ctx = None
        scope.route = plan.route_start(scope.request_id, scope.mode, scope.alias)
        if ctx is None:
            return await self.plain_leg(request, creq, scope, gen, key)
        if self.schedule == "generation_first":
            return await self._generation_first(request, creq, scope, ctx, gen, key)
        ctx_ans, ctx_raw, ctx = await self._context_leg(creq, scope, ctx, key)
        if ctx_ans is None:   # every context server unreachable, fallback says aggregate
            return await self.plain_leg(request, creq, scope, gen, key)
        if not trt.needs_generation(ctx_ans):
            # The request ended on the context server; the generation lease is unused.
            scope.release(gen, True)
            return self._context_only(creq, scope, ctx_raw)
        self.m_place[plan.DISAGGREGATED].inc()
        body, dp = trt.generation_body(self.answer_base(creq), creq.kind == CHAT, ctx_ans, scope.request_id,
                                       self.schedule, self.config.gen_strip_message_history)
        try:
            return await self.final_leg(request, creq, scope, gen, orjson.dumps(body), key, self._sig(dp),
                                        gen_only=True)
        except _NoKvTransfer as e:
            # This generation server cannot receive KV (no transfer agent): serve it aggregated there,
            # and release the context leg's pinned KV now rather than at its pin timeout.
            log.warning("generation server %s cannot receive KV (501 to generation_only); serving its "
                        "requests aggregated", e.placement.server)
            self.no_transfer.add(e.placement.server)
            scope.abort_on(CTX, ctx.server)
            scope.mode = scope.route["mode"] = plan.NO_KV_TRANSFER
            scope.route.pop("context", None)
            return await self.final_leg(request, creq, scope, e.placement,
                                        orjson.dumps(self.answer_base(creq)), key)

    def _sig(self, dp: dict) -> bytes:
        if not self.hmac_key:
            return b""
        return b"%s: %s\r\n" % (AUTH_HEADER.encode(), sign(self.hmac_key, dp).encode())

    @staticmethod
    def answer_base(creq: ClientRequest) -> dict:
        return plan.answer_body(creq.body, creq.stream, creq.include_usage)

    async def _context_leg(self, creq: ClientRequest, scope: RequestScope, ctx: Placement, key: dict | None):
        """(context answer, its raw bytes, the placement used); (None, b"", ctx) when no context
        server was reachable and the request falls back to aggregated."""
        body, dp = trt.context_body(creq.body, scope.request_id, self.schedule)
        t = time.perf_counter()
        try:
            resp, ctx = await self.send(scope, CTX, ctx, PATHS[creq.kind], orjson.dumps(body), key, self._sig(dp))
        except ApiError as e:
            if self.falls_back(e):
                log.warning("request %d: no context server reachable (%s); serving aggregated",
                            scope.request_id, e.message)
                scope.mode = plan.AGGREGATED_FALLBACK
                return None, b"", ctx
            raise
        raw = await self.relay.read(resp, scope, CTX, ctx)
        self.placer.first_token(ctx)     # prefill done, the KV ready: no longer queued prefill
        self.relay.leg_latency[CTX].observe(time.perf_counter() - t)
        if scope.trace is not None:
            scope.trace.leg_done(CTX)
        try:
            ans = trt.decode_context_answer(raw)
            self.relay.observe_context(scope, ctx, ans.usage)
            trt.check_generation_params(ans)
        except trt.BadContextAnswer as e:
            if e.malformed:
                ctx.failed = True
            raise ApiError(502, f"context server {ctx.server} {e}", code="upstream_error") from None
        scope.route["context"] = self.route_of(ctx)
        return ans, raw, ctx

    # ------------------------------------------------------------------ generation_first
    async def _generation_first(self, request, creq: ClientRequest, scope: RequestScope, ctx: Placement,
                                gen: Placement, key: dict | None):
        ep = trt.ctx_info_endpoint(self.placer.server_info(ctx.server))
        body, dp = trt.generation_first_body(self.answer_base(creq), scope.request_id, ep)
        # The generation request goes out first so its worker can pull as soon as the context worker
        # publishes; its headers are awaited only after the context leg is answered.
        gen_task = asyncio.get_running_loop().create_task(
            self.send(scope, GEN, gen, PATHS[creq.kind], orjson.dumps(body), key, self._sig(dp)))
        try:
            ctx_ans, ctx_raw, ctx = await self._context_leg(creq, scope, ctx, key)
        except BaseException:
            gen_task.cancel()
            await asyncio.gather(gen_task, return_exceptions=True)
            raise
        if ctx_ans is None or not trt.needs_generation(ctx_ans):
            gen_task.cancel()
            await asyncio.gather(gen_task, return_exceptions=True)
            scope.abort_role(GEN, gen.server)
            scope.release(gen, True)
            if ctx_ans is None:
                raise ApiError(502, "no context server reachable for the generation_first request",
                               code="upstream_unavailable", retry_after=1)
            return self._context_only(creq, scope, ctx_raw)
        self.m_place[plan.DISAGGREGATED].inc()
        resp, gen = await gen_task
        out = await self.answer(request, creq, scope, gen, resp)
        if not scope.failed:
            # The generation leg is complete, so it holds the KV: release the context worker's pins now.
            # (A context_first transfer carries the context worker's address and releases them itself; a
            # generation_first one may not, and nothing else would before the pin timeout.)
            scope.abort_on(CTX, ctx.server, count=False)
        return out

    # ------------------------------------------------------------------ answers
    async def plain_leg(self, request, creq: ClientRequest, scope: RequestScope, gen: Placement,
                        key: dict | None):
        """The generation server alone answers, with the client's body (no context leg)."""
        self.m_place[scope.mode].inc()
        return await self.final_leg(request, creq, scope, gen, orjson.dumps(self.answer_base(creq)), key)

    async def final_leg(self, request, creq: ClientRequest, scope: RequestScope, gen: Placement, body: bytes,
                        key: dict | None, sig: bytes = b"", gen_only: bool = False):
        resp, gen = await self.send(scope, GEN, gen, PATHS[creq.kind], body, key, sig, gen_only)
        return await self.answer(request, creq, scope, gen, resp)

    async def answer(self, request, creq: ClientRequest, scope: RequestScope, gen: Placement,
                     resp: Response):
        route = plan.route_header(scope.route, request_id=scope.request_id, alias=scope.alias, mode=scope.mode,
                                  generation=self.route_of(gen), attempts=scope.attempts,
                                  detail=self.route_detail)
        return await self.relay.answer(request, creq, scope, gen, resp, route)

    def _context_only(self, creq: ClientRequest, scope: RequestScope, raw: bytes):
        scope.mode = plan.CONTEXT_ONLY
        self.m_place[plan.CONTEXT_ONLY].inc()
        route = plan.route_header(scope.route, request_id=scope.request_id, alias=scope.alias, mode=plan.CONTEXT_ONLY,
                                  detail=self.route_detail)
        return self.relay.context_answer(creq, scope, raw, route)

    @staticmethod
    def route_of(p: Placement) -> dict:
        return plan.route_of(p.server, p.policy, p.explanation)


class _NoKvTransfer(Exception):
    """A generation server answered 501 to a generation_only request: it has no KV transfer agent."""

    def __init__(self, placement: Placement):
        super().__init__(placement.server)
        self.placement = placement


def _no_context(e: NoContextServer) -> ApiError:
    """The client's 503 when no context server fits and `no_context_fallback` is `reject`."""
    return ApiError(503, f"no healthy context server ({e}) and no_context_fallback is 'reject'",
                    code="no_context_server", retry_after=1)
