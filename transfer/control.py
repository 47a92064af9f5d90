"""The control messages of KV transfer, one msgspec Struct each (the one place they are defined).

On the wire each is a msgpack map whose `t` names the type (msgspec's tag); `Messenger` carries
them. Who sends what (`gen` = a generation rank, `ctx` = a context rank):

    gen → ctx rank 0   GetInstance                        → Instance {ranks: [RankInfo bytes]}
    gen → ctx rank i   Register {info}                    → Registered | RegisterFailed {error}
    gen → ctx rank i   Recv {req, n, ids: [int64 bytes per group]}   (one whole-prompt receive)
    ctx → gen          Result {req, from, status, slices, span, last, meta}
    gen → ctx          Cancel {req}                       → Result {status: cancelled}
    gen → ctx rank 0   Claim {req}            (no reply: "a generation rank holds this request")
    either             Error {error}          (a request it could not parse)
"""
from __future__ import annotations

import enum
from typing import Union

import msgspec

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


class RegisterFailed(_Msg, tag="register_failed"):
    error: str
    key: str = ""


class Recv(_Msg, tag="recv"):
    req: int
    n: int
    ids: list[bytes]


class Result(_Msg, tag="result"):
    req: int
    sender: str = msgspec.field(name="from")
    status: ResultStatus = ResultStatus.OK
    error: str | None = None
    slices: tuple[int, int] = (0, 0)
    span: tuple[int, int] = (0, 0)
    last: bool = True
    meta: dict | None = None


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


def to_wire(msg: ControlMessage) -> dict:
    """The map `Messenger` packs (builtins only; bytes stay bytes)."""
    return msgspec.to_builtins(msg, builtin_types=(bytes,))
