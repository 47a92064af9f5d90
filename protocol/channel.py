"""The fleet↔coordinator channel: its frame types and framing, the one module both sides import.

A fleet process opens one persistent connection per coordinator (`GET /channel` with
`Upgrade: splitserve-channel/1` on the coordinator's own HTTP listener, TCP or Unix socket; the
answer `101 Switching Protocols` turns the connection into a stream of frames). A coordinator
that does not offer the channel answers anything else (404 from an older one, or the aiohttp
server) and the client keeps using the HTTP API.

Frame: a 4-byte big-endian payload length, then one msgpack payload (msgspec, array-like tagged
structs: the first element names the type). Client → coordinator: `Batch` only; coordinator →
client: one `Replies` per `Batch`, in order, carrying the batch's `seq`. A `Batch` holds every
call a fleet process made since its last flush (one event-loop turn) and every lease end it
queued: finishes carry no call id and get no result of their own; the `Replies` with the same
`seq` acknowledges all of them at once (applied exactly once: a finish of a lease already ended
is counted and ignored, so re-sending an unacknowledged batch's finishes after a reconnect is
safe). First-token reports (`FirstToken`: a leg's first token arrived, a context leg answered)
ride the same way (applied before the batch's finishes), sent once each and idempotent at the
coordinator; one lost
with a dropped connection is not re-sent (the lease leaves prefill at `leases.prefill_ttl_s` or
its finish instead). A batch without them is the 5-element frame older coordinators read. Results carry the HTTP API's answer bodies (same shapes as `/select`, `/select_pair`,
`/renew`) with the HTTP status they would have had, less `info.server_info`: the fleet keeps each
server's `/server_info` from its own view of the cluster, and an SGLang worker's is kilobytes of
server arguments that would be encoded and decoded for every leg. A `kv_cache_aware` leg's
explanation travels as the numbers it is built from (`KvChoice`, in `info["kv"]`), which the
client expands (coordinator/channel_client.py).

Validation happens here, at decode: roles are canonical names, ids are u64, block keys are one
`bin` of little-endian u64; the coordinator does not re-check per call what the schema enforces.
"""
from __future__ import annotations

import struct
from typing import Annotated, Any, Union

import msgspec
import numpy as np

from protocol import coord
from protocol.roles import Role   # canonical names only on the channel (no aliases)

PATH = "/channel"
PROTOCOL = "splitserve-channel/1"
HEADER = struct.Struct(">I")
MAX_FRAME = 32 * 1024 * 1024       # same bound as an HTTP body (coordinator.listeners.MAX_BODY_BYTES)

# Result statuses: the HTTP API's, so one error mapping serves both transports.
OK = 200
BAD_REQUEST = 400
UNAVAILABLE = 503            # no server fits the placement
OVERLOADED = 429             # the coordinator shed the call: it waited too long in its queue
NOT_SERVING = 421            # this replica is not the serving one (body: {error, serving})

U64 = Annotated[int, msgspec.Meta(ge=0)]    # msgpack ints stop at u64 by themselves


class Select(msgspec.Struct, tag=0, array_like=True, omit_defaults=True):
    id: U64
    role: Role
    req_id: U64
    routing_key: coord.RoutingKeyField = None
    exclude: list[str] | None = None


class SelectPair(msgspec.Struct, tag=1, array_like=True, omit_defaults=True):
    id: U64
    req_id: U64
    routing_key: coord.RoutingKeyField = None
    exclude_ctx: list[str] | None = None
    exclude_gen: list[str] | None = None


class Renew(msgspec.Struct, tag=2, array_like=True):
    id: U64
    role: Role
    req_id: U64


class Finish(msgspec.Struct, array_like=True, omit_defaults=True):
    role: Role
    req_id: U64
    success: bool = True
    usage: coord.FinishUsage | None = None   # the worker's report against the prediction (/finish's)


class FirstToken(msgspec.Struct, array_like=True):
    role: Role
    req_id: U64


Call = Union[Select, SelectPair, Renew]


class Batch(msgspec.Struct, tag="b", array_like=True):
    seq: U64
    sent: float | None = None      # the client's monotonic clock at send (queueing estimate)
    # Each call and finish is decoded on its own (`decode_call`, `decode_finish`), so one that
    # does not fit the schema costs its own 400, not the whole batch or the connection.
    calls: list[msgspec.Raw] = []
    finishes: list[msgspec.Raw] = []
    started: list[msgspec.Raw] = []    # FirstToken reports


class DecodedBatch(msgspec.Struct, tag="b", array_like=True):
    """The same frame as `Batch` with its calls and finishes decoded in the one pass (the common
    case: every item fits the schema). `decode_frame` falls back to `Batch` when one does not."""
    seq: U64
    sent: float | None = None
    calls: list[Call] = []
    finishes: list[Finish] = []
    started: list[FirstToken] = []


