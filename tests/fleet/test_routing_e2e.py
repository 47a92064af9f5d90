"""KV-aware routing's silent failures, through real processes: sim workers, an external
coordinator, a fleet. Each places real requests and reads where they landed (the
`x-splitserve-route` receipt) and what the worker reported cached
(`usage.prompt_tokens_details.cached_tokens`).

- `routing.namespace` configured: the coordinator's index must key events under it (it used to
  match nothing);
- a model directory whose chat template lives only in `chat_template.jinja`: the fleet must
  tokenize chats as the worker does (it used to miss the file);
- the key parity probe: a worker with another chat template or namespace is marked `kv_mismatch`
  with the differing field, counted, logged, placed by load, and verified again after a restart.
"""
from __future__ import annotations

import json

import pytest

from .conftest import free_port, http, metric, wait_for
from .routing_fixtures import (OTHER_TEMPLATE, cluster_info, coordinator_and_fleet, model_dir,
                               post, servers)

# Matches from the workers' KV events only: speculative entries for routed blocks would match a
# repeat on their own, whatever the index holds.
CONFIRMED_ONLY = {"track_routed_blocks": False}
PROMPT = "A shared system prompt that is long enough to fill several KV blocks of sixteen. " * 6


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def _repeat_lands_cached(url: str, path: str, body: dict, n_servers: int):
    """First placement, then repeats until the index has the prompt: → (first, receipt, usage)."""
    first, _ = post(url, path, body)
    seen = {}

    def hit():
        r, u = post(url, path, body)
        seen["r"], seen["u"] = r, u
        return r["generation"].get("matched_tokens", 0) > 0
    wait_for(hit, 15, f"a predicted prefix match for a repeated request over {n_servers} servers")
    return first["generation"]["server"], seen["r"], seen["u"]


def test_namespace_routes_with_matches(cluster):
    # The workers know no namespace (the default): the coordinator salts their event tokens.
    urls = [u for _, u in cluster.workers(*(("generation", {"name": f"ns-w{i}"}) for i in range(2)))]
    url, curl, _, _ = coordinator_and_fleet(cluster, gen_urls=urls, routing={"namespace": "tenant-a"},
                                            router_args=CONFIRMED_ONLY)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    first, r, u = _repeat_lands_cached(url, "/v1/completions", body, 2)
    g = r["generation"]
    assert g["server"] == first                       # landed where it is cached
    assert g["matched_tokens"] >= 16 * 4
    assert _cached(u) >= g["matched_tokens"]          # and the worker really reused it
    info = cluster_info(curl)
    assert info["routing"]["namespace"] == "tenant-a"
    assert all(s["kv_parity"]["status"] == "ok" for s in servers(info).values())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"good": model_dir(root, "good"), "other": model_dir(root, "other", OTHER_TEMPLATE),
            "none": model_dir(root, "none", None)}


def test_chat_template_jinja_only(cluster, dirs):
    m = ("--model", dirs["good"])
    urls = [u for _, u in cluster.workers(*(("generation", {"name": f"tpl-w{i}", "extra": m}) for i in range(2)))]
    url, _, _, _ = coordinator_and_fleet(cluster, gen_urls=urls, model=dirs["good"],
                                         router_args=CONFIRMED_ONLY)
    body = {"model": "good", "max_tokens": 2, "messages": [
        {"role": "system", "content": PROMPT}, {"role": "user", "content": "Say hello."}]}
    first, r, u = _repeat_lands_cached(url, "/v1/chat/completions", body, 2)
    g = r["generation"]
    assert g["server"] == first and g["matched_tokens"] > 0
    assert _cached(u) >= g["matched_tokens"]


