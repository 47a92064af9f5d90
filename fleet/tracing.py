"""The fleet's spans (`otlp_config`, protocol/tracing.py): one trace per request.

    POST /v1/chat/completions          SERVER  (parent: the client's traceparent, if any)
    ├─ placement                       the coordinator's (or the local) choice of servers, with the
    │                                  route receipt: mode, and per role server, policy, score,
    │                                  matched tokens, load, candidates (JSON)
    ├─ leg context  → worker's span    CLIENT, one per attempt; `traceparent` sent with the leg so
    └─ leg generation → worker's span  the engine continues the trace (our worker does)

The request span ends when the answer is complete (a stream: after its last byte), with the final
mode, the retries and the HTTP status. `Flow.tracing` is None when tracing is off: the request path
then never reaches this module.
"""
from __future__ import annotations

import orjson

from protocol.tracing import make_tracer, parent_context, traceparent_of

from .legs import plan

__all__ = ["FleetTracing", "RequestTrace"]

ROLE_NAMES = ("context", "generation")


class FleetTracing:
    def __init__(self, provider):
        self.provider = provider
        self.tracer = provider.tracer

    @classmethod
    def from_config(cls, config) -> "FleetTracing | None":
        oc = config.otlp_config
        p = make_tracer(oc.otlp_traces_endpoint if oc is not None else None, "splitserve-fleet")
        return None if p is None else cls(p)

    def start(self, request, scope) -> "RequestTrace":
        from opentelemetry.trace import SpanKind
        span = self.tracer.start_span(f"{request.method} {request.path}", kind=SpanKind.SERVER,
                                      context=parent_context(request.headers))
        if span.is_recording():   # not when the sampler (OTEL_TRACES_SAMPLER) dropped the trace
            attrs = {"splitserve.request_id": scope.request_id, "http.request.method": request.method,
                     "url.path": request.path}
            if scope.alias is not None:
                attrs["splitserve.client_request_id"] = scope.alias
            span.set_attributes(attrs)
        return RequestTrace(self.tracer, span)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _route_attributes(attrs: dict, prefix: str, route: dict) -> None:
    """One leg's entry of the route receipt (plan.route_of) as span attributes."""
    for k, v in route.items():
        if isinstance(v, (str, bool, int, float)):
            attrs[f"{prefix}.{k}"] = v
        elif v is not None:      # the candidates' rows, and any other structured value, as JSON
            attrs[f"{prefix}.{k}"] = orjson.dumps(v).decode()


class RequestTrace:
    __slots__ = ("tracer", "root", "legs", "_ctx")

    def __init__(self, tracer, root):
        from opentelemetry.trace import set_span_in_context
        self.tracer = tracer
        self.root = root
        self.legs: dict = {}
        self._ctx = set_span_in_context(root)

    async def placement(self, scope, placing):
        """Await `placing` (the flow's placement) under a `placement` span carrying the receipt."""
        span = self.tracer.start_span("placement", context=self._ctx)
        try:
            ctx, gen = await placing
        except BaseException as e:
            self._fail(span, e)
            span.end()
            raise
        if span.is_recording():
            attrs = {"splitserve.route.mode": scope.mode}
            for role, p in zip(ROLE_NAMES, (ctx, gen)):
                if p is not None:
                    _route_attributes(attrs, f"splitserve.route.{role}",
                                      plan.route_of(p.server, p.policy, p.explanation))
            span.set_attributes(attrs)
        span.end()
        return ctx, gen

    def leg(self, role: str, server: str, attempt: int) -> bytes:
        """Start the span of one leg attempt; the `traceparent` header line to send with it."""
        from opentelemetry.trace import SpanKind, StatusCode
        prev = self.legs.pop(role, None)
        if prev is not None:       # the previous attempt failed and is retried on another server
            prev.set_status(StatusCode.ERROR, "retried on another server")
            prev.end()
        span = self.tracer.start_span(f"leg {role}", kind=SpanKind.CLIENT, context=self._ctx)
        if span.is_recording():
            span.set_attributes({"splitserve.role": role, "server.address": server,
                                 "splitserve.attempt": attempt})
        self.legs[role] = span
        return b"traceparent: %s\r\n" % traceparent_of(span).encode()

    def leg_done(self, role: str) -> None:
        span = self.legs.pop(role, None)
        if span is not None:
            span.end()

    def end(self, scope, error: BaseException | None, status: int | None = None) -> None:
        root = self.root
        if error is not None:
            status = getattr(error, "status", None)
            self._fail(root, error)
        if root.is_recording():
            attrs = {"splitserve.mode": scope.mode}
            if any(scope.attempts.values()):
                attrs["splitserve.retries"] = orjson.dumps(scope.attempts).decode()
            if status is not None:
                attrs["http.response.status_code"] = status
            root.set_attributes(attrs)
        for span in self.legs.values():
            if error is not None:
                self._fail(span, error)
            span.end()
        self.legs.clear()
        root.end()

    @staticmethod
    def _fail(span, e: BaseException) -> None:
        from opentelemetry.trace import StatusCode
        span.set_status(StatusCode.ERROR, getattr(e, "message", None) or type(e).__name__)
