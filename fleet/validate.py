"""Validation of public request bodies (`/v1/completions`, `/v1/chat/completions`).

`parse_request(raw, kind)` turns the raw body into a `ClientRequest` or raises `ApiError(400)` naming
the offending `param`, with what was expected and what was found. Fields we do not know are passed
through to the workers unchanged (engines add their own sampling extensions); fields we know are
type-checked here so a bad request never costs a placement or a worker round trip.

Invariants of a returned `ClientRequest`:
- `body` is the client's dict; `prompt` (completions) is a `str` or a `list[int]`, unwrapped from a
  one-element batch; `messages` (chat) is a non-empty list of objects with a string `role`;
- `stream` is a bool, `include_usage` is True only when streaming with `stream_options.include_usage`;
- `disaggregated_params` has been removed from `body` (the flow decides what to forward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from router.block_keys import TOKEN_ID_LIMIT

from .errors import ApiError, bad_request
from .legs import INTERNAL_FIELDS

CHAT = "chat"
COMPLETION = "completion"

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_MAX_STOP = 16


def _tname(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {_tname(v)} {v!r:.40}", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{name}' must be {rng}, got {v}", name)


def _num(body: dict, name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_num(v):
        raise bad_request(f"'{name}' must be a number, got {_tname(v)} {v!r:.40}", name, "invalid_type")
    if not (lo <= v <= hi):
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", name)


def _bool(body: dict, name: str) -> None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {_tname(v)} {v!r:.40}", name, "invalid_type")


def _str(body: dict, name: str) -> None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {_tname(v)}", name, "invalid_type")


def _token_list(v: Any) -> bool:
    """An array of integers (range checked by `_check_ids`)."""
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _check_ids(v: list, name: str) -> None:
    bad = [t for t in v if not 0 <= t < TOKEN_ID_LIMIT]
    if bad:
        raise bad_request(f"'{name}' must hold token ids in [0, 2**32), found {bad[:3]}", name)


@dataclass(slots=True)
class ClientRequest:
    kind: str                      # CHAT or COMPLETION
    body: dict                     # client body, minus disaggregated_params
    model: str
    stream: bool
    include_usage: bool
    conversation_id: str | None
    client_disagg_params: dict | None   # what the client sent under disaggregated_params (to be vetted)


def parse_json(raw: bytes) -> dict:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object", None, "invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {_tname(body)}", None, "invalid_type")
    return body


def _validate_common(body: dict) -> None:
    _int(body, "max_tokens", 1)
    _int(body, "max_completion_tokens", 1)
    _int(body, "min_tokens", 0)
    _num(body, "temperature", 0.0, 2.0)
    _num(body, "top_p", 0.0, 1.0)
    _num(body, "presence_penalty", -2.0, 2.0)
    _num(body, "frequency_penalty", -2.0, 2.0)
    _num(body, "repetition_penalty", 0.0, 10.0)
    _int(body, "top_k", -1)
    _int(body, "seed")
    _bool(body, "ignore_eos")
    _str(body, "user")
    n = body.get("n")
    if n is not None:
        _int(body, "n", 1)
        if n != 1:
            raise bad_request(f"'n' must be 1 (one choice per request in disaggregated serving), got {n}", "n",
                              "unsupported_value")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request(f"'stop' must be a string or an array of strings, got {_tname(stop)}", "stop",
                              "invalid_type")
        if len(stop) > _MAX_STOP:
            raise bad_request(f"'stop' may hold at most {_MAX_STOP} strings, got {len(stop)}", "stop")
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise bad_request(f"'logit_bias' must be an object, got {_tname(lb)}", "logit_bias", "invalid_type")
    pti = body.get("prompt_token_ids")
    if pti is not None:
        if not _token_list(pti):
            raise bad_request(f"'prompt_token_ids' must be an array of integer token ids, got {_tname(pti)}",
                              "prompt_token_ids", "invalid_type")
        _check_ids(pti, "prompt_token_ids")


def _conversation_id(body: dict) -> str | None:
    cp = body.get("conversation_params")
    if cp is None:
        return None
    if not isinstance(cp, dict):
        raise bad_request(f"'conversation_params' must be an object, got {_tname(cp)}", "conversation_params",
                          "invalid_type")
    cid = cp.get("conversation_id")
    if cid is None:
        return None
    if not isinstance(cid, str) or not cid:
        raise bad_request("'conversation_params.conversation_id' must be a non-empty string",
                          "conversation_params.conversation_id", "invalid_type")
    return cid


def _validate_messages(msgs: Any) -> None:
    if msgs is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise bad_request(f"'messages' must be an array of message objects, got {_tname(msgs)}", "messages",
                          "invalid_type")
    if not msgs:
        raise bad_request("'messages' must hold at least one message", "messages")
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{p}' must be an object, got {_tname(m)}", p, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"'{p}.role' must be a string, got {_tname(role)}", f"{p}.role", "invalid_type")
        if role not in _ROLES:
            raise bad_request(f"'{p}.role' must be one of {sorted(_ROLES)}, got {role!r:.40}", f"{p}.role")
        c = m.get("content")
        if c is None:
            if role != "assistant":
                raise bad_request(f"'{p}.content' is required for role {role!r}", f"{p}.content",
                                  "missing_required_parameter")
        elif isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad_request(f"'{p}.content[{j}]' must be an object with a string 'type'",
                                      f"{p}.content[{j}]", "invalid_type")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    t = part.get("text")
                    raise bad_request(f"'{p}.content[{j}].text' must be a string, got {_tname(t)}",
                                      f"{p}.content[{j}].text", "invalid_type")
        elif not isinstance(c, str):
            raise bad_request(f"'{p}.content' must be a string or an array of content parts, got {_tname(c)}",
                              f"{p}.content", "invalid_type")


def _validate_prompt(body: dict) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        if body.get("prompt_token_ids") is not None:
            return
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        if _token_list(prompt):
            _check_ids(prompt, "prompt")
            return
        if len(prompt) == 1 and (isinstance(prompt[0], str) or _token_list(prompt[0])):
            if isinstance(prompt[0], list):
                _check_ids(prompt[0], "prompt")
            body["prompt"] = prompt[0]   # one-element batch: the single prompt it holds
            return
        if all(isinstance(p, str) for p in prompt) or all(_token_list(p) for p in prompt):
            raise bad_request(f"batched prompts are not supported (got {len(prompt)} prompts); send one request "
                              f"per prompt", "prompt", "unsupported_value")
    raise bad_request(f"'prompt' must be a string or an array of token ids, got {_tname(prompt)}", "prompt",
                      "invalid_type")


def parse_request(raw: bytes, kind: str) -> ClientRequest:
    body = parse_json(raw)
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad_request(f"'model' must be a non-empty string, got {_tname(model)}", "model", "invalid_type")
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise bad_request(f"'stream' must be a boolean, got {_tname(stream)} {stream!r:.40}", "stream",
                          "invalid_type")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request(f"'stream_options' must be an object, got {_tname(so)}", "stream_options",
                              "invalid_type")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad_request(f"'stream_options.include_usage' must be a boolean, got {_tname(iu)}",
                              "stream_options.include_usage", "invalid_type")
        include_usage = bool(iu)
    _validate_common(body)
    if kind == CHAT:
        _validate_messages(body.get("messages"))
        _bool(body, "logprobs")
        _int(body, "top_logprobs", 0, 20)
    else:
        _validate_prompt(body)
        _bool(body, "echo")
        _int(body, "logprobs", 0, 20)
        _int(body, "best_of", 1, 1)
        _str(body, "suffix")
    for name in INTERNAL_FIELDS:
        if name in body:
            raise bad_request(f"'{name}' is a leg field set by the router, not by clients; remove it",
                              name, "internal_field")
    dp = body.pop("disaggregated_params", None)
    if dp is not None and not isinstance(dp, dict):
        raise bad_request(f"'disaggregated_params' must be an object, got {_tname(dp)}", "disaggregated_params",
                          "invalid_type")
    return ClientRequest(kind, body, model, stream, include_usage and stream, _conversation_id(body), dp)


def too_large(limit: int, got: int | None) -> ApiError:
    what = f"{got} bytes" if got is not None else "more"
    return ApiError(413, f"request body too large: limit is {limit} bytes, got {what}", code="request_too_large")
