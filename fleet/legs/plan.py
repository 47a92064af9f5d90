"""What a request's legs look like, decided without I/O: the answering leg's body and the
`x-splitserve-route` receipt. Every engine family's flow (fleet/flow.py, fleet/pd_flow.py) uses
these; the per-protocol bodies are in the sibling modules. Which mode a request is placed in, and
the context-fallback rule, are pairing's (router/pairing.py), shared with the coordinator.

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
LOCAL_PREFILL = Mode.LOCAL_PREFILL
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


def context_unreachable(status: int, code: str | None) -> bool:
    """The context leg's error says no context server could be reached (every retry spent), rather
    than a server that answered with an error: the case `no_context_fallback` may serve aggregated
    (router/pairing.py `PairRules.aggregates_after_context_loss`)."""
    return status in (502, 503) and code == "upstream_unavailable"


def kv_transferred(mode: str) -> bool:
    """The generation leg received its prompt's KV from the context leg (issue 39): its worker
    computed no prefix, so it reports no cached tokens whatever the KV index predicted. The
    client's `cached_tokens` are then the context leg's, and the generation leg's report is no
    predicted-vs-actual signal (its alarm could never hold)."""
    return mode == DISAGGREGATED


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


def route_start(request_id: int, mode: str, alias: int | None, engine_protocol: str | None = None) -> dict:
    """The route receipt as the flow starts its legs (legs add `context`, protocols add theirs)."""
    r: dict = {"id": request_id, "mode": mode}
    if engine_protocol is not None:
        r["protocol"] = engine_protocol
    if alias is not None:
        r["client_request_id"] = alias
    return r


# `fleet.route_header: short` keeps of each leg only what names no server and no load
_SHORT_LEG_KEYS = ("policy", "matched_tokens")


def route_header(route: dict, *, request_id: int, alias: int | None, mode: str, generation: dict | None = None,
                 attempts: dict | None = None, detail: str = "full") -> str | None:
    """The `x-splitserve-route` value of an answer: `route` (as the flow built it; not modified) with
    the final mode, the answering leg, and the retries per role when there were any. `detail` is
    `fleet.route_header`: None for off; short drops server URLs, loads, scores and candidates."""
    if detail == "off":
        return None
    r = dict(route) if route else {"id": request_id, "mode": mode}
    if alias is not None:
        r["client_request_id"] = alias
    r["mode"] = mode
    if generation is not None:
        r["generation"] = generation
    if attempts and any(attempts.values()):
        r["retries"] = dict(attempts)
    if detail == "short":
        for k, v in list(r.items()):
            if isinstance(v, dict):
                r[k] = {f: v[f] for f in _SHORT_LEG_KEYS if f in v}
    return orjson.dumps(r).decode()

