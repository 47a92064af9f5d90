"""The worker PodDisruptionBudgets (templates/workers-pdb.yaml) and the autoscaling examples
(helm/splitserve/examples/autoscaling/): rendered with `helm template` and checked the way the API
server and the autoscalers would read them."""
from __future__ import annotations

import re

import pytest
import yaml

from tests.helm import chart as C
from tests.helm.conftest import CHART

ROOT = CHART.parents[1]
AUTOSCALING = CHART / "examples" / "autoscaling"


def _worker_pdbs(docs) -> dict[str, dict]:
    out = {}
    for p in C.by_kind(docs, "PodDisruptionBudget"):
        for role in ("context", "generation"):
            if C.selector_matches(p["spec"]["selector"], C.pod_labels(C.component(docs, role))):
                out[role] = p
    return out


def test_each_scaled_role_gets_a_budget_that_selects_only_its_workers(helm):
    docs = C.render(helm, sets=["workers.defaults.replicas=2", "workers.generation.replicas=3",
                                "workers.generation.pdb.maxUnavailable=2"])
    pdbs = _worker_pdbs(docs)
    assert set(pdbs) == {"context", "generation"}
    assert pdbs["context"]["spec"]["maxUnavailable"] == 1
    assert pdbs["generation"]["spec"]["maxUnavailable"] == 2
    assert pdbs["context"] is not pdbs["generation"]
    # a role's budget never counts the other role's pods, nor the control plane's
    for role, pdb in pdbs.items():
        for comp in ("context", "generation", "fleet", "coordinator"):
            matches = C.selector_matches(pdb["spec"]["selector"], C.pod_labels(C.component(docs, comp)))
            assert matches == (comp == role), (role, comp)
    assert not C.check_autoscaling(docs)


def test_no_budget_for_a_single_replica_role_or_when_disabled(helm):
    # one replica: a budget allowing no eviction would block every node drain
    assert _worker_pdbs(C.render(helm)) == {}
    docs = C.render(helm, sets=["workers.defaults.replicas=2", "workers.context.pdb.enabled=false"])
    assert set(_worker_pdbs(docs)) == {"generation"}


def test_worker_budgets_validate(helm, kubernetes_validate):
    docs = C.render(helm, sets=["workers.defaults.replicas=2", "workers.defaults.pdb.maxUnavailable=50%"])
    pdbs = _worker_pdbs(docs)
    assert pdbs["context"]["spec"]["maxUnavailable"] == "50%"
    for p in pdbs.values():
        kubernetes_validate.validate(p, "1.30", strict=True)


def test_a_bad_budget_is_rejected_by_the_schema(helm):
    r = C.run_helm(helm, "template", "rel", str(CHART), "--set", "workers.defaults.pdb.maxUnavailable=0")
    assert r.returncode != 0 and "maxUnavailable" in r.stderr


def _metrics_doc_names() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(splitserve_\w+)`", text, re.M))


@pytest.mark.parametrize("path", sorted(AUTOSCALING.glob("*.yaml")), ids=lambda p: p.name)
def test_autoscaling_examples_target_the_rendered_workers_on_exported_metrics(helm, path):
    docs = C.render(helm, release="llama", namespace="llm")
    objs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert objs
    documented = _metrics_doc_names()
    for o in objs:
        assert o["metadata"]["namespace"] == "llm"
        ref = o["spec"]["scaleTargetRef"]
        target = C.find(docs, ref["kind"], ref["name"])
        assert target is not None, f"{ref['kind']}/{ref['name']} is not rendered by the chart"
        assert ref["apiVersion"] == target["apiVersion"]
        assert C.pod_labels(target)["app.kubernetes.io/component"] in ("context", "generation")
        text = yaml.safe_dump(o["spec"])
        used = set(re.findall(r"\bsplitserve_[a-z0-9_]+", text))
        assert used and used <= documented, used - documented


def test_the_hpa_example_validates(kubernetes_validate):
    (hpa,) = [d for d in yaml.safe_load_all((AUTOSCALING / "hpa-external-metric.yaml").read_text()) if d]
    kubernetes_validate.validate(hpa, "1.30", strict=True)
