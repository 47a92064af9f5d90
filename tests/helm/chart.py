"""Rendering the chart and the checks a real API server (or controller) would enforce that JSON-schema
validation of the manifests misses. Each check returns a list of human-readable problems (empty =
fine), so a failing test shows every problem at once.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, Iterable

import yaml

from tests.helm.conftest import CHART

EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))

# Everything optional switched on, so every template renders in at least one value set.
ALL_FEATURES_SETS = [
    "fleet.hpa.enabled=true",
    "fleet.service.type=NodePort",
    "fleet.service.nodePort=30080",
    "networkPolicy.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "workers.defaults.kind=StatefulSet",
    "workers.defaults.modelVolume.persistentVolumeClaim=weights",
    "workers.defaults.rdma.enabled=true",
    "workers.defaults.numBlocks=4096",
    "workers.generation.engine=sim",
    "workers.generation.device=cpu",
    "auth.apiKeys.existingSecret=api-keys",
    "auth.internalAuth.existingSecret=hmac",
    "cluster.conditionalDisagg.enabled=true",
    "cluster.model=demo",
]
MONITORING_API = "monitoring.coreos.com/v1"

# name -> (values files, --set args, extra --api-versions)
VALUE_SETS: dict[str, tuple[list[Path], list[str], list[str]]] = {
    "default": ([], [], []),
    **{p.stem: ([p], [], [MONITORING_API]) for p in EXAMPLES},
    "all-features": ([], ALL_FEATURES_SETS, [MONITORING_API]),
}

_render_cache: dict[tuple, list[dict]] = {}


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def render(helm: Path, values: Iterable[Path] = (), sets: Iterable[str] = (),
           api_versions: Iterable[str] = (), kube_version: str | None = None,
           release: str = "rel", namespace: str = "llm") -> list[dict]:
    key = (tuple(map(str, values)), tuple(sets), tuple(api_versions), kube_version, release, namespace)
    if key not in _render_cache:
        args = ["template", release, str(CHART), "--namespace", namespace]
        for v in values:
            args += ["-f", str(v)]
        for s in sets:
            args += ["--set", s]
        for a in api_versions:
            args += ["--api-versions", a]
        if kube_version:
            args += ["--kube-version", kube_version]
        proc = run_helm(helm, *args)
        if proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
        _render_cache[key] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return _render_cache[key]


def render_set(helm: Path, name: str, **kw: Any) -> list[dict]:
    files, sets, apis = VALUE_SETS[name]
    return render(helm, files, sets, apis, **kw)


# ----------------------------------------------------------------------------------- accessors

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def find(docs: list[dict], kind: str, name: str) -> dict | None:
    return next((d for d in docs if d.get("kind") == kind and d["metadata"]["name"] == name), None)


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d.get("kind") in WORKLOAD_KINDS]


def pod_spec(w: dict) -> dict:
    return w["spec"]["template"]["spec"]


def pod_labels(w: dict) -> dict:
    return w["spec"]["template"]["metadata"].get("labels") or {}


def containers(w: dict) -> list[dict]:
    spec = pod_spec(w)
    return list(spec.get("initContainers") or []) + list(spec["containers"])


def component(docs: list[dict], comp: str) -> dict:
    for w in workloads(docs):
        if pod_labels(w).get("app.kubernetes.io/component") == comp:
            return w
    raise AssertionError(f"no workload with component {comp!r} among "
                         f"{[w['metadata']['name'] for w in workloads(docs)]}")


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels AND matchExpressions); None/{} = everything
    for NetworkPolicy peers but is rejected for workloads (checked separately)."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, key, vals = e["operator"], e["key"], e.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and labels.get(key) in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def plain_selector(sel: dict) -> dict:
    """A Service's selector is a bare label map."""
    return {"matchLabels": sel}