def test_chat_without_any_template_is_a_400_naming_messages(cluster, dirs):
    _, w = cluster.worker("generation", name="notpl-w", extra=("--model", dirs["none"]))
    url, _, _, _ = coordinator_and_fleet(cluster, gen_urls=[w], model=dirs["none"])
    st, _, raw = http("POST", url + "/v1/chat/completions", {
        "model": "none", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    err = json.loads(raw)["error"]
    assert st == 400 and err["param"] == "messages" and "chat template" in err["message"], raw


def test_parity_probe_marks_mismatch_and_rechecks_after_restart(cluster, dirs):
    ns = ("--kv-namespace", "tenant-a")
    good = ("--model", dirs["good"], *ns)   # a worker told the cluster's namespace: also fine
    bport = free_port()
    (_, a), (pb, b), (_, c) = cluster.workers(
        ("generation", {"name": "par-good", "extra": good}),
        ("generation", {"name": "par-tpl", "port": bport, "extra": ("--model", dirs["other"], *ns)}),
        ("generation", {"name": "par-ns", "extra": ("--model", dirs["good"], "--kv-namespace", "tenant-b")}))
    url, curl, coord, _ = coordinator_and_fleet(cluster, gen_urls=[a, b, c], model=dirs["good"],
                                                routing={"namespace": "tenant-a"})

    def probed():
        s = servers(cluster_info(curl))
        return all(s[u]["kv_parity"] for u in (a, b, c)) and s
    s = wait_for(probed, 20, "parity probes of three servers")
    assert s[a]["kv_parity"]["status"] == "ok" and s[a]["kv_mismatch"] is None
    assert s[b]["kv_parity"]["status"] == "kv_mismatch" and s[b]["kv_mismatch"] == "chat_template"
    assert s[c]["kv_mismatch"] == "namespace"
    assert sorted(cluster_info(curl)["routing_diagnostics"]["kv_mismatch"]) == sorted([b, c])
    _, _, mtext = http("GET", curl + "/metrics")
    assert metric(mtext.decode(), "splitserve_coordinator_kv_key_mismatch_total", server=b,
                  field="chat_template") == 1
    log = coord.log()
    assert log.count(f"server {b}: KV key mismatch in chat_template") == 1

    # Placement: a mismatched server's matches are unknown, not zero; every request succeeds and
    # the receipt says why.
    body = {"model": "good", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}
    r, _ = post(url, "/v1/chat/completions", body)
    rows = {row["server"]: row for row in r["generation"]["candidates"]}
    assert "kv_mismatch" in rows[b]["why"] and "kv_mismatch" in rows[c]["why"]
    assert rows[b]["matched_tokens"] == 0

    # Restart the mismatched worker with the right template: verified again, under a new id.
    old_wid = s[b]["worker_id"]
    pb.stop()
    wait_for(lambda: not servers(cluster_info(curl))[b]["healthy"], 20, "b seen down")
    cluster.worker("generation", name="par-tpl-fixed", port=bport, extra=good)

    def fixed():
        sb = servers(cluster_info(curl))[b]
        return sb["healthy"] and sb["worker_id"] != old_wid and sb["kv_parity"]["status"] == "ok"
    wait_for(fixed, 30, "b re-probed after its restart")
    assert servers(cluster_info(curl))[b]["kv_mismatch"] is None
    assert "KV keys match again" in coord.log()


def test_predicted_vs_actual_alarm_on_a_worker_that_never_reuses(cluster):
    (_, good), (_, bad) = cluster.workers(("generation", {"name": "pva-good"}),
                                          ("generation", {"name": "pva-bad", "extra": ("--sim-prefix-reuse", "off")}))
    url, curl, coord, _ = coordinator_and_fleet(cluster, gen_urls=[good, bad])
    landed = {good: 0, bad: 0}
    for i in range(40):   # until both have had repeated prompts (placement decides which)
        body = {"model": "tiny", "prompt": f"conversation {i}: " + PROMPT, "max_tokens": 2}
        for _ in range(4):
            r, u = post(url, "/v1/completions", body)
            g = r["generation"]
            landed[g["server"]] += 1
            if g["server"] == bad:
                assert _cached(u) == 0      # the fault: events stored, nothing ever reused
        if min(landed.values()) >= 12:
            break
    assert min(landed.values()) >= 12, landed

    def alarmed():
        return bad in cluster_info(curl)["routing_diagnostics"]["prediction_alarm"]
    wait_for(alarmed, 10, "the predicted-vs-actual alarm for the worker that never reuses")
    s = servers(cluster_info(curl))
    pb, pg = s[bad]["routing_prediction"], s[good]["routing_prediction"]
    assert pb["alarm"] and pb["predicted_tokens"] > 0 and pb["actual_cached_tokens"] == 0
    assert pb["recent"]["ratio"] == 0.0
    assert not pg["alarm"] and pg["recent"]["ratio"] >= 0.9
    assert cluster_info(curl)["routing_diagnostics"]["prediction_alarm"] == [bad]
    _, _, m = http("GET", curl + "/metrics")
    text = m.decode()
    assert metric(text, "splitserve_coordinator_routing_prediction_alarm", server=bad) == 1
    assert metric(text, "splitserve_coordinator_routing_prediction_alarm", server=good) == 0
    assert metric(text, "splitserve_coordinator_routing_predicted_cached_tokens_total",
                  server=bad) == pb["predicted_tokens"]
    assert metric(text, "splitserve_coordinator_routing_actual_cached_tokens_total",
                  server=good) == pg["actual_cached_tokens"] > 0
    assert f"server {bad}: workers reported 0 cached tokens where routing predicted" in coord.log()
