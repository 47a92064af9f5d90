"""The chart's coordinator replicas (docs/failover.md), rendered with `helm template`:
`coordinator.replicas` (default 2) gives a StatefulSet with stable pod DNS names, a headless
Service publishing them before readiness, a PodDisruptionBudget, anti-affinity across nodes, and
every replica in cluster.yaml (the fleet's ordered list, each replica finding itself by its pod
name) and in each worker's registration; `replicas: 1` keeps the single Recreate Deployment."""
from __future__ import annotations

import yaml

from coordinator.config import load_config
from coordinator.election import own_index
from tests.helm import chart as C


def _cfg(docs):
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "cluster.yaml" in d.get("data", {}))
    return load_config(yaml.safe_load(cm["data"]["cluster.yaml"]))


def test_default_is_two_replicas_with_pdb_and_anti_affinity(helm):
    docs = C.render(helm)
    sts = C.component(docs, "coordinator")
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert not [d for d in docs if d["kind"] == "Deployment"
                and d["metadata"]["name"] == sts["metadata"]["name"]], "a Deployment beside the replicas"
    hl = C.find(docs, "Service", sts["spec"]["serviceName"])
    assert hl["spec"]["clusterIP"] == "None" and hl["spec"]["publishNotReadyAddresses"] is True
    labels = C.pod_labels(sts)
    assert C.selector_matches({"matchLabels": hl["spec"]["selector"]}, labels)
    pdb = C.find(docs, "PodDisruptionBudget", sts["metadata"]["name"])
    assert pdb["spec"]["maxUnavailable"] == 1 and C.selector_matches(pdb["spec"]["selector"], labels)
    terms = C.pod_spec(sts)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    t = terms[0]["podAffinityTerm"]
    assert t["topologyKey"] == "kubernetes.io/hostname"
    assert C.selector_matches(t["labelSelector"], labels)

    cfg = _cfg(docs)
    ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
    port = int(C.arg_value(C.pod_spec(sts)["containers"][0]["args"], "--port"))
    want = [f"http://{name}-{i}.{hl['metadata']['name']}.{ns}.svc:{port}" for i in range(2)]
    assert list(cfg.coordinator.replicas) == want and cfg.topology == "external_coordinator"
    # each pod finds itself in the list by its host name (the StatefulSet's pod name)
    assert [own_index(want, f"{name}-{i}") for i in range(2)] == [0, 1]
    for role in ("context", "generation"):
        args = C.pod_spec(C.component(docs, role))["containers"][0]["args"]
        assert C.arg_value(args, "--coordinator-url") == ",".join(want)
    fleet = C.pod_spec(C.component(docs, "fleet"))["containers"][0]["args"]
    assert C.arg_value(fleet, "--coordinator-url") is None


def test_hard_anti_affinity_and_three_replicas(helm):
    docs = C.render(helm, sets=["coordinator.replicas=3", "coordinator.antiAffinity=hard"])
    sts = C.component(docs, "coordinator")
    assert sts["spec"]["replicas"] == 3
    req = C.pod_spec(sts)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert req[0]["topologyKey"] == "kubernetes.io/hostname"
    assert len(_cfg(docs).coordinator.replicas) == 3


def test_one_replica_keeps_the_recreate_deployment(helm):
    docs = C.render(helm, sets=["coordinator.replicas=1"])
    coord = C.component(docs, "coordinator")
    assert coord["kind"] == "Deployment" and coord["spec"]["strategy"]["type"] == "Recreate"
    assert "affinity" not in C.pod_spec(coord)
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"
                and d["metadata"]["name"] == coord["metadata"]["name"]]
    cfg = _cfg(docs)
    assert cfg.coordinator.replicas == () and cfg.disagg_coordinator_url
