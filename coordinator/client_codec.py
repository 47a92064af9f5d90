"""The coordinator client's codec: one mapping from calls to request bodies (the API's own
request structs, `protocol.coord.SelectBody` …) and from answers to results or typed errors, shared by every transport (coordinator/client.py: in-process, HTTP over
TCP or a Unix socket, the fleet's pooled HTTP in fleet/coord_client.py) and by the persistent
channel (coordinator/channel_client.py), so no transport decides on its own what an answer means.

Errors (protocol/coord.py):
- `NoServerAvailable` — a placement (`/select`, `/select_pair`) answered 503: no server fits;
- `CoordinatorOverloaded` — 429: the coordinator shed the call, `retry_after` seconds;
- `CoordinatorRequestError` — it rejected the call (400/404/415), with `.field` when known;
- `CoordinatorUnavailable` — it could not be reached, timed out, or failed (other 5xx);
- `NotServing` (a `CoordinatorUnavailable`) — 421: this replica defers to another (`.serving`).
"""
from __future__ import annotations

from typing import Any

from protocol.channel import wire_key
from protocol.failures import Cause
from protocol.coord import (BadRequest, CoordinatorOverloaded, CoordinatorRequestError,
                            CoordinatorUnavailable, FinishBody, FirstTokenBody, IdentityBody,
                            IdentityReleaseBody, LeaseRecord, LeasesBody, NoServerAvailable,
                            NotServing, RenewBody, SelectBody, SelectPairBody, encode_msgpack)

SELECT = "/select"
SELECT_PAIR = "/select_pair"
FINISH = "/finish"
RENEW = "/renew"
FIRST_TOKEN = "/first_token"
CLUSTER_INFO = "/cluster_info"
HEALTH = "/health"
IDENTITY = "/identity"
IDENTITY_RELEASE = "/identity/release"
LEASES = "/leases"
REPLICA = "/replica"
PLACEMENTS = frozenset({SELECT, SELECT_PAIR})
HOT = frozenset({SELECT, SELECT_PAIR, FINISH, RENEW, FIRST_TOKEN})     # per request: the fast transports' calls


def _excl(v: Any) -> Any:
    if v is None or isinstance(v, (str, list)):
        return v
    return list(v)


def _key(rk: Any, wire: bool) -> Any:
    return wire_key(rk) if wire and rk is not None else rk


def select_body(role: str, req_id: int, routing_key: Any = None, exclude: Any = None,
                wire: bool = True) -> SelectBody:
    """`wire=False`: the routing key stays as given (an in-process coordinator reads every form)."""
    return SelectBody(role, req_id, _key(routing_key, wire), _excl(exclude) if exclude else None)


def select_pair_body(req_id: int, routing_key: Any = None, exclude_ctx: Any = None,
                     exclude_gen: Any = None, wire: bool = True) -> SelectPairBody:
    return SelectPairBody(req_id, _key(routing_key, wire), _excl(exclude_ctx) if exclude_ctx else None,
                          _excl(exclude_gen) if exclude_gen else None)


def finish_body(role: str, req_id: int, success: bool = True, usage: dict | None = None) -> FinishBody:
    # `usage` stays the caller's mapping: the coordinator checks it and names a bad field (400).
    return FinishBody(role, req_id, bool(success), usage)


def renew_body(role: str, req_id: int) -> RenewBody:
    return RenewBody(role, req_id)


def first_token_body(role: str, req_id: int) -> FirstTokenBody:
    return FirstTokenBody(role, req_id)


def identity_body(holder: str, node_id: int | None = None, process_id: int | None = None) -> IdentityBody:
    if node_id is None or process_id is None:
        return IdentityBody(holder)
    return IdentityBody(holder, node_id, process_id)


def identity_release_body(holder: str, end_leases: bool = False) -> IdentityReleaseBody:
    return IdentityReleaseBody(holder, end_leases)


def leases_body(leases) -> LeasesBody:
    """`leases`: `(role, req_id, server, tokens, started)` tuples."""
    return LeasesBody([LeaseRecord(*rec) for rec in leases])


def encode(body: Any) -> bytes:
    """A request body (one of the `protocol.coord` request structs) as the msgpack the API reads."""
    return encode_msgpack(body)


def renewed(ans: Any) -> bool:
    return bool(ans.get("renewed")) if isinstance(ans, dict) else False


def released(ans: Any) -> bool:
    return bool(ans.get("released")) if isinstance(ans, dict) else False


def identity(ans: Any) -> tuple[int, int]:
    return int(ans["node_id"]), int(ans["process_id"])


def answer_or_raise(url: str, path: str, status: int, obj: Any, raw: bytes) -> Any:
    """The decoded body `obj` of a 200 answer to `path`; for any other status, its typed error."""
    if status == 200:
        return obj
    raise error_of(url, path, status, obj, raw)


def error_of(url: str, path: str, status: int, obj: Any, raw: bytes) -> Exception:
    """The typed error of a non-200 answer to `path` (over HTTP or the channel, whose statuses are
    HTTP's: protocol/channel.py).

    `obj` is None when the body was not one the coordinator writes (an error page from a proxy);
    the message then quotes the start of `raw`. 503 means "no server fits" only for the placement
    calls; elsewhere it is the coordinator failing.
    """
    msg = obj.get("error") if isinstance(obj, dict) else None
    msg = msg if isinstance(msg, str) else raw[:200].decode("utf-8", "replace")
    if status == 503 and path in PLACEMENTS:
        return NoServerAvailable(msg)
    if status == 421:
        serving = obj.get("serving") if isinstance(obj, dict) else None
        return NotServing(msg, serving if isinstance(serving, str) else None)
    if status == 429:
        ra = obj.get("retry_after") if isinstance(obj, dict) else None
        return CoordinatorOverloaded(msg, float(ra) if isinstance(ra, (int, float)) else 1.0)
    if 400 <= status < 500:
        return CoordinatorRequestError(status, msg, obj.get("field") if isinstance(obj, dict) else None)
    return CoordinatorUnavailable(f"coordinator {url} answered {status} for {path}: {msg}",
                                  Cause.UPSTREAM_5XX)


def rejected(exc: BadRequest) -> CoordinatorRequestError:
    """A coordinator's own validation error as the client's (the in-process transport's 400)."""
    return CoordinatorRequestError(400, exc.message, exc.field)
