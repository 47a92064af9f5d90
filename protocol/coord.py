"""The coordinator API's contract: its errors, request and answer structs, and the body codec.

Shared by the coordinator (which decodes requests here and builds the answers these structs
describe) and by its clients (the fleet decodes every answer with one typed `decode_answer` /
`as_answer`, no field guessing). Bodies are msgpack first, JSON accepted.

Requests are decoded straight into typed structs by msgspec, which rejects wrong types (a bool
where an int belongs, a float block key) with the key path; `decode` turns that into
`BadRequest(message, field)`. Block keys may travel as a msgpack array of u64 or, cheaper, as one
`bin` of little-endian u64 (8 bytes per key; JSON: base64 string) — the binary form is decoded
into numpy without a copy.

Errors (HTTP mapping): `BadRequest` → 400, `UnsupportedMediaType` → 415, `NotServing` → 421
(a coordinator replica that is not the serving one; `serving` names the one it defers to, when it
knows it: docs/failover.md), `NoServerAvailable` →
503, `CoordinatorOverloaded` → 429 (a placement shed by a saturated coordinator, or by a fleet
process whose calls to it are already at their bound; a subclass of `NoServerAvailable`, so every
caller that answers "no server" with 503 + Retry-After sheds it the same way, and none falls back
to local placement). Client side: `CoordinatorRequestError` (the coordinator rejected the call),
`CoordinatorUnavailable` (it could not be reached: `.cause` says how).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec
import numpy as np

from protocol.failures import BadAnswer, Cause, NoServerAvailable
from protocol.roles import PAIR_MODES, ROLE_ALIASES, Mode, Role

__all__ = [
    "BadRequest", "CoordinatorError", "CoordinatorOverloaded", "CoordinatorRequestError",
    "CoordinatorUnavailable", "NoServerAvailable", "NotServing", "UnsupportedMediaType",
    "LeaseRecord", "LeasesBody", "identity_slot",
    "SelectBody", "SelectPairBody", "FinishBody", "FirstTokenBody", "RenewBody", "RegisterBody", "DeregisterBody",
    "IdentityBody", "IdentityReleaseBody", "RoutingKeyBody", "FinishUsage",
    "SelectAnswer", "SelectPairAnswer", "RenewAnswer", "ClusterInfo", "ServerView",
    "decode", "decode_answer", "as_answer", "encode_msgpack", "encode_json",
]


# ============================================================================== errors

class CoordinatorError(Exception):
    """Base of the errors raised by the coordinator's Python API and clients."""


class BadRequest(CoordinatorError, ValueError):
    """A request body that does not fit the API; `field` names the offending key path (or None)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def to_body(self) -> dict:
        return {"error": self.message, "field": self.field}


class UnsupportedMediaType(BadRequest):
    """A body whose Content-Type is neither msgpack nor JSON."""


class CoordinatorRequestError(CoordinatorError, ValueError):
    """Client side: the coordinator rejected the call (4xx other than 503); carries status and field."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(f"coordinator rejected the request ({status}): {message}"
                         + (f" [field {field}]" if field else ""))
        self.status = status
        self.message = message
        self.field = field


class CoordinatorUnavailable(CoordinatorError, ConnectionError):
    """Client side: the coordinator could not be reached. `cause`: `CONNECT_REFUSED` (connect
    failed or reset), `TIMEOUT` (no answer in time), `UPSTREAM_5XX` (it answered 5xx),
    `PEER_LOST` (the channel to it broke with calls in flight)."""

    def __init__(self, message: str, cause: Cause = Cause.CONNECT_REFUSED):
        super().__init__(message)
        self.cause = cause


