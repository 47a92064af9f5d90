"""The public OpenAI front door of one fleet process (aiohttp, on the event loop that
`fleet.event_loop` names: fleet/cli.py).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /cluster_info`, `GET /metrics`. Errors are OpenAI error bodies (docs/design.md §4).

Start-up order matters for the shared port: a fleet process first reaches the coordinator (bounded
retries up to `server_start_timeout`), leases its snowflake identity and loads the server list, and
only *then* binds and listens. A process that is still starting, or that failed to start, is never a
listening-but-idle member of the SO_REUSEPORT group; on shutdown the listener is closed first, then
in-flight requests drain (bounded by `fleet.drain_timeout_s`), then leases and aborts are flushed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import weakref

from aiohttp import web

from protocol.coord import CoordinatorError
from protocol.version import VERSION
from coordinator.gc_tuning import settle_heap

from . import metrics as M
from .auth import AUTH_HEADER, ApiKeys, vet_client_params
from protocol.openai import ApiError
from .flow import Flow
from .http_messages import BadBody, BodyTooLarge, FleetRequest
from .http_server import FleetHttpServer
from .launcher import holder_name
from .keys import TokenizerUnavailable, make_key_builder
from .placement import CTX, GEN, Placer
from .snowflake import SnowflakeGenerator
from .upstream import UpstreamPool
from .validate import CHAT, COMPLETION, client_request_id, parse_request, too_large

log = logging.getLogger("splitserve.fleet")
access_log = logging.getLogger("splitserve.fleet.access")

EXIT_COORDINATOR_UNREACHABLE = 3
EXIT_CONFIG = 2
EXIT_FOREIGN_COORDINATOR = 5   # the coordinator that answered belongs to another cluster


def _is_json(mimetype: str) -> bool:
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


class StartupError(RuntimeError):
    """The fleet process cannot start (coordinator unreachable, port busy, ...); exit non-zero."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


LISTEN_BACKLOG = 4096

