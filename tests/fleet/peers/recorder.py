"""A recording mock engine: answers like a vLLM or SGLang prefill/decode server and records every
request it gets (method, path, the headers that matter, the JSON body) as one JSON line in a file.

Run as a process in front of which a real router (vllm-router, sglang-router) or splitserve's fleet
is started, so the tests compare the exact leg requests each router sends for one client request.
The answers follow the engines' own shapes, cited where they come from:

- vLLM prefill (`kv_transfer_params.do_remote_decode` true): a JSON completion with top-level
  `kv_transfer_params` as NIXL's scheduler returns it (vllm 0.33.0,
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py `request_finished`);
- vLLM decode / SGLang either role: a JSON answer, or SSE when the body says `stream: true`;
- SGLang `/server_info` carries `disaggregation_mode` and `disaggregation_bootstrap_port`, as
  sglang 0.5.23's `server_args.resolved_dict()` does (sglang/srt/utils/common.py
  `build_server_info`); `/abort_request` (sglang/srt/entrypoints/http_server.py) is recorded too.

Usage: python -m tests.fleet.peers.recorder --port P --record FILE --engine vllm|sglang
                                            --role prefill|decode [--bootstrap-port B]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

KEEP_HEADERS = ("x-request-id", "authorization", "content-type", "x-splitserve-role")


def make_app(record: str, engine: str, role: str, bootstrap_port: int | None,
             tokens: int = 3, delay_s: float = 0.0, port: int | None = None) -> web.Application:
    seq = {"n": 0}

    def log(request: web.Request, body, event: str | None = None) -> None:
        if not record:
            return
        rec = {"t": time.time(), "port": port, "event": event, "method": request.method, "path": request.path,
               "query": request.query_string,
               "headers": {k.lower(): v for k, v in request.headers.items() if k.lower() in KEEP_HEADERS},
               "body": body}
        with open(record, "a") as f:
            f.write(json.dumps(rec) + "\n")

    async def gen(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        log(request, body)
        seq["n"] += 1
        chat = request.path.endswith("/chat/completions")
        rid = request.headers.get("X-Request-Id") or f"req-{seq['n']}"
        b = body if isinstance(body, dict) else {}
        out = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()),
               "model": b.get("model") or "mock", "object": "chat.completion" if chat else "text_completion"}
        usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        kv = b.get("kv_transfer_params") if isinstance(b.get("kv_transfer_params"), dict) else None
        if delay_s:
            await asyncio.sleep(delay_s)
        dp = b.get("disaggregated_params") if isinstance(b.get("disaggregated_params"), dict) else None
        if engine == "trtllm" and dp and dp.get("request_type") == "context_only":
            # TensorRT-LLM's context answer (docs/reference/trtllm_disagg.md).
            ch = {"index": 0, "finish_reason": "length", "disaggregated_params": {
                "request_type": "context_only", "ctx_request_id": 42, "first_gen_tokens": [7],
                "encoded_opaque_state": "AAAA", "ctx_info_endpoint": None}}
            ch.update({"message": {"role": "assistant", "content": ""}} if chat else {"text": ""})
            out.update(choices=[ch], usage=usage, prompt_token_ids=list(range(1000, 1008)))
            return web.json_response(out)
        if engine == "vllm" and kv and kv.get("do_remote_decode"):
            # The prefill answer: one token, finish_reason length, the NIXL producer's params.
            ch = {"index": 0, "finish_reason": "length", "logprobs": None}
            ch.update({"message": {"role": "assistant", "content": "a"}} if chat else {"text": "a"})
            out.update(choices=[ch], usage=usage, kv_transfer_params={
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
                "remote_engine_id": f"engine-{port}", "remote_request_id": f"cmpl-{rid}-0",
                "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "dcp_size": 1,
                "pp_size": 1, "remote_num_tokens": 8, "remote_blocks_expiry_time": None,
                "remote_registration_generation": 0, "transfer_mode": "pull"})
            return web.json_response(out)
        # A vLLM decode returns its own params on the final chunk / answer (chat_completion/protocol.py
        # `kv_transfer_params`; set when the connector keeps the decode's blocks for a readback).
        decode_kv = ({"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[9]],
                      "remote_engine_id": f"engine-{port}", "remote_host": "127.0.0.1", "remote_port": 5601}
                     if engine == "vllm" and kv and kv.get("do_remote_prefill") else None)
        mt = b.get("max_tokens") or b.get("max_completion_tokens")
        n = min(tokens, mt) if type(mt) is int and mt > 0 else tokens
        if b.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i in range(n):
                    ch = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
                    ch.update({"delta": {"content": "b"}} if chat else {"text": "b"})
                    chunk = {**out, "object": "chat.completion.chunk" if chat else "text_completion",
                             "choices": [ch]}
                    if i == n - 1 and decode_kv is not None:
                        chunk["kv_transfer_params"] = decode_kv
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    await asyncio.sleep(0.01)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                log(request, None, event="stream_completed")
            except (ConnectionError, asyncio.CancelledError):
                # The router closed this leg's connection: that is how a hang-up reaches the engine.
                log(request, None, event="connection_closed")
                raise
            return resp
        ch = {"index": 0, "finish_reason": "length", "logprobs": None}
        ch.update({"message": {"role": "assistant", "content": "b" * n}} if chat else {"text": "b" * n})
        out.update(choices=[ch], usage={**usage, "completion_tokens": n})
        if decode_kv is not None:
            out["kv_transfer_params"] = decode_kv
        return web.json_response(out)

    async def any_get(request: web.Request) -> web.Response:
        log(request, None)
        p = request.path
        if p in ("/health", "/health_generate", "/liveness", "/readiness", "/ping"):
            return web.Response(text="")
        if p == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "mock", "object": "model",
                                                                  "owned_by": engine}]})
        if p in ("/server_info", "/get_server_info") and engine == "sglang":
            return web.json_response({"model_path": "mock", "served_model_name": "mock", "page_size": 16,
                                      "disaggregation_mode": role,
                                      "disaggregation_bootstrap_port": bootstrap_port or 8998,
                                      "dp_size": 1, "tp_size": 1, "version": "0.5.23"})
        if p in ("/model_info", "/get_model_info"):
            return web.json_response({"model_path": "mock", "served_model_name": "mock",
                                      "is_generation": True})
        return web.json_response({"error": f"no route {p}"}, status=404)

    async def any_post(request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        log(request, body)
        return web.Response(text="")

    app = web.Application()
    for p in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(p, gen)
    app.router.add_get("/{tail:.*}", any_get)
    app.router.add_post("/{tail:.*}", any_post)
    return app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--record", required=True, help="JSON-lines file ('' = record nothing)")
    ap.add_argument("--engine", choices=("vllm", "sglang", "trtllm"), required=True)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--bootstrap-port", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--delay-s", type=float, default=0.0)
    a = ap.parse_args(argv)
    web.run_app(make_app(a.record, a.engine, a.role, a.bootstrap_port, a.tokens, a.delay_s, a.port),
                host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
