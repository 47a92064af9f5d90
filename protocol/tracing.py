"""OpenTelemetry tracing shared by the fleet and our worker: one tracer per process exporting over
OTLP/HTTP (protobuf) to `otlp_config.otlp_traces_endpoint`, and the W3C `traceparent` header that
carries a trace from the fleet to each engine (and from a client into the fleet).

`otlp_config` is TensorRT-LLM's key with upstream's shape (`OtlpConfig(otlp_traces_endpoint:
Optional[str] = None)` in tensorrt_llm/llmapi/disagg_utils.py at commit
0228a71223416496ff056a157936bad2e42c762f); upstream's exporter (tensorrt_llm/llmapi/tracing.py,
`get_span_exporter`) picks the protocol from `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, default `grpc`.
Here only `http/protobuf` is shipped, and it is the default: a `grpc` setting is refused at start
rather than silently exporting nothing.

Nothing here is imported unless tracing is configured: a process without `otlp_config` never loads
OpenTelemetry, and its request path only tests one attribute against None.
"""
from __future__ import annotations

import os
from typing import Mapping

__all__ = ["make_tracer", "parent_context", "traceparent_of", "TRACEPARENT"]

TRACEPARENT = "traceparent"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


class _Provider:
    """The process's provider and tracer; `shutdown()` flushes what is still batched."""

    def __init__(self, endpoint: str, service_name: str, export_delay_ms: int | None):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        proto = os.environ.get(PROTOCOL_ENV, "http/protobuf")
        if proto != "http/protobuf":
            raise ValueError(f"{PROTOCOL_ENV}: expected 'http/protobuf' (the OTLP exporter "
                             f"splitserve ships), found {proto!r}")
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        kw = {} if export_delay_ms is None else {"schedule_delay_millis": export_delay_ms}
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                            **kw))
        self.tracer = self.provider.get_tracer("splitserve")

    def shutdown(self) -> None:
        self.provider.shutdown()


def make_tracer(endpoint: str | None, service_name: str, *,
                export_delay_ms: int | None = None) -> _Provider | None:
    """The process's tracer provider for `endpoint` (None: tracing off, nothing loaded).
    `export_delay_ms` shortens the batch period (default: the SDK's, 5 s)."""
    if not endpoint:
        return None
    return _Provider(endpoint, service_name, export_delay_ms)


def parent_context(headers: Mapping[str, str]):
    """The remote span a request's `traceparent` names (None without a valid one)."""
    tp = headers.get(TRACEPARENT)
    if not tp:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract({TRACEPARENT: tp}) or None


def traceparent_of(span) -> str:
    """The W3C `traceparent` value naming `span` as the parent (version 00, sampled flag)."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
