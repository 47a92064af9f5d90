"""One readiness rule: a coordinator process and a fleet process given the same config and the same
workers report the same `/health` (`ClusterConfig.health_minimums`, coordinator/config_schema.py), and the
fleet's aggregated-only shortcut follows from the same minimums (`ClusterConfig.aggregated_only`).

Each case below is one where the three former copies of the rule (fleet/server.py, fleet/flow.py,
coordinator/service.py) disagreed: a context-only list, `no_context_fallback: reject` with
generation servers only, and no static list at all (workers register themselves).
"""
from __future__ import annotations

import json

import pytest

from .conftest import NO_SHEDDING, free_port, group, http, wait_for


@pytest.fixture(scope="module")
def workers(module_cluster):
    (_, ctx), (_, gen) = module_cluster.workers(("context", {"name": "ready-ctx"}),
                                                ("generation", {"name": "ready-gen"}))
    return ctx, gen


def _status(url: str) -> int:
    return http("GET", url + "/health", timeout=5)[0]


def _counts(fleet: str) -> tuple[int, int]:
    body = json.loads(http("GET", fleet + "/health", timeout=5)[2])
    return body["context_servers"], body["generation_servers"]


def _coord_counts(coord: str) -> tuple[int, int]:
    lists = json.loads(http("GET", coord + "/cluster_info", timeout=5)[2])["server_lists"]
    return len(lists["context"]), len(lists["generation"])


def _pair(cluster, name: str, **doc) -> tuple[str, str, object, object]:
    """A coordinator process and a one-process fleet on it, both loading the same config."""
    cport, port = free_port(), free_port()
    doc = {"coordinator": {"port": cport, **NO_SHEDDING}, **doc}
    ccfg = cluster.config(f"{name}-coord.yaml", port=cport + 1, **doc)
    coord = cluster.coordinator(ccfg, cport, name=f"{name}-coordinator")
    curl = f"http://127.0.0.1:{cport}"
    wait_for(lambda: http("GET", curl + "/version", timeout=2)[0] == 200, 60, "coordinator", coord)
    fcfg = cluster.config(f"{name}-fleet.yaml", port=port, **doc)
    fleet = cluster.fleet(fcfg, "--num-workers", 1, "--coordinator-url", curl, name=f"{name}-fleet")
    furl = f"http://127.0.0.1:{port}"
    wait_for(lambda: http("GET", furl + "/health", timeout=2)[0] in (200, 503), 90, "fleet", fleet)
    return curl, furl, coord, fleet


def _agree(curl: str, furl: str, counts: tuple[int, int], fleet) -> int:
    """Wait until both processes see `counts` healthy (context, generation) servers, then their
    /health must agree; returns the common status."""
    wait_for(lambda: _coord_counts(curl) == counts and _counts(furl) == counts, 60,
             f"both processes seeing {counts} healthy servers", fleet)
    st_coord, st_fleet = _status(curl), _status(furl)
    assert st_coord == st_fleet, (st_coord, st_fleet, http("GET", furl + "/health")[2])
    return st_coord


def test_context_only_list_is_ready_on_both(cluster, workers):
    ctx, _ = workers
    curl, furl, _, fleet = _pair(cluster, "ctxonly", context_servers=group([ctx]))
    assert _agree(curl, furl, (1, 0), fleet) == 200
    body = json.loads(http("GET", furl + "/health")[2])
    assert (body["min_context_servers"], body["min_generation_servers"]) == (1, 0)


def test_reject_fallback_needs_a_context_server_on_both(cluster, workers):
    _, gen = workers
    curl, furl, _, fleet = _pair(cluster, "reject", generation_servers=group([gen]),
                                 no_context_fallback="reject")
    assert _agree(curl, furl, (0, 1), fleet) == 503
    # Not aggregated-only: the flow asks for a context server and rejects (no_context_fallback).
    st, _, raw = http("POST", furl + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert st == 503 and json.loads(raw)["error"]["code"] == "no_context_server", raw


def test_generation_only_list_is_aggregated_and_ready_on_both(cluster, workers):
    _, gen = workers
    curl, furl, _, fleet = _pair(cluster, "aggr", generation_servers=group([gen]))
    assert _agree(curl, furl, (0, 1), fleet) == 200
    st, h, raw = http("POST", furl + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert st == 200, raw
    route = json.loads(h["x-splitserve-route"])
    assert route["mode"] == "aggregated" and "context" not in route


def test_registered_workers_need_both_roles_on_both(cluster):
    curl, furl, _, fleet = _pair(cluster, "dyn")
    _, gen = cluster.worker("generation", name="dyn-gen", extra=("--coordinator-url", curl))
    assert _agree(curl, furl, (0, 1), fleet) == 503
    _, ctx = cluster.worker("context", name="dyn-ctx", extra=("--coordinator-url", curl))
    assert _agree(curl, furl, (1, 1), fleet) == 200
    st, h, raw = http("POST", furl + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert st == 200, raw
    route = json.loads(h["x-splitserve-route"])
    assert route["mode"] == "disaggregated" and route["context"]["server"] == ctx, route