class NotServing(CoordinatorUnavailable):
    """A coordinator replica refused a call only the serving replica answers (placements, leases,
    identities): a replica ahead of it in the ordered list is up, or the election backend says
    another one leads. `serving` is that replica's URL when known. A client that knows no other
    replica treats it as an unreachable coordinator (local placement), so a fleet pointed at a
    standby alone still serves."""

    def __init__(self, message: str, serving: str | None = None):
        super().__init__(message, Cause.NOT_SERVING)
        self.serving = serving

    def to_body(self) -> dict:
        return {"error": str(self), "serving": self.serving}


class CoordinatorOverloaded(NoServerAvailable):
    """A placement shed because the coordinator (or the path to it) is saturated; no lease was
    taken. `retry_after` is the seconds the caller should wait (the `Retry-After` it passes on)."""

    cause = Cause.OVERLOADED

    def __init__(self, reason: str, retry_after: float = 1.0):
        super().__init__(reason)
        self.retry_after = retry_after


# ============================================================================== requests

U64_MAX = (1 << 64) - 1

MSGPACK = "application/msgpack"
JSON = "application/json"
_MSGPACK_TYPES = frozenset({"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"})
_JSON_TYPES = frozenset({"application/json", "text/json"})

ROLES = ROLE_ALIASES    # name → canonical role name: the names the API accepts for a role

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
StrList = Union[list[str], str, None]


class RoutingKeyBody(msgspec.Struct, forbid_unknown_fields=True):
    block_keys: Union[list[int], bytes, None] = None
    num_tokens: NonNeg | None = None
    conversation_id: str | None = None


RoutingKeyField = Union[RoutingKeyBody, str, None]


