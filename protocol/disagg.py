"""`disaggregated_params` and the context→generation opaque state: the one description of both.

`disaggregated_params` is TensorRT-LLM's `DisaggregatedParams` (docs/design.md §5,
docs/protocols.md): the fleet puts one on each leg, the context worker answers one in
`choices[i].disaggregated_params`, the generation worker reads it. `DisaggParams` names the fields
splitserve reads or writes; a leg copies the context answer's object verbatim (fields we do not
name included), only `request_type` changes.

`encoded_opaque_state` is base64 (standard alphabet) of one msgpack map that only the two workers
read (`OpaqueState`): the context worker's scheduler writes its part (`v` … `block_ids`), its KV
connector (worker/kv_connector_transfer.py) adds the `tx_*` fields, the vLLM/SGLang shims
(worker/engine_protocols.py) write `worker_url` (+ `wait`). No pickle.
"""
from __future__ import annotations

import base64
import binascii
import re
from enum import StrEnum
from typing import Annotated, Any

import msgspec

from protocol.openai import tname

__all__ = ["RequestType", "REQUEST_TYPES", "DisaggParams", "DisaggParamsError", "parse_disagg_params",
           "OpaqueState", "OpaqueStateError",
           "encode_opaque_state", "decode_opaque_state", "OPAQUE_FIELD", "OPAQUE_VERSION"]


class RequestType(StrEnum):
    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"
    CONTEXT_AND_GENERATION = "context_and_generation"


REQUEST_TYPES = tuple(RequestType)
OPAQUE_FIELD = "disaggregated_params.encoded_opaque_state"
OPAQUE_VERSION = 1


class DisaggParams(msgspec.Struct, omit_defaults=True):
    """The `disaggregated_params` fields splitserve reads or writes (None: absent)."""
    request_type: RequestType | None = None
    disagg_request_id: Annotated[int, msgspec.Meta(ge=0)] | None = None   # the fleet's snowflake id
    ctx_request_id: int | None = None          # the context worker's id for the request
    first_gen_tokens: list[int] | None = None  # the context worker's first token(s)
    encoded_opaque_state: str | None = None    # `OpaqueState`, encoded; relayed verbatim
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None       # the context worker's KV transfer endpoint
    schedule_style: str | None = None          # context_first | generation_first
    conversation_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class DisaggParamsError(ValueError):
    """`disaggregated_params` does not fit `DisaggParams`; `field` is the offending key path."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def parse_disagg_params(dp: Any) -> DisaggParams:
    """The typed view of a request's `disaggregated_params` (the dict itself is relayed as is:
    fields this struct does not name pass through)."""
    if not isinstance(dp, dict):
        raise DisaggParamsError(f"'disaggregated_params' must be an object, got {tname(dp)}",
                                "disaggregated_params")
    try:
        return msgspec.convert(dp, DisaggParams)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _AT.search(msg)
        path = m.group(1) if m else ""
        name = re.split(r"[.\[]", path, maxsplit=1)[0] if path else ""
        field = f"disaggregated_params.{name}" if name else "disaggregated_params"
        raise DisaggParamsError(f"'{field}': {msg[:m.start()] if m else msg}"
                                + (f" (at {path})" if path and path != name else ""), field) from None


class OpaqueState(msgspec.Struct):
    """What a context worker hands its generation peer through `encoded_opaque_state`."""
    v: int = OPAQUE_VERSION
    worker_id: str | None = None
    worker_url: str | None = None      # the context worker's HTTP URL (release / readiness calls)
    ctx_request_id: int | None = None
    num_tokens: int | None = None
    block_size: int | None = None
    key_scheme: str | None = None
    block_ids: list[int] | None = None
    # added by the KV connector (worker/kv_connector_transfer.py): where to fetch the KV from
    tx_ep: str | None = None           # the context rank's transfer control endpoint
    tx_inst: str | None = None         # its transceiver instance id
    tx_req: int | None = None          # the send session's id there
    tx_agent: str | None = None        # the agent kind (nixl, tcp, shm)
    # vLLM/SGLang shims: the prefill may still be running; wait for it before fetching
    wait: bool = False


class OpaqueStateError(ValueError):
    """`encoded_opaque_state` is not what a context worker writes; names what was found."""

    field = OPAQUE_FIELD


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(OpaqueState)


def encode_opaque_state(state: OpaqueState | dict) -> str:
    """base64 of msgpack of the state (a struct, or a map of its fields)."""
    if isinstance(state, dict):
        unknown = set(state) - set(OpaqueState.__struct_fields__)
        if unknown:    # a field only one side knows would be dropped here: name it instead
            raise ValueError(f"opaque state field(s) {sorted(unknown)} are not in "
                             "protocol.disagg.OpaqueState")
        state = msgspec.convert(state, OpaqueState)
    return base64.b64encode(_enc.encode(state)).decode("ascii")


def decode_opaque_state(blob: Any) -> OpaqueState:
    """The state a context worker encoded; `OpaqueStateError` saying what is wrong otherwise."""
    if not isinstance(blob, str):
        raise OpaqueStateError(f"encoded_opaque_state must be a string, got {type(blob).__name__}")
    try:
        raw = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError) as e:
        raise OpaqueStateError(f"encoded_opaque_state is not base64 msgpack: {e}") from None
    try:
        return _dec.decode(raw)
    except msgspec.ValidationError as e:
        raise OpaqueStateError(f"encoded_opaque_state does not fit the opaque state: {e}") from None
    except msgspec.DecodeError as e:
        raise OpaqueStateError(f"encoded_opaque_state is not base64 msgpack: {e}") from None
