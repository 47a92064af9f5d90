"""The fleet's leg planning, relay transforms and request scope, without processes: the bodies each
leg gets in every mode (aggregated, context + generation, generation_first, local prefill,
fallback), the route receipt, the SSE/JSON cleaning, and what leaving a request's scope ends. The
same flows end to end, through real workers: test_flow.py, test_disconnect.py,
test_hangup_leases.py, test_engine_protocols.py."""
from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from protocol.openai import ApiError
from fleet.legs import plan
from fleet.legs import trtllm as trt
from fleet.placement import CTX, GEN, Placement
from fleet.relay import clean_json, replay_events, stream_usage, worker_error
from fleet.scope import RequestScope
from worker.openai_api import parse_chat, parse_completion

CLIENT = {"model": "m", "prompt": "hi there", "max_tokens": 9, "stream": True, "temperature": 0}
RID = 1 << 41


def ctx_answer(finish="length", ids=b"[1,2,3]", dp=None, usage=None) -> trt.ContextAnswer:
    raw = orjson.dumps({"choices": [{"index": 0, "finish_reason": finish, "disaggregated_params":
                                     dp if dp is not None else {"ctx_request_id": RID, "encoded_opaque_state": "x"}}],
                        "usage": usage})
    raw = raw[:-1] + b',"prompt_token_ids":' + ids + b"}"
    return trt.decode_context_answer(raw)


# --------------------------------------------------------------------------- bodies per mode

def test_aggregated_body_is_the_clients_and_asks_a_stream_for_usage():
    b = plan.answer_body(CLIENT, stream=True, include_usage=False)
    assert b["stream_options"] == {"include_usage": True} and "disaggregated_params" not in b
    assert "stream_options" not in CLIENT                      # the client's body is not touched
    assert plan.answer_body({**CLIENT, "stream": False}, False, False) == {**CLIENT, "stream": False}
    signed = plan.with_params(b, {"request_type": "context_only", "disagg_request_id": 5})
    assert signed["disaggregated_params"] == {"request_type": "context_only", "disagg_request_id": 5}


def test_context_leg_body():
    b, dp = trt.context_body({**CLIENT, "stream_options": {"include_usage": True}}, RID, "context_first")
    assert b["stream"] is False and b["stream_options"] is None and b["prompt"] == "hi there"
    assert dp == {"request_type": "context_only", "disagg_request_id": RID, "schedule_style": "context_first"}
    assert b["disaggregated_params"] is dp


@pytest.mark.parametrize("chat", [False, True])
def test_generation_leg_relays_the_context_answers_params_and_token_ids(chat):
    ans = ctx_answer(ids=b"[ 7, 8,9 ]", usage={"prompt_tokens": 3})
    base = plan.answer_body({**CLIENT, "messages": [{"role": "user", "content": "hi"}]} if chat else CLIENT,
                            True, False)
    b, dp = trt.generation_body(base, chat, ans, RID, "context_first")
    assert dp == {"ctx_request_id": RID, "encoded_opaque_state": "x", "request_type": "generation_only",
                  "disagg_request_id": RID, "schedule_style": "context_first", "ctx_usage": {"prompt_tokens": 3}}
    wire = orjson.dumps(b)
    # the context worker's bytes, as it wrote them (never re-parsed)
    assert (b'"prompt_token_ids":[ 7, 8,9 ]' if chat else b'"prompt":[ 7, 8,9 ]') in wire
    assert "disaggregated_params" not in base
    # and the worker reads that leg as a generation_only request of those tokens
    obj = json.loads(wire)
    parse = parse_chat if chat else parse_completion
    req = parse(obj, None, max_model_len=64)
    assert req.request_type == "generation_only" and req.prompt_token_ids == [7, 8, 9]


def test_generation_leg_without_token_ids_keeps_the_clients_prompt():
    b, _ = trt.generation_body(CLIENT, False, ctx_answer(ids=b"null"), RID, "context_first")
    assert b["prompt"] == "hi there"


def test_generation_first_body_names_the_context_request():
    ep = trt.ctx_info_endpoint({"disaggregated_params": {"ctx_info_endpoint": "tcp://10.0.0.1:5000"}})
    b, dp = trt.generation_first_body(CLIENT, RID, ep)
    assert dp == {"request_type": "generation_only", "ctx_request_id": RID, "disagg_request_id": RID,
                  "ctx_info_endpoint": "tcp://10.0.0.1:5000", "schedule_style": "generation_first"}
    assert trt.ctx_info_endpoint({}) is None and trt.ctx_info_endpoint(None) is None


@pytest.mark.parametrize("finish, more", [("length", True), ("not_finished", True), ("stop", False)])
def test_context_answer_decides_whether_a_generation_leg_runs(finish, more):
    assert trt.needs_generation(ctx_answer(finish)) is more


def test_bad_context_answers_are_typed():
    with pytest.raises(trt.BadContextAnswer) as e:
        trt.decode_context_answer(b"<html>")
    assert e.value.malformed
    with pytest.raises(trt.BadContextAnswer, match="no choices") as e:
        trt.decode_context_answer(b'{"choices": []}')
    assert not e.value.malformed
    with pytest.raises(trt.BadContextAnswer, match="ctx_request_id"):
        trt.check_generation_params(ctx_answer(dp={}))
    trt.check_generation_params(ctx_answer("stop", dp={}))     # a finished request needs none


