"""The route receipt's leg entries (fleet/legs/plan.py `route_of`) from the kv_cache_aware records
the router really builds (router/policy_kv.py `explain`, in every state its tests pin down:
unhealthy rows, ties, hot servers, unknown matches, more servers than rows, no key): each entry is
the key-by-key projection of the record, to the byte (same keys, same order, same values), whether
a row takes the copy path or the general one."""
from __future__ import annotations

import orjson
import pytest

from fleet.legs import plan
from tests.router.test_kv_choice import _states


def _projection(server: str, policy: str, explanation: dict) -> dict:
    """The entry as the route receipt defines it: the leg, the record's own keys among
    `_ROUTE_KEYS`, and its first `TOP_CANDIDATES` rows' `_CANDIDATE_KEYS`, key by key."""
    out = {"server": server, "policy": policy}
    out.update({k: explanation[k] for k in plan._ROUTE_KEYS if k in explanation})
    cands = explanation.get("candidates")
    if isinstance(cands, list) and cands:
        out["candidates"] = [{k: c[k] for k in plan._CANDIDATE_KEYS if k in c}
                             for c in cands[:plan.TOP_CANDIDATES] if isinstance(c, dict)]
    return out


@pytest.mark.parametrize("state", list(_states()), ids=lambda s: s[0])
def test_route_entry_is_the_projection_of_the_record(state):
    _, policy, cands, key, view = state
    d = policy.select(cands, key, view)
    record = dict(d.explanation, lease_ttl_s=30.0)
    got = plan.route_of(d.server, "kv_cache_aware", record)
    assert orjson.dumps(got) == orjson.dumps(_projection(d.server, "kv_cache_aware", record))
    assert got["candidates"] and all("load_tokens" not in c for c in got["candidates"])
    assert record["candidates"][0].keys() >= {"load_tokens"}      # the record itself is untouched


def test_rows_of_other_shapes_go_key_by_key():
    rows = [{"why": "unhealthy", "server": "u"},                              # another order
            {"server": "a", "matched_tokens": 1, "load_requests": 0, "load_tokens": 0, "score": 1,
             "why": "w", "extra": 1},                                         # an extra key
            {"server": "b", "matched_tokens": 1, "load_requests": 0, "score": 1, "why": "w"},
            "not a row"]
    expl = {"matched_tokens": 1, "reason": "r", "candidates": rows}
    got = plan.route_of("a", "kv_cache_aware", expl)
    assert orjson.dumps(got) == orjson.dumps(_projection("a", "kv_cache_aware", expl))
    assert list(got["candidates"][0]) == ["server", "why"]
