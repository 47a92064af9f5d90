"""What a request's legs look like, decided without I/O: the answering leg's body, the placement
mode, the fallback rule, and the `x-splitserve-route` receipt. Every engine family's flow
(fleet/flow.py, fleet/pd_flow.py) uses these; the per-protocol bodies are in the sibling modules.

Modes (the route header's `mode`, the `splitserve_fleet_placements_total` label; the values are
`protocol.roles.Mode`'s, the coordinator's spelling):
- `aggregated` — no context servers configured, or a vetted client request carrying its own leg;
- `disaggregated` — a context leg, then (or, for SGLang, alongside) a generation leg;
- `generation_only` (LOCAL_PREFILL) — conditional disaggregation: the generation server caches
  nearly all of the prompt and computes the rest itself;
- `aggregate_fallback` — no healthy context server and `no_context_fallback: aggregate`;
- `no_kv_transfer` — the generation server cannot receive KV (or the engines differ): served there;
- `context_only` — the context leg already finished the request.
"""
from __future__ import annotations

import orjson

from protocol.roles import Mode
from router.policy_kv import ROW_KEYS as _KV_ROW

CHAT = "chat"
PATHS = {CHAT: "/v1/chat/completions", "completion": "/v1/completions"}

AGGREGATED = Mode.AGGREGATED
DISAGGREGATED = Mode.DISAGGREGATED
LOCAL_PREFILL = Mode.GENERATION_ONLY
AGGREGATED_FALLBACK = Mode.AGGREGATE_FALLBACK
NO_KV_TRANSFER = Mode.NO_KV_TRANSFER
CONTEXT_ONLY = Mode.CONTEXT_ONLY
MODES = tuple(Mode)

_ROUTE_KEYS = ("matched_tokens", "score", "reason", "load_requests")
_CANDIDATE_KEYS = ("server", "matched_tokens", "load_requests", "score", "why")
# A `kv_cache_aware` row (router/policy_kv.py `ROW_KEYS`, in that order): its entry is the row less
# `load_tokens`, a copy and a delete (two rows: 0.95 against 1.4 µs key by key, 2-core box; two
# legs per request). Any other row goes key by key.
assert tuple(k for k in _KV_ROW if k != "load_tokens") == _CANDIDATE_KEYS
TOP_CANDIDATES = 4


def answer_body(body: dict, stream: bool, include_usage: bool) -> dict:
    """The client's body for the leg that answers. A stream always asks the worker for usage (the
    routing-quality metrics need `cached_tokens`); the relay drops that chunk if the client did not
    ask for it (fleet/relay.py)."""
    out = dict(body)
    if stream and not include_usage:
        so = dict(out.get("stream_options") or {})
        so["include_usage"] = True
        out["stream_options"] = so
    return out


def with_params(body: dict, params: dict) -> dict:
    """A vetted (HMAC-signed) client request's own leg instruction, forwarded as is."""
    out = dict(body)
    out["disaggregated_params"] = params
    return out


def local_prefill(num_tokens: int | None, matched_tokens: int, max_local_prefill_length: int) -> bool:
    """Conditional disaggregation, when the fleet places the legs one by one: skip the context leg
    when the generation server already caches all but `max_local_prefill_length` prompt tokens."""
    return bool(num_tokens) and matched_tokens > 0 and num_tokens - matched_tokens <= max_local_prefill_length


def placed(mode: str, has_context: bool, receives_kv: bool) -> tuple[str, bool]:
    """(mode, whether the context leg runs) once the legs are placed: a generation server known
    not to receive KV (or of another engine family) serves the request alone, so the context leg
    would be wasted work."""
    if has_context and not receives_kv:
        return NO_KV_TRANSFER, False
    return mode, has_context


def falls_back_to_aggregate(status: int, code: str | None, no_context_fallback: str,
                            healthy_context_servers: int) -> bool:
    """A context leg that found no reachable server (every retry spent) is served aggregated on the
    generation server when the config says `aggregate` and no context server is usable any more."""
    return (status in (502, 503) and code == "upstream_unavailable" and no_context_fallback == "aggregate"
            and not healthy_context_servers)


def route_of(server: str, policy: str, explanation: dict) -> dict:
    """One leg's entry in the route header: its server and policy, and what the coordinator said
    about the choice (matched tokens, score, reason, load, the top candidates)."""
    out = {"server": server, "policy": policy}
    for k in _ROUTE_KEYS:
        if k in explanation:
            out[k] = explanation[k]
    cands = explanation.get("candidates")
    if isinstance(cands, list) and cands:
        out["candidates"] = [_candidate(c) for c in cands[:TOP_CANDIDATES] if isinstance(c, dict)]
    return out


def _candidate(row: dict) -> dict:
    """A candidate row's entry in the route header: its `_CANDIDATE_KEYS`, in that order."""
    if tuple(row) == _KV_ROW:
        c = row.copy()
        del c["load_tokens"]
        return c
    return {k: row[k] for k in _CANDIDATE_KEYS if k in row}


def route_start(rid: int, mode: str, alias: int | None, protocol: str | None = None) -> dict:
    """The route receipt as the flow starts its legs (legs add `context`, protocols add theirs)."""
    r: dict = {"id": rid, "mode": mode}
    if protocol is not None:
        r["protocol"] = protocol
    if alias is not None:
        r["client_request_id"] = alias
    return r


def route_header(route: dict, *, rid: int, alias: int | None, mode: str, generation: dict | None = None,
                 attempts: dict | None = None) -> str:
    """The `x-splitserve-route` value of an answer: `route` (as the flow built it; not modified) with
    the final mode, the answering leg, and the retries per role when there were any."""
    r = dict(route) if route else {"id": rid, "mode": mode}
    if alias is not None:
        r["client_request_id"] = alias
    r["mode"] = mode
    if generation is not None:
        r["generation"] = generation
    if attempts and any(attempts.values()):
        r["retries"] = dict(attempts)
    return orjson.dumps(r).decode()