class SelectBody(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    req_id: int
    routing_key: RoutingKeyField = None
    exclude: StrList = None
    exclude_server: StrList = None  # upstream's name for `exclude`


class SelectPairBody(msgspec.Struct, forbid_unknown_fields=True):
    req_id: int
    routing_key: RoutingKeyField = None
    exclude_ctx: StrList = None
    exclude_gen: StrList = None


class FinishUsage(msgspec.Struct, forbid_unknown_fields=True):
    """What the worker reported for a finished leg, against the route receipt's prediction."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0


class FinishBody(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    req_id: int
    success: bool = True
    usage: FinishUsage | None = None


def finish_usage(u) -> tuple[int, int, int] | None:
    """(prompt, predicted, cached) from a FinishUsage, a dict or None; BadRequest naming the field."""
    if u is None:
        return None
    if type(u) is FinishUsage:
        p, c, pr = u.prompt_tokens, u.cached_tokens, u.predicted_tokens
        if type(p) is int and type(c) is int and type(pr) is int and p >= 0 and c >= 0 and pr >= 0:
            return p, pr, c
    if isinstance(u, FinishUsage):
        vals = {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                "predicted_tokens": u.predicted_tokens}
    elif isinstance(u, dict):
        unknown = set(u) - {"prompt_tokens", "cached_tokens", "predicted_tokens"}
        if unknown:
            raise BadRequest(f"unknown usage field(s) {sorted(unknown)}: expected prompt_tokens, "
                             "cached_tokens, predicted_tokens", f"usage.{sorted(unknown)[0]}")
        vals = {k: u.get(k, 0) for k in ("prompt_tokens", "cached_tokens", "predicted_tokens")}
    else:
        raise BadRequest(f"usage must be an object, got {type(u).__name__}", "usage")
    for k, v in vals.items():
        if type(v) is not int or v < 0:
            raise BadRequest(f"usage.{k} must be a non-negative integer, got {v!r}", f"usage.{k}")
    return vals["prompt_tokens"], vals["predicted_tokens"], vals["cached_tokens"]


class RenewBody(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    req_id: int


class FirstTokenBody(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /first_token`: the leg's first token arrived (a context leg: its answer)."""
    role: str
    req_id: int


class RegisterBody(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    role: str | None = None
    ttl_s: Positive | None = None
    worker_id: str | None = None


class DeregisterBody(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    role: str | None = None  # sent by workers; the url alone names the registration


class IdentityBody(msgspec.Struct, forbid_unknown_fields=True):
    holder: str
    node_id: NonNeg | None = None      # preferred pair (kept across a coordinator restart when free)
    process_id: NonNeg | None = None


class IdentityReleaseBody(msgspec.Struct, forbid_unknown_fields=True):
    holder: str
    # The holder's process is gone (its launcher saw it exit): end every lease its request ids
    # carry (`identity_slot`) now instead of at `leases.ttl_s` (the fleet's restart announcement).
    end_leases: bool = False


class LeaseRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One lease a fleet process holds: `[role, req_id, server, tokens, started]` (`started`: its
    first token was reported, so it no longer counts as queued prefill)."""
    role: str
    req_id: int
    server: str
    tokens: NonNeg = 0
    started: bool = False


class LeasesBody(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /leases`: a fleet process re-registers the leases it holds with a replica that just
    became its serving coordinator. Idempotent by `(role, req_id)`: a lease already there is
    replaced by the same one (its load counted once)."""
    leases: list[LeaseRecord]


# The snowflake layout's identity bits (docs/design.md §3; the generator is fleet/snowflake.py):
# [0 | timestamp_ms 39 | node_id 8 | process_id 6 | counter 10], rotated by + 2**40.
_ID_OFFSET = 1 << 40
_ID_END = (1 << 63) - 1


def identity_slot(req_id: int) -> int | None:
    """`node_id * 64 + process_id` of a fleet-minted request id (coordinator/identity.py's slot;
    decoded as `fleet.snowflake.decode` does), or None outside the global range `[2**40,
    2**63 - 1)` (a worker-local or client-chosen id)."""
    if not _ID_OFFSET <= req_id < _ID_END:
        return None
    return ((req_id - _ID_OFFSET) >> 10) & 0x3FFF


# ============================================================================== answers
#
# What the coordinator answers (its Python API returns the same shapes as plain dicts). Answer
# structs ignore fields they do not name, so an older fleet keeps reading a newer coordinator;
# tests/coordinator/test_protocol_answers.py drives a real coordinator over a socket and checks that
# every field it emits is described here (decoded and encoded again, nothing is lost).

Unset = msgspec.UnsetType
UNSET = msgspec.UNSET


class SelectAnswer(msgspec.Struct):
    """`/select`: the leased server. `info` is the policy's explanation (router/policy_base.py's
    `Decision`, its `explanation`) plus `server_info` and `lease_ttl_s`."""
    server: str
    req_id: int
    info: dict[str, Any] = {}

    @property
    def explanation(self) -> dict:
        return self.info

    @property
    def matched_tokens(self) -> int:
        return int(self.info.get("matched_tokens") or 0)


class SelectPairAnswer(msgspec.Struct):
    """`/select_pair`: both legs at once; `context` is None unless `mode` is disaggregated."""
    generation: SelectAnswer
    context: SelectAnswer | None = None
    mode: Mode = Mode.DISAGGREGATED
    reason: str | None = None

    def __post_init__(self):
        if self.mode not in PAIR_MODES:
            raise ValueError(f"mode {self.mode.value!r} is not a placement mode: expected one of "
                             + ", ".join(sorted(m.value for m in PAIR_MODES)))
        if (self.context is None) == (self.mode is Mode.DISAGGREGATED):
            raise ValueError(f"mode {self.mode.value!r} with "
                             + ("no context leg" if self.context is None else "a context leg"))


class RenewAnswer(msgspec.Struct):
    renewed: bool


class Load(msgspec.Struct):
    """A server's leased load, by phase (router/leases.py): legs not yet past their first token
    are prefilling (their uncached tokens queued), the rest decoding."""
    requests: int
    tokens: int
    queued_prefill_tokens: int = 0
    prefilling: int = 0
    decoding: int = 0
    decoding_tokens: int = 0


class ServerView(msgspec.Struct):
    """One server in `/cluster_info` `servers.<role>[]` (coordinator/registry.py `describe` plus
    the coordinator's load and KV-index view). The nested diagnostics stay open mappings: they are
    for operators, not a contract anything branches on."""
    url: str
    roles: list[Role]
    source: str
    state: str
    healthy: bool
    reason: str | None = None
    worker_id: str | None = None
    since_s: float = 0.0
    consecutive_failures: dict[str, int] = {}
    ejections: int = 0
    readmissions: int = 0
    last_error: str | None = None
    registration: dict[str, Any] | Unset = UNSET      # registered (not configured) servers only
    model: str | None | Unset = UNSET                 # these three once /server_info was read
    block_size: int | None | Unset = UNSET
    key_scheme: str | None | Unset = UNSET
    load: Load | Unset = UNSET
    kv_index_blocks: int = 0
    kv_ready: bool = False
    kv_index_empty_under_traffic: bool = False
    kv_parity: dict[str, Any] | None = None
    kv_mismatch: str | None = None
    routing_prediction: dict[str, Any] | None = None
    kv_capacity_model: dict[str, Any] | None = None     # the index's capacity model, when known
    kv_events: dict[str, Any] | None = None
    server_info: dict[str, Any] | None = None


class ServersByRole(msgspec.Struct):
    context: list[ServerView] = []
    generation: list[ServerView] = []


class RoutingInfo(msgspec.Struct):
    """How block keys are computed; the fleet keys prompts with exactly this."""
    block_size: int
    key_scheme: str
    namespace: str | None = None
    ns_seed: int = 0


class ClusterInfo(msgspec.Struct):
    """`GET /cluster_info`."""
    is_ready: bool
    servers: ServersByRole
    routing: RoutingInfo
    not_ready_reason: str | None = None
    server_lists: dict[Role, list[str]] = {}
    minimal_instances: dict[str, int] = {}
    routing_key_configs: dict[Role, dict[str, Any]] = {}
    routers: dict[Role, dict[str, Any]] = {}
    leases: dict[str, Any] = {}
    kv_index: dict[str, Any] = {}
    routing_diagnostics: dict[str, Any] = {}
    select_latency_s: dict[str, Any] = {}
    identities: dict[str, Any] = {}
    membership: dict[str, Any] | None = None   # etcd membership (store, prefix, revision, workers), or null
    version: str = ""
    cluster_id: str = ""        # minted by the launcher: a fleet process checks it is its own
    uptime_s: float = 0.0


def as_answer(schema: type, obj: Any, what: str = "coordinator answer"):
    """A decoded answer body (a dict from either transport, or the struct itself) as `schema`;
    `BadAnswer` naming the field when it does not fit."""
    if type(obj) is schema:
        return obj
    try:
        return msgspec.convert(obj, schema, str_keys=True)
    except msgspec.ValidationError as exc:
        raise BadAnswer("coordinator", f"{what} does not fit {schema.__name__}: {exc}") from None


def decode_answer(schema: type, body: bytes, msgpack_body: bool):
    """An answer body straight from bytes into `schema` (`BadAnswer` when it does not fit)."""
    mp, js = _decoder_pair(schema)
    try:
        return (mp if msgpack_body else js).decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadAnswer("coordinator", f"answer does not fit {schema.__name__}: {exc}") from None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a coordinator answer")


_mp_enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_js_enc = msgspec.json.Encoder(enc_hook=_enc_hook)
encode_msgpack = _mp_enc.encode
encode_json = _js_enc.encode

_decoders: dict[type, tuple[msgspec.msgpack.Decoder, msgspec.json.Decoder]] = {}


def _decoder_pair(schema: type) -> tuple[msgspec.msgpack.Decoder, msgspec.json.Decoder]:
    pair = _decoders.get(schema)
    if pair is None:
        pair = _decoders[schema] = (msgspec.msgpack.Decoder(schema), msgspec.json.Decoder(schema))
    return pair


_CT_CACHE: dict[str, bool] = {}


def is_msgpack(content_type: str | None, body: bytes) -> bool:
    """Which codec a body uses: by Content-Type; with none given, JSON iff it looks like JSON."""
    if content_type:
        known = _CT_CACHE.get(content_type)
        if known is not None:
            return known
        ct = content_type.split(";", 1)[0].strip().lower()
        if ct in _MSGPACK_TYPES or ct in _JSON_TYPES:
            if len(_CT_CACHE) < 256:
                _CT_CACHE[content_type] = ct in _MSGPACK_TYPES
            return ct in _MSGPACK_TYPES
        if ct not in ("application/octet-stream", "text/plain", ""):
            raise UnsupportedMediaType(
                f"unsupported Content-Type {ct!r}: expected application/msgpack or application/json")
    return body[:1] not in (b"{", b"[", b" ", b"\n", b"\r", b"\t")


_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD_RE = re.compile(r"field `([^`]+)`")


def _validation_error(exc: Exception) -> BadRequest:
    msg = str(exc)
    field = None
    m = _PATH_RE.search(msg)
    if m:
        field = m.group(1) or None
        msg = msg[: m.start()]
    fm = _FIELD_RE.search(msg)
    if fm:
        field = f"{field}.{fm.group(1)}" if field else fm.group(1)
    return BadRequest(msg, field)


def decode(schema: type, body: bytes, msgpack_body: bool):
    """Decode and type-check a request body; raise `BadRequest` naming the field on any mismatch."""
    if not body:
        raise BadRequest("empty request body: expected a msgpack or JSON object")
    mp, js = _decoder_pair(schema)
    try:
        return (mp if msgpack_body else js).decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None
    except msgspec.DecodeError as exc:
        kind = "msgpack" if msgpack_body else "JSON"
        raise BadRequest(f"malformed {kind} body: {exc}") from None
    except OverflowError:
        raise BadRequest("integer out of range: ids and block keys are unsigned 64-bit") from None


def parse_role(role: str, field: str = "role") -> str:
    canon = ROLES.get(role) if isinstance(role, str) else None
    if canon is None:
        raise BadRequest(f"invalid role {role!r}: expected one of context, ctx, generation, gen", field)
    return canon


def check_req_id(req_id: int, field: str = "req_id") -> int:
    if type(req_id) is not int or req_id < 0 or req_id > U64_MAX:
        raise BadRequest(f"req_id must be an unsigned 64-bit integer, got {req_id!r}", field)
    return req_id


_U64LE = np.dtype("<u8")   # a dtype object: frombuffer parses a dtype string on every call (~0.4 µs)


def block_keys_array(keys: Any, field: str = "routing_key.block_keys") -> np.ndarray:
    """Block keys as a uint64 array: from bytes (little-endian u64, no copy), a list, or an array."""
    if isinstance(keys, (bytes, bytearray, memoryview)):   # first: the wire form
        n = len(keys)
        if n % 8:
            raise BadRequest(f"binary block keys must be a multiple of 8 bytes (little-endian u64), "
                             f"got {n} bytes", field)
        return np.frombuffer(keys, _U64LE)
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys
        if keys.dtype.kind not in "iu" or (keys.size and keys.dtype.kind == "i" and keys.min() < 0):
            raise BadRequest(f"block keys must be unsigned 64-bit integers, got dtype {keys.dtype}", field)
        return keys.astype(np.uint64)
    if isinstance(keys, (list, tuple)):
        try:
            return np.array(keys, dtype=np.uint64)
        except (OverflowError, TypeError, ValueError):
            bad = next((k for k in keys if type(k) is not int or not 0 <= k <= U64_MAX), None)
            raise BadRequest(f"block keys must be unsigned 64-bit integers, found {bad!r}", field) from None
    raise BadRequest(f"block keys must be a list of u64 or bytes, got {type(keys).__name__}", field)
