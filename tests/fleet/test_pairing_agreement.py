"""The coordinator and a fleet process place a pair of legs by the same rules (router/pairing.py).

A fleet process places pairs itself for `round_robin`, and for every policy while the coordinator
is unreachable (least in-flight); the coordinator places them with its registry and leases. Given
the same servers, config and sequence of placements, exclusions and finishes, both must reach the
same decisions: the same servers, the same mode, the same refusals. Both sides are the real objects:
a `Coordinator` whose servers were admitted through its registry, and a `Placer` whose coordinator
client points at a port nobody listens on (the real unreachable path, not a flag).
"""
from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.client import HttpCoordinatorClient
from coordinator.config import load_config
from coordinator.service import Coordinator
from fleet.placement import CTX, GEN, Placer
from protocol.failures import NoServerAvailable
from router.block_keys import KEY_SCHEME
from router.pairing import NoContextServer
from splitserve_testing import free_ports

DEAD = f"http://127.0.0.1:{free_ports()}"     # no coordinator listens here


def _urls(role: str, n: int) -> list[str]:
    base = 21000 if role == CTX else 22000
    return [f"http://127.0.0.1:{base + i}" for i in range(n)]


@st.composite
def scenarios(draw):
    n_ctx, n_gen = draw(st.integers(0, 3)), draw(st.integers(1, 3))
    fallback = draw(st.sampled_from(["aggregate", "reject"]))
    subsets = lambda n: st.frozensets(st.integers(0, max(0, n - 1)), max_size=n)  # noqa: E731
    op = st.one_of(
        st.tuples(st.just("pair"), subsets(n_ctx), subsets(n_gen)),
        st.tuples(st.just("finish"), st.integers(0, 40)),
    )
    return {
        "policy": draw(st.sampled_from(["round_robin", "load_balancing"])),
        "n_ctx": n_ctx, "n_gen": n_gen, "fallback": fallback,
        "max_local": draw(st.one_of(st.none(), st.integers(0, 64))),
        "ops": draw(st.lists(op, min_size=1, max_size=30)),
    }


def _config(sc: dict):
    cfg = {
        "context_servers": {"urls": _urls(CTX, sc["n_ctx"]), "router": {"type": sc["policy"]}},
        "generation_servers": {"urls": _urls(GEN, sc["n_gen"]), "router": {"type": sc["policy"]}},
        "no_context_fallback": sc["fallback"],
    }
    if sc["max_local"] is not None:
        cfg["conditional_disagg_config"] = {"max_local_prefill_length": sc["max_local"]}
    return load_config(cfg)


def _coordinator(cfg) -> Coordinator:
    """A coordinator whose listed servers passed their `/server_info` check (what its health loop
    records through the registry once a worker answers)."""
    c = Coordinator(cfg)
    for role, group in ((CTX, cfg.context_servers), (GEN, cfg.generation_servers)):
        for url in group.urls:
            c.registry.prepared(url, {"role": role, "block_size": cfg.routing.block_size,
                                      "key_scheme": KEY_SCHEME, "worker_id": url}, c.clock())
    return c


def _excluded(role: str, idx: frozenset[int], n: int) -> set[str]:
    urls = _urls(role, n)
    return {urls[i] for i in idx if i < n}


async def _both(sc: dict) -> tuple[list, list]:
    cfg = _config(sc)
    coord = _coordinator(cfg)
    client = HttpCoordinatorClient(DEAD, timeout_s=2.0, channel=False)
    placer = Placer(cfg, client, turn=0)
    on_coord, on_fleet = [], []
    placed: list[tuple[int, list]] = []     # (req_id, the fleet's placements) of each placed pair
    try:
        for i, op in enumerate(sc["ops"]):
            rid = 1000 + i
            if op[0] == "finish":
                if not placed:
                    continue
                req_id, legs = placed.pop(op[1] % len(placed))
                for p in legs:
                    assert coord.finish(p.role, req_id) is True
                    placer.track(p, -1)
                    placer.finish(p, True)
                continue
            ex_ctx, ex_gen = _excluded(CTX, op[1], sc["n_ctx"]), _excluded(GEN, op[2], sc["n_gen"])
            try:
                ans = coord.select_pair(rid, None, sorted(ex_ctx), sorted(ex_gen))
            except NoServerAvailable as e:
                on_coord.append(("refused", isinstance(e, NoContextServer)))
            else:
                ctx = ans["context"]
                on_coord.append((ctx["server"] if ctx else None, ans["generation"]["server"],
                                 str(ans["mode"])))
            try:
                ctx, gen, mode = await placer.place_pair(rid, None, ex_ctx, ex_gen)
            except NoServerAvailable as e:
                on_fleet.append(("refused", isinstance(e, NoContextServer)))
            else:
                on_fleet.append((ctx.server if ctx else None, gen.server, str(mode)))
                legs = [p for p in (ctx, gen) if p is not None]
                for p in legs:
                    assert not p.lease          # placed here: no coordinator lease to finish
                    placer.track(p, +1)
                placed.append((rid, legs))
    finally:
        await client.close()
    if placer.delegated(GEN) and on_fleet:
        assert not placer.coord_ok      # every delegated placement above was the local fallback
    # what the coordinator counts is what the fleet counts: in-flight legs per server
    for url in _urls(CTX, sc["n_ctx"]) + _urls(GEN, sc["n_gen"]):
        if sc["policy"] == "load_balancing":
            assert coord.load(url)[0] == placer._by_url[url].inflight
    return on_coord, on_fleet


@settings(max_examples=80, deadline=None)
@given(scenarios())
def test_coordinator_and_fleet_local_pairs_agree(sc):
    on_coord, on_fleet = asyncio.run(_both(sc))
    assert on_fleet == on_coord
    refused = [o for o in on_coord if o[0] == "refused"]
    # a context refusal is the reject rule's, never the aggregate one's
    assert all(not ctx_refused for _, ctx_refused in refused) or sc["fallback"] == "reject"
