"""The coordinator's HTTP API as one synchronous function of (method, path, headers, body).

Every endpoint is a state operation on the `Coordinator` with no await inside, so one call
computes the whole answer; both servers use this: the lean HTTP/1.1 protocol in
`coordinator.http` (the default) and aiohttp (`make_app`, and `CoordinatorServer(http="aiohttp")`).

Bodies are msgpack or JSON and answered in kind; GET answers are JSON unless `Accept` names
msgpack. Errors: 400 `{error, field}`, 415, 404, 405 (with `Allow`), 421 `{error, serving}` (a
replica that is not the serving one: docs/failover.md), 503 `{error}`; a placement
that found the event loop saturated (its timers late by more than `max_queue_delay_s`, twice in a
row) is shed with 429 `{error, retry_after}` + `Retry-After`, no lease taken.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from coordinator import metrics as metrics_mod
from coordinator.snapshot import ListenerCounters
from coordinator import checks
from protocol import coord as wire
from protocol.coord import BadRequest, NoServerAvailable, NotServing
from coordinator.identity import IdentityExhausted

__all__ = ["Api", "Reply", "make_app"]

MSGPACK_CT = wire.MSGPACK
JSON_CT = wire.JSON
_EMPTY: dict = {}


@dataclass(slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class _Status:
    """A non-200 answer from an endpoint function."""
    status: int
    body: dict


def _reason(exc: Exception) -> str:
    r = getattr(exc, "reason", None)
    return r if isinstance(r, str) and r else str(exc)


def _encode(obj: Any, mp: bool, status: int = 200, headers: tuple = ()) -> Reply:
    if mp:
        return Reply(status, MSGPACK_CT, wire.encode_msgpack(obj), headers)
    return Reply(status, JSON_CT, wire.encode_json(obj), headers)


def _wants_msgpack(accept: str | None) -> bool:
    return bool(accept) and "msgpack" in accept


class Api:
    """Endpoints of docs/design.md §6 (+ /select_pair, /identity, /version) over a Coordinator."""

    def __init__(self, coord, *, watch=None, max_queue_delay_s: float | None = None,
                 counters: Callable[[], ListenerCounters] | None = None):
        """`counters`: what the listeners serving the coordinator counted, for `/metrics`
        (coordinator/listeners.py `CoordinatorServer.counters`); by default this API's own."""
        self.coord = coord
        self.counters = counters or (lambda: ListenerCounters(http_shed=self.shed))
        self.watch = watch            # coordinator.channel.LoopWatch, or None: never shed
        self.max_queue_delay_s = max_queue_delay_s
        self.shed = 0
        c = coord
        self.post: dict[str, tuple[str, type, Callable[[Any], Any]]] = {
            "/select": ("select", wire.SelectBody, self._select),
            "/select_pair": ("select_pair", wire.SelectPairBody, self._select_pair),
            "/finish": ("finish", wire.FinishBody, self._finish),
            "/renew": ("renew", wire.RenewBody, lambda b: {"renewed": c.renew_lease(
                wire.parse_role(b.role), wire.check_req_id(b.req_id))}),
            "/first_token": ("first_token", wire.FirstTokenBody, lambda b: {"applied": c.lease_first_token(
                wire.parse_role(b.role), wire.check_req_id(b.req_id))}),
            "/register": ("register", wire.RegisterBody,
                          lambda b: c.register(b.url, b.role, b.ttl_s, b.worker_id)),
            "/heartbeat": ("heartbeat", wire.RegisterBody, self._heartbeat),
            "/deregister": ("deregister", wire.DeregisterBody, lambda b: {"removed": c.deregister(b.url)}),
            "/identity": ("identity", wire.IdentityBody,
                          lambda b: c.lease_identity(b.holder, b.node_id, b.process_id)),
            "/identity/release": ("identity_release", wire.IdentityReleaseBody,
                                  lambda b: {"released": c.release_identity(b.holder, b.end_leases)}),
            "/leases": ("leases", wire.LeasesBody, lambda b: c.register_leases(b.leases)),
        }
        self.get: dict[str, Callable[[bool], Reply]] = {
            "/cluster_info": lambda mp: _encode(c.cluster_info(), mp),
            "/health": self._health,
            "/metrics": lambda mp: Reply(200, metrics_mod.CONTENT_TYPE,
                                         metrics_mod.render(c.snapshot(self.counters()))),
            "/version": lambda mp: _encode({"version": c.version, "cluster_id": c.cluster_id}, mp),
            "/replica": lambda mp: _encode(c.replica_info(), mp),
        }
        self.routes = [("POST", p) for p in self.post] + [("GET", p) for p in self.get]

    # ---- endpoint bodies ---------------------------------------------------------------------
    # The body's types were checked by its decoder (`wire.decode`); what the schema leaves open
    # (role aliases, the u64 range of ids, usage bounds, routing keys and urls against the
    # cluster) is checked here, once, before the coordinator's validated calls.
    def _select(self, b: wire.SelectBody) -> dict:
        c = self.coord
        ex = b.exclude if b.exclude is not None else b.exclude_server
        return c.place(wire.parse_role(b.role), wire.check_req_id(b.req_id), checks.routing_key(b.routing_key, c.block_size),
                       checks.exclusions(ex, "exclude"))

    def _select_pair(self, b: wire.SelectPairBody) -> dict:
        c = self.coord
        return c.place_pair(wire.check_req_id(b.req_id), checks.routing_key(b.routing_key, c.block_size),
                            checks.exclusions(b.exclude_ctx, "exclude_ctx"),
                            checks.exclusions(b.exclude_gen, "exclude_gen"))

    def _finish(self, b: wire.FinishBody) -> dict:
        self.coord.end_lease(wire.parse_role(b.role), wire.check_req_id(b.req_id), b.success,
                             wire.finish_usage(b.usage))
        return _EMPTY

    def _heartbeat(self, b: wire.RegisterBody):
        ans = self.coord.heartbeat(b.url, b.role, b.ttl_s, b.worker_id)
        if ans is None:
            return _Status(404, {"error": f"unknown server {b.url!r}: register it first (or send its "
                                          "role with the heartbeat)", "field": "url"})
        return ans

    def _health(self, mp: bool) -> Reply:
        reason = self.coord.not_ready_reason()
        if reason is None:
            return _encode({"status": "ready"}, mp)
        return _encode({"status": "not_ready", "error": reason}, mp, 503)

    # ---- dispatch ----------------------------------------------------------------------------
    def handle(self, method: str, path: str, content_type: str | None, accept: str | None,
               body: bytes) -> Reply:
        """The whole answer to one request (never raises for bad input)."""
        if method == "POST":
            ep = self.post.get(path)
            if ep is not None:
                if self.watch is not None and (path == "/select" or path == "/select_pair"):
                    now = time.monotonic()
                    if self.watch.saturated(now, self.max_queue_delay_s):
                        return self._overloaded(self.watch.lag(now), content_type, body)
                return self._call(ep, content_type, accept, body)
        elif method == "GET" or method == "HEAD":
            ep = self.get.get(path)
            if ep is not None:
                return ep(_wants_msgpack(accept))
        allowed = [m for (m, p) in self.routes if p == path]
        if allowed:
            return _encode({"error": f"method {method} not allowed on {path}; use {', '.join(allowed)}"},
                           False, 405, (("Allow", ", ".join(allowed)),))
        return _encode({"error": f"no endpoint {path}"}, False, 404)

    def _call(self, ep, content_type: str | None, accept: str | None, body: bytes) -> Reply:
        name, schema, fn = ep
        try:
            mp = wire.is_msgpack(content_type, body)
        except BadRequest as exc:
            return self._bad(name, exc, _wants_msgpack(accept))
        try:
            ans = fn(wire.decode(schema, body, mp))
        except BadRequest as exc:
            return self._bad(name, exc, mp)
        except NotServing as exc:
            return _encode(exc.to_body(), mp, 421)
        except NoServerAvailable as exc:
            return _encode({"error": _reason(exc)}, mp, 503)
        except IdentityExhausted as exc:
            return _encode({"error": str(exc)}, mp, 503)
        if type(ans) is _Status:
            return _encode(ans.body, mp, ans.status)
        return _encode(ans, mp)

    def _overloaded(self, lag: float, content_type: str | None, body: bytes) -> Reply:
        self.shed += 1
        try:
            mp = wire.is_msgpack(content_type, body)
        except BadRequest:
            mp = False
        return _encode({"error": f"coordinator overloaded: its event loop is {lag * 1e3:.0f} ms behind "
                                 f"(max_queue_delay_s {self.max_queue_delay_s:g})",
                        "retry_after": 1}, mp, 429, (("Retry-After", "1"),))

    def _bad(self, endpoint: str, exc: BadRequest, mp: bool) -> Reply:
        st = self.coord.stats
        st.bad_requests[endpoint] = st.bad_requests.get(endpoint, 0) + 1
        return _encode(exc.to_body(), mp, 415 if isinstance(exc, wire.UnsupportedMediaType) else 400)


def make_app(coord, *, client_max_size: int = 32 * 1024 * 1024):
    """The API as an aiohttp Application (for embedding in another aiohttp server)."""
    from aiohttp import web

    api = Api(coord)
    app = web.Application(client_max_size=client_max_size)
    handler = aiohttp_handler(api)
    for method, path in api.routes:
        if method == "GET":
            app.router.add_get(path, handler)  # HEAD too
        else:
            app.router.add_route(method, path, handler)
    app["coordinator"] = coord
    return app


def aiohttp_handler(api: Api):
    """An aiohttp request handler (web.Application route or low-level server) for the API."""
    from aiohttp import web

    async def handler(request) -> web.StreamResponse:
        body = await request.read() if request.method == "POST" else b""
        h = request.headers
        r = api.handle(request.method, request.path, h.get("Content-Type"), h.get("Accept"), body)
        headers = {"Content-Type": r.content_type}
        for k, v in r.headers:
            headers[k] = v
        return web.Response(body=r.body, status=r.status, headers=headers)
    return handler
