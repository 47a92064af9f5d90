"""The answering leg relayed to the client, and the accounting that rides on it.

- JSON: read to its end, internal fields dropped (`prompt_token_ids`, `disaggregated_params`,
  vLLM's `kv_transfer_params`), usage recorded;
- SSE: upstream chunks cut at event boundaries and written as they arrive; `kv_transfer_params`
  stripped; the usage-only chunk recorded and dropped when the client did not ask for usage (the
  leg always asks for it: fleet/legs/plan.py `answer_body`); the lease renewed on long streams; a
  failure after the headers went out ends the stream with an error event and `[DONE]`;
- a streaming request whose context leg already finished gets that answer replayed as SSE chunks;
- usage: each leg's `prompt_tokens`/`cached_tokens` is kept on its placement (the `/finish` report
  against the coordinator's prediction) and counted per role and server; a generation leg whose KV
  arrived by transfer (`plan.kv_transferred`) reports nothing against the prediction, and the
  client's `cached_tokens` are then the context leg's.

The pure event/body transforms are module functions (unit-tested in tests/fleet/test_plan.py);
`Relay` is the shell that reads upstream responses and writes the client's.
"""
from __future__ import annotations

import asyncio
import time

import msgspec
import orjson
from . import metrics as M
from protocol.openai import ApiError
from .legs.plan import CHAT, kv_transferred
from .placement import CTX, GEN, Placement
from .http_messages import FleetRequest, FleetStream, Reply
from .upstream import Response, UpstreamError, UpstreamTimeout

ROUTE_HEADER = "x-splitserve-route"
JSON_TYPE = {"Content-Type": "application/json"}


def answer_headers(base: dict, scope, route: str | None) -> dict:
    """An answer's headers: `base`, the request's X-Request-Id and, unless `fleet.route_header` is
    off (`route` None), the route receipt."""
    h = {**base, "X-Request-Id": scope.x_request_id}
    if route is not None:
        h[ROUTE_HEADER] = route
    return h
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_INTERNAL = ("prompt_token_ids", "prompt_token_ids_b64", "kv_transfer_params")


class _UsageOnly(msgspec.Struct):
    usage: dict | None = None


_usage_decoder = msgspec.json.Decoder(_UsageOnly)


# --------------------------------------------------------------------------- pure transforms

def cached_tokens(usage: dict | None) -> tuple[int, int] | None:
    """(prompt_tokens, cached_tokens) of an OpenAI usage object, or None when there is none."""
    if not isinstance(usage, dict):
        return None
    d = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int((d.get("cached_tokens") if isinstance(d, dict) else 0) or 0)


def decode_usage(data: bytes) -> dict | None:
    """The `usage` of a JSON answer (None when absent); msgspec.DecodeError when it is not one."""
    return _usage_decoder.decode(data).usage


def usage_of(data: bytes) -> dict | None:
    """The `usage` of a JSON answer (None when absent or the bytes are not JSON)."""
    try:
        return _usage_decoder.decode(data).usage
    except msgspec.DecodeError:
        return None


def clean_answer(obj: dict) -> dict:
    """A worker's JSON answer without the fields that are internal to the fleet (in place)."""
    for k in _INTERNAL:
        obj.pop(k, None)
    for c in obj.get("choices") or ():
        if isinstance(c, dict):
            c.pop("disaggregated_params", None)
    return obj


def clean_json(data: bytes) -> tuple[bytes, dict | None]:
    """(the JSON answer for the client, its usage). Bytes without internal fields pass unchanged."""
    if b"disaggregated_params" not in data and b"prompt_token_ids" not in data \
            and b"kv_transfer_params" not in data:
        return data, usage_of(data)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data, None
    if not isinstance(obj, dict):
        return orjson.dumps(obj), None
    usage = obj.get("usage")
    return orjson.dumps(clean_answer(obj)), usage