def test_vllm_mode_after_the_prefill_answer():
    from fleet.legs import vllm
    assert vllm.mode_of({"do_remote_prefill": True, "remote_engine_id": "e"}) == plan.DISAGGREGATED
    # no KV connector on the prefill server (no params, or params without a remote prefill)
    assert vllm.mode_of(None) == plan.NO_KV_TRANSFER
    assert vllm.mode_of({"do_remote_prefill": False}) == plan.NO_KV_TRANSFER


def test_context_unreachable():
    # only a context leg that reached no server may be served aggregated (router/pairing.py decides
    # whether it is: tests/router/test_pairing.py)
    assert plan.context_unreachable(502, "upstream_unavailable")
    assert plan.context_unreachable(503, "upstream_unavailable")
    assert not plan.context_unreachable(502, "upstream_error")
    assert not plan.context_unreachable(504, "upstream_unavailable")


# --------------------------------------------------------------------------- route receipt

EXPL = {"matched_tokens": 64, "score": 0.5, "ignored": 1,
        "candidates": [{"server": f"s{i}", "score": i, "extra": 0} for i in range(6)]}


@pytest.mark.parametrize("mode", [plan.AGGREGATED, plan.DISAGGREGATED, plan.LOCAL_PREFILL,
                                  plan.AGGREGATED_FALLBACK, plan.NO_KV_TRANSFER])
def test_route_header_per_mode(mode):
    route = plan.route_start(RID, mode, alias=7)
    if mode == plan.DISAGGREGATED:
        route["context"] = plan.route_of("http://c:1", "kv_cache_aware", EXPL)
    gen = plan.route_of("http://g:1", "kv_cache_aware", EXPL)
    h = json.loads(plan.route_header(route, request_id=RID, alias=7, mode=mode, generation=gen,
                                     attempts={CTX: 0, GEN: 0}))
    assert h["id"] == RID and h["mode"] == mode and h["client_request_id"] == 7 and "retries" not in h
    assert h["generation"] == {"server": "http://g:1", "policy": "kv_cache_aware", "matched_tokens": 64,
                               "score": 0.5, "candidates": [{"server": f"s{i}", "score": i} for i in range(4)]}
    assert ("context" in h) is (mode == plan.DISAGGREGATED)
    assert "generation" not in route                       # the flow's route is not modified


def test_route_header_retries_context_only_and_protocol():
    h = json.loads(plan.route_header({}, request_id=RID, alias=None, mode=plan.AGGREGATED,
                                     generation=plan.route_of("g", "round_robin", {}), attempts={CTX: 0, GEN: 2}))
    assert h == {"id": RID, "mode": "aggregated", "generation": {"server": "g", "policy": "round_robin"},
                 "retries": {"context": 0, "generation": 2}}
    route = {**plan.route_start(RID, plan.DISAGGREGATED, None, "sglang"), "bootstrap_room": 5}
    h = json.loads(plan.route_header(route, request_id=RID, alias=None, mode=plan.CONTEXT_ONLY))
    assert h == {"id": RID, "mode": "context_only", "protocol": "sglang", "bootstrap_room": 5}


# --------------------------------------------------------------------------- relay transforms

def test_clean_json_drops_internal_fields_and_returns_usage():
    usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}
    raw = orjson.dumps({"id": "x", "prompt_token_ids": [1], "kv_transfer_params": {"a": 1}, "usage": usage,
                        "choices": [{"text": "t", "disaggregated_params": {"ctx_request_id": 1}}]})
    out, u = clean_json(raw)
    assert orjson.loads(out) == {"id": "x", "usage": usage, "choices": [{"text": "t"}]} and u == usage
    plain = b'{"id":"y","usage":{"prompt_tokens":2}}'
    assert clean_json(plain) == (plain, {"prompt_tokens": 2})     # unchanged bytes
    assert clean_json(b"not json")[1] is None


def test_stream_usage_is_recorded_and_dropped_when_not_asked_for():
    ev = (b'data: {"choices":[{"text":"a"}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n')
    kept, usages = stream_usage(ev, drop=True)
    assert kept == b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n' and usages == [{"prompt_tokens": 3}]
    assert stream_usage(ev, drop=False) == (ev, [{"prompt_tokens": 3}])


