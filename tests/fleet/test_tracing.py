"""`otlp_config`: one trace per request from the client's `traceparent` through the fleet's
placement and each leg into both workers, received here as real OTLP/HTTP exports and decoded with
the OpenTelemetry protobuf definitions (`opentelemetry-proto`'s ExportTraceServiceRequest).

The key is TensorRT-LLM's (`OtlpConfig.otlp_traces_endpoint`, tensorrt_llm/llmapi/disagg_utils.py at
commit 0228a71223416496ff056a157936bad2e42c762f); the header is W3C Trace Context's `traceparent`.
"""
from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .conftest import NO_SHEDDING, PY, clean_env, free_port, group, healthy, http, wait_for


class OtlpReceiver:
    """A minimal OTLP/HTTP traces endpoint: every exported span, decoded."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest, ExportTraceServiceResponse)
        self.spans: list[dict] = []
        self.content_types: set[str] = set()
        lock = threading.Lock()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with lock:
                    rx.content_types.add(self.headers.get("Content-Type"))
                    for rs in req.resource_spans:
                        service = {a.key: a.value.string_value for a in rs.resource.attributes
                                   }.get("service.name")
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                rx.spans.append(_span(s, service))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def named(self, name: str) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _span(s, service) -> dict:
    return {"name": s.name, "service": service, "trace_id": s.trace_id.hex(),
            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
            "kind": s.kind, "status": s.status.code,
            "attrs": {a.key: _value(a.value) for a in s.attributes}}


@pytest.fixture
def otlp():
    r = OtlpReceiver()
    yield r
    r.close()


def test_one_trace_from_the_client_through_placement_and_both_legs_into_the_workers(cluster, otlp):
    env = clean_env(OTEL_BSP_SCHEDULE_DELAY="100")
    urls = {}
    for role in ("context", "generation"):
        port = free_port()
        p = cluster.spawn(role, [PY, "-m", "splitserve_cli", "worker", "--role", role, "--engine",
                                 "sim", "--model", "tiny", "--port", str(port), "--device", "cpu",
                                 "--otlp-traces-endpoint", otlp.url], env)
        urls[role] = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(urls[role]), 60, f"{role} worker", p)
    port = free_port()
    cfg = cluster.config(port=port, otlp_config={"otlp_traces_endpoint": otlp.url},
                         context_servers=group([urls["context"]], "kv_cache_aware"),
                         generation_servers=group([urls["generation"]], "kv_cache_aware"),
                         coordinator=NO_SHEDDING)
    fleet = cluster.fleet(cfg, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(base), 60, "fleet", fleet)

    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    st, headers, body = http("POST", base + "/v1/completions",
                             {"model": "tiny", "prompt": "tracing " * 40, "max_tokens": 4},
                             headers={"traceparent": f"00-{client_trace}-{client_span}-01"})
    assert st == 200, body
    route = json.loads(headers["x-splitserve-route"])
    rid = route["id"]

    wait_for(lambda: len(otlp.named("POST /v1/completions")) == 1
             and len(otlp.named("worker /v1/completions")) == 2, 20, "the request's spans exported")
    root = otlp.named("POST /v1/completions")[0]
    (place,) = otlp.named("placement")
    (leg_ctx,) = otlp.named("leg context")
    (leg_gen,) = otlp.named("leg generation")
    workers = {s["attrs"]["splitserve.role"]: s for s in otlp.named("worker /v1/completions")}
    assert otlp.content_types == {"application/x-protobuf"}

    # one trace, the client's, continued by every process
    for s in (root, place, leg_ctx, leg_gen, *workers.values()):
        assert s["trace_id"] == client_trace, s
    assert root["parent"] == client_span
    assert place["parent"] == leg_ctx["parent"] == leg_gen["parent"] == root["span_id"]
    # each worker's span is the child of the leg that reached it (traceparent on the leg)
    assert workers["context"]["parent"] == leg_ctx["span_id"]
    assert workers["generation"]["parent"] == leg_gen["span_id"]
    assert {root["service"], workers["context"]["service"]} == {"splitserve-fleet",
                                                                 "splitserve-worker"}

    # the request id and the route receipt as attributes
    assert root["attrs"]["splitserve.request_id"] == rid
    assert root["attrs"]["splitserve.mode"] == "disaggregated"
    assert root["attrs"]["http.response.status_code"] == 200
    assert workers["context"]["attrs"]["splitserve.request_id"] == str(rid)
    assert workers["context"]["attrs"]["splitserve.request_type"] == "context_only"
    assert workers["generation"]["attrs"]["splitserve.request_type"] == "generation_only"
    a = place["attrs"]
    assert a["splitserve.route.mode"] == "disaggregated"
    assert a["splitserve.route.context.server"] == urls["context"]
    assert a["splitserve.route.generation.server"] == urls["generation"]
    assert a["splitserve.route.context.policy"] == "kv_cache_aware"
    cands = json.loads(a["splitserve.route.context.candidates"])
    assert [c["server"] for c in cands] == [urls["context"]]
    assert "score" in cands[0]
    assert leg_ctx["attrs"]["server.address"] == urls["context"]
    assert leg_gen["attrs"]["splitserve.attempt"] == 0


def test_without_otlp_config_opentelemetry_is_never_loaded():
    """Tracing off costs the request path one `is None` test: no tracer, no OpenTelemetry import
    (checked in a fresh interpreter with the fleet's and the worker's request modules loaded)."""
    import subprocess
    code = ("import sys\n"
            "from coordinator.config import load_config\n"
            "import fleet.flow, fleet.server, worker.server\n"
            "from fleet.tracing import FleetTracing\n"
            "from protocol.tracing import make_tracer\n"
            "assert FleetTracing.from_config(load_config({}, env={})) is None\n"
            "assert make_tracer(None, 'w') is None\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_retried_leg_is_one_span_per_attempt(cluster, otlp):
    """A worker answering 503 is retried on another server: two `leg generation` spans in the
    request's trace, the first ended in error, the second the one the worker continued."""
    from .stand_ins import StatusServer
    busy = StatusServer(503)
    try:
        env = clean_env(OTEL_BSP_SCHEDULE_DELAY="100")
        port = free_port()
        p = cluster.spawn("gen", [PY, "-m", "splitserve_cli", "worker", "--role", "generation",
                                  "--engine", "sim", "--model", "tiny", "--port", str(port),
                                  "--device", "cpu", "--otlp-traces-endpoint", otlp.url], env)
        good = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(good), 60, "generation worker", p)
        fport = free_port()
        cfg = cluster.config(port=fport, otlp_config={"otlp_traces_endpoint": otlp.url},
                             generation_servers=group([busy.url, good]),
                             context_servers={"urls": []}, max_retries=1,
                             fleet={"retry_backoff_s": 0.01}, coordinator=NO_SHEDDING)
        fleet = cluster.fleet(cfg, env=env)
        base = f"http://127.0.0.1:{fport}"
        wait_for(lambda: healthy(base), 60, "fleet", fleet)
        retried = None
        for _ in range(4):          # round robin: one of two requests starts on the busy server
            st, headers, body = http("POST", base + "/v1/completions",
                                     {"model": "tiny", "prompt": "retry me", "max_tokens": 2})
            assert st == 200, body
            route = json.loads(headers["x-splitserve-route"])
            if route.get("retries"):
                retried = route["id"]
                break
        assert retried is not None and busy.hits
        def exported():
            # the fleet's spans and the worker's come from two processes, each on its own schedule
            roots = [s for s in otlp.named("POST /v1/completions")
                     if s["attrs"].get("splitserve.request_id") == retried]
            return roots and any(s["trace_id"] == roots[0]["trace_id"]
                                 for s in otlp.named("worker /v1/completions"))
        wait_for(exported, 20, "the retried request's spans exported (the fleet's and the worker's)")
        (root,) = [s for s in otlp.named("POST /v1/completions")
                   if s["attrs"]["splitserve.request_id"] == retried]
        legs = sorted((s for s in otlp.named("leg generation") if s["trace_id"] == root["trace_id"]),
                      key=lambda s: s["attrs"]["splitserve.attempt"])
        assert [s["attrs"]["server.address"] for s in legs] == [busy.url, good]
        assert legs[0]["status"] == 2 and legs[1]["status"] != 2     # STATUS_CODE_ERROR = 2
        assert root["attrs"]["splitserve.retries"] == json.dumps({"context": 0, "generation": 1},
                                                                 separators=(",", ":"))
        (worker,) = [s for s in otlp.named("worker /v1/completions")
                     if s["trace_id"] == root["trace_id"]]
        assert worker["parent"] == legs[1]["span_id"]
    finally:
        busy.close()
