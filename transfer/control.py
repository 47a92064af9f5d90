"""The control messages of KV transfer, one msgspec Struct each (the one place they are defined).

On the wire each is a msgpack map whose `t` names the type (msgspec's tag); `Messenger` carries
them. Who sends what (`gen` = a generation rank, `ctx` = a context rank):

    gen → ctx rank 0   GetInstance                        → Instance {ranks: [RankInfo bytes]}
    gen → ctx rank i   Register {info}          → Registered {lane, local_lane} | RegisterFailed {error}
                       (then the generation rank connects the control lane `local_lane` names,
                       else `lane`, when there is one, and sends everything below to that rank
                       on it)
    gen → ctx rank i   Recv {req, n, ids: [int64 bytes per group], notif, ready}   (one whole-prompt receive)
    ctx → gen          Result {req, from, status, slices, span, last, meta, ready}
                       (with `notif`, an `ok` result travels as the transfer agent's notification
                       attached to the write it reports: `result_notif`, below; with `ready`, it
                       leaves when the write is posted, carrying what the receiver waits on)
    gen → ctx          Cancel {req}                       → Result {status: cancelled}
    gen → ctx rank 0   Claim {req}            (no reply: "a generation rank holds this request")
    either             Error {error}          (a request it could not parse)
"""
from __future__ import annotations

import enum
from typing import Union

import msgspec
import msgspec.msgpack

from .errors import ProtocolError


class ResultStatus(enum.StrEnum):
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


class _Msg(msgspec.Struct, tag_field="t", frozen=True):
    pass


class GetInstance(_Msg, tag="get_instance"):
    pass


class Instance(_Msg, tag="instance"):
    ranks: list[bytes]
    answering: str = msgspec.field(name="self", default="")   # key of the rank that answered


class Register(_Msg, tag="register"):
    info: bytes


class Registered(_Msg, tag="registered"):
    key: str
    # Where this rank listens for control lanes (`host:port`, transfer/lanes.py); "" for none.
    lane: str = ""
    # ...and for lanes from its own host (a Unix socket's abstract name, `lanes.listen_local`);
    # "" for none. A peer that cannot reach it uses `lane`.
    local_lane: str = ""


class RegisterFailed(_Msg, tag="register_failed"):
    error: str
    key: str = ""


class Recv(_Msg, tag="recv"):
    req: int
    n: int
    ids: list[bytes]
    # The receiver's agent delivers notifications as they arrive (`deliver_notifications`): send
    # `ok` results as the notification of the write they report, not as a control message. A
    # sender that does not know the field ignores it (msgspec skips unknown fields).
    notif: bool = False
    # The receiver can tell by itself when a direct GPU write landed (it waits on the CUDA IPC
    # event recorded after the write's kernel: `Result.ready`), so the `ok` result may leave as
    # soon as the write is posted.
    ready: bool = False


class Result(_Msg, tag="result"):
    req: int
    sender: str = msgspec.field(name="from")
    status: ResultStatus = ResultStatus.OK
    error: str | None = None
    slices: tuple[int, int] = (0, 0)
    span: tuple[int, int] = (0, 0)
    last: bool = True
    meta: dict | None = None
    # With `Recv.ready`: the completion token of the write this result reports (the IPC handle
    # of the event after its kernel); the receiver counts the slices only once it has passed.
    ready: bytes | None = None


class Cancel(_Msg, tag="cancel"):
    req: int


class Claim(_Msg, tag="claim"):
    req: int


class Error(_Msg, tag="error"):
    error: str | None = None


ControlMessage = Union[GetInstance, Instance, Register, Registered, RegisterFailed, Recv, Result,
                       Cancel, Claim, Error]

#: What arrives on a rank's ROUTER (requests from peers) and on its DEALERs (their replies).
REQUESTS = (GetInstance, Register, Recv, Cancel, Claim)
REPLIES = (Instance, Registered, RegisterFailed, Result, Error)
TAGS = frozenset(c.__struct_config__.tag for c in REQUESTS + REPLIES)