@pytest.mark.parametrize("chat", [False, True])
def test_replayed_answer_is_a_stream_of_it(chat):
    ch = ({"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"} if chat
          else {"index": 0, "text": "Hi", "finish_reason": "stop"})
    obj = {"id": "c1", "created": 1, "model": "m", "choices": [ch], "usage": {"prompt_tokens": 1}}
    evs = replay_events(obj, chat, include_usage=True)
    assert evs[-1] == b"data: [DONE]\n\n" and len(evs) == 3
    first = orjson.loads(evs[0][6:])
    assert first["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert (first["choices"][0]["delta"]["content"] if chat else first["choices"][0]["text"]) == "Hi"
    assert orjson.loads(evs[1][6:])["usage"] == {"prompt_tokens": 1}
    assert len(replay_events(obj, chat, include_usage=False)) == 2


def test_worker_errors_relayed():
    e = worker_error(GEN, "g", 400, b'{"error":{"message":"bad n","param":"n","code":"c","type":"t"}}')
    assert (e.status, e.message, e.param, e.code, e.type) == (400, "bad n", "n", "c", "t")
    e = worker_error(CTX, "c", 500, b"boom")
    assert e.status == 502 and "context server c answered 500: boom" in e.message


# --------------------------------------------------------------------------- request scope

class _Placer:
    """Records what the scope ends (the scope is under test, not the coordinator)."""

    def __init__(self):
        self.finished, self.tracked = [], {}

    def track(self, p, d):
        self.tracked[p.server] = self.tracked.get(p.server, 0) + d

    def finish(self, p, success):
        if not p.finished:
            p.finished = True
            self.finished.append((p.role, p.server, success))


class _Resp:
    aborted = False

    def abort(self):
        self.aborted = True


class _Flow:
    def __init__(self):
        self.placer, self.aliases, self.aborts, self._n = _Placer(), set(), [], RID
        self.ids = self
        self.tasks = []

    def next_id(self):
        self._n += 1
        return self._n

    def spawn(self, coro):
        self.tasks.append(asyncio.ensure_future(coro))

    async def post_abort(self, role, server, rid, count=True):
        self.aborts.append((role, server, rid))


def _p(role, server):
    return Placement(role, server, RID, True, "kv_cache_aware")


async def test_hang_up_inside_the_scope_ends_every_lease_and_leg():
    flow = _Flow()
    started = asyncio.Event()
    resp = _Resp()

    async def handler():
        async with RequestScope(flow, 0.0, alias=9) as s:
            ctx, gen = _p(CTX, "c"), _p(GEN, "g")
            s.hold(ctx)
            s.hold(gen)
            s.sent(CTX, "c")
            s.sent(GEN, "g")
            s.sent(GEN, "g")              # a second attempt on one server: one abort
            s.opened(resp)
            gen.failed = True
            started.set()
            await asyncio.sleep(10)       # the client hangs up here

    t = asyncio.ensure_future(handler())
    await started.wait()
    assert flow.aliases == {9}
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await asyncio.gather(*flow.tasks)
    assert flow.placer.finished == [(CTX, "c", True), (GEN, "g", False)]   # success=false: the server failed
    assert flow.placer.tracked == {"c": 0, "g": 0} and resp.aborted
    assert sorted(flow.aborts) == [(CTX, "c", RID + 1), (GEN, "g", RID + 1)]
    assert flow.aliases == set()


async def test_completed_request_aborts_nothing_and_released_leases_end_once():
    flow = _Flow()
    async with RequestScope(flow, 0.0) as s:
        ctx, gen = _p(CTX, "c"), _p(GEN, "g")
        s.hold(ctx)
        s.hold(gen)
        s.sent(CTX, "c")
        s.release(ctx, True)      # e.g. the generation server cannot receive KV: the context lease is unused
        assert flow.placer.tracked == {"c": 0, "g": 1}
        s.settled()
    assert flow.placer.finished == [(CTX, "c", True), (GEN, "g", True)] and not flow.tasks


async def test_a_failed_stream_or_an_error_aborts():
    flow = _Flow()
    with pytest.raises(ApiError):
        async with RequestScope(flow, 0.0) as s:
            s.hold(_p(GEN, "g"))
            s.sent(GEN, "g")
            raise ApiError(400, "bad")
    async with RequestScope(flow, 0.0) as s:
        s.sent(GEN, "g2")
        s.failed = True           # error event after the stream's headers went out
    await asyncio.gather(*flow.tasks)
    assert [a[1] for a in flow.aborts] == ["g", "g2"]


async def test_duplicate_alias_in_flight_is_409():
    flow = _Flow()
    async with RequestScope(flow, 0.0, alias=3):
        with pytest.raises(ApiError) as e:
            async with RequestScope(flow, 0.0, alias=3):
                pass
        assert e.value.status == 409 and e.value.code == "duplicate_request_id"
    async with RequestScope(flow, 0.0, alias=3):     # free again once the first ended
        pass


def test_generation_leg_strips_the_chat_history_when_asked():
    """gen_strip_message_history (upstream's key): with the prompt as token ids, only the last
    message goes on the generation leg."""
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    base = plan.answer_body({**CLIENT, "messages": msgs}, False, False)
    b, _ = trt.generation_body(base, True, ctx_answer(ids=b"[1,2]"), RID, "context_first", True)
    assert b["messages"] == msgs[-1:] and base["messages"] == msgs
    b, _ = trt.generation_body(base, True, ctx_answer(ids=b"[1,2]"), RID, "context_first")
    assert b["messages"] == msgs
    # no ids to read: the worker needs the whole conversation
    b, _ = trt.generation_body(base, True, ctx_answer(ids=b"null"), RID, "context_first", True)
    assert b["messages"] == msgs
