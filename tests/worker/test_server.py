"""The worker's HTTP API on real sockets: OpenAI shapes (JSON and SSE), errors with `param`, abort by
X-Request-Id, client disconnects, context/generation legs across two workers, metrics, registration."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from tests.worker.conftest import make_sim_engine, metric, start_server, wait_for
from protocol.disagg import decode_opaque_state


@pytest.fixture
async def servers():
    made = []

    async def make(role="both", engine=None, **kw):
        srv, url = await start_server(engine or make_sim_engine(**kw.pop("engine_kw", {})),
                                      role=role, **kw)
        made.append(srv)
        return srv, url

    yield make
    for s in made:
        await s.stop()
        assert s.engine.pool.num_used == 0


async def sse(resp):
    """Parse an SSE body into JSON events, checking the [DONE] terminator."""
    text = (await resp.read()).decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e.strip("\n") for e in text.split("\n\n") if e.strip("\n")]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


async def test_completion_and_chat_shapes_and_cached_tokens(servers, http):
    srv, url = await servers()
    body = {"model": "tiny", "prompt": "The quick brown fox jumps over", "max_tokens": 7,
            "temperature": 0}
    async with http.post(url + "/v1/completions", json=body,
                         headers={"X-Request-Id": "12345"}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == "12345"
        a = await r.json()
    assert a["object"] == "text_completion" and a["id"] == "cmpl-12345" and a["model"] == "tiny"
    ch = a["choices"][0]
    assert ch["finish_reason"] == "length" and len(ch["text"]) == 7 and ch["index"] == 0
    assert a["usage"] == {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    async with http.post(url + "/v1/completions", json=body) as r:
        b = await r.json()
    assert b["choices"][0]["text"] == ch["text"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 28
    # streaming: same text, usage in a last chunk with no choices
    async with http.post(url + "/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        chunks = await sse(r)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ch["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    # prompt as token ids, and top-level prompt_token_ids win over the prompt
    async with http.post(url + "/v1/completions", json={
            "prompt": [256, 65, 66], "prompt_token_ids": [256, 67, 68, 69], "max_tokens": 2}) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == 4
    # chat
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    async with http.post(url + "/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 5, "temperature": 0}) as r:
        c = await r.json()
    assert c["object"] == "chat.completion"
    assert c["choices"][0]["message"]["role"] == "assistant"
    assert len(c["choices"][0]["message"]["content"]) == 5
    async with http.post(url + "/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 5, "temperature": 0, "stream": True}) as r:
        chunks = await sse(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        c["choices"][0]["message"]["content"]
    assert "usage" not in chunks[-1], "no usage chunk unless include_usage"
    # stop string over HTTP
    stop = ch["text"][2:4]
    async with http.post(url + "/v1/completions", json={**body, "stop": [stop]}) as r:
        s = await r.json()
    assert s["choices"][0]["finish_reason"] == "stop" and s["choices"][0]["stop_reason"] == stop
    assert s["choices"][0]["text"] == ch["text"][:ch["text"].index(stop)]


async def test_info_endpoints(servers, http):
    srv, url = await servers(role="context")
    async with http.get(url + "/health") as r:
        assert r.status == 200
    async with http.get(url + "/v1/models") as r:
        m = await r.json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["tiny"]
    async with http.get(url + "/server_info") as r:
        info = await r.json()
    assert set(info) == {"role", "model", "engine", "block_size", "key_scheme", "ns_seed",
                         "worker_id", "start_id", "max_batch_size", "max_num_tokens", "kv_events",
                         "transfer", "disaggregated_params", "disagg_protocol", "attention_backend",
                         "async_scheduling", "kv_capacity_blocks", "routing_model"}
    # what kv_cache_aware's time cost reads (router/policy_kv.py model_of): the sim's own model
    assert set(info["routing_model"]) == {"prefill_s_per_token", "chunk_tokens", "decode_s_per_step",
                                          "decode_s_per_request", "decode_s_per_context_token"}
    assert info["routing_model"]["chunk_tokens"] == info["max_num_tokens"]
    assert info["kv_capacity_blocks"] > 0
    # this process's incarnation: the same id on its KV-event stream (docs/failover.md)
    assert info["start_id"] and info["kv_events"]["epoch"] == info["start_id"]
    assert info["role"] == "context" and info["engine"] == "sim" and info["block_size"] == 4
    assert info["key_scheme"] == "xxh3_chain_v1" and info["ns_seed"] == 0
    assert set(info["kv_events"]) == {"publisher", "replay", "topic", "snapshot", "format",
                                     "epoch", "heartbeat_s"}
    assert info["kv_events"]["publisher"].startswith("tcp://127.0.0.1:")
    assert info["transfer"] is None and info["disaggregated_params"] == {"ctx_info_endpoint": None}
    assert info["disagg_protocol"] == "trtllm"   # fleet/legs/__init__.py `infer` reads it
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    for name in ("num_requests_running", "num_requests_waiting", 'kv_blocks{state="used"}',
                 'kv_blocks{state="free"}', 'kv_blocks{state="cached"}',
                 "prefix_cache_hit_tokens_total", "prefill_tokens_per_second",
                 "decode_tokens_per_second"):
        assert "splitserve_worker_" + name in text, name


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 2000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "disaggregated_params": {"request_type": "both"}}, 400,
     "disaggregated_params.request_type"),
    ("/v1/completions", {"prompt": "x", "disaggregated_params": {
        "request_type": "generation_only", "first_gen_tokens": "a"}}, 400,
     "disaggregated_params.first_gen_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content[0]"),
    ("/v1/abort", {"id": 3}, 400, "request_id"),
    ("/kv_release", {"ctx_request_id": "x"}, 400, "ctx_request_id"),
])
async def test_errors_are_openai_shaped_and_name_the_field(servers, http, path, body, status,
                                                          param):
    srv, url = await servers(engine_kw=dict(num_blocks=64, block_size=16))
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(url + path, **kw) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert srv.engine.pool.num_used == 0


async def test_size_route_and_transfer_errors(servers, http):
    srv, url = await servers(max_body_bytes=1024)
    async with http.post(url + "/v1/completions", json={"prompt": "y" * 5000}) as r:
        assert r.status == 413
        assert "1024" in (await r.json())["error"]["message"]
    async with http.get(url + "/v1/nothing") as r:
        assert r.status == 404 and "error" in await r.json()
    async with http.get(url + "/v1/completions") as r:
        assert r.status == 405 and "error" in await r.json()
    # a worker without a KV connector (a torch worker started without the transfer layer)
    _, url = await servers(engine_kw=dict(kv_connector=None))
    async with http.post(url + "/v1/completions", json={"prompt": "x", "disaggregated_params": {
            "request_type": "generation_only", "ctx_request_id": 7, "first_gen_tokens": [70]}}) as r:
        assert r.status == 501
        err = (await r.json())["error"]
    assert err["type"] == "not_implemented" and "generation_only needs a KV transfer agent" in \
        err["message"]
    ctx_srv, ctx_url = await servers(role="context")
    async with http.post(ctx_url + "/v1/completions", json={"prompt": "x", "disaggregated_params": {
            "request_type": "generation_only", "ctx_request_id": 7, "first_gen_tokens": [70]}}) as r:
        assert r.status == 400


async def test_abort_by_request_id_and_client_disconnects_free_blocks(servers, http):
    srv, url = await servers(engine_kw=dict(decode_us=3000))
    body = {"prompt": "abort me please", "max_tokens": 900, "stream": True}
    async with http.post(url + "/v1/completions", json=body,
                         headers={"X-Request-Id": "777"}) as r:
        assert r.status == 200
        await r.content.readline()  # the first chunk is out: the request is decoding
        assert await metric(http, url, "kv_blocks", {"state": "used"}) > 0
        async with http.post(url + "/v1/abort", json={"request_id": 777}) as a:
            assert await a.json() == {"aborted": True}
        chunks = await sse(r)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    async with http.post(url + "/v1/abort", json={"request_id": "777"}) as a:
        assert await a.json() == {"aborted": False}
    # streaming client goes away
    async with aiohttp.ClientSession() as s2:
        r = await s2.post(url + "/v1/completions", json=body)
        await r.content.readline()
        r.close()
    await wait_for(lambda: srv.engine.stats()["requests_finished"].get("abort") == 2)
    # non-streaming client goes away: the handler is cancelled and the request aborted
    task = asyncio.create_task(http.post(url + "/v1/completions",
                                         json={**body, "stream": False}))
    await wait_for(lambda: srv.engine.stats()["running"] == 1)
    task.cancel()
    await wait_for(lambda: srv.engine.stats()["requests_finished"].get("abort") == 3)
    assert await metric(http, url, "kv_blocks", {"state": "used"}) == 0
    assert await metric(http, url, "num_requests_running") == 0


async def test_context_then_generation_across_two_workers(servers, http):
    ctx, ctx_url = await servers(role="context")
    gen, gen_url = await servers(role="generation")
    _, one_url = await servers()
    prompt = "Disaggregated serving splits prefill and decode."
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    async with http.post(one_url + "/v1/completions", json=body) as r:
        want = (await r.json())["choices"][0]["text"]
    # leg 1, as the fleet sends it
    async with http.post(ctx_url + "/v1/completions", headers={"X-Request-Id": "4242"}, json={
            **body, "stream": False, "disaggregated_params": {
                "request_type": "context_only", "disagg_request_id": 4242,
                "schedule_style": "context_first"}}) as r:
        c = await r.json()
    dp = c["choices"][0]["disaggregated_params"]
    assert c["choices"][0]["finish_reason"] == "length" and c["choices"][0]["text"] == want[:1]
    assert dp["request_type"] == "context_only" and dp["ctx_request_id"] == 4242
    assert dp["disagg_request_id"] == 4242 and dp["schedule_style"] == "context_first"
    assert len(dp["first_gen_tokens"]) == 1 and dp["ctx_info_endpoint"] is None
    assert c["prompt_token_ids"][0] == 256 and len(c["prompt_token_ids"]) == c["usage"][
        "prompt_tokens"]
    state = decode_opaque_state(dp["encoded_opaque_state"])
    assert state.ctx_request_id == 4242 and state.worker_url == ctx_url and state.v == 1
    assert state.num_tokens == len(c["prompt_token_ids"]) and state.block_ids
    assert await metric(http, ctx_url, "num_pinned_transfers") == 1
    # leg 2: the gen worker emits the first token itself; the stream equals the one-leg answer
    gen_dp = {**dp, "request_type": "generation_only"}
    async with http.post(gen_url + "/v1/completions", headers={"X-Request-Id": "4242"}, json={
            **body, "prompt": c["prompt_token_ids"], "stream": True,
            "stream_options": {"include_usage": True}, "disaggregated_params": gen_dp}) as r:
        assert r.status == 200, await r.text()
        chunks = await sse(r)
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == want
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    # the sim "transfer" told the context worker it may free its pinned blocks
    await wait_for(lambda: ctx.engine.pool.num_used == 0, timeout=5)
    assert ctx.engine.counters["pins_released_transferred"] == 1
    # a context leg the fleet gives up on is released by /kv_release or /v1/abort
    for how in ("release", "abort"):
        async with http.post(ctx_url + "/v1/completions", json={
                **body, "disaggregated_params": {"request_type": "context_only",
                                                 "disagg_request_id": 99}}) as r:
            assert r.status == 200
        assert ctx.engine.pool.num_pinned > 0
        if how == "release":
            async with http.post(ctx_url + "/kv_release", json={"ctx_request_id": 99,
                                                                "reason": "cancelled"}) as r:
                assert await r.json() == {"released": True}
        else:
            async with http.post(ctx_url + "/v1/abort", json={"request_id": 99}) as r:
                assert await r.json() == {"aborted": True}
        assert ctx.engine.pool.num_used == 0


async def test_registration_heartbeats_reregistration_and_deregistration(servers, http):
    calls = []
    forget = {"on": False}

    async def handler(request):
        body = await request.json()
        calls.append((request.path, body))
        if request.path == "/heartbeat" and forget["on"]:
            forget["on"] = False
            return web.json_response({"error": "unknown worker"}, status=404)
        return web.json_response({})

    app = web.Application()
    for p in ("/register", "/heartbeat", "/deregister"):
        app.router.add_post(p, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    coord = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        srv, url = await start_server(make_sim_engine(), role="generation",
                                      coordinator_url=coord, register_ttl_s=0.3)
        await wait_for(lambda: sum(p == "/heartbeat" for p, _ in calls) >= 2, timeout=5)
        assert calls[0] == ("/register", {"url": url, "role": "generation", "ttl_s": 0.3,
                                          "worker_id": srv.worker_id})
        forget["on"] = True
        await wait_for(lambda: sum(p == "/register" for p, _ in calls) >= 2, timeout=5)
        await srv.stop()
        assert calls[-1] == ("/deregister", {"url": url, "role": "generation"})
    finally:
        await runner.cleanup()
    # a coordinator that is down does not keep the worker from serving
    srv, url = await start_server(make_sim_engine(), coordinator_url="http://127.0.0.1:9",
                                  register_ttl_s=0.3)
    try:
        await asyncio.sleep(0.4)
        async with http.post(url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}) as r:
            assert r.status == 200
    finally:
        await srv.stop()


async def test_echo_prepends_the_prompt(servers, http):
    srv, url = await servers()
    body = {"prompt": "echo this", "max_tokens": 3, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as r:
        plain = (await r.json())["choices"][0]["text"]
    async with http.post(url + "/v1/completions", json={**body, "echo": True}) as r:
        assert (await r.json())["choices"][0]["text"] == "echo this" + plain
    async with http.post(url + "/v1/completions", json={**body, "echo": True, "stream": True}) as r:
        chunks = await sse(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "echo this" + plain


async def test_return_token_ids_times_every_token(servers, http):
    """`return_token_ids` (vLLM's extension): the JSON answer lists the generated ids, and a stream
    sends one chunk per produced token, even when its text is empty, so clients can time tokens."""
    srv, url = await servers()
    body = {"model": "tiny", "prompt": "token timing", "max_tokens": 9, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as r:
        plain = await r.json()
    assert "token_ids" not in plain["choices"][0]
    async with http.post(url + "/v1/completions", json={**body, "return_token_ids": True}) as r:
        full = await r.json()
    ids = full["choices"][0]["token_ids"]
    assert len(ids) == full["usage"]["completion_tokens"] == 9
    async with http.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "token timing"}],
            "max_tokens": 9, "temperature": 0, "stream": True, "return_token_ids": True}) as r:
        events = await sse(r)
    per_chunk = [e["choices"][0]["token_ids"] for e in events[1:]]  # [0] is the role chunk
    assert sum(len(t) for t in per_chunk) == 9
    assert all(len(t) >= 1 for t in per_chunk[:-1])
    async with http.post(url + "/v1/completions", json={
            **body, "stream": True, "return_token_ids": True}) as r:
        streamed = [i for e in await sse(r) for i in e["choices"][0]["token_ids"]]
    assert streamed == ids
