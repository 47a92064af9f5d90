"""The worker's OpenAI-compatible HTTP server (aiohttp), contract in docs/worker.md, "HTTP contract".

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON and SSE), ``GET /v1/models``,
``GET /health``, ``GET /server_info``, ``GET /kv_snapshot`` (msgpack), ``POST /v1/abort``,
``POST /kv_release`` (a context request's pinned KV: transfer done), ``POST /reset_prefix_cache``,
``GET /metrics``.

A request is registered in the engine under a fresh internal id plus the ``X-Request-Id`` header
and ``disaggregated_params.disagg_request_id`` as aliases, so ``/v1/abort`` finds it by either.
A client that disconnects cancels its handler (``handler_cancellation``), which closes the
engine stream and so aborts the request and frees its blocks.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import secrets
import os
import socket
import time
import uuid

import msgpack
import orjson
from aiohttp import web

from protocol import kv_replay
from protocol.openai import ApiError, error_body
from router.block_keys import KEY_SCHEME, block_keys_list
from worker import engine_protocols, openai_api
from worker.metrics import make_registry, render
from worker.requests import (
    CONTEXT_ONLY, GENERATION_ONLY, EngineRequest, EngineStopped, InvalidRequest,
)

log = logging.getLogger("splitserve.worker.server")

__all__ = ["WorkerServer", "ROLES"]

ROLES = ("context", "generation", "both")
def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None, type_: str | None = None,
                   headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, param, code, type_),
                        content_type="application/json", headers=headers)


def _json(obj, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json",
                        headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class WorkerServer:
    """Owns the HTTP app, the engine's lifecycle, the KV-event publisher hookup and the optional
    coordinator registration."""

    def __init__(self, engine, *, model_name: str, role: str = "both", host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None, publisher=None,
                 coordinator_url: str | None = None, register_ttl_s: float = 30.0,
                 max_body_bytes: int = 32 << 20, worker_id: str | None = None,
                 transfer_info: dict | None = None, ctx_info_endpoint: str | None = None,
                 engine_protocol: str = "trtllm", bootstrap_port: int | None = None,
                 cluster_uri: str | None = None, cluster_name: str = "",
                 otlp_traces_endpoint: str | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if engine_protocol not in engine_protocols.ENGINE_PROTOCOLS:
            raise ValueError(f"disagg_protocol must be one of {engine_protocols.ENGINE_PROTOCOLS}, got {engine_protocol!r}")
        self.engine_protocol = engine_protocol
        # SGLang prefill side: the port its bootstrap server listens on (0 = pick a free one).
        self.bootstrap_port = bootstrap_port if engine_protocol == "sglang" and role != "generation" else None
        self._bootstrap_runner: web.AppRunner | None = None
        self._local_ids = itertools.count(random.randrange(1 << 20, 1 << 39))
        self.engine = engine
        self.model_name = model_name
        self.role = role
        self.host = host
        self.port = port
        self.advertise_host = advertise_host or (
            socket.gethostname() if host in ("0.0.0.0", "::", "") else host)
        self.publisher = publisher
        self.coordinator_url = coordinator_url
        self.cluster_uri = cluster_uri
        from protocol.tracing import make_tracer
        # None unless --otlp-traces-endpoint: the request path then only tests it against None.
        self.tracing = make_tracer(otlp_traces_endpoint, "splitserve-worker")
        self.cluster_name = cluster_name
        self.register_ttl_s = register_ttl_s
        self.max_body_bytes = max_body_bytes
        self.worker_id = worker_id
        self.transfer_info = transfer_info
        self.ctx_info_endpoint = ctx_info_endpoint
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._registration = None
        self._created = int(time.time())
        self.draining = False
        self.registry = make_registry(engine, publisher)
        self.app = self._make_app()
        # This process's incarnation: in /server_info, on every KV-event batch and in /kv_snapshot,
        # so the coordinator drops what it knew of a previous process at this url at once
        # (docs/failover.md "Worker restarts").
        self.start_id = secrets.token_hex(8)
        self._heartbeat_task: asyncio.Task | None = None
        if publisher is not None:
            if publisher.epoch is None:
                publisher.epoch = self.start_id
            engine.event_sink = publisher.publish

    # ------------------------------------------------------------------ lifecycle
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[self._errors_middleware])
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/server_info", self.server_info)
        r.add_get("/kv_snapshot", self.kv_snapshot)
        r.add_post("/kv_keys", self.kv_keys)
        r.add_post("/v1/abort", self.abort)
        r.add_post("/kv_release", self.kv_release)
        r.add_post("/kv_wait", self.kv_wait)
        if self.engine_protocol == "sglang":
            r.add_post("/abort_request", self.abort_request)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> str:
        """Start the engine and listen; returns the advertised base URL."""
        await self.engine.start()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        h = self.advertise_host
        self.url = f"http://{'[' + h + ']' if ':' in h else h}:{self.port}"
        if self.worker_id is None:
            self.worker_id = f"{self.role}-{h}:{self.port}-{os.getpid()}"
        self.engine.worker_id = self.worker_id
        self.engine.worker_url = self.url
        if self.publisher is not None and self.publisher.heartbeat_s > 0:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeats())
        if self.bootstrap_port is not None:
            await self._start_bootstrap()
        if self.coordinator_url:
            from worker.registration import CoordinatorRegistration, Registrations
            # Several coordinator replicas (comma separated): every one of them must know this
            # worker, so each keeps its own index warm (docs/failover.md).
            self._registration = Registrations([CoordinatorRegistration(
                u.strip(), url=self.url, role=self.role, ttl_s=self.register_ttl_s,
                worker_id=self.worker_id) for u in self.coordinator_url.split(",") if u.strip()])
            await self._registration.start()
        elif self.cluster_uri:
            from worker.registration import EtcdRegistration
            self._registration = EtcdRegistration(
                self.cluster_uri, self.cluster_name, host=h, port=self.port, role=self.role,
                worker_id=self.worker_id, ttl_s=self.register_ttl_s)
            await self._registration.start()
        return self.url

    async def drain(self, timeout_s: float) -> bool:
        """Graceful shutdown, first half: deregister, answer new generation requests (and
        ``/health``) with 503, and wait up to ``timeout_s`` for running and queued requests to
        finish and for pinned context KV to be fetched. True if everything finished in time."""
        self.draining = True
        if self._registration is not None:
            await self._registration.stop()
            self._registration = None
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            st = self.engine.stats()
            if st["running"] == 0 and st["waiting"] == 0 and st["pinned_transfers"] == 0:
                return True
            if time.monotonic() >= deadline:
                log.warning("drain timed out after %.1fs with %d running, %d waiting, %d pinned "
                            "transfers; aborting them", timeout_s, st["running"], st["waiting"],
                            st["pinned_transfers"])
                return False
            await asyncio.sleep(0.05)

    async def _heartbeats(self) -> None:
        """An idle publisher's heartbeat (worker/kv_events.py), on the loop that publishes."""
        pub = self.publisher
        while True:
            await asyncio.sleep(pub.heartbeat_s / 2)
            try:
                pub.heartbeat()
            except Exception as e:   # never the worker's end: a missed heartbeat is only late
                log.warning("KV-event heartbeat failed: %s", e)

    async def stop(self) -> None:
        """Deregister, stop accepting, abort in-flight requests, stop the engine."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        if self._registration is not None:
            await self._registration.stop()
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._bootstrap_runner is not None:
            await self._bootstrap_runner.cleanup()
        if self.publisher is not None:
            self.publisher.close()
        if self.tracing is not None:   # exports what is still batched
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    async def _start_bootstrap(self) -> None:
        """The SGLang prefill side's bootstrap server: where a decode leg waits for its room's
        prefill and reports the transfer done (worker/engine_protocols.py)."""
        app = web.Application(middlewares=[self._errors_middleware])
        app.router.add_post("/kv_wait", self.kv_wait)
        app.router.add_post("/kv_release", self.kv_release)
        self._bootstrap_runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._bootstrap_runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.bootstrap_port))
        self.bootstrap_port = sock.getsockname()[1]
        await web.SockSite(self._bootstrap_runner, sock).start()

    # ------------------------------------------------------------------ errors
    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:    # EngineError and protocol.openai.InvalidRequest
            return error_response(e.status, e.message, param=e.param, code=e.code, type_=e.type)
        except web.HTTPRequestEntityTooLarge as e:
            return error_response(413, f"request body too large: the limit is "
                                  f"{self.max_body_bytes} bytes ({e.text})", code="body_too_large")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            msg = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}"}.get(
                       e.status, e.text or e.reason)
            return error_response(e.status, msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(500, f"internal error: {type(e).__name__}: {e}")

    async def _body(self, request: web.Request):
        raw = await request.read()
        if not raw:
            raise InvalidRequest("the request body is empty; expected a JSON object")
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise InvalidRequest(f"the request body is not valid JSON: {e}") from None

    # ------------------------------------------------------------------ info endpoints
    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return error_response(503, "the worker is draining", type_="service_unavailable")
        if getattr(self.engine, "alive", True):
            return _json({"status": "ok"})
        return error_response(503, "the engine loop is not running", type_="service_unavailable")

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self._created,
            "owned_by": "splitserve", "max_model_len": self.engine.max_model_len}]})

    def server_info_dict(self) -> dict:
        return {
            "role": self.role,
            "model": self.model_name,
            "engine": self.engine.engine_name,
            # "triton" / "torch" for the torch engine (worker/attention), null for engines without one.
            "attention_backend": getattr(getattr(self.engine, "runner", None), "attention_backend", None),
            # The torch engine's step loop (worker/step_loop.py ``StepLoop.run_async``); null for the sim engine.
            "async_scheduling": getattr(self.engine, "async_scheduling", None),
            "block_size": self.engine.block_size,
            "key_scheme": KEY_SCHEME,
            "ns_seed": self.engine.pool.ns_seed,
            "worker_id": self.worker_id,
            "start_id": self.start_id,
            "max_batch_size": self.engine.max_batch_size,
            "max_num_tokens": self.engine.max_num_tokens,
            # KV capacity in blocks (the coordinator's index models eviction with it)
            "kv_capacity_blocks": self.engine.pool.num_blocks,
            # the latency model kv_cache_aware's time cost uses (null: it learns one online)
            "routing_model": self.engine.routing_model() if hasattr(self.engine, "routing_model") else None,
            "kv_events": self._kv_events_info(),
            "transfer": self.transfer_info,
            "disaggregated_params": {"ctx_info_endpoint": self.ctx_info_endpoint},
            "disagg_protocol": self.engine_protocol,
            **({"disaggregation_mode": engine_protocols.SGLANG_MODES[self.role],
                "disaggregation_bootstrap_port": self.bootstrap_port}
               if self.engine_protocol == "sglang" else {}),
        }

    def _kv_events_info(self) -> dict | None:
        pub = self.publisher
        if pub is None:
            return None
        if self.engine_protocol == "sglang":
            # SGLang's own descriptor (sglang 0.5.23 srt/runtime_context.py
            # `describe_kv_events_publisher`): no replay, no snapshot.
            host, _, port = pub.publisher_endpoint.split("://", 1)[1].rpartition(":")
            return {"publisher": "zmq", "endpoint_host": host.strip("[]"), "endpoint_port_base": int(port),
                    "topic": pub.topic, "block_size": self.engine.block_size, "dp_size": 1}
        return {"publisher": pub.publisher_endpoint, "replay": pub.replay_endpoint,
                "topic": pub.topic, "snapshot": "/kv_snapshot", "format": "vllm",
                "epoch": pub.epoch, "heartbeat_s": pub.heartbeat_s}

    async def server_info(self, request: web.Request) -> web.Response:
        if self.engine_protocol == "vllm":
            # Like a stock vLLM (it serves /server_info only with VLLM_SERVER_DEV_MODE=1): the fleet
            # must be told the protocol, and the coordinator its KV-event publisher (`kv_events`).
            return error_response(404, "no route GET /server_info (a vLLM server without dev mode)")
        return _json(self.server_info_dict())

    async def kv_snapshot(self, request: web.Request) -> web.Response:
        # Publish whatever is pending first: then the resident set is exactly the state after
        # batch `seq` (both read on the loop thread, nothing in between).
        self.engine.flush_events()
        body = kv_replay.encode_snapshot(self.publisher.last_seq if self.publisher is not None else -1,
                                         self.engine.block_size, KEY_SCHEME,
                                         self.engine.pool.resident_keys(),
                                         self.publisher.epoch if self.publisher is not None else None)
        return web.Response(body=body, content_type="application/msgpack")

    async def kv_keys(self, request: web.Request) -> web.Response:
        """The prompt token ids and block keys this worker computes for a request body, by the
        same parse as generation (`?kind=completion|chat`): the coordinator's key parity probe
        compares them with its own recipe (coordinator/kv_parity.py)."""
        kind = request.query.get("kind", "completion")
        if kind not in ("completion", "chat"):
            raise InvalidRequest(f"'kind' must be 'completion' or 'chat', got {kind!r}", param="kind")
        body = await self._body(request)
        eng = self.engine
        parse = openai_api.parse_completion if kind == "completion" else openai_api.parse_chat
        try:
            parsed = parse(body, eng.tokenizer, max_model_len=eng.max_model_len)
        except ValueError as e:
            if isinstance(e, ApiError):
                raise
            raise InvalidRequest(f"cannot tokenize the prompt: {e}", param="prompt") from None
        ids = list(parsed.prompt_token_ids)
        return _json({"token_ids": ids, "block_size": eng.block_size, "key_scheme": KEY_SCHEME,
                      "ns_seed": eng.pool.ns_seed,
                      "block_keys": block_keys_list(ids, eng.block_size, eng.pool.ns_seed)})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ------------------------------------------------------------------ control endpoints
    async def abort(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rid = body.get("request_id") if isinstance(body, dict) else None
        if isinstance(rid, bool) or not isinstance(rid, (int, str)) or rid == "":
            raise InvalidRequest(f"'request_id' must be an integer or a non-empty string, got "
                                 f"{rid!r}", param="request_id")
        return _json({"aborted": self.engine.abort(rid)})

    async def kv_release(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        cid = body.get("ctx_request_id") if isinstance(body, dict) else None
        if isinstance(cid, bool) or not isinstance(cid, int):
            raise InvalidRequest(f"'ctx_request_id' must be an integer, got {cid!r}",
                                 param="ctx_request_id")
        reason = body.get("reason", "transferred")
        if not isinstance(reason, str) or not reason:
            raise InvalidRequest(f"'reason' must be a non-empty string, got {reason!r}",
                                 param="reason")
        return _json({"released": self.engine.release(cid, reason[:64])})

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's abort: ``{"rid": ...}`` (or ``abort_all``), by the request's ``rid``."""
        body = await self._body(request)
        if not isinstance(body, dict):
            raise InvalidRequest("expected a JSON object with 'rid'", param="rid")
        if body.get("abort_all") is True:
            raise InvalidRequest("'abort_all' is not supported by this worker; name one 'rid'",
                                 param="abort_all", code="unsupported_parameter")
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequest(f"'rid' must be a non-empty string, got {rid!r}", param="rid")
        return _json({"aborted": self.engine.abort(rid)})

    async def kv_wait(self, request: web.Request) -> web.Response:
        """Wait until the prefill of ``ctx_request_id`` holds its KV (pinned for the transfer), at
        most ``timeout_s``; answers ``{"ready": bool}``."""
        body = await self._body(request)
        cid = body.get("ctx_request_id") if isinstance(body, dict) else None
        if isinstance(cid, bool) or not isinstance(cid, int):
            raise InvalidRequest(f"'ctx_request_id' must be an integer, got {cid!r}", param="ctx_request_id")
        t = body.get("timeout_s", 30.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 600:
            raise InvalidRequest(f"'timeout_s' must be a number in [0, 600], got {t!r}", param="timeout_s")
        deadline = time.monotonic() + t
        while self.engine.pinned_transfer(cid) is None:
            if time.monotonic() >= deadline:
                return _json({"ready": False})
            await asyncio.sleep(0.005)
        return _json({"ready": True})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.clear_cache()
        return _json({"cleared": True})

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.tracing is None:
            return await self._generate_untraced(request, kind)
        return await self._generate_traced(request, kind)

    async def _generate_traced(self, request: web.Request, kind: str) -> web.StreamResponse:
        """The request under a SERVER span continuing the caller's trace (`traceparent`, sent by
        the fleet with each leg), ended when the answer (a stream: its last byte) is written."""
        from opentelemetry.trace import SpanKind, StatusCode
        from protocol.tracing import parent_context
        span = self.tracing.tracer.start_span(
            f"worker {request.path}", kind=SpanKind.SERVER, context=parent_context(request.headers))
        span.set_attribute("splitserve.role", self.role)
        span.set_attribute("splitserve.worker_id", self.worker_id or "")
        xrid = request.headers.get("X-Request-Id")
        if xrid:
            span.set_attribute("splitserve.request_id", xrid)
        try:
            resp = await self._generate_untraced(request, kind, span)
        except BaseException as e:
            span.set_status(StatusCode.ERROR, getattr(e, "message", None) or type(e).__name__)
            span.end()
            raise
        span.set_attribute("http.response.status_code", resp.status)
        span.end()
        return resp

    async def _generate_untraced(self, request: web.Request, kind: str,
                                 span=None) -> web.StreamResponse:
        if self.draining:
            raise EngineStopped("the worker is draining for shutdown; retry on another worker")
        body = await self._body(request)
        eng = self.engine
        pd = None
        if self.engine_protocol != "trtllm" and isinstance(body, dict):
            body, pd = engine_protocols.incoming(self.engine_protocol, self.role, body, next(self._local_ids))
        parse = openai_api.parse_completion if kind == "completion" else openai_api.parse_chat
        try:
            parsed = parse(body, eng.tokenizer, max_model_len=eng.max_model_len,
                           vocab_size=getattr(eng, "vocab_size", None))
        except ValueError as e:
            if isinstance(e, ApiError):
                raise
            raise InvalidRequest(f"cannot tokenize the prompt: {e}", param="prompt") from None
        if parsed.model is not None and parsed.model != self.model_name:
            return error_response(404, f"the model {parsed.model!r} does not exist on this worker; "
                                  f"it serves {self.model_name!r}", param="model",
                                  code="model_not_found")
        rt = parsed.request_type
        if rt == GENERATION_ONLY and self.role == "context":
            raise InvalidRequest("this is a context worker; it does not accept generation_only "
                                 "requests", param="disaggregated_params.request_type")
        if rt == CONTEXT_ONLY and self.role == "generation":
            raise InvalidRequest("this is a generation worker; it does not accept context_only "
                                 "requests", param="disaggregated_params.request_type")
        xrid = request.headers.get("X-Request-Id")
        aliases = tuple(str(a) for a in (xrid, parsed.disagg_request_id, (pd or {}).get("rid"))
                        if a not in (None, ""))
        if pd is not None and pd["kind"].endswith("_prefill"):
            parsed.stream = False   # the router reads a prefill answer to its end; JSON is enough
        ctx_id = None
        if rt == CONTEXT_ONLY:
            if parsed.disagg_request_id is not None:
                ctx_id = parsed.disagg_request_id
            elif xrid is not None and xrid.isdigit():
                ctx_id = int(xrid)
        dp = dict(parsed.disaggregated_params)
        ereq = EngineRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=parsed.prompt_token_ids,
            sampling=parsed.sampling, request_type=rt, aliases=aliases, ctx_request_id=ctx_id,
            disaggregated_params=dp if rt == GENERATION_ONLY else None,
            first_gen_tokens=parsed.first_gen_tokens)
        if span is not None:
            span.set_attribute("splitserve.request_type", str(getattr(rt, "value", rt)))
            span.set_attribute("gen_ai.usage.prompt_tokens", len(parsed.prompt_token_ids))
        try:
            stream = await eng.submit(ereq)
        except InvalidRequest as e:
            # the engine knows "the prompt" and "max_tokens"; the client sent these fields
            e.param = {"prompt": parsed.prompt_field, "max_tokens": parsed.max_tokens_field}.get(e.param, e.param)
            raise
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        oid = prefix + (xrid if xrid else ereq.request_id)
        headers = {"X-Request-Id": xrid} if xrid else None
        async with stream:
            if parsed.stream:
                return await self._stream(request, stream, parsed, kind, oid, headers)
            return await self._collect(stream, parsed, kind, oid, headers, pd)

    def _echo(self, parsed) -> str:
        """The prompt's text for completions with ``echo: true`` (special tokens dropped)."""
        if not parsed.echo:
            return ""
        return self.engine.tokenizer.decode(parsed.prompt_token_ids)

    def _disagg_out(self, parsed, ev):
        if ev.context is None:
            return None, None
        return (openai_api.disagg_response_params(parsed, ev.context, self.ctx_info_endpoint),
                ev.context.prompt_token_ids)

    async def _collect(self, stream, parsed, kind, oid, headers, pd=None) -> web.Response:
        parts: list[str] = [self._echo(parsed)]
        token_ids: list[int] = []
        last = None
        async for ev in stream:
            parts.append(ev.text)
            token_ids.extend(ev.token_ids)
            last = ev
        if last.finish_reason == "error":
            return error_response(500, last.error or "generation failed", headers=headers)
        use = openai_api.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        disagg, prompt_ids = self._disagg_out(parsed, last)
        text = "".join(parts)
        shape = openai_api.completion_response if kind == "completion" else openai_api.chat_response
        body = shape(oid, self.model_name, text, last.finish_reason, last.stop_reason, use,
                     disagg, prompt_ids)
        if parsed.return_token_ids:
            body["choices"][0]["token_ids"] = token_ids
        if pd is not None:
            body = engine_protocols.outgoing(body, pd, last.context, engine_id=self.worker_id,
                                         host=self.advertise_host, port=self.port)
        return _json(body, headers=headers)

    async def _stream(self, request, stream, parsed, kind, oid, headers) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **(headers or {})})
        await resp.prepare(request)
        created = int(time.time())
        model = self.model_name
        chat = kind == "chat"
        if chat:
            await resp.write(_sse(openai_api.chat_chunk(oid, created, model,
                                                      {"role": "assistant", "content": ""})))
        echo = self._echo(parsed)
        if echo:
            await resp.write(_sse(openai_api.completion_chunk(oid, created, model, echo)))
        last = None
        async for ev in stream:
            last = ev
            if ev.finish_reason == "error":
                await resp.write(_sse({"error": {"message": ev.error or "generation failed",
                                                 "type": "internal_server_error", "param": None,
                                                 "code": None}}))
                break
            if ev.finish_reason is None and not ev.text and not (
                    parsed.return_token_ids and ev.token_ids):
                continue  # an incomplete UTF-8 character: wait for the rest
            disagg = self._disagg_out(parsed, ev)[0] if ev.finish_reason else None
            if chat:
                chunk = openai_api.chat_chunk(oid, created, model,
                                            {"content": ev.text} if ev.text else {},
                                            ev.finish_reason, ev.stop_reason, disagg)
            else:
                chunk = openai_api.completion_chunk(oid, created, model, ev.text, ev.finish_reason,
                                                  ev.stop_reason, disagg)
            if parsed.return_token_ids:
                chunk["choices"][0]["token_ids"] = list(ev.token_ids)
            if parsed.include_usage:
                chunk["usage"] = None
            await resp.write(_sse(chunk))
        if last is not None and parsed.include_usage and last.finish_reason != "error":
            use = openai_api.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
            await resp.write(_sse(openai_api.usage_chunk(kind, oid, created, model, use)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
