"""The value checks of a placement request that its decoder cannot make: a routing key against
the cluster's block size, exclusions as server urls. Each transport runs them once, where it
decodes the request (coordinator/api.py for HTTP bodies, coordinator/channel.py for channel frames,
`Coordinator.select`/`select_pair` for plain Python values); the coordinator's validated calls
(`place`, `place_pair`) take their results.
"""
from __future__ import annotations

from typing import Any

from protocol import coord as wire
from protocol.coord import BadRequest
from coordinator.registry import normalize_url
from router.policies import RoutingKey

__all__ = ["exclusions", "routing_key"]


def routing_key(rk: Any, block_size: int) -> RoutingKey | None:
    """Check a routing key against the cluster (block keys as u64, no more full blocks than
    `num_tokens` holds at this block size). A decoded wire struct (`wire.RoutingKeyBody`) or a
    conversation-id string has its types guaranteed by the decoder; a dict or `RoutingKey`
    from a Python caller is type-checked here."""
    if isinstance(rk, wire.RoutingKeyBody):   # first: the channel's and the HTTP API's decoded form
        keys, n, conv = rk.block_keys, rk.num_tokens, rk.conversation_id
    elif rk is None:
        return None
    elif isinstance(rk, str):
        return RoutingKey(block_keys=None, num_tokens=0, conversation_id=rk)
    else:
        keys, n, conv = _python_routing_key(rk)
    arr = None if keys is None else wire.block_keys_array(keys)
    if arr is not None:
        if n is None:
            n = int(arr.size) * block_size
        elif arr.size > n // block_size:
            raise BadRequest(f"{arr.size} block keys for {n} tokens: at block size "
                             f"{block_size} at most {n // block_size} full blocks exist",
                             "routing_key.block_keys")
    return RoutingKey(arr, n or 0, conv)


_NONE: frozenset[str] = frozenset()


def exclusions(exclude: Any, field_name: str) -> set[str] | frozenset[str]:
    """Server urls to leave out, normalised (BadRequest naming `field_name` otherwise); the
    result is read, never changed, by the placement calls."""
    if exclude is None:
        return _NONE
    if isinstance(exclude, str):
        exclude = [exclude]
    if not isinstance(exclude, (list, tuple, set, frozenset)):
        raise BadRequest("exclude must be a server url or a list of them", field_name)
    return {normalize_url(u, field_name) for u in exclude}


def _python_routing_key(rk: Any) -> tuple[Any, Any, Any]:
    """(block_keys, num_tokens, conversation_id) of a routing key a Python caller passed (a dict
    or a `RoutingKey`), type-checked: the part of the wire schema's job no decoder did."""
    if isinstance(rk, RoutingKey):
        keys, n, conv = rk.block_keys, rk.num_tokens, rk.conversation_id
    elif isinstance(rk, dict):
        unknown = set(rk) - {"block_keys", "num_tokens", "conversation_id"}
        if unknown:
            raise BadRequest(f"unknown routing_key field(s) {sorted(unknown)}: expected "
                             "block_keys, num_tokens, conversation_id",
                             f"routing_key.{sorted(unknown)[0]}")
        keys, n, conv = rk.get("block_keys"), rk.get("num_tokens"), rk.get("conversation_id")
    else:
        raise BadRequest(f"routing_key must be an object or a conversation id string, got "
                         f"{type(rk).__name__}", "routing_key")
    if n is not None and (type(n) is not int or n < 0):
        raise BadRequest(f"num_tokens must be a non-negative integer, got {n!r}",
                         "routing_key.num_tokens")
    if conv is not None and not isinstance(conv, str):
        raise BadRequest("conversation_id must be a string", "routing_key.conversation_id")
    return keys, n, conv