class KvChoice(msgspec.Struct, array_like=True):
    """What a `kv_cache_aware` placement decided, in the numbers it decided from: the channel sends
    this as a leg's `info["kv"]` instead of the explanation, which the client rebuilds from it
    (router/policy_kv.py `explain`, the same function that builds the HTTP API's). Building the
    explanation's rows and reasons took over a third of a two-candidate `select` (bench/RESULTS.md,
    "coordinator · the kv explanation built by the channel's client"), and only the fleet reads
    them. Lists are per healthy candidate, in candidate order."""
    servers: list[str]
    matched: list[int]                    # reported matched tokens
    loads: list[tuple[int, int]]          # (in-flight requests, in-flight tokens)
    costs: list[float | int]
    pick: int                             # index of the chosen server
    tied: list[int] = []                  # indexes tied at the lowest cost ([] when no tie)
    hot: list[tuple[int, str]] = []       # (index, why) of the hot candidates
    skip_hot: bool = False                # hot candidates were passed over
    unknown: list[int] = []               # indexes whose cache match is unknown (kv_mismatch)
    unhealthy: list[dict[str, Any]] = []  # the explanation's rows for unhealthy candidates
    num_tokens: int = 0
    conversation: str | None = None
    pinned: str | None = None
    explain_rows: int = 8

    @property
    def matched_tokens(self) -> int:
        """The chosen server's reported matched tokens (the explanation's `matched_tokens`)."""
        return self.matched[self.pick]


class Result(msgspec.Struct, array_like=True):
    id: int
    status: int
    body: Any                      # the HTTP API's answer, or {"error", "field"?, "retry_after"?}


class Replies(msgspec.Struct, tag="r", array_like=True):
    seq: int                       # the Batch answered; its finishes are applied
    results: list[Result] = []


_enc = msgspec.msgpack.Encoder(enc_hook=coord._enc_hook)
_batch_dec = msgspec.msgpack.Decoder(Batch)
_decoded_dec = msgspec.msgpack.Decoder(DecodedBatch)
_replies_dec = msgspec.msgpack.Decoder(Replies)
_call_dec = msgspec.msgpack.Decoder(Call)
_finish_dec = msgspec.msgpack.Decoder(Finish)
_started_dec = msgspec.msgpack.Decoder(FirstToken)
_any_dec = msgspec.msgpack.Decoder()


def frame(obj: Batch | Replies) -> bytes:
    """One frame: length prefix and msgpack payload."""
    payload = _enc.encode(obj)
    return HEADER.pack(len(payload)) + payload


def batch_frame(seq: int, sent: float, calls: list, finishes: list, started: list | None = None) -> bytes:
    """A client's `Batch` frame from call, finish and first-token structs (encoded in place of
    the Raw items)."""
    payload = _enc.encode(("b", seq, sent, calls, finishes, started) if started else
                          ("b", seq, sent, calls, finishes))
    return HEADER.pack(len(payload)) + payload


def decode_batch(payload: bytes | memoryview) -> Batch:
    return _batch_dec.decode(payload)


def decode_frame(payload: bytes | memoryview) -> DecodedBatch | Batch:
    """A client's frame, its items decoded in one pass when they all fit the schema; otherwise a
    `Batch` whose items the caller decodes one by one (`decode_call`, `decode_finish`), so that a
    malformed one costs only its own answer. Raises `msgspec.DecodeError`/`ValidationError` when
    the frame itself is not a batch."""
    try:
        return _decoded_dec.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _batch_dec.decode(payload)


def decode_call(raw: msgspec.Raw) -> Call:
    return _call_dec.decode(raw)


def decode_finish(raw: msgspec.Raw) -> Finish:
    return _finish_dec.decode(raw)


def decode_started(raw: msgspec.Raw) -> FirstToken:
    return _started_dec.decode(raw)


def call_id(raw: msgspec.Raw) -> int | None:
    """The id of a call that did not decode, when it has a readable one (to answer it)."""
    try:
        v = _any_dec.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(v, list) and len(v) > 1 and type(v[1]) is int:
        return v[1]
    return None


def decode_replies(payload: bytes | memoryview) -> Replies:
    return _replies_dec.decode(payload)


class FrameTooLarge(ValueError):
    def __init__(self, size: int):
        super().__init__(f"channel frame of {size} bytes: at most {MAX_FRAME} allowed")
        self.size = size


def split_frames(buf: bytearray) -> list[bytes]:
    """Remove and return the complete payloads at the front of `buf` (the rest stays)."""
    out = []
    pos, n = 0, len(buf)
    while n - pos >= 4:
        (size,) = HEADER.unpack_from(buf, pos)
        if size > MAX_FRAME:
            raise FrameTooLarge(size)
        end = pos + 4 + size
        if end > n:
            break
        out.append(bytes(buf[pos + 4:end]))
        pos = end
    if pos:
        del buf[:pos]
    return out


def upgrade_request(host: str = "coordinator") -> bytes:
    return (f"GET {PATH} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\n"
            f"Upgrade: {PROTOCOL}\r\n\r\n").encode()


UPGRADE_ANSWER = (f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                  f"Upgrade: {PROTOCOL}\r\n\r\n").encode()


def wire_key(rk: Any) -> Any:
    """A routing key in its wire form (block keys as little-endian u64 bytes), for both transports:
    a dict, a `router.policies.RoutingKey` (or any object with its attributes), a string or None."""
    if rk is None or isinstance(rk, str):
        return rk
    if isinstance(rk, dict):
        out = dict(rk)
    else:
        out = {"block_keys": getattr(rk, "block_keys", None),
               "num_tokens": getattr(rk, "num_tokens", None),
               "conversation_id": getattr(rk, "conversation_id", None)}
        out = {k: v for k, v in out.items() if v is not None}
    keys = out.get("block_keys")
    if isinstance(keys, np.ndarray):
        out["block_keys"] = np.ascontiguousarray(keys, dtype="<u8").tobytes()
    elif isinstance(keys, (bytearray, memoryview)):
        out["block_keys"] = bytes(keys)
    elif isinstance(keys, tuple):
        out["block_keys"] = list(keys)
    return out
