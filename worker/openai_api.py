"""OpenAI request parsing and response shaping for the worker's HTTP API (no I/O here).

Parsing turns a JSON body into a ``ParsedRequest`` or raises ``InvalidRequest`` whose ``param``
names the offending field and whose message says what was expected and what was found. Shaping
builds the JSON objects of ``/v1/completions`` and ``/v1/chat/completions`` (whole responses and
SSE chunks), including ``disaggregated_params`` and ``usage.prompt_tokens_details.cached_tokens``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from protocol.disagg import DisaggParamsError, encode_opaque_state, parse_disagg_params
from protocol.prompt import chat_ids, prompt_ids
from protocol.openai import (SEED_MAX, SEED_MIN, bool_field, int_field, is_int,
                             messages_field, model_field, n_field, num_field, stop_field,
                             stream_fields, tname, token_ids)
from worker.requests import (
    CONTEXT_AND_GENERATION, CONTEXT_ONLY, GENERATION_ONLY, ContextResult,
    InvalidRequest, SamplingParams,
)

__all__ = [
    "ParsedRequest", "parse_completion", "parse_chat", "usage", "completion_response",
    "chat_response", "completion_chunk", "chat_chunk", "usage_chunk", "disagg_response_params",
]


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    request_type: str = CONTEXT_AND_GENERATION
    disaggregated_params: dict[str, Any] = field(default_factory=dict)
    first_gen_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    echo: bool = False
    # The body fields the prompt and the token budget came from, so that an engine's error about
    # "the prompt" or "max_tokens" names the field this client actually sent.
    prompt_field: str = "prompt"
    max_tokens_field: str = "max_tokens"
    # vLLM's extension: every chunk carries `token_ids`, and a stream sends one chunk per engine
    # step even when the step's text is empty (a partial UTF-8 character, a special token), so a
    # client can time each token.
    return_token_ids: bool = False


def _token_ids(v: Any, name: str, vocab_size: int | None = None) -> list[int]:
    # the vocabulary bound is checked here, where the field's name is known (the scheduler only
    # knows "the prompt")
    return list(token_ids(v, name, vocab_size))


def _unsupported(body: dict, name: str, ok) -> None:
    v = body.get(name)
    if v is not None and not ok(v):
        raise InvalidRequest(f"'{name}'={v!r} is not supported by this worker", param=name,
                             code="unsupported_parameter")


def _sampling(body: dict, default_max_tokens: int | None, max_model_len: int,
              prompt_len: int, max_tokens_names=("max_tokens",)) -> SamplingParams:
    max_tokens = None
    for name in max_tokens_names:
        v = int_field(body, name, None, lo=1)
        if v is not None:
            max_tokens = v
            break
    if max_tokens is None:
        max_tokens = (default_max_tokens if default_max_tokens is not None
                      else max(1, max_model_len - prompt_len))
    n_field(body)
    _unsupported(body, "best_of", lambda v: v == 1)
    _unsupported(body, "logprobs", lambda v: v is False or v == 0)
    _unsupported(body, "top_logprobs", lambda v: v == 0)
    _unsupported(body, "logit_bias", lambda v: v == {})
    _unsupported(body, "presence_penalty", lambda v: v == 0)
    _unsupported(body, "frequency_penalty", lambda v: v == 0)
    _unsupported(body, "tools", lambda v: v == [])
    _unsupported(body, "response_format",
                 lambda v: isinstance(v, dict) and v.get("type") == "text")
    temperature = num_field(body, "temperature", 1.0, 0.0, 2.0)
    top_p = num_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise InvalidRequest(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = int_field(body, "top_k", 0, lo=-1)
    if top_k == -1:
        top_k = 0
    seed = int_field(body, "seed", None, lo=SEED_MIN, hi=SEED_MAX)
    stops = stop_field(body)
    stop_ids = body.get("stop_token_ids")
    stop_ids = tuple(_token_ids(stop_ids, "stop_token_ids")) if stop_ids is not None else ()
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed, stop=stops, stop_token_ids=stop_ids,
                          ignore_eos=bool_field(body, "ignore_eos", False))


def _stream_opts(body: dict) -> tuple[bool, bool]:
    return stream_fields(body)


def _model(body: dict) -> str | None:
    return model_field(body, required=False)


def _disagg(body: dict, out: ParsedRequest) -> None:
    dp = body.get("disaggregated_params")
    if dp is None:
        return
    try:
        p = parse_disagg_params(dp)       # every field's type, at once (protocol.disagg)
    except DisaggParamsError as e:
        raise InvalidRequest(str(e), param=e.field) from None
    rt = p.request_type or CONTEXT_AND_GENERATION
    did = p.disagg_request_id
    if rt == GENERATION_ONLY:
        fg, cid = p.first_gen_tokens, p.ctx_request_id
        if fg is not None:
            out.first_gen_tokens = _token_ids(fg, "disaggregated_params.first_gen_tokens")
            if not out.first_gen_tokens:
                raise InvalidRequest("'disaggregated_params.first_gen_tokens' must not be empty",
                                     param="disaggregated_params.first_gen_tokens")
        if fg is None and cid is None:
            raise InvalidRequest(
                "a generation_only request needs disaggregated_params.ctx_request_id (and "
                "first_gen_tokens from the context response, or a generation_first schedule)",
                param="disaggregated_params.ctx_request_id")
    out.request_type = rt
    out.disaggregated_params = dp
    out.disagg_request_id = did


def _top_prompt_ids(body: dict, vocab_size: int | None) -> list[int] | None:
    v = body.get("prompt_token_ids")
    if v is None:
        return None
    ids = _token_ids(v, "prompt_token_ids", vocab_size)
    if not ids:
        raise InvalidRequest("'prompt_token_ids' must not be empty", param="prompt_token_ids")
    return ids


def parse_completion(body: Any, tokenizer, *, max_model_len: int,
                     vocab_size: int | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {tname(body)}")
    model = _model(body)
    ids = _top_prompt_ids(body, vocab_size)
    from_ids = ids is not None
    if ids is None:
        if "prompt" not in body or body["prompt"] is None:
            raise InvalidRequest("'prompt' is required (a string or a list of token ids)",
                                 param="prompt", code="missing_required_parameter")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise InvalidRequest("'prompt' must not be empty", param="prompt")
            ids = list(prompt_ids(tokenizer, p))
        elif isinstance(p, list) and p and all(is_int(t) for t in p):
            ids = _token_ids(p, "prompt", vocab_size)
        elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise InvalidRequest(
                f"'prompt' holds {len(p)} prompts; this worker serves one prompt per request",
                param="prompt", code="unsupported_parameter")
        else:
            raise InvalidRequest(
                f"'prompt' must be a non-empty string or list of token ids, got {tname(p)}",
                param="prompt")
    _unsupported(body, "suffix", lambda v: v == "")
    stream, include_usage = _stream_opts(body)
    out = ParsedRequest(kind="completion", model=model, prompt_token_ids=ids,
                        sampling=_sampling(body, 16, max_model_len, len(ids)),
                        stream=stream, include_usage=include_usage,
                        echo=bool_field(body, "echo", False),
                        return_token_ids=bool_field(body, "return_token_ids", False),
                        prompt_field="prompt_token_ids" if from_ids else "prompt")
    _disagg(body, out)
    return out


def _text_only(msgs: list[dict]) -> None:
    """This worker serves text: every content part must be a text part (protocol.openai checked
    the shapes already)."""
    for i, m in enumerate(msgs):
        c = m.get("content")
        if isinstance(c, list):
            for j, part in enumerate(c):
                if part.get("type") != "text":
                    raise InvalidRequest(
                        f"'messages[{i}].content[{j}]' must be a text part {{'type': 'text', 'text': "
                        f"string}}; this worker serves text only, got type {part.get('type')!r:.40}",
                        param=f"messages[{i}].content[{j}]", code="unsupported_value")


def parse_chat(body: Any, tokenizer, *, max_model_len: int,
               vocab_size: int | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {tname(body)}")
    model = _model(body)
    msgs = messages_field(body.get("messages"))
    _text_only(msgs)
    ids = _top_prompt_ids(body, vocab_size)
    from_ids = ids is not None
    if ids is None:
        agp = bool_field(body, "add_generation_prompt", True)
        try:
            # The rendered prompt already holds any BOS the template adds.
            ids = list(chat_ids(tokenizer, msgs, agp))
        except ValueError as e:  # ChatTemplateError / TokenizerError
            raise InvalidRequest(f"the chat template failed on these messages: {e}",
                                 param="messages") from None
        if not ids:
            raise InvalidRequest("the chat template produced an empty prompt", param="messages")
    stream, include_usage = _stream_opts(body)
    out = ParsedRequest(kind="chat", model=model, prompt_token_ids=ids,
                        sampling=_sampling(body, None, max_model_len, len(ids),
                                           ("max_completion_tokens", "max_tokens")),
                        stream=stream, include_usage=include_usage,
                        return_token_ids=bool_field(body, "return_token_ids", False),
                        prompt_field="prompt_token_ids" if from_ids else "messages",
                        max_tokens_field="max_completion_tokens"
                        if body.get("max_completion_tokens") is not None else "max_tokens")
    _disagg(body, out)
    return out


# ---------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def disagg_response_params(req: ParsedRequest, ctx: ContextResult,
                           ctx_info_endpoint: str | None) -> dict:
    """``choices[0].disaggregated_params`` of a context_only response
    (docs/design.md §5, docs/protocols.md)."""
    out = {k: v for k, v in req.disaggregated_params.items()
           if k in ("schedule_style", "conversation_id", "disagg_request_id")}
    out.update({
        "request_type": CONTEXT_ONLY,
        "ctx_request_id": ctx.ctx_request_id,
        "first_gen_tokens": list(ctx.first_gen_tokens),
        "encoded_opaque_state": encode_opaque_state(ctx.opaque_state) if ctx.pinned else None,
        "ctx_dp_rank": None,
        "ctx_info_endpoint": ctx_info_endpoint,
    })
    out.setdefault("disagg_request_id", req.disagg_request_id)
    return out


def completion_response(rid: str, model: str, text: str, finish_reason: str | None,
                        stop_reason, use: dict, disagg: dict | None = None,
                        prompt_token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    if disagg is not None:
        choice["disaggregated_params"] = disagg
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [choice], "usage": use}
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    return out


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, stop_reason,
                  use: dict, disagg: dict | None = None,
                  prompt_token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
    if disagg is not None:
        choice["disaggregated_params"] = disagg
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": [choice], "usage": use}
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    return out


def _stream_chunk(obj: str, rid: str, created: int, model: str, content_key: str, content,
                  finish_reason, stop_reason, disagg: dict | None) -> dict:
    """One SSE chunk with a single choice; `stop_reason` appears only once the choice finishes."""
    choice = {"index": 0, content_key: content, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if disagg is not None:
        choice["disaggregated_params"] = disagg
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason=None,
                     stop_reason=None, disagg: dict | None = None) -> dict:
    return _stream_chunk("text_completion", rid, created, model, "text", text, finish_reason,
                         stop_reason, disagg)


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason=None,
               stop_reason=None, disagg: dict | None = None) -> dict:
    return _stream_chunk("chat.completion.chunk", rid, created, model, "delta", delta,
                         finish_reason, stop_reason, disagg)


def usage_chunk(kind: str, rid: str, created: int, model: str, use: dict) -> dict:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}
