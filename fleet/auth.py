"""Shared-secret checks of the fleet: public API keys and the HMAC on internal `disaggregated_params`.

`disaggregated_params` steer workers (which KV to pull from where), so a client must not be able to
forge them. A client-supplied object is forwarded only with header `x-splitserve-disagg-auth:
sha256=<hex>` = HMAC-SHA256(`internal_request_auth_key`, canonical JSON of the object) — canonical
meaning sorted keys, no whitespace (orjson `OPT_SORT_KEYS`). Otherwise only a positive
`disagg_request_id` survives (docs/design.md §3) and the rest is dropped. The fleet signs the
`disaggregated_params` it sends to workers the same way when the key is configured.
"""
from __future__ import annotations

import hashlib
import hmac

import orjson

AUTH_HEADER = "x-splitserve-disagg-auth"
_MAX_ID = (1 << 63) - 1


def _raw(header: str) -> bytes:
    """A header value's bytes: fleet/http_server.py keeps bytes that are not UTF-8 as surrogates."""
    return header.encode("utf-8", "surrogateescape")


def sign(key: str, params: dict) -> str:
    mac = hmac.new(key.encode(), orjson.dumps(params, option=orjson.OPT_SORT_KEYS), hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(key: str | None, params: dict, header: str | None) -> bool:
    if not key or not header:
        return False
    # bytes: compare_digest refuses non-ASCII str (a client's header may hold any byte)
    return hmac.compare_digest(sign(key, params).encode(), _raw(header.strip()))


def vet_client_params(params: dict | None, key: str | None, header: str | None) -> tuple[dict | None, int | None, bool]:
    """→ (params to forward or None, client request id or None, whether anything was stripped)."""
    if not params:
        return None, None, False
    request_id = params.get("disagg_request_id")
    request_id = request_id if isinstance(request_id, int) and not isinstance(request_id, bool) and 0 < request_id <= _MAX_ID else None
    if verify(key, params, header):
        return params, request_id, False
    stripped = any(k != "disagg_request_id" for k in params)
    return None, request_id, stripped


class ApiKeys:
    """Bearer-token check of the public API; an empty key set disables auth."""

    def __init__(self, keys):
        self._keys = [k.encode() for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> bool:
        if not self._keys:
            return True
        if not authorization or not authorization.startswith("Bearer "):
            return False
        got = _raw(authorization[7:].strip())
        ok = False
        for k in self._keys:   # compare against every key: timing does not reveal which one matched
            ok |= hmac.compare_digest(k, got)
        return ok