def strip_stream_kv(events: bytes) -> bytes:
    """SSE events without `kv_transfer_params` (vLLM puts the decode side's KV handle on a stream's
    final chunk; it is internal, like `disaggregated_params`)."""
    out = []
    for ev in events.split(b"\n\n"):
        if not ev:
            continue
        if ev.startswith(b"data: {") and b'"kv_transfer_params"' in ev:
            try:
                obj = orjson.loads(ev[6:])
            except orjson.JSONDecodeError:
                out.append(ev)
                continue
            if isinstance(obj, dict):
                obj.pop("kv_transfer_params", None)
                ev = b"data: " + orjson.dumps(obj)
        out.append(ev)
    return b"".join(e + b"\n\n" for e in out)


def with_cached(obj: dict, cached: int) -> bool:
    """Set `usage.prompt_tokens_details.cached_tokens` of an answer or chunk `obj` (in place);
    False when it carries no usage object or already says `cached`."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return False
    d = u.get("prompt_tokens_details")
    if not isinstance(d, dict):
        d = u["prompt_tokens_details"] = {}
    if d.get("cached_tokens") == cached:
        return False
    d["cached_tokens"] = cached
    return True


def json_with_cached(data: bytes, cached: int) -> bytes:
    """A JSON answer whose usage reports `cached` cached prompt tokens (unchanged if it does)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    return orjson.dumps(obj) if isinstance(obj, dict) and with_cached(obj, cached) else data


def stream_usage(events: bytes, drop: bool, cached: int | None = None) -> tuple[bytes, list[dict]]:
    """(the events to relay, the usage objects they carried, as the worker sent them); with `drop`,
    the usage-only chunk (`"choices": []`) is left out; with `cached`, the relayed usage reports
    that many cached prompt tokens."""
    keep, usages = [], []
    for ev in events.split(b"\n\n"):
        if not ev:
            continue
        if ev.startswith(b"data: {") and (b'"usage":{' in ev or b'"usage": {' in ev):
            u = usage_of(ev[6:])
            if u:
                usages.append(u)
                if drop and (b'"choices":[]' in ev or b'"choices": []' in ev):
                    continue
                if cached is not None:
                    ev = b"data: " + json_with_cached(ev[6:], cached)
        keep.append(ev)
    return b"".join(e + b"\n\n" for e in keep), usages