# ----------------------------------------------------------------------------------- checks

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
IANA_SVC_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
VAR_REF = re.compile(r"\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def check_names(docs: list[dict]) -> list[str]:
    errs = []
    for d in docs:
        name = d["metadata"]["name"]
        kind = d["kind"]
        where = f"{kind}/{name}"
        if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
            errs.append(f"{where}: name is not a DNS-1123 subdomain")
        if kind == "Service" and (len(name) > 63 or not DNS1035_LABEL.match(name)):
            errs.append(f"{where}: Service names must be DNS-1035 labels (<= 63, start with a letter)")
        if kind in ("Deployment", "StatefulSet") and len(name) > 63:
            errs.append(f"{where}: name longer than 63 (pod names derive from it)")
        if kind == "StatefulSet" and len(name) > 52:
            # controller-revision-hash label = name + '-' + 10-char hash must fit 63.
            errs.append(f"{where}: StatefulSet name longer than 52")
        for k, v in list((d["metadata"].get("labels") or {}).items()):
            if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
                errs.append(f"{where}: label {k}={v!r} is not a valid label value")
    return errs


def check_workload_selectors(docs: list[dict]) -> list[str]:
    errs = []
    for w in workloads(docs):
        where = f"{w['kind']}/{w['metadata']['name']}"
        sel = w["spec"].get("selector")
        if not sel or not (sel.get("matchLabels") or sel.get("matchExpressions")):
            errs.append(f"{where}: empty selector")
            continue
        if not selector_matches(sel, pod_labels(w)):
            errs.append(f"{where}: selector {sel} does not match pod labels {pod_labels(w)}")
        # Two workloads selecting each other's pods fight over them.
        for other in workloads(docs):
            if other is not w and selector_matches(sel, pod_labels(other)):
                errs.append(f"{where}: selector also matches pods of "
                            f"{other['kind']}/{other['metadata']['name']}")
        if w["kind"] == "StatefulSet":
            svc = find(docs, "Service", w["spec"].get("serviceName", ""))
            if svc is None:
                errs.append(f"{where}: serviceName {w['spec'].get('serviceName')!r} is not rendered")
            elif svc["spec"].get("clusterIP") != "None":
                errs.append(f"{where}: serviceName {svc['metadata']['name']} is not headless")
    return errs


def check_ports_and_probes(docs: list[dict]) -> list[str]:
    errs = []
    for w in workloads(docs):
        pod_port_numbers: set[int] = set()
        for c in containers(w):
            where = f"{w['kind']}/{w['metadata']['name']}/{c['name']}"
            names, numbers = set(), set()
            for p in c.get("ports") or []:
                n = p["containerPort"]
                if not 1 <= n <= 65535:
                    errs.append(f"{where}: containerPort {n} out of 1..65535")
                if n in pod_port_numbers:
                    errs.append(f"{where}: containerPort {n} declared twice in the pod")
                pod_port_numbers.add(n)
                numbers.add(n)
                name = p.get("name")
                if name is not None:
                    if len(name) > 15 or not IANA_SVC_NAME.match(name) or "--" in name \
                            or not re.search(r"[a-z]", name):
                        errs.append(f"{where}: port name {name!r} is not an IANA_SVC_NAME (<= 15)")
                    if name in names:
                        errs.append(f"{where}: port name {name!r} declared twice")
                    names.add(name)
            for probe_kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(probe_kind)
                if probe is None:
                    errs.append(f"{where}: no {probe_kind}")
                    continue
                handler = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc")
                if handler is not None:
                    port = handler.get("port")
                    if isinstance(port, str) and port not in names:
                        errs.append(f"{where}: {probe_kind} targets port {port!r}, not one of {sorted(names)}")
                    if isinstance(port, int) and port not in numbers:
                        errs.append(f"{where}: {probe_kind} targets port {port}, not one of {sorted(numbers)}")
                elif "exec" not in probe:
                    errs.append(f"{where}: {probe_kind} has no handler")
                if probe_kind != "readinessProbe" and probe.get("successThreshold", 1) != 1:
                    errs.append(f"{where}: {probe_kind}.successThreshold must be 1")
                if probe.get("timeoutSeconds", 1) > probe.get("periodSeconds", 10):
                    errs.append(f"{where}: {probe_kind}.timeoutSeconds exceeds periodSeconds")
    return errs


def check_services(docs: list[dict]) -> list[str]:
    errs = []
    for s in by_kind(docs, "Service"):
        where = f"Service/{s['metadata']['name']}"
        sel = s["spec"].get("selector") or {}
        targets = [w for w in workloads(docs) if sel and selector_matches(plain_selector(sel), pod_labels(w))]
        if not targets:
            errs.append(f"{where}: selector {sel} matches no rendered pods")
            continue
        seen = set()
        for p in s["spec"]["ports"]:
            name = p.get("name")
            if name is not None and (len(name) > 15 or not IANA_SVC_NAME.match(name)):
                errs.append(f"{where}: port name {name!r} is not an IANA_SVC_NAME (<= 15)")
            if (p["port"], p.get("protocol", "TCP")) in seen:
                errs.append(f"{where}: port {p['port']} declared twice")
            seen.add((p["port"], p.get("protocol", "TCP")))
            tp = p.get("targetPort", p["port"])
            for w in targets:
                ports = [cp for c in containers(w) for cp in c.get("ports") or []]
                ok = any(cp.get("name") == tp for cp in ports) if isinstance(tp, str) \
                    else any(cp["containerPort"] == tp for cp in ports)
                if not ok:
                    errs.append(f"{where}: targetPort {tp!r} is not a container port of "
                                f"{w['kind']}/{w['metadata']['name']}")
            if "nodePort" in p and s["spec"].get("type") not in ("NodePort", "LoadBalancer"):
                errs.append(f"{where}: nodePort set on a {s['spec'].get('type', 'ClusterIP')} Service")
    return errs


def check_autoscaling(docs: list[dict]) -> list[str]:
    errs = []
    for h in by_kind(docs, "HorizontalPodAutoscaler"):
        where = f"HPA/{h['metadata']['name']}"
        ref = h["spec"]["scaleTargetRef"]
        target = find(docs, ref["kind"], ref["name"])
        if target is None:
            errs.append(f"{where}: scale target {ref['kind']}/{ref['name']} is not rendered")
            continue
        if ref.get("apiVersion") != target["apiVersion"]:
            errs.append(f"{where}: scaleTargetRef.apiVersion {ref.get('apiVersion')} != {target['apiVersion']}")
        if "replicas" in target["spec"]:
            errs.append(f"{where}: target sets spec.replicas, so every upgrade resets the HPA's count")
        if h["spec"].get("minReplicas", 1) > h["spec"]["maxReplicas"]:
            errs.append(f"{where}: minReplicas > maxReplicas")
        for m in h["spec"].get("metrics") or []:
            if m["type"] == "Resource" and m["resource"]["target"]["type"] == "Utilization":
                res = m["resource"]["name"]
                for c in containers(target):
                    if res not in ((c.get("resources") or {}).get("requests") or {}):
                        errs.append(f"{where}: {res} utilization needs {res} requests on container "
                                    f"{c['name']}")
    for p in by_kind(docs, "PodDisruptionBudget"):
        if not any(selector_matches(p["spec"]["selector"], pod_labels(w)) for w in workloads(docs)):
            errs.append(f"PDB/{p['metadata']['name']}: selector matches no rendered pods")
    return errs


def check_references(docs: list[dict], declared_secrets: set[str]) -> list[str]:
    """ConfigMaps, Secrets and ServiceAccounts a pod needs must be rendered here, or be Secrets the
    values declare as existing."""
    errs = []
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    sas = {d["metadata"]["name"] for d in by_kind(docs, "ServiceAccount")} | {"default"}
    for w in workloads(docs):
        where = f"{w['kind']}/{w['metadata']['name']}"
        spec = pod_spec(w)
        if spec.get("serviceAccountName", "default") not in sas:
            errs.append(f"{where}: serviceAccountName {spec['serviceAccountName']!r} is not rendered")
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        for v in vols.values():
            if "configMap" in v:
                cm = configmaps.get(v["configMap"]["name"])
                if cm is None:
                    errs.append(f"{where}: volume {v['name']} uses ConfigMap {v['configMap']['name']!r}, not rendered")
                else:
                    for item in v["configMap"].get("items") or []:
                        if item["key"] not in cm.get("data", {}):
                            errs.append(f"{where}: ConfigMap {cm['metadata']['name']} has no key {item['key']!r}")
            if "secret" in v and v["secret"]["secretName"] not in declared_secrets:
                errs.append(f"{where}: volume {v['name']} uses undeclared Secret {v['secret']['secretName']!r}")
            if "persistentVolumeClaim" in v and not v["persistentVolumeClaim"].get("readOnly"):
                errs.append(f"{where}: model volume {v['name']} should be mounted read-only")
        for c in containers(w):
            cwhere = f"{where}/{c['name']}"
            mounts = [m["name"] for m in c.get("volumeMounts") or []]
            for m in mounts:
                if m not in vols:
                    errs.append(f"{cwhere}: volumeMount {m!r} has no volume")
            if len(set(m["mountPath"] for m in c.get("volumeMounts") or [])) != len(mounts):
                errs.append(f"{cwhere}: two volumeMounts share a mountPath")
            env_names = []
            for e in c.get("env") or []:
                if not ENV_NAME.match(e["name"]):
                    errs.append(f"{cwhere}: env name {e['name']!r} is invalid")
                env_names.append(e["name"])
                src = e.get("valueFrom") or {}
                if "secretKeyRef" in src and src["secretKeyRef"]["name"] not in declared_secrets:
                    errs.append(f"{cwhere}: env {e['name']} reads undeclared Secret {src['secretKeyRef']['name']!r}")
                if "configMapKeyRef" in src:
                    ref = src["configMapKeyRef"]
                    if ref["name"] not in configmaps or ref["key"] not in configmaps[ref["name"]].get("data", {}):
                        errs.append(f"{cwhere}: env {e['name']} reads missing ConfigMap key {ref}")
            if len(env_names) != len(set(env_names)):
                errs.append(f"{cwhere}: duplicate env names {env_names}")
            # Kubernetes leaves an undefined $(VAR) in args verbatim: a silent misconfiguration.
            for a in list(c.get("command") or []) + list(c.get("args") or []):
                for var in VAR_REF.findall(str(a)):
                    if var not in env_names:
                        errs.append(f"{cwhere}: argument {a!r} references $({var}), which is not in env")
            for kind in ("requests", "limits"):
                for rname, q in ((c.get("resources") or {}).get(kind) or {}).items():
                    if not QUANTITY.match(str(q)):
                        errs.append(f"{cwhere}: resources.{kind}.{rname}={q!r} is not a quantity")
            req = (c.get("resources") or {}).get("requests") or {}
            lim = (c.get("resources") or {}).get("limits") or {}
            for rname in set(req) & set(lim):
                if "/" in rname and str(req[rname]) != str(lim[rname]):
                    errs.append(f"{cwhere}: extended resource {rname} needs requests == limits")
                elif "/" not in rname and parse_quantity(req[rname]) > parse_quantity(lim[rname]):
                    errs.append(f"{cwhere}: {rname} request {req[rname]} exceeds limit {lim[rname]}")
    return errs


def check_monitoring(docs: list[dict]) -> list[str]:
    errs = []
    services = by_kind(docs, "Service")
    for sm in by_kind(docs, "ServiceMonitor"):
        where = f"ServiceMonitor/{sm['metadata']['name']}"
        sel = sm["spec"]["selector"]
        matched = [s for s in services if selector_matches(sel, s["metadata"].get("labels") or {})]
        if not matched:
            errs.append(f"{where}: selects no rendered Service")
        for ep in sm["spec"]["endpoints"]:
            for s in matched:
                if ep["port"] not in [p.get("name") for p in s["spec"]["ports"]]:
                    errs.append(f"{where}: Service/{s['metadata']['name']} has no port named {ep['port']!r}")
    for np in by_kind(docs, "NetworkPolicy"):
        where = f"NetworkPolicy/{np['metadata']['name']}"
        pods = [w for w in workloads(docs) if selector_matches(np["spec"]["podSelector"], pod_labels(w))]
        if not pods:
            errs.append(f"{where}: podSelector matches no rendered pods")
        for rule in np["spec"].get("ingress") or []:
            for peer in rule.get("from") or []:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    if not any(selector_matches(peer["podSelector"], pod_labels(w)) for w in workloads(docs)):
                        errs.append(f"{where}: peer {peer['podSelector']} matches no rendered pods")
            for p in rule.get("ports") or []:
                if isinstance(p.get("port"), str):
                    for w in pods:
                        names = [cp.get("name") for c in containers(w) for cp in c.get("ports") or []]
                        if p["port"] not in names:
                            errs.append(f"{where}: named port {p['port']!r} not declared by "
                                        f"{w['kind']}/{w['metadata']['name']}")
    return errs


_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 1e-3}