def bind_socket(host: str, port: int, reuse_port: bool, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A listening TCP socket; with `reuse_port` it joins the SO_REUSEPORT group of `port`."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(addr)
        s.listen(backlog)
        s.setblocking(False)
    except OSError as e:
        s.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return s


class FleetServer:
    """One fleet process: the app, its coordinator client, placement, the upstream pool."""

    def __init__(self, config, coordinator, *, holder: str, process_index: int = 0,
                 coordinator_label: str = "in-process", cluster_id: str | None = None):
        """`cluster_id`: the id the launcher gave its coordinator; the coordinator that answers
        must report it, or this process joined another cluster (a busy port or socket)."""
        self.config = config
        self.cluster_id = cluster_id
        self.coord = coordinator
        self.holder = holder
        self.process_index = process_index
        self.coordinator_label = coordinator_label
        self.pool = UpstreamPool(connect_timeout=min(3.0, config.request_timeout),
                                 idle_timeout=min(15.0, max(1.0, config.server_keep_alive_timeout)))
        self.placer = Placer(config, coordinator)
        self.keys = None
        self.ids: SnowflakeGenerator | None = None
        self.identity: tuple[int, int] | None = None
        self.flow: Flow | None = None
        self.api_keys = ApiKeys(config.api_keys)
        self.max_body = config.fleet.max_body_bytes
        self.max_inflight = config.fleet.max_inflight_requests
        from .admission import RateLimiter
        self.rate_limit = RateLimiter.from_config(config)   # None: fleet.rate_limit off
        self.body_timeout = config.fleet.body_timeout_s
        self.keepalive_requests = config.fleet.keepalive_requests
        self.access_log = config.fleet.access_log
        self._conn_requests: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        mins = config.health_minimums   # the coordinator's readiness rule (coordinator/config_schema.py)
        self.min_ctx, self.min_gen = mins.context_servers, mins.generation_servers
        self._identity_task: asyncio.Task | None = None
        self._m_req: dict = {}
        self.http: FleetHttpServer | None = None
        # the generation routes go straight to `_generate` (one coroutine per request less)
        self._routes = {("POST", "/v1/completions"): lambda r: self._generate(r, COMPLETION),
                        ("POST", "/v1/chat/completions"): lambda r: self._generate(r, CHAT),
                        ("GET", "/v1/models"): self.models, ("GET", "/health"): self.health,
                        ("GET", "/ready"): self.ready, ("GET", "/version"): self.version,
                        ("GET", "/cluster_info"): self.cluster_info, ("GET", "/metrics"): self.metrics}
        self.started = False

    # ------------------------------------------------------------------ start / stop
    async def probe_coordinator(self) -> dict:
        """`/cluster_info` with bounded retries up to `server_start_timeout`; StartupError if it never answers."""
        deadline = time.monotonic() + self.config.server_start_timeout
        attempts, last = 0, None
        delay = 0.1
        while True:
            attempts += 1
            try:
                return await asyncio.wait_for(self.coord.cluster_info(), self.config.fleet.coordinator_timeout_s)
            except (CoordinatorError, OSError, asyncio.TimeoutError) as e:
                last = e
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartupError(
                    f"coordinator at {self.coordinator_label} not reachable after "
                    f"{self.config.server_start_timeout:g}s ({attempts} attempts, last error: "
                    f"{type(last).__name__}: {last}); is it running? (server_start_timeout bounds the wait)",
                    EXIT_COORDINATOR_UNREACHABLE)
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 2.0)

    async def _lease_identity(self) -> tuple[int, int]:
        # The pair in use is asked for again: a replica that took over (docs/failover.md) has no
        # lease of ours and gives it back when free.
        node, proc = await self.coord.lease_identity(self.holder, *(self.identity or (None, None)))
        if self.config.node_id is not None:
            node = self.config.node_id
        return int(node), int(proc)

    async def start(self) -> None:
        ci = await self.probe_coordinator()
        theirs = ci.get("cluster_id") if isinstance(ci, dict) else None
        if self.cluster_id is not None and theirs != self.cluster_id:
            raise StartupError(
                f"the coordinator at {self.coordinator_label} belongs to another cluster (its "
                f"cluster_id is {theirs!r}, this fleet's launcher started {self.cluster_id!r}): "
                f"another splitserve cluster uses this coordinator port or socket",
                EXIT_FOREIGN_COORDINATOR)
        self.placer.apply_cluster_info(ci)
        try:
            self.keys = make_key_builder(self.config, self.placer.models())
        except (TokenizerUnavailable, ValueError) as e:
            raise StartupError(f"cannot compute routing keys: {e}; set `model:` in the config to a preset "
                               f"(tiny, 1b, 8b), a named GGUF model (smollm2-135m), a .gguf file or a local "
                               f"Hugging Face directory with tokenizer.json",
                               EXIT_CONFIG) from None
        try:
            self.identity = await self._lease_identity()
        except (CoordinatorError, OSError, asyncio.TimeoutError) as e:
            raise StartupError(f"could not lease a request-id identity from the coordinator at "
                               f"{self.coordinator_label}: {e}", EXIT_COORDINATOR_UNREACHABLE) from None
        self.ids = SnowflakeGenerator(*self.identity)
        self.flow = Flow(self.config, self.placer, self.pool, self.ids, self.keys)
        from .tracing import FleetTracing
        try:
            self.flow.tracing = FleetTracing.from_config(self.config)
        except ValueError as e:
            raise StartupError(f"otlp_config: {e}", EXIT_CONFIG) from None
        self.placer.start()
        self._identity_task = asyncio.get_running_loop().create_task(self._renew_identity())
        self.started = True
        log.info("fleet process %d ready: identity node_id=%d process_id=%d, %d context / %d generation "
                 "servers, policies ctx=%s gen=%s", os.getpid(), self.identity[0], self.identity[1],
                 len(self.placer.servers[CTX]), len(self.placer.servers[GEN]),
                 self.placer.policy[CTX], self.placer.policy[GEN])

    async def _renew_identity(self) -> None:
        every = max(1.0, self.config.coordinator.identity_ttl_s / 3)
        while True:
            await asyncio.sleep(every if self.placer.coord_ok else 0.5)
            try:
                ident = await self._lease_identity()
            except (CoordinatorError, OSError, asyncio.TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("identity renew failed")
                continue
            if ident != self.identity:
                # The coordinator lost our lease (e.g. it restarted): switch to the pair it gave us now.
                log.warning("request-id identity changed from %s to %s", self.identity, ident)
                self.identity = ident
                self.ids = SnowflakeGenerator(*ident)
                if self.flow is not None:
                    self.flow.ids = self.ids

    async def close(self) -> None:
        if self._identity_task is not None:
            self._identity_task.cancel()
            await asyncio.gather(self._identity_task, return_exceptions=True)
        if self.flow is not None:
            await self.flow.drain(5.0)
            if self.flow.tracing is not None:   # exports what is still batched
                await asyncio.get_running_loop().run_in_executor(None, self.flow.tracing.shutdown)
        await self.placer.stop()
        await self.pool.close()
        if self.identity is not None:
            try:
                await asyncio.wait_for(self.coord.release_identity(self.holder), 2.0)
            except Exception:
                pass   # the lease expires on its own

    # ------------------------------------------------------------------ app
    def dispatch(self, request: FleetRequest):
        """The route's coroutine for `request` (a HEAD is its GET without the body)."""
        method = request.method
        h = self._routes.get(("GET" if method == "HEAD" else method, request.path))
        return (h or self.not_found)(request)

    def _count(self, endpoint: str, status: int) -> None:
        k = (endpoint, status)
        c = self._m_req.get(k)
        if c is None:
            c = self._m_req[k] = M.REQUESTS.labels(endpoint, str(status))
        c.inc()

    def _auth(self, request: FleetRequest) -> None:
        if self.api_keys.enabled and not self.api_keys.check(request.headers.get("Authorization")):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def completions(self, request: FleetRequest):
        return await self._generate(request, COMPLETION)

    async def chat(self, request: FleetRequest):
        return await self._generate(request, CHAT)

    async def _read_body(self, request: FleetRequest) -> bytes:
        """The request body, within `fleet.body_timeout_s`; typed 4xx for what the client got wrong."""
        ct = request.headers.get("Content-Type")
        if ct is not None and not _is_json(request.content_type):
            raise ApiError(415, f"Content-Type must be application/json, got {ct[:80]!r}",
                           code="unsupported_media_type")
        cl = request.content_length
        if cl is not None and cl > self.max_body:
            raise too_large(self.max_body, cl)
        try:
            if request.body_complete:
                return request.body_now()     # the usual case: it came with the head, no timer needed
            async with asyncio.timeout(self.body_timeout):
                return await request.read()
        except BodyTooLarge:
            raise too_large(self.max_body, None) from None
        except TimeoutError:
            M.BODY_TIMEOUTS.inc()
            raise ApiError(408, f"the request body was not received within {self.body_timeout:g}s "
                                f"(fleet.body_timeout_s)", code="request_timeout", close=True) from None
        except BadBody as e:
            # e.g. bad chunked encoding that arrived after the head
            raise ApiError(400, f"malformed request body: {e.message[:200]}",
                           code="bad_http_request", close=True) from None

    async def _generate(self, request: FleetRequest, kind: str):
        t0 = time.perf_counter()
        flow = self.flow
        status = 500
        counted = False
        # The request's id from its first byte: errors before the flow carry it too.
        request_id = flow.ids.next_id()
        x_request_id = client_request_id(request.headers.get("X-Request-Id")) or str(request_id)
        try:
            self._auth(request)
            raw = await self._read_body(request)
            if self.rate_limit is not None:
                await self.rate_limit.admit()
            # Only now does the request take a slot: a client that stalls its body holds no capacity.
            M.INFLIGHT.inc()
            flow.inflight += 1
            counted = True
            if self.max_inflight is not None and flow.inflight > self.max_inflight:
                raise ApiError(429, f"this fleet process already serves {self.max_inflight} requests "
                                    f"(fleet.max_inflight_requests); retry shortly", code="overloaded",
                               retry_after=1)
            creq = parse_request(raw, kind)
            if "chat_template" in creq.body and not self.config.allow_request_chat_template:
                # upstream's guard: a client's own template is code the worker would render
                raise ApiError(400, "a request's own chat_template is not accepted here "
                                    "(allow_request_chat_template is false); remove it",
                               param="chat_template", code="chat_template_not_allowed")
            models = self.placer.models()
            if models and creq.model not in models:
                raise ApiError(404, f"model {creq.model!r} does not exist; this server serves "
                                    f"{', '.join(repr(m) for m in models)}", param="model",
                               code="model_not_found")
            dp = creq.client_disagg_params
            params, alias, stripped = (vet_client_params(dp, self.config.internal_request_auth_key,
                                                         request.headers.get(AUTH_HEADER))
                                       if dp else (None, None, False))
            if stripped:
                M.STRIPPED.inc()
                log.info("stripped client-supplied disaggregated_params without a valid HMAC")
            resp = await flow.handle(request, creq, alias, params, t0, request_id, x_request_id)
            status = resp.status
            self._keepalive_cap(request, resp)
            return resp
        except ApiError as e:
            status = e.status
            e.request_id = x_request_id
            return e.response()
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception as e:
            log.exception("request %s: internal error on %s", x_request_id, request.path)
            err = ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
            err.request_id = x_request_id
            status = 500
            return err.response()
        finally:
            if counted:
                M.INFLIGHT.dec()
                flow.inflight -= 1
            self._count(kind, status)
            if self.access_log:
                ms = (time.perf_counter() - t0) * 1000
                access_log.info("%s %s %d %.1fms id=%s", request.method, request.path, status, ms, x_request_id,
                                extra={"fields": {"method": request.method, "path": request.path,
                                                  "status": status, "duration_ms": round(ms, 3),
                                                  "request_id": x_request_id}})

    def _keepalive_cap(self, request: FleetRequest, resp) -> None:
        cap = self.keepalive_requests
        if cap is None:
            return
        tr = request.transport
        if tr is None:
            return
        n = self._conn_requests.get(tr, 0) + 1
        self._conn_requests[tr] = n
        if n >= cap and not resp.prepared:
            # Close this connection after the answer: the client reconnects and the kernel's
            # SO_REUSEPORT hash may land it on another fleet process (long-lived pools spread out).
            resp.force_close()

    async def models(self, request: FleetRequest) -> web.Response:
        try:
            self._auth(request)
        except ApiError as e:
            return e.response()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "splitserve"} for m in self.placer.models()]
        return web.json_response({"object": "list", "data": data})

    def _counts(self) -> dict:
        return {"context_servers": self.placer.healthy_count(CTX),
                "generation_servers": self.placer.healthy_count(GEN), "min_context_servers": self.min_ctx,
                "min_generation_servers": self.min_gen, "coordinator_reachable": self.placer.coord_ok}

    def _health(self) -> tuple[bool, dict]:
        """Cluster readiness, the coordinator's rule and wording (every role at its minimum)."""
        c = self._counts()
        n_ctx, n_gen = c["context_servers"], c["generation_servers"]
        if not self.started:
            reason = "starting"
        elif n_ctx < self.min_ctx:
            reason = f"need {n_ctx}/{self.min_ctx} healthy context servers"
        elif n_gen < self.min_gen:
            reason = f"need {n_gen}/{self.min_gen} healthy generation servers"
        else:
            return True, {"status": "ready", **c}
        return False, {"status": "not_ready", "error": reason, **c}

    async def health(self, request: FleetRequest) -> web.Response:
        ok, body = self._health()
        return web.json_response(body, status=200 if ok else 503)

    async def ready(self, request: FleetRequest) -> web.Response:
        """Whether this process serves requests now (the chart's readiness probe): unlike `/health`,
        200 while context servers are short and `no_context_fallback: aggregate` serves requests
        on a generation server alone (`mode: aggregate_fallback`)."""
        c = self._counts()
        mode = self.placer.rules.serving_mode(c["context_servers"], c["generation_servers"],
                                              self.min_ctx, self.min_gen) if self.started else None
        if mode is not None:
            return web.json_response({"status": "ready", "mode": mode, **c})
        reason = "starting" if not self.started else (
            f"cannot serve: {c['context_servers']}/{self.min_ctx} healthy context servers "
            f"(no_context_fallback: {self.config.no_context_fallback}), {c['generation_servers']}/"
            f"{self.min_gen} healthy generation servers")
        return web.json_response({"status": "not_ready", "error": reason, **c}, status=503)

    async def version(self, request: FleetRequest) -> web.Response:
        return web.json_response({"version": VERSION, "process_index": self.process_index,
                                  "cluster_id": self.cluster_id})

    async def cluster_info(self, request: FleetRequest) -> web.Response:
        try:
            self._auth(request)
        except ApiError as e:
            return e.response()
        ci = self.placer.cluster_info
        if self.placer.coord_ok:
            try:
                ci = await asyncio.wait_for(self.placer.refresh(), self.config.fleet.coordinator_timeout_s)
            except (CoordinatorError, OSError, asyncio.TimeoutError):
                pass
        ok, health = self._health()
        fleet = {"pid": os.getpid(), "process_index": self.process_index, "holder": self.holder,
                 "node_id": self.identity[0] if self.identity else None,
                 "process_id": self.identity[1] if self.identity else None,
                 "coordinator": self.coordinator_label, "coordinator_reachable": self.placer.coord_ok,
                 "ejected_servers": self.placer.ejected(), "inflight_requests": self.flow.inflight if self.flow else 0,
                 "policies": dict(self.placer.policy), "health": health, "schedule_style": self.config.schedule_style}
        return web.json_response({**ci, "fleet": fleet})

    async def metrics(self, request: FleetRequest) -> web.Response:
        body, ctype = M.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def not_found(self, request: FleetRequest) -> web.Response:
        known = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET",
                 "/health": "GET", "/ready": "GET", "/version": "GET", "/cluster_info": "GET",
                 "/metrics": "GET"}
        # a CONNECT's target is a host:port (authority form), never one of these paths
        m = known.get(request.path) if request.method != "CONNECT" else None
        if m is not None:
            return ApiError(405, f"{request.method} is not allowed on {request.path}; use {m}",
                            code="method_not_allowed").response({"Allow": m})
        return ApiError(404, f"no route {request.method} {request.path}; the API serves "
                             f"{', '.join(sorted(known))}", code="not_found").response()

    # ------------------------------------------------------------------ serving
    async def serve(self, sock: socket.socket, stop: asyncio.Event) -> None:
        """Serve on `sock` (already listening) until `stop` is set, then drain and close."""
        self.http = FleetHttpServer(self.dispatch, max_body=self.max_body,
                                    keepalive_s=self.config.server_keep_alive_timeout,
                                    header_timeout_s=self.config.fleet.header_timeout_s)
        # the loop listens on the socket again: with the bound backlog, not a default of 128 (256
        # connections opened at once overflowed it: ~1 s retransmissions, issue 13)
        await self.http.serve(sock, LISTEN_BACKLOG)
        try:
            await stop.wait()
        finally:
            log.info("fleet process %d: draining (%d in flight, up to %.0fs)", os.getpid(),
                     self.flow.inflight if self.flow else 0, self.config.fleet.drain_timeout_s)
            # closes the listener first, then waits for in-flight requests
            await self.http.close(self.config.fleet.drain_timeout_s)
            await self.close()


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass


async def _watch_parent(ppid: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(1.0)
        if os.getppid() != ppid:
            log.warning("fleet process %d: launcher (pid %d) is gone; shutting down", os.getpid(), ppid)
            stop.set()


async def run_process(config, *, coordinator_url: str | None, process_index: int = 0,
                      reuse_port: bool = False, ready_fd: int | None = None,
                      cluster_id: str | None = None) -> int:
    """One fleet process, start to exit. With no `coordinator_url` the coordinator runs in-process."""
    from coordinator.client import InProcessCoordinatorClient, ReplicaClient

    from .coord_client import FleetCoordinatorClient

    stop = asyncio.Event()
    install_stop_signals(stop)
    if ready_fd is not None:
        # A launcher's child: SIGTERM comes from the launcher; Ctrl-C on the terminal goes to the launcher.
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    watchdog = None
    if process_index is not None and reuse_port:
        # A launcher's child: if the launcher dies (even SIGKILL), stop instead of lingering as an orphan.
        watchdog = asyncio.get_running_loop().create_task(_watch_parent(os.getppid(), stop))
    replicas = config.coordinator.replicas
    if coordinator_url is None and not replicas:
        try:
            client = await InProcessCoordinatorClient.start(config)
        except OSError as e:   # its API's port or socket (dynamic membership) is taken
            log.error("cannot start the in-process coordinator: %s", e)
            return 1
        label = "in-process"
    else:
        def one(url: str) -> FleetCoordinatorClient:
            return FleetCoordinatorClient(url, timeout=config.fleet.coordinator_timeout_s,
                                          channel=config.fleet.coordinator_channel,
                                          max_pending=config.fleet.coordinator_max_pending)
        if len(replicas) > 1:
            client = ReplicaClient([one(u) for u in replicas],
                                   failover_wait_s=config.fleet.failover_wait_s)
            label = "replicas " + ", ".join(replicas)
        else:
            label = replicas[0] if replicas else coordinator_url
            client = one(label)
    holder = holder_name(config.port, os.getpid())
    server = FleetServer(config, client, holder=holder, process_index=process_index, coordinator_label=label,
                         cluster_id=cluster_id)
    try:
        try:
            await server.start()
        except StartupError as e:
            log.error("%s", e)
            return e.exit_code
        try:
            sock = bind_socket(config.effective_bind_host, config.port, reuse_port)
        except StartupError as e:
            log.error("%s", e)
            return 1
        log.info("fleet process %d listening on %s:%d (event loop %s)", os.getpid(),
                 config.effective_bind_host, sock.getsockname()[1],
                 type(asyncio.get_running_loop()).__module__.partition(".")[0])
        # Everything allocated so far (modules, config, tokenizer) lives as long as the process: keep it
        # out of the collector's scans so per-request garbage collection stays cheap.
        settle_heap()
        if ready_fd is not None:
            os.write(ready_fd, b"%d\n" % sock.getsockname()[1])
            os.close(ready_fd)
        await server.serve(sock, stop)
        return 0
    finally:
        if watchdog is not None:
            watchdog.cancel()
        try:
            await client.close()    # an in-process coordinator stops with its client
        except Exception as e:
            log.warning("closing the coordinator client failed: %s", e)
