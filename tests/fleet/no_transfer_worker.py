"""A generation backend without KV transfer, for the fleet's 501 fallback test: it answers
`generation_only` with 501 (as our worker does when it has no transfer agent) and serves aggregated
requests itself. Usage: python no_transfer_worker.py PORT"""
import sys

from aiohttp import web


async def health(request):
    return web.json_response({"status": "ok"})


async def server_info(request):
    return web.json_response({"role": "generation", "model": "tiny", "engine": "stub", "transfer": None})


async def completions(request):
    body = await request.json()
    dp = body.get("disaggregated_params") or {}
    if dp.get("request_type") == "generation_only":
        return web.json_response({"error": {"message": "this worker cannot serve generation_only requests: no KV "
                                            "transfer agent", "type": "not_implemented", "param": None,
                                            "code": None}}, status=501)
    request.app["aggregated"] += 1
    return web.json_response({"id": "cmpl-stub", "object": "text_completion", "created": 1, "model": "tiny",
                              "choices": [{"index": 0, "text": " aggregated", "finish_reason": "length"}],
                              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                                        "prompt_tokens_details": {"cached_tokens": 0}}})


async def stats(request):
    return web.json_response({"aggregated": request.app["aggregated"]})


async def abort(request):
    return web.json_response({"aborted": False})


app = web.Application()
app["aggregated"] = 0
app.router.add_get("/health", health)
app.router.add_get("/server_info", server_info)
app.router.add_get("/stats", stats)
app.router.add_post("/v1/completions", completions)
app.router.add_post("/v1/abort", abort)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