def parse(msg: dict) -> ControlMessage:
    """A decoded msgpack map (what `Messenger` hands over) as its typed message."""
    try:
        return msgspec.convert(msg, ControlMessage)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"control message {msg.get('t')!r}: {e}") from None


#: Fields added after the first release of a message: left out of the map while at their default,
#: so the maps peers of an earlier release send and read stay the same.
_LATE_FIELDS = ("ready", "lane", "local_lane")


_decoder = msgspec.msgpack.Decoder(ControlMessage)


def decode(data: bytes) -> ControlMessage:
    """A control message straight from its msgpack bytes (one pass; ~20× faster than a dict and
    `parse`). Raises on anything `parse` would refuse, and on unknown tags: callers then take
    the dict path, which tells those apart."""
    return _decoder.decode(data)


def to_wire(msg: ControlMessage) -> dict:
    """The map `Messenger` packs (builtins only; bytes stay bytes)."""
    d = msgspec.to_builtins(msg, builtin_types=(bytes,))
    for k in _LATE_FIELDS:
        if k in d and not d[k]:
            del d[k]
    return d


_encoder = msgspec.msgpack.Encoder()


def _late_tails() -> dict[type, tuple[str, object, bytes] | None]:
    """Per message type with a late field: (field, its default, the bytes that field adds at the
    end of the encoded map while at that default). msgspec writes the tag, then the fields in
    their declaration order: a late field is declared last (checked here, once)."""
    out = {}
    for cls in REQUESTS + REPLIES:
        names = cls.__struct_fields__
        late = [k for k in _LATE_FIELDS if k in names]
        if not late:
            continue
        if len(late) > 1:   # not on the critical path (Registered): the dict way, always
            out[cls] = None
            continue
        (k,) = late
        if names[-1] != k:
            raise TypeError(f"{cls.__name__}: late field {k!r} must be declared last")
        default = cls.__struct_defaults__[-1]
        out[cls] = (k, default, _encoder.encode(k) + _encoder.encode(default))
    return out


_LATE_TAILS = _late_tails()
_BYTE = [bytes((i,)) for i in range(256)]


def encode(msg: ControlMessage) -> bytes:
    """`msg` as the msgpack bytes of `to_wire(msg)`'s map, encoded straight from the struct (no
    dict in between: ~10 against ~44 µs right after an idle wait on the 2-core box, once per
    control message on the round trip). A late field at its default is cut off the end of the
    map, as `to_wire` leaves it out."""
    tail = _LATE_TAILS.get(type(msg), ())
    if tail is None:
        return _encoder.encode(to_wire(msg))
    data = _encoder.encode(msg)
    if not tail:
        return data
    k, default, suffix = tail
    value = getattr(msg, k)
    if value is default or (value == default and type(value) is type(default)):
        head = data[0]
        if 0x81 <= head <= 0x8f and data.endswith(suffix):   # a fixmap: n - 1 entries
            # (a prepared one-byte head: bytes((head - 1,)) made this trim cost more than
            # the encode itself, ~2.2 against ~1 µs warm)
            return _BYTE[head - 1] + data[1:-len(suffix)]
    elif value:
        return data
    return _encoder.encode(to_wire(msg))   # a falsy non-default, or a long map: the dict way


#: An agent notification that carries a `Result` starts with these bytes (other notifications are
#: not ours to read).
RESULT_NOTIF = b"ssR1"
_result_enc = msgspec.msgpack.Encoder()
_result_dec = msgspec.msgpack.Decoder(Result)


def result_notif(msg: Result) -> bytes:
    """`msg` as the payload of a transfer agent's notification."""
    return RESULT_NOTIF + _result_enc.encode(msg)


def parse_result_notif(data: bytes) -> Result | None:
    """The `Result` a notification carries; None when it carries something else."""
    if not data.startswith(RESULT_NOTIF):
        return None
    try:
        return _result_dec.decode(memoryview(data)[len(RESULT_NOTIF):])
    except msgspec.ValidationError as e:
        raise ProtocolError(f"result notification: {e}") from None
