"""SGLang's prefill/decode legs (bootstrap rendezvous), as SGLang's own router sends them in PD mode:
sglang-router 0.3.2 `--pd-disaggregation` (captured in tests/fleet/peers/fixtures/sglang-router-0.3.2.json)
sends the client's body to the prefill and the decode server at the same time, each with
`bootstrap_host` (the prefill server's host), `bootstrap_port` (its bootstrap server's port) and one
`bootstrap_room`, and relays the decode answer. The fields are SGLang's `PDRoutingFields` (sglang
0.5.23, sglang/srt/entrypoints/openai/protocol.py); the bootstrap port is the prefill server's
`--disaggregation-bootstrap-port` (default 8998, sglang/srt/arg_groups/fields/disagg.py), which its
`/server_info` reports as `disaggregation_bootstrap_port`.

Differences from SGLang's router, on purpose:
- the room is the request's snowflake id (already < 2**63, unique and time-ordered), not a random
  number, so the room, the logs and the coordinator's lease all name the request the same way;
- both legs carry `rid` (the request id SGLang's OpenAI request accepts), so a client that hangs up
  is aborted on both engines with `POST /abort_request {"rid": ...}` (sglang/srt/entrypoints/
  http_server.py `abort_request`), not only by closing the connections (which is all the router
  does: a decode waiting for a prefill that never comes would otherwise hold its slot).
"""
from __future__ import annotations

from urllib.parse import urlsplit

NAME = "sglang"
SEQUENTIAL = False         # both legs at once; they meet at the prefill's bootstrap server
ALLOWS_LOCAL_PREFILL = False      # a decode-mode SGLang server needs a prefill (no conditional aggregation)
ABORT_PATH = "/abort_request"
DEFAULT_BOOTSTRAP_PORT = 8998
ROOM_BITS = 63


def rid_of(request_id: int) -> str:
    return str(request_id)


def abort_body(request_id: int) -> dict | None:
    return {"rid": rid_of(request_id)}


def room_of(request_id: int) -> int:
    if not 0 <= request_id < 1 << ROOM_BITS:
        raise ValueError(f"expected a request id in [0, 2**63) for bootstrap_room, found {request_id}")
    return request_id


def bootstrap_port(configured: int | None, info: dict | None) -> int:
    """The prefill server's bootstrap port: its group's `bootstrap_port`, else what its `/server_info`
    reports, else SGLang's default."""
    if configured is not None:
        return configured
    if isinstance(info, dict):
        p = info.get("disaggregation_bootstrap_port")
        if type(p) is int and 0 < p < 65536:
            return p
    return DEFAULT_BOOTSTRAP_PORT


def bootstrap_host(prefill_url: str) -> str:
    host = urlsplit(prefill_url).hostname
    if not host:
        raise ValueError(f"expected a prefill server URL like http://host:port, found {prefill_url!r}")
    return host


def leg_body(body: dict, host: str, port: int, room: int, request_id: int) -> dict:
    """The body of both legs (prefill and decode get the same one)."""
    out = dict(body)
    out["bootstrap_host"] = host
    out["bootstrap_port"] = port
    out["bootstrap_room"] = room
    out["rid"] = rid_of(request_id)
    return out
