"""Offline validation of the Helm chart (helm/splitserve): lint, render, schema-validate the
manifests for two Kubernetes versions, reject bad values, and check what a real API server or
controller would reject but schema validation misses. No cluster exists here (see the chart
README, "What is validated").
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from tests.helm import chart as C
from tests.helm.conftest import CHART

KUBE_VERSIONS = ["1.25.0", "1.34.0"]  # the chart's kubeVersion floor and a recent release
VALUE_SET_NAMES = list(C.VALUE_SETS)


def _declared_secrets(name: str) -> set[str]:
    files, sets, _ = C.VALUE_SETS[name]
    declared = set()
    for f in files:
        auth = (yaml.safe_load(f.read_text()) or {}).get("auth") or {}
        declared |= {v.get("existingSecret") for v in auth.values() if v.get("existingSecret")}
    declared |= {s.split("=", 1)[1] for s in sets if s.startswith("auth.") and ".existingSecret=" in s}
    return declared


def test_examples_exist():
    assert {p.stem for p in C.EXAMPLES} == {"cpu-demo", "gpu-1p1d", "xpyd-multinode"}


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_lint_strict(helm, name):
    files, sets, apis = C.VALUE_SETS[name]
    args = ["lint", "--strict", str(CHART)]
    for f in files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    proc = C.run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_manifests_validate_strict(helm, kubernetes_validate, name, kube_version):
    docs = C.render_set(helm, name, kube_version=kube_version)
    assert docs, "nothing rendered"
    problems = []
    for d in docs:
        if d["apiVersion"] == C.MONITORING_API:
            continue  # a CRD: no schema in kubernetes-validate; checked below with our own schema
        try:
            kubernetes_validate.validate(d, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{d['kind']}/{d['metadata']['name']}: {e.message} at "
                            f"{'.'.join(map(str, e.path))}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_api_server_rules(helm, name):
    docs = C.render_set(helm, name)
    problems = C.all_checks(docs, _declared_secrets(name))
    assert not problems, "\n".join(problems)


# The parts of monitoring.coreos.com/v1 ServiceMonitor the chart emits; unknown fields rejected
# (the CRD validators available offline accept unknown fields).
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "additionalProperties": False, "required": ["name", "namespace"],
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["key", "operator"],
                        "properties": {"key": {"type": "string"},
                                       "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                       "values": {"type": "array", "items": {"type": "string"}}}}}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "scrapeTimeout": {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                    }}},
            }},
    },
}


def test_service_monitor_gated_on_crd_and_valid(helm):
    sets = ["metrics.serviceMonitor.enabled=true"]
    without = C.render(helm, sets=sets)
    assert not C.by_kind(without, "ServiceMonitor"), "rendered without monitoring.coreos.com/v1"
    docs = C.render(helm, sets=sets, api_versions=[C.MONITORING_API])
    sms = C.by_kind(docs, "ServiceMonitor")
    assert len(sms) == 2
    for sm in sms:
        jsonschema.validate(sm, SERVICE_MONITOR_SCHEMA)
    assert not C.check_monitoring(docs)
    # Every Service of the release is scraped by exactly one ServiceMonitor, but the coordinator
    # replicas' headless Service (pod DNS records only: its pods are scraped through the Service).
    for svc in C.by_kind(docs, "Service"):
        if svc["metadata"]["labels"].get("app.kubernetes.io/component") == "coordinator-replicas":
            continue
        n = sum(C.selector_matches(sm["spec"]["selector"], svc["metadata"]["labels"]) for sm in sms)
        assert n == 1, f"Service/{svc['metadata']['name']} is selected by {n} ServiceMonitors"


def test_notes(helm, tmp_path):
    sets = ["metrics.serviceMonitor.enabled=true"]
    notes = C.render_notes(helm, tmp_path / "a", sets)
    assert "no ServiceMonitor was created" in notes, "enabled without the CRD: NOTES must say why"
    assert "not signed" in notes, "no HMAC Secret: NOTES must warn"
    docs = C.render(helm, sets=sets)
    for kind, name in re.findall(r"(deployment|service)/([a-z0-9-]+)", notes):
        assert C.find(docs, kind.capitalize(), name), f"NOTES names {kind}/{name}, which is not rendered"
    notes = C.render_notes(helm, tmp_path / "b", sets + ["auth.internalAuth.existingSecret=h",
                                                         "auth.apiKeys.existingSecret=k"], [C.MONITORING_API])
    assert "ServiceMonitor" not in notes and "not signed" not in notes
    assert "authorization: Bearer" in notes


BAD_VALUES = [
    # (--set args, expected fragment of helm's error)
    (["fleet.numWorkers=0"], "fleet.numWorkers"),
    (["fleet.port=http"], "fleet.port"),
    (["fleet.replicaz=2"], "replicaz"),
    (["coordinator.replicas=0"], "coordinator.replicas"),
    (["coordinator.antiAffinity=maybe"], "coordinator.antiAffinity"),
    (["cluster.context.router.type=random"], "cluster.context.router.type"),
    (["cluster.scheduleStyle=whatever"], "cluster.scheduleStyle"),
    (["cluster.routing.blockSize=0"], "cluster.routing.blockSize"),
    (["workers.context.tpSize=0"], "workers.context.tpSize"),
    (["workers.generation.device=tpu"], "workers.generation.device"),
    (["workers.defaults.engine=vllm"], "workers.defaults.engine"),
    (["workers.context.ports.http=70000"], "workers.context.ports.http"),
    (["auth.apiKeys.value=sk-inline"], "value"),
    (["auth.internalAuth.existingSecret=Not_A_Name"], "auth.internalAuth.existingSecret"),
    (["fleet.resources.requests.cpu=lots"], "fleet.resources.requests.cpu"),
    (["workers.defaults.modelVolume.hostPath=/m", "workers.defaults.modelVolume.persistentVolumeClaim=w"],
     "workers.defaults.modelVolume"),
    (["fleet.probes.liveness.successThreshold=2"], "fleet.probes.liveness.successThreshold"),
    (["metrics.serviceMonitor.interval=15"], "metrics.serviceMonitor.interval"),
]
# Cross-field rules that JSON Schema cannot express, enforced by the templates (`fail`). They stop
# `helm template/install/upgrade`; `helm lint` only logs a template `fail` as INFO.
BAD_COMBINATIONS = [
    (["fleet.hpa.enabled=true", "fleet.hpa.minReplicas=5", "fleet.hpa.maxReplicas=2"], "minReplicas (5)"),
    (["fleet.hpa.enabled=true", "fleet.resources.requests=null"], "fleet.resources.requests.cpu"),
    (["workers.context.ports.kvEvents=8100"], "four different ports"),
    (["workers.context.enabled=false"], "no context servers"),
    (["workers.generation.engine=sim"], "engine sim runs no model"),
    (["workers.context.drainTimeoutSeconds=90"], "must exceed drainTimeoutSeconds"),
    (["fleet.drainTimeoutSeconds=58"], "fleet.terminationGracePeriodSeconds (60)"),
    (["workers.defaults.tpSize=2"], "one device per worker"),
]


@pytest.mark.parametrize("sets,fragment,cmds", [(s, f, ("template", "lint")) for s, f in BAD_VALUES]
                         + [(s, f, ("template",)) for s, f in BAD_COMBINATIONS],
                         ids=[";".join(s) for s, _ in BAD_VALUES + BAD_COMBINATIONS])
def test_bad_values_rejected(helm, sets, fragment, cmds):
    variants = {"template": ["template", "rel", str(CHART)], "lint": ["lint", "--strict", str(CHART)]}
    for cmd in (variants[c] for c in cmds):
        args = list(cmd)
        for s in sets:
            args += ["--set", s]
        proc = C.run_helm(helm, *args)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"helm {cmd[0]} accepted {sets}:\n{out[-500:]}"
        assert fragment in out, f"helm {cmd[0]} error does not mention {fragment!r}:\n{out[-800:]}"


def test_static_urls_without_workers(helm):
    """A role may be served only by static urls (e.g. an existing engine fleet)."""
    docs = C.render(helm, sets=["workers.context.enabled=false", "cluster.context.urls[0]=10.0.0.7:8000"])
    assert not any(C.pod_labels(w).get("app.kubernetes.io/component") == "context" for w in C.workloads(docs))
    cfg = _cluster_yaml(docs)
    assert cfg["context_servers"]["urls"] == ["10.0.0.7:8000"]


def _cluster_yaml(docs) -> dict:
    cms = [d for d in C.by_kind(docs, "ConfigMap") if "cluster.yaml" in d.get("data", {})]
    assert len(cms) == 1, f"expected one ConfigMap with cluster.yaml, found {len(cms)}"
    return yaml.safe_load(cms[0]["data"]["cluster.yaml"])


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_cluster_config_loads_and_matches_workloads(helm, name):
    """The rendered cluster.yaml passes the coordinator's own strict loader, and the processes agree
    with it (ports, coordinator URL, block size, registration TTL)."""
    from coordinator.config import load_config

    docs = C.render_set(helm, name)
    raw = _cluster_yaml(docs)
    cfg = load_config(raw, env={"SPLITSERVE_API_KEYS": "k1,k2"})
    assert cfg.topology == "external_coordinator"
    coord = C.component(docs, "coordinator")
    fleet = C.component(docs, "fleet")
    coord_svc = C.find(docs, "Service", coord["metadata"]["name"])
    ns = coord["metadata"]["namespace"]
    svc_port = next(p["port"] for p in coord_svc["spec"]["ports"] if p["name"] == "http")
    url = f"http://{coord_svc['metadata']['name']}.{ns}.svc:{svc_port}"
    assert cfg.disagg_cluster is not None and cfg.disagg_cluster.cluster_uri == url
    fargs = fleet["spec"]["template"]["spec"]["containers"][0]["args"]
    assert fargs[0] == "serve"
    if coord["kind"] == "StatefulSet":
        # replicas (docs/failover.md): the fleet walks the ordered list, workers register with all
        hl = coord["spec"]["serviceName"]
        reps = [f"http://{coord['metadata']['name']}-{i}.{hl}.{ns}.svc:{cfg.coordinator.port}"
                for i in range(coord["spec"]["replicas"])]
        assert list(cfg.coordinator.replicas) == reps and cfg.disagg_coordinator_url is None
        assert C.arg_value(fargs, "--coordinator-url") is None
        url = ",".join(reps)
    else:
        assert cfg.disagg_coordinator_url == url
        assert C.arg_value(fargs, "--coordinator-url") == url
    assert int(C.arg_value(fargs, "--port")) == cfg.port
    assert int(C.arg_value(fargs, "--num-workers")) == cfg.num_workers
    assert fleet["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == cfg.port

    cargs = coord["spec"]["template"]["spec"]["containers"][0]["args"]
    assert cargs[0] == "coordinator"
    assert int(C.arg_value(cargs, "--port")) == cfg.coordinator.port

    for role in ("context", "generation"):
        try:
            w = C.component(docs, role)
        except AssertionError:
            continue
        c = w["spec"]["template"]["spec"]["containers"][0]
        args = c["args"]
        assert args[0] == "worker" and C.arg_value(args, "--role") == role
        assert C.arg_value(args, "--coordinator-url") == url
        assert int(C.arg_value(args, "--block-size")) == cfg.routing.block_size
        assert float(C.arg_value(args, "--register-ttl")) == cfg.disagg_cluster.inactive_timeout_sec
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(C.arg_value(args, "--port")) == ports["http"]
        assert int(C.arg_value(args, "--kv-events-port")) == ports["kv-events"]
        assert int(C.arg_value(args, "--kv-replay-port")) == ports["kv-replay"]
        assert int(C.arg_value(args, "--transfer-port")) == ports["kv-xfer"]
        gpus = (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")
        ranks = int(C.arg_value(args, "--tp-size")) * int(C.arg_value(args, "--pp-size"))
        if C.arg_value(args, "--device") == "cuda":
            assert gpus == ranks, f"{role}: {ranks} TP*PP ranks but {gpus} GPUs requested"
        else:
            assert gpus is None, f"{role}: a CPU worker requests {gpus} GPUs"


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_control_plane_and_security(helm, name):
    docs = C.render_set(helm, name)
    coord = C.component(docs, "coordinator")
    if coord["kind"] == "Deployment":    # one coordinator: never two side by side
        assert coord["spec"]["replicas"] == 1 and coord["spec"]["strategy"]["type"] == "Recreate"
    else:                                # replicas: tests/helm/test_coordinator_replicas.py
        assert coord["kind"] == "StatefulSet" and coord["spec"]["replicas"] >= 2
    for w in C.workloads(docs):
        spec = C.pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        comp = C.pod_labels(w)["app.kubernetes.io/component"]
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert "ALL" in sc["capabilities"]["drop"]
            if comp in ("coordinator", "fleet"):
                assert sc["readOnlyRootFilesystem"] is True
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert "/tmp" in mounts, f"{comp}: read-only root needs a writable /tmp"
        annotations = w["spec"]["template"]["metadata"].get("annotations") or {}
        assert annotations.get("prometheus.io/scrape") == "true"
        port = int(annotations["prometheus.io/port"])
        assert port in [p["containerPort"] for c in spec["containers"] for p in c.get("ports") or []]
        for c in spec["containers"]:
            for e in c.get("env") or []:
                assert "value" not in e or not re.search(r"(KEY|TOKEN|SECRET|PASSWORD)S?$", e["name"]), \
                    f"credential {e['name']} inlined as a plain value"


def test_secrets_referenced_never_inlined(helm):
    """Credentials come from existing Secrets into the fleet only, and the real config loader turns
    that environment into the fleet's API keys and HMAC key; the coordinator, reading the same
    cluster.yaml without them, still starts."""
    from coordinator.config import apply_overrides, load_config

    docs = C.render_set(helm, "xpyd-multinode")
    assert not C.by_kind(docs, "Secret"), "the chart must not create Secrets holding credentials"
    raw = _cluster_yaml(docs)
    assert not {"api_keys", "api_keys_env", "internal_request_auth_key"} & set(raw)
    fleet = C.component(docs, "fleet")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in fleet["env"]}
    assert env["SPLITSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "splitserve-api-keys", "key": "api-keys"}
    assert env["SPLITSERVE_INTERNAL_REQUEST_AUTH_KEY"]["valueFrom"]["secretKeyRef"] == \
        {"name": "splitserve-hmac", "key": "hmac-key"}
    secret_values = {"SPLITSERVE_API_KEYS": "key-one,key-two", "SPLITSERVE_INTERNAL_REQUEST_AUTH_KEY": "h" * 64}
    fleet_env = {k: e.get("value", secret_values.get(k)) for k, e in env.items()}
    cfg = apply_overrides(load_config(raw, env=fleet_env), env=fleet_env)
    assert cfg.api_keys == ("key-one", "key-two")
    assert cfg.internal_request_auth_key == "h" * 64
    for comp in ("coordinator", "context", "generation"):
        cenv = C.component(docs, comp)["spec"]["template"]["spec"]["containers"][0].get("env") or []
        leaked = [e["name"] for e in cenv if "secretKeyRef" in (e.get("valueFrom") or {})]
        assert not leaked, f"{comp} receives credentials it does not use: {leaked}"
    coord_cfg = load_config(raw, env={})
    assert coord_cfg.api_keys == () and coord_cfg.internal_request_auth_key is None


def test_config_change_rolls_control_plane(helm):
    a = C.render(helm)
    b = C.render(helm, sets=["cluster.context.router.type=round_robin"])
    for comp in ("coordinator", "fleet"):
        ca = C.component(a, comp)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        cb = C.component(b, comp)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        assert ca != cb, f"{comp} pods would keep running with the old cluster.yaml"


def test_statefulset_workers_advertise_stable_names(helm):
    docs = C.render_set(helm, "xpyd-multinode")
    for role in ("context", "generation"):
        w = C.component(docs, role)
        assert w["kind"] == "StatefulSet"
        args = w["spec"]["template"]["spec"]["containers"][0]["args"]
        assert C.arg_value(args, "--advertise-host") == \
            f"$(POD_NAME).{w['spec']['serviceName']}.$(POD_NAMESPACE).svc"
    docs = C.render_set(helm, "cpu-demo")
    args = C.component(docs, "context")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert C.arg_value(args, "--advertise-host") == "$(POD_IP)"


def test_hpa_and_pdb(helm):
    docs = C.render_set(helm, "xpyd-multinode")
    (hpa,) = C.by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == C.component(docs, "fleet")["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    fleet_labels = C.pod_labels(C.component(docs, "fleet"))
    # the fleet's own budget (the workers' are tests/helm/test_workers_pdb.py's)
    (pdb,) = [p for p in C.by_kind(docs, "PodDisruptionBudget")
              if C.selector_matches(p["spec"]["selector"], fleet_labels)]
    assert not C.by_kind(C.render_set(helm, "cpu-demo"), "HorizontalPodAutoscaler")


def test_fleet_readiness_probe_follows_the_context_fallback(helm):
    """Issue 39, item 5: the fleet's readiness is `/ready` (200 while requests are served, in
    aggregate_fallback too), not `/health` (cluster readiness, 503 without a context worker)."""
    fleet = C.component(C.render_set(helm, "cpu-demo"), "fleet")
    (cont,) = fleet["spec"]["template"]["spec"]["containers"]
    assert cont["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_network_policy_keeps_internal_ports_internal(helm):
    docs = C.render_set(helm, "xpyd-multinode")
    nps = C.by_kind(docs, "NetworkPolicy")
    coord = C.component(docs, "coordinator")
    fleet = C.component(docs, "fleet")
    gen = C.component(docs, "generation")

    def allowed(target, port_name, source_labels) -> bool:
        for np in nps:
            if not C.selector_matches(np["spec"]["podSelector"], C.pod_labels(target)):
                continue
            for rule in np["spec"].get("ingress") or []:
                ports = [p["port"] for p in rule.get("ports") or []]
                if ports and port_name not in ports:
                    continue
                peers = rule.get("from")
                if not peers:
                    return True
                for peer in peers:
                    if "namespaceSelector" in peer:
                        continue  # other namespaces (monitoring): not the sources tried here
                    if C.selector_matches(peer.get("podSelector"), source_labels):
                        return True
        return False

    outsider = {"app.kubernetes.io/name": "something-else"}
    assert allowed(fleet, "http", outsider), "the public port must stay reachable"
    assert not allowed(coord, "http", outsider)
    assert allowed(coord, "http", C.pod_labels(fleet))
    assert allowed(coord, "http", C.pod_labels(gen))
    for port in ("http", "kv-events", "kv-replay", "kv-xfer"):
        assert not allowed(gen, port, outsider), f"worker port {port} open to any pod"
    assert allowed(gen, "kv-events", C.pod_labels(coord))
    assert not allowed(gen, "kv-events", C.pod_labels(fleet))
    assert allowed(gen, "kv-xfer", C.pod_labels(C.component(docs, "context")))
    assert allowed(gen, "http", C.pod_labels(fleet))


def test_long_release_name_fits_dns_limits(helm):
    docs = C.render(helm, release="a-very-long-release-name-for-a-production-llm-cluster",
                    sets=["workers.defaults.kind=StatefulSet"])
    assert not C.check_names(docs)
    assert not C.check_workload_selectors(docs)


def test_dashboard_is_valid_grafana_json(helm):
    docs = C.render(helm)
    (cm,) = [d for d in C.by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["splitserve.json"])
    assert dash["title"] and dash["uid"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in dash["panels"]:
        if p.get("type") == "row":
            continue
        assert p.get("targets"), f"panel {p.get('title')!r} has no query"
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), f"unbalanced PromQL: {t['expr']}"


def test_checks_catch_broken_manifests(helm):
    """The API-server checks above must be able to fail: break a rendered manifest in each way
    and expect the matching complaint."""
    import copy

    base = C.render_set(helm, "all-features")

    def broken(mutate):
        docs = copy.deepcopy(base)
        mutate(docs)
        return C.all_checks(docs, {"api-keys", "hmac"})

    def fleet(docs):
        return C.component(docs, "fleet")

    def worker(docs):
        return C.component(docs, "generation")

    def cont(w):
        return w["spec"]["template"]["spec"]["containers"][0]

    cases = [
        (lambda d: fleet(d)["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/component": "flet"}),
         "does not match pod labels"),
        (lambda d: cont(worker(d))["ports"][1].update(name="kv-events-publisher"), "IANA_SVC_NAME"),
        (lambda d: cont(fleet(d))["readinessProbe"]["httpGet"].update(port="metrics"), "readinessProbe targets port"),
        (lambda d: cont(fleet(d))["livenessProbe"]["tcpSocket"].update(port=9999), "livenessProbe targets port 9999"),
        (lambda d: C.by_kind(d, "HorizontalPodAutoscaler")[0]["spec"]["scaleTargetRef"].update(name="nope"),
         "scale target Deployment/nope"),
        (lambda d: fleet(d)["spec"].update(replicas=3), "target sets spec.replicas"),
        (lambda d: C.by_kind(d, "Service")[0]["spec"]["ports"][0].update(targetPort="nope"), "targetPort 'nope'"),
        (lambda d: cont(fleet(d))["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "forgotten", "key": "k"}}}), "undeclared Secret"),
        (lambda d: cont(worker(d))["args"].extend(["--advertise-host", "$(HOST_IP)"]), "$(HOST_IP)"),
        (lambda d: fleet(d)["metadata"].update(name="Fleet_1"), "DNS-1123"),
        (lambda d: cont(fleet(d))["resources"]["requests"].update(cpu="lots"), "not a quantity"),
        (lambda d: C.pod_spec(fleet(d))["volumes"][0]["configMap"].update(name="gone"), "ConfigMap 'gone'"),
        (lambda d: C.by_kind(d, "ServiceMonitor")[0]["spec"]["endpoints"][0].update(port="prom"),
         "no port named 'prom'"),
        (lambda d: C.by_kind(d, "NetworkPolicy")[0]["spec"]["ingress"][0]["ports"][0].update(port="grpc"),
         "named port 'grpc'"),
        (lambda d: worker(d)["spec"].update(serviceName="missing"), "serviceName 'missing'"),
    ]
    assert not C.all_checks(copy.deepcopy(base), {"api-keys", "hmac"})
    for mutate, fragment in cases:
        errs = broken(mutate)
        assert any(fragment in e for e in errs), f"expected a problem mentioning {fragment!r}, got {errs}"


# The fleet's metrics are module-level (prometheus_client's default registry), so their names are
# checked here statically; the coordinator's and workers' come from collectors and are checked
# against live /metrics scrapes in test_chart_processes.py.
METRIC_MODULES = {"splitserve_fleet_": "fleet.metrics"}
METRIC_PREFIXES = ("splitserve_fleet_", "splitserve_coordinator_", "splitserve_worker_")
_TYPE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                  "gauge": ("",), "summary": ("_sum", "_count", "_created", ""), "info": ("_info",)}


def exported_metric_names() -> set[str]:
    """Every sample name the project's metric modules can expose, from their registered families."""
    import importlib

    from prometheus_client import REGISTRY

    for mod in METRIC_MODULES.values():
        importlib.import_module(mod)
    names = set()
    for fam in REGISTRY.collect():
        for suffix in _TYPE_SUFFIXES.get(fam.type, ("",)):
            names.add(fam.name + suffix)
    return names


def dashboard_metrics() -> set[str]:
    dash = json.loads((CHART / "dashboards" / "splitserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs.append(dash["templating"]["list"][1]["definition"])
    return {m for e in exprs for m in re.findall(r"\bsplitserve_[a-z0-9_]+", e)}


def test_dashboard_uses_exported_metric_names():
    used = dashboard_metrics()
    for prefix in METRIC_PREFIXES:
        assert any(m.startswith(prefix) for m in used), f"the dashboard shows no {prefix}* metric"
    for m in used:
        assert m.startswith(METRIC_PREFIXES), f"{m}: not a metric of the fleet, coordinator or workers"
    fleet_used = {m for m in used if m.startswith(tuple(METRIC_MODULES))}
    missing = sorted(fleet_used - exported_metric_names())
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"

