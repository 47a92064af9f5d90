"""TensorRT-LLM's `disaggregated_params` legs (docs/design.md §5, docs/protocols.md; our worker
speaks the same), as pure functions: the context leg's body, the context answer's decoding, and the
generation leg's body for both schedule styles. fleet/flow.py sends them.

- context leg: the client's body with `stream=false`, `stream_options=null`,
  `disaggregated_params={request_type: context_only, disagg_request_id, schedule_style}`;
- generation leg (`context_first`) only when the context answer's `finish_reason` is `length` or
  `not_finished`: the context answer's `disaggregated_params` with `request_type: generation_only`,
  and its `prompt_token_ids` as the raw JSON bytes the context worker wrote (never re-tokenized,
  never re-parsed: msgspec `Raw`, orjson `Fragment`); the generation worker emits the first token
  itself, so nothing is prepended;
- generation leg (`generation_first`): sent before the context leg, naming the context request by
  the fleet's id and the context server's `ctx_info_endpoint` (from its `/server_info`).
"""
from __future__ import annotations

import msgspec
import orjson

from protocol.disagg import DisaggParamsError, RequestType, parse_disagg_params

NAME = "trtllm"
SEQUENTIAL = True          # the generation leg needs the context answer's disaggregated_params
ALLOWS_LOCAL_PREFILL = True       # a generation server serves a plain request aggregated
ABORT_PATH = "/v1/abort"   # worker/server.py `abort`: by X-Request-Id or disagg_request_id
NEED_GENERATION = frozenset({"length", "not_finished"})


def abort_body(request_id: int) -> dict | None:
    return {"request_id": request_id}


class ContextChoice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    disaggregated_params: dict | None = None


class ContextAnswer(msgspec.Struct):
    choices: list[ContextChoice] = []
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"")
    usage: dict | None = None


_decoder = msgspec.json.Decoder(ContextAnswer)


class BadContextAnswer(ValueError):
    """The context answer cannot end the request nor start a generation leg (`str(e)` says why).
    `malformed`: the bytes are not a context answer at all (the server failed, not the request)."""

    def __init__(self, message: str, malformed: bool = False):
        super().__init__(message)
        self.malformed = malformed


def decode_context_answer(raw: bytes) -> ContextAnswer:
    """The context leg's JSON answer, with at least one choice."""
    try:
        ans = _decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise BadContextAnswer(f"returned an invalid answer: {e}", malformed=True) from None
    if not ans.choices:
        raise BadContextAnswer("returned no choices")
    return ans


def check_generation_params(ans: ContextAnswer) -> None:
    """A context answer that asks for a generation leg names its context request
    (`choices[0].disaggregated_params.ctx_request_id`)."""
    c = ans.choices[0]
    if c.finish_reason in NEED_GENERATION:
        try:
            dp = parse_disagg_params(c.disaggregated_params)     # typed: protocol.disagg
        except DisaggParamsError as e:
            raise BadContextAnswer(f"finished with {c.finish_reason!r} but its choices[0].{e}") from None
        if dp.ctx_request_id is None:
            raise BadContextAnswer(f"finished with {c.finish_reason!r} but without "
                                   f"choices[0].disaggregated_params.ctx_request_id")


def needs_generation(ans: ContextAnswer) -> bool:
    """Whether the request goes on to a generation leg (else the context answer is the answer)."""
    return ans.choices[0].finish_reason in NEED_GENERATION


def context_body(body: dict, request_id: int, schedule: str) -> tuple[dict, dict]:
    """(context leg body, its disaggregated_params: what gets signed)."""
    out = dict(body)
    out["stream"] = False
    out["stream_options"] = None
    dp = {"request_type": RequestType.CONTEXT_ONLY, "disagg_request_id": request_id, "schedule_style": schedule}
    out["disaggregated_params"] = dp
    return out, dp


def generation_body(base: dict, chat: bool, ans: ContextAnswer, request_id: int,
                    schedule: str, strip_history: bool = False) -> tuple[dict, dict]:
    """(generation leg body after a context answer, its disaggregated_params). `base` is the
    answering leg's body (fleet/legs/plan.py `answer_body`); it is not modified. `strip_history`
    (`gen_strip_message_history`, as upstream) keeps only the last message of a chat whose prompt
    goes as token ids: the generation worker reads the ids, the history is bytes on the wire."""
    body = dict(base)
    dp = dict(ans.choices[0].disaggregated_params)
    dp["request_type"] = RequestType.GENERATION_ONLY
    dp.setdefault("disagg_request_id", request_id)
    dp["schedule_style"] = schedule
    if ans.usage is not None:
        dp["ctx_usage"] = ans.usage
    body["disaggregated_params"] = dp
    ids = bytes(ans.prompt_token_ids)
    if ids and ids != b"null":
        frag = orjson.Fragment(ids)
        if chat:
            body["prompt_token_ids"] = frag
            msgs = body.get("messages")
            if strip_history and isinstance(msgs, list) and len(msgs) > 1:
                body["messages"] = msgs[-1:]
        else:
            body["prompt"] = frag
            body.pop("prompt_token_ids", None)
    return body, dp


def generation_first_body(base: dict, request_id: int, ctx_info_endpoint: str | None) -> tuple[dict, dict]:
    """(generation leg body sent before the context leg, its disaggregated_params)."""
    body = dict(base)
    dp = {"request_type": RequestType.GENERATION_ONLY, "ctx_request_id": request_id, "disagg_request_id": request_id,
          "ctx_info_endpoint": ctx_info_endpoint, "schedule_style": "generation_first"}
    body["disaggregated_params"] = dp
    return body, dp


def ctx_info_endpoint(server_info: dict | None) -> str | None:
    """Where a generation_first generation worker asks the context worker for the KV's location."""
    if not isinstance(server_info, dict):
        return None
    dp = server_info.get("disaggregated_params")
    return dp.get("ctx_info_endpoint") if isinstance(dp, dict) else None