def replay_events(obj: dict, chat: bool, include_usage: bool) -> list[bytes]:
    """A complete (cleaned) answer as the SSE events a stream of it would have had."""
    base = {"id": obj.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": obj.get("created"), "model": obj.get("model")}
    out = []
    for c in obj.get("choices") or ():
        if chat:
            msg = c.get("message") or {}
            delta = {"role": msg.get("role", "assistant"), "content": msg.get("content") or ""}
            ch = {"index": c.get("index", 0), "delta": delta, "finish_reason": c.get("finish_reason")}
        else:
            ch = {"index": c.get("index", 0), "text": c.get("text") or "", "logprobs": c.get("logprobs"),
                  "finish_reason": c.get("finish_reason")}
        out.append(b"data: " + orjson.dumps({**base, "choices": [ch]}) + b"\n\n")
    if include_usage and obj.get("usage") is not None:
        out.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": obj["usage"]}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def worker_error(role: str, server: str, status: int, data: bytes) -> ApiError:
    """A worker's error answer as the client's: a 4xx relayed with its message, param, code and
    type; anything else a 502 naming the server."""
    msg, param, code, typ = None, None, None, None
    try:
        obj = orjson.loads(data)
        e = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(e, dict):
            msg, param, code, typ = e.get("message"), e.get("param"), e.get("code"), e.get("type")
        elif isinstance(e, str):
            msg = e
        elif isinstance(obj, dict) and isinstance(obj.get("message"), str):
            msg = obj["message"]
    except orjson.JSONDecodeError:
        msg = data[:300].decode("utf-8", "replace")
    if 400 <= status < 500:
        return ApiError(status, msg or f"{role} server rejected the request ({status})", param=param,
                        code=code, type_=typ)
    return ApiError(502, f"{role} server {server} answered {status}: {msg or 'no detail'}", code="upstream_error")


class ReplayStream:
    """A complete answer replayed as SSE chunks (a streaming request the context leg finished);
    sent by the handler once the flow returns it."""

    def __init__(self, obj: dict, chat: bool, include_usage: bool, headers: dict):
        self.obj, self.chat, self.include_usage, self.headers = obj, chat, include_usage, headers

    async def send(self, request: FleetRequest) -> FleetStream:
        out = FleetStream(status=200, headers=self.headers)
        await out.prepare(request)
        for ev in replay_events(self.obj, self.chat, self.include_usage):
            await out.write(ev)
        await out.write_eof()
        return out


# --------------------------------------------------------------------------- the shell

class Relay:
    def __init__(self, placer, timeout: float, renew_every: float):
        self.placer = placer
        self.timeout = timeout
        self.renew_every = renew_every
        self.leg_latency = {r: M.LEG_LATENCY.labels(r) for r in (CTX, GEN)}
        self._m_tokens: dict = {}
        self._m_latency: dict = {}

    def _latency(self, mode: str) -> tuple:
        """(TTFT, E2E) histograms of a placement mode."""
        m = self._m_latency.get(mode)
        if m is None:
            m = self._m_latency[mode] = (M.TTFT.labels(mode), M.E2E.labels(mode))
        return m

    # ------------------------------------------------------------------ usage
    def observe_context(self, scope, ctx: Placement, usage: dict | None) -> None:
        """The context leg's usage: counted, and kept for the client's answer (`kv_transferred`)."""
        self.observe_usage(CTX, ctx, usage)
        scope.context_usage = ctx.usage

    def observe_usage(self, role: str, p: Placement, usage: dict | None, transferred: bool = False) -> None:
        """Count a leg's usage; keep it on `p` for the `/finish` report, unless the leg received its
        KV by transfer (`plan.kv_transferred`): then its cached tokens say nothing about routing."""
        ct = cached_tokens(usage)
        if ct is None:
            return
        prompt, cached = ct
        if transferred:
            if prompt:
                M.PROMPT_TOKENS.labels(role, p.server).inc(prompt)
            return
        p.usage = (prompt, cached)
        k = (role, p.server)
        m = self._m_tokens.get(k)
        if m is None:
            m = self._m_tokens[k] = (M.PROMPT_TOKENS.labels(role, p.server), M.CACHED_TOKENS.labels(role, p.server),
                                     M.PREDICTED_TOKENS.labels(role, p.server))
        # an inc(0) writes the value it leaves (two mmap writes a leg when nothing is cached)
        if prompt:
            m[0].inc(prompt)
        if cached:
            m[1].inc(cached)
        if p.lease:
            predicted = p.predicted_tokens
            if predicted:
                m[2].inc(predicted)

    # ------------------------------------------------------------------ reading a leg
    async def read(self, resp: Response, scope, role: str, p: Placement) -> bytes:
        """A leg's whole body; a timeout or a broken connection is the client's 504/502."""
        try:
            data = await resp.read()
        except UpstreamTimeout:
            resp.abort()
            p.failed = True
            raise ApiError(504, f"{role} server {p.server} did not finish within {self.timeout:g}s",
                           code="upstream_timeout") from None
        except UpstreamError as e:
            resp.abort()
            p.failed = True
            self.placer.report_failure(role, p.server)
            raise ApiError(502, f"{role} server {p.server} failed mid-response: {e.detail}",
                           code="upstream_error") from None
        resp.release()
        scope.closed(resp)
        return data

    # ------------------------------------------------------------------ answers
    def context_answer(self, creq, scope, raw: bytes, route: str | None):
        """The context leg already finished the request (e.g. EOS on the first token)."""
        obj = clean_answer(orjson.loads(raw))
        scope.settled()
        now = time.perf_counter()
        M.TTFT.labels(scope.mode).observe(now - scope.t0)
        M.E2E.labels(scope.mode).observe(now - scope.t0)
        if not creq.stream:
            return Reply(200, orjson.dumps(obj), answer_headers(JSON_TYPE, scope, route))
        return ReplayStream(obj, creq.kind == CHAT, creq.include_usage, answer_headers(SSE_HEADERS, scope, route))

    async def answer(self, request: FleetRequest, creq, scope, gen: Placement, resp: Response,
                     route: str | None):
        """Relay the answering leg `resp` (status < 400, headers read) to the client."""
        # from when the leg was sent, as the context leg's: its headers (for a JSON answer, the
        # whole decode) are already behind us here
        t_leg = scope.gen_sent_at or time.perf_counter()
        transferred = kv_transferred(scope.mode)
        # the prefix was reused (or not) on the context server: the client is told that
        cached = scope.context_usage[1] if transferred and scope.context_usage is not None else None
        if not creq.stream or not resp.content_type.startswith("text/event-stream"):
            data = await self.read(resp, scope, GEN, gen)
            self.leg_latency[GEN].observe(time.perf_counter() - t_leg)
            data, usage = clean_json(data)
            self.observe_usage(GEN, gen, usage, transferred)
            if cached is not None and usage is not None:
                data = json_with_cached(data, cached)
            ttft, e2e = self._latency(scope.mode)
            took = time.perf_counter() - scope.t0
            ttft.observe(took)
            e2e.observe(took)
            scope.settled()
            return Reply(200, data, answer_headers(JSON_TYPE, scope, route))
        out = FleetStream(status=200, headers=answer_headers(SSE_HEADERS, scope, route))
        await out.prepare(request)
        scope.bytes_sent = True
        if await self._stream(out, creq, scope, gen, resp, transferred, cached):
            resp.release()
            scope.closed(resp)
            scope.settled()
            self.leg_latency[GEN].observe(time.perf_counter() - t_leg)
            await out.write_eof()
            M.E2E.labels(scope.mode).observe(time.perf_counter() - scope.t0)
        return out

    async def _stream(self, out: FleetStream, creq, scope, gen: Placement, resp: Response,
                      transferred: bool, cached: int | None) -> bool:
        """Copy the SSE events; False when the leg failed mid-stream (the error event was sent)."""
        buf = b""
        last = None
        first = True
        itl = M.ITL
        drop = not creq.include_usage
        placer = self.placer
        try:
            async for chunk in resp.iter_chunks():
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                events, buf = buf[:cut + 2], buf[cut + 2:]
                if b'"kv_transfer_params":{' in events or b'"kv_transfer_params": {' in events:
                    events = strip_stream_kv(events)
                if b'"usage":{' in events or b'"usage": {' in events:
                    events, usages = stream_usage(events, drop, cached)
                    for u in usages:
                        self.observe_usage(GEN, gen, u, transferred)
                    if not events:
                        continue
                await out.write(events)
                now = time.perf_counter()
                if first:
                    M.TTFT.labels(scope.mode).observe(now - scope.t0)
                    placer.first_token(gen)
                    first = False
                elif last is not None:
                    itl.observe(now - last)
                last = now
                if placer.renew_due(gen, self.renew_every):
                    placer.renew(gen)
        except UpstreamTimeout:
            resp.abort()
            gen.failed = True
            M.LEG_ERRORS.labels(GEN, "timeout").inc()
            await _stream_error(out, scope, ApiError(504, f"generation stream exceeded request_timeout "
                                                   f"({self.timeout:g}s)", code="upstream_timeout"))
            scope.failed = True
            return False
        except UpstreamError as e:
            resp.abort()
            gen.failed = True
            placer.report_failure(GEN, gen.server)
            M.LEG_ERRORS.labels(GEN, "disconnect").inc()
            await _stream_error(out, scope, ApiError(502, f"generation server {gen.server} failed mid-stream: "
                                                   f"{e.detail}", code="upstream_error"))
            scope.failed = True
            return False
        except ConnectionError:
            # The client is gone (a write failed before aiohttp cancelled the handler).
            raise asyncio.CancelledError() from None
        if buf:
            await out.write(buf)
        return True


async def _stream_error(out: FleetStream, scope, err: ApiError) -> None:
    err.request_id = scope.x_request_id
    try:
        await out.write(err.sse_event() + b"data: [DONE]\n\n")
        await out.write_eof()
    except (ConnectionError, RuntimeError):
        pass
