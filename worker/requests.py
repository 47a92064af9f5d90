"""Value types shared by the engines, the scheduler and the HTTP server (no torch here)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from protocol.disagg import REQUEST_TYPES, RequestType
from protocol.openai import ApiError, InvalidRequest

__all__ = [
    "CONTEXT_ONLY", "GENERATION_ONLY", "CONTEXT_AND_GENERATION", "REQUEST_TYPES",
    "SamplingParams", "EngineRequest", "TokenEvent", "ContextResult", "ReceiveSpec",
    "PinnedTransfer", "EngineError", "InvalidRequest", "TransferUnavailable",
    "EngineStopped",
]

# The request types of `disaggregated_params` (protocol.disagg.RequestType), by their old names.
CONTEXT_ONLY = RequestType.CONTEXT_ONLY
GENERATION_ONLY = RequestType.GENERATION_ONLY
CONTEXT_AND_GENERATION = RequestType.CONTEXT_AND_GENERATION


class EngineError(ApiError):
    """Base of the engine's own errors; each subclass has its status and OpenAI error type.
    (A 400 is `protocol.openai.InvalidRequest`, the one the fleet raises too.)"""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(type(self).status, message, param=param, code=code, type_=type(self).type)


class TransferUnavailable(EngineError):
    """A generation_only request reached an engine with no KV receiver plugged in."""

    status = 501
    type = "not_implemented"


class EngineStopped(EngineError):
    status = 503
    type = "service_unavailable"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` (or ``top_k == 1``) is greedy; a ``seed`` makes
    sampling reproducible whatever else shares the batch (one generator per request)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class EngineRequest:
    """One sequence to run. ``request_id`` is the engine-unique key; ``aliases`` are other names
    ``abort`` accepts (the ``X-Request-Id`` header, ``disagg_request_id``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_type: str = CONTEXT_AND_GENERATION
    aliases: tuple[str, ...] = ()
    # context_only: the id the response carries as ctx_request_id (disagg id, or a local id).
    ctx_request_id: int | None = None
    # generation_only: what the context leg sent (first_gen_tokens, encoded_opaque_state, ...).
    disaggregated_params: dict[str, Any] | None = None
    first_gen_tokens: list[int] | None = None


@dataclass(frozen=True, slots=True)
class ContextResult:
    """What a finished context_only request hands to the generation leg."""

    ctx_request_id: int
    first_gen_tokens: list[int]
    prompt_token_ids: list[int]
    block_ids: list[int]
    opaque_state: dict[str, Any]
    pinned: bool


@dataclass(slots=True)
class TokenEvent:
    """Progress of one request: tokens/text produced since the previous event. The last event of a
    stream has ``finish_reason`` set (``stop``, ``length``, ``abort`` or ``error``)."""

    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    context: ContextResult | None = None

    def replace(self, **kw) -> "TokenEvent":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True, slots=True)
class ReceiveSpec:
    """What a ``KvConnector.receive`` must fill: the whole prompt's K/V into ``block_ids`` (position ``p``
    lives in ``block_ids[p // block_size]`` at slot ``p % block_size``)."""

    request_id: str
    ctx_request_id: int | None
    prompt_token_ids: list[int]
    block_ids: list[int]
    block_size: int
    disaggregated_params: dict[str, Any]


@dataclass(slots=True)
class PinnedTransfer:
    """A finished context request's prompt blocks, held (pinned) until the KV transfer is done,
    cancelled, or ``deadline`` (monotonic seconds) passes."""

    ctx_request_id: int
    request_id: str
    aliases: tuple[str, ...]
    prompt_token_ids: list[int]
    block_ids: list[int]
    created: float
    deadline: float