def parse_quantity(q: Any) -> float:
    m = re.match(r"^([+-]?[0-9.]+)([a-zA-Z]*)$", str(q))
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"unsupported quantity {q!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def all_checks(docs: list[dict], declared_secrets: set[str]) -> list[str]:
    return (check_names(docs) + check_workload_selectors(docs) + check_ports_and_probes(docs)
            + check_services(docs) + check_autoscaling(docs) + check_references(docs, declared_secrets)
            + check_monitoring(docs))


def arg_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in a container's args (last one wins, like argparse)."""
    val = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


def render_notes(helm: Path, tmp: Path, sets: Iterable[str] = (), api_versions: Iterable[str] = (),
                 release: str = "rel", namespace: str = "llm", values: Iterable[Path] = ()) -> str:
    """NOTES.txt as `helm install` would print it. `helm template` skips NOTES and `helm install
    --dry-run` needs a cluster with Helm 3, so a copy of the chart renders it through `tpl` inside
    an extra ConfigMap template."""
    import shutil

    copy = tmp / "chart"
    shutil.copytree(CHART, copy)
    (copy / "notes.txt").write_text((copy / "templates" / "NOTES.txt").read_text())
    (copy / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        "data:\n  notes: {{ tpl (.Files.Get \"notes.txt\") . | quote }}\n")
    args = ["template", release, str(copy), "--namespace", namespace, "--show-only", "templates/zz-notes.yaml"]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    for a in api_versions:
        args += ["--api-versions", a]
    proc = run_helm(helm, *args)
    if proc.returncode != 0:
        raise AssertionError(f"rendering NOTES.txt failed:\n{proc.stderr}")
    return yaml.safe_load(proc.stdout)["data"]["notes"]
