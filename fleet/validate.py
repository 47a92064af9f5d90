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

import re
from dataclasses import dataclass

import orjson

from protocol.openai import (ApiError, bad_request, bool_field, int_field, is_int, messages_field,
                             model_field, n_field, num_field, SEED_MAX, SEED_MIN, stop_field,
                             str_field, stream_fields, tname, token_ids)

from .legs import INTERNAL_FIELDS

CHAT = "chat"
COMPLETION = "completion"


def _token_list(v) -> bool:
    return isinstance(v, list) and all(is_int(t) for t in v)


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
        raise bad_request(f"request body must be a JSON object, got {tname(body)}", None, "invalid_type")
    return body


def _logit_bias(body: dict) -> None:
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise bad_request(f"'logit_bias' must be an object, got {tname(lb)}", "logit_bias", "invalid_type")


def _prompt_token_ids(body: dict) -> None:
    pti = body.get("prompt_token_ids")
    if pti is not None:
        token_ids(pti, "prompt_token_ids")


# (field, check) in the order the checks run, so that of several bad fields the same one is named
# first; a check runs only when its field is present (each is a no-op for an absent one), which
# skips ~20 calls on a typical body of three or four fields.
_COMMON = (
    ("max_tokens", lambda b: int_field(b, "max_tokens", lo=1)),
    ("max_completion_tokens", lambda b: int_field(b, "max_completion_tokens", lo=1)),
    ("min_tokens", lambda b: int_field(b, "min_tokens", lo=0)),
    ("temperature", lambda b: num_field(b, "temperature", None, 0.0, 2.0)),
    ("top_p", lambda b: num_field(b, "top_p", None, 0.0, 1.0)),
    ("presence_penalty", lambda b: num_field(b, "presence_penalty", None, -2.0, 2.0)),
    ("frequency_penalty", lambda b: num_field(b, "frequency_penalty", None, -2.0, 2.0)),
    ("repetition_penalty", lambda b: num_field(b, "repetition_penalty", None, 0.0, 10.0)),
    ("top_k", lambda b: int_field(b, "top_k", lo=-1)),
    ("seed", lambda b: int_field(b, "seed", lo=SEED_MIN, hi=SEED_MAX)),
    ("ignore_eos", lambda b: bool_field(b, "ignore_eos")),
    ("user", lambda b: str_field(b, "user")),
    ("n", n_field),
    ("stop", stop_field),
    ("logit_bias", _logit_bias),
    ("prompt_token_ids", _prompt_token_ids),
)
_CHAT = (
    ("logprobs", lambda b: bool_field(b, "logprobs")),
    ("top_logprobs", lambda b: int_field(b, "top_logprobs", lo=0, hi=20)),
)
_COMPLETION = (
    ("echo", lambda b: bool_field(b, "echo")),
    ("logprobs", lambda b: int_field(b, "logprobs", lo=0, hi=20)),
    ("best_of", lambda b: int_field(b, "best_of", lo=1, hi=1)),
    ("suffix", lambda b: str_field(b, "suffix")),
)
_INTERNAL = frozenset(INTERNAL_FIELDS)


def _check(body: dict, checks) -> None:
    for name, check in checks:
        if name in body:
            check(body)


def _validate_common(body: dict) -> None:
    _check(body, _COMMON)


def _conversation_id(body: dict) -> str | None:
    cp = body.get("conversation_params")
    if cp is None:
        return None
    if not isinstance(cp, dict):
        raise bad_request(f"'conversation_params' must be an object, got {tname(cp)}", "conversation_params",
                          "invalid_type")
    cid = cp.get("conversation_id")
    if cid is None:
        return None
    if not isinstance(cid, str) or not cid:
        raise bad_request("'conversation_params.conversation_id' must be a non-empty string",
                          "conversation_params.conversation_id", "invalid_type")
    return cid


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
            token_ids(prompt, "prompt")
            return
        if len(prompt) == 1 and (isinstance(prompt[0], str) or _token_list(prompt[0])):
            if isinstance(prompt[0], list):
                token_ids(prompt[0], "prompt")
            body["prompt"] = prompt[0]   # one-element batch: the single prompt it holds
            return
        if all(isinstance(p, str) for p in prompt) or all(_token_list(p) for p in prompt):
            raise bad_request(f"batched prompts are not supported (got {len(prompt)} prompts); send one request "
                              f"per prompt", "prompt", "unsupported_value")
    raise bad_request(f"'prompt' must be a string or an array of token ids, got {tname(prompt)}", "prompt",
                      "invalid_type")


def parse_request(raw: bytes, kind: str) -> ClientRequest:
    body = parse_json(raw)
    model = model_field(body, required=True)
    stream, include_usage = stream_fields(body)
    _validate_common(body)
    if kind == CHAT:
        messages_field(body.get("messages"))
        _check(body, _CHAT)
    else:
        _validate_prompt(body)
        _check(body, _COMPLETION)
    if not _INTERNAL.isdisjoint(body):
        for name in INTERNAL_FIELDS:
            if name in body:
                raise bad_request(f"'{name}' is a leg field set by the router, not by clients; remove it",
                                  name, "internal_field")
    dp = body.pop("disaggregated_params", None)
    if dp is not None and not isinstance(dp, dict):
        raise bad_request(f"'disaggregated_params' must be an object, got {tname(dp)}", "disaggregated_params",
                          "invalid_type")
    return ClientRequest(kind, body, model, stream, include_usage and stream, _conversation_id(body), dp)


def too_large(limit: int, got: int | None) -> ApiError:
    what = f"{got} bytes" if got is not None else "more"
    return ApiError(413, f"request body too large: limit is {limit} bytes, got {what}", code="request_too_large")


REQUEST_ID_MAX = 128
_RID_OK = re.compile(r"[A-Za-z0-9._:/@+=-]{1,%d}" % REQUEST_ID_MAX)
_RID_BAD = re.compile(r"[^A-Za-z0-9._:/@+=-]+")


def client_request_id(header: str | None) -> str | None:
    """A client's `X-Request-Id`, made safe to echo and log: characters outside
    `[A-Za-z0-9._:/@+=-]` dropped (no header or log injection, no quotes), at most
    `REQUEST_ID_MAX` kept; None when nothing is left."""
    if not header:
        return None
    s = header if _RID_OK.fullmatch(header) else _RID_BAD.sub("", header)
    return s[:REQUEST_ID_MAX] or None
