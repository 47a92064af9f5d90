"""The chart's commands are valid: run them.

The CPU demo (helm/splitserve/examples/cpu-demo.yaml, with API keys and the HMAC key read from Secrets) is rendered,
and every container of every rendered pod is started here as a real process, with exactly the
`command`, `args` and `env` of the manifest. Only what the cluster would provide is substituted:
each pod's container ports get free loopback ports, Service DNS names resolve to 127.0.0.1 with
the Service port mapped through its targetPort, `0.0.0.0` binds become `127.0.0.1`, ConfigMap and
emptyDir mounts become temporary directories, the downward API gives 127.0.0.1 / the pod name /
the namespace, and secretKeyRefs read test values. Then the pods' own probes are run against them
(startup, then liveness and readiness, as the kubelet would), the workers must have registered
themselves with the coordinator, a completion must come back through the fleet, the
prometheus.io-annotated ports must serve the metrics the Grafana dashboard queries, and SIGTERM must
stop every process cleanly (a PID-1 process that ignores SIGTERM would hang until SIGKILL).
"""
from __future__ import annotations

import json
import re
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from splitserve_testing import Proc, clean_env, free_port, stop_all
from tests.helm import chart as C
from tests.helm.conftest import CHART

RELEASE, NAMESPACE = "demo", "llm"
SECRET_SETS = ["auth.apiKeys.existingSecret=demo-api-keys", "auth.internalAuth.existingSecret=demo-hmac"]
API_KEY = "sk-demo-1"
SECRETS = {("demo-api-keys", "api-keys"): f"{API_KEY},sk-demo-2", ("demo-hmac", "hmac-key"): "ab" * 32}
START_DEADLINE_S = 45.0


def _http(method: str, url: str, body: dict | None = None, headers: dict | None = None,
          timeout: float = 10.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        **({"Content-Type": "application/json"} if data else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@dataclass
class Pod:
    workload: dict
    index: int
    root: Path
    ports: dict[int, int] = field(default_factory=dict)      # containerPort -> loopback port
    named: dict[str, int] = field(default_factory=dict)      # port name -> containerPort
    mounts: dict[str, Path] = field(default_factory=dict)    # mountPath -> local dir
    procs: list[tuple[dict, Proc]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.workload['metadata']['name']}-{self.index}"

    @property
    def component(self) -> str:
        return C.pod_labels(self.workload)["app.kubernetes.io/component"]

    def port(self, ref) -> int:
        """A probe/Service port reference (name or number) → the loopback port."""
        return self.ports[self.named[ref] if isinstance(ref, str) else ref]

    def logs(self) -> str:
        return "\n".join(f"--- {c['name']} of {self.name} (rc={p.returncode}):\n" + p.log()[-3000:]
                         for c, p in self.procs)


class Cluster:
    """The rendered manifests, run as local processes."""

    def __init__(self, docs: list[dict], workdir: Path):
        self.docs = docs
        self.workdir = workdir
        self.services = {s["metadata"]["name"]: s for s in C.by_kind(docs, "Service")}
        self.configmaps = {c["metadata"]["name"]: c for c in C.by_kind(docs, "ConfigMap")}
        self.pods: list[Pod] = []
        for w in C.workloads(docs):
            for i in range(w["spec"].get("replicas", 1)):
                pod = Pod(w, i, workdir / f"{w['metadata']['name']}-{i}")
                for c in C.pod_spec(w)["containers"]:
                    for p in c.get("ports") or []:
                        pod.ports[p["containerPort"]] = free_port()
                        if "name" in p:
                            pod.named[p["name"]] = p["containerPort"]
                self.pods.append(pod)

    def pod(self, component: str, index: int = 0) -> Pod:
        return [p for p in self.pods if p.component == component][index]

    # ---- what the cluster network and kubelet provide -------------------------------------
    def _service_target(self, host: str, port: int) -> int | None:
        labels = host.split(".")
        svc = self.services.get(labels[0])
        if svc is None or labels[1:] not in ([], [NAMESPACE], [NAMESPACE, "svc"],
                                              [NAMESPACE, "svc", "cluster", "local"]):
            return None
        sp = next((p for p in svc["spec"]["ports"] if p["port"] == port), None)
        assert sp is not None, f"Service {labels[0]} has no port {port}"
        backends = [p for p in self.pods if C.selector_matches({"matchLabels": svc["spec"]["selector"]},
                                                               C.pod_labels(p.workload))]
        assert backends, f"Service {labels[0]} selects no pod"
        return backends[0].port(sp.get("targetPort", sp["port"]))

    def rewrite(self, text: str, pod: Pod) -> str:
        def url(m: re.Match) -> str:
            target = self._service_target(m.group(2), int(m.group(3)))
            return m.group(0) if target is None else f"{m.group(1)}://127.0.0.1:{target}"

        text = re.sub(r"\b(https?|tcp)://([a-z0-9][-a-z0-9.]*):(\d+)", url, text)
        if pod.mounts:  # one pass, longest first: a local dir may itself lie under /tmp
            alt = "|".join(re.escape(m) for m in sorted(pod.mounts, key=len, reverse=True))
            text = re.sub(rf"(?<![\w/])({alt})(?=/|$|\s)", lambda m: str(pod.mounts[m.group(1)]), text)
        return text.replace("0.0.0.0", "127.0.0.1")

    def _volumes(self, pod: Pod, c: dict) -> None:
        vols = {v["name"]: v for v in C.pod_spec(pod.workload).get("volumes") or []}
        for m in c.get("volumeMounts") or []:
            v = vols[m["name"]]
            local = pod.root / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in v:
                for key, value in self.configmaps[v["configMap"]["name"]]["data"].items():
                    (local / key).write_text(value)
            elif "emptyDir" not in v:
                pytest.fail(f"{pod.name}: volume {m['name']} is neither a ConfigMap nor an emptyDir; "
                            "the CPU demo must not need node storage")
            pod.mounts[m["mountPath"]] = local
        for m in c.get("volumeMounts") or []:  # file contents may name other mounts (paths)
            v = vols[m["name"]]
            if "configMap" in v:
                for f in pod.mounts[m["mountPath"]].iterdir():
                    f.write_text(self.rewrite(f.read_text(), pod))

    def _env(self, pod: Pod, c: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in c.get("env") or []:
            if "value" in e:
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
                env[e["name"]] = self.rewrite(value, pod)
                continue
            src = e["valueFrom"]
            if "fieldRef" in src:
                env[e["name"]] = {"status.podIP": "127.0.0.1", "metadata.name": pod.name,
                                  "metadata.namespace": NAMESPACE}[src["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                env[e["name"]] = SECRETS[(ref["name"], ref["key"])]
            else:
                pytest.fail(f"{pod.name}: unsupported env source {src}")
        return env

    def _argv(self, pod: Pod, c: dict, env: dict[str, str]) -> list[str]:
        args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in c["args"]]
        for i, a in enumerate(args):
            flag, eq, val = a.partition("=")
            if eq and flag.startswith("--") and flag.endswith("port") and val.isdigit():
                args[i] = f"{flag}={pod.ports.get(int(val), val)}"
            elif i and args[i - 1].startswith("--") and args[i - 1].endswith("port") and a.isdigit():
                assert int(a) in pod.ports, f"{pod.name}: {args[i - 1]} {a} is not a declared containerPort"
                args[i] = str(pod.ports[int(a)])
        args = [self.rewrite(a, pod) for a in args]
        assert c["command"] == ["splitserve"], c["command"]
        exe = Path(sys.executable).with_name("splitserve")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "splitserve_cli"]
        return cmd + args

    def start(self) -> None:
        for pod in self.pods:
            for c in C.pod_spec(pod.workload)["containers"]:
                self._volumes(pod, c)
                env = self._env(pod, c)
                argv = self._argv(pod, c, env)
                base = clean_env()
                if "/tmp" in pod.mounts:
                    base["TMPDIR"] = str(pod.mounts["/tmp"])
                proc = Proc(f"{pod.name}/{c['name']}", argv, pod.root / f"{c['name']}.log", {**base, **env},
                            cwd=pod.root, append=False)
                pod.procs.append((c, proc))

    # ---- the kubelet's probes ---------------------------------------------------------------
    def probe(self, pod: Pod, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        if "httpGet" in probe:
            h = probe["httpGet"]
            try:
                status, _ = _http("GET", f"http://127.0.0.1:{pod.port(h['port'])}{h['path']}", timeout=timeout)
            except (OSError, urllib.error.URLError):
                return False
            return 200 <= status < 400
        if "tcpSocket" in probe:
            try:
                socket.create_connection(("127.0.0.1", pod.port(probe["tcpSocket"]["port"])), timeout=timeout).close()
                return True
            except OSError:
                return False
        pytest.fail(f"{pod.name}: unsupported probe {probe}")

    def wait(self, kind: str, deadline: float, stable: int = 1) -> None:
        """Until every container's `kind` probe passed `stable` times in a row. Several fleet
        processes share one port and each refreshes its own view of the cluster, so a probe may
        reach any of them: readiness is settled once consecutive probes agree."""
        pending = {(id(pod), c["name"]): (pod, c) for pod in self.pods for c, _ in pod.procs}
        streak = dict.fromkeys(pending, 0)
        while pending:
            for key, (pod, c) in list(pending.items()):
                for cc, proc in pod.procs:
                    if cc is c and not proc.alive():
                        pytest.fail(f"{pod.name}/{c['name']} exited with {proc.returncode} before its "
                                    f"{kind} passed:\n{self.all_logs()}")
                streak[key] = streak[key] + 1 if self.probe(pod, c[kind]) else 0
                if streak[key] >= stable:
                    del pending[key]
            if pending and time.monotonic() > deadline:
                names = [f"{p.name}/{c['name']}" for p, c in pending.values()]
                pytest.fail(f"{kind} never passed for {names}:\n{self.all_logs()}")
            if pending:
                time.sleep(0.2)

    def all_logs(self) -> str:
        return "\n".join(p.logs() for p in self.pods)

    def stop(self, pods: list[Pod] | None = None, grace: float = 20.0) -> dict[str, int | None]:
        """SIGTERM every container of ``pods`` at once → {pod/container: exit code, None if it
        needed SIGKILL after ``grace`` seconds}."""
        pods = self.pods if pods is None else pods
        return stop_all([proc for pod in pods for _, proc in pod.procs], grace)


@pytest.fixture(scope="module")
def cluster(helm):
    docs = C.render(helm, [CHART / "examples" / "cpu-demo.yaml"], SECRET_SETS,
                    release=RELEASE, namespace=NAMESPACE)
    # Short paths: the coordinator's Unix socket must fit in sun_path (108 bytes).
    with tempfile.TemporaryDirectory(prefix="ss-helm-") as tmp:
        cl = Cluster(docs, Path(tmp))
        cl.helm, cl.sets = helm, SECRET_SETS
        try:
            cl.start()
            deadline = time.monotonic() + START_DEADLINE_S
            cl.wait("startupProbe", deadline)
            cl.wait("readinessProbe", deadline, stable=10)
            yield cl
        finally:
            for pod in cl.pods:
                for _, proc in pod.procs:
                    if proc.alive():
                        proc.killpg(signal.SIGKILL)
                    proc.stop(grace=5)


def test_demo_runs_every_component_once(cluster):
    comps = sorted(p.component for p in cluster.pods)
    assert comps == ["context", "coordinator", "fleet", "generation"]


def test_probes_pass_after_startup(cluster):
    for pod in cluster.pods:
        for c, proc in pod.procs:
            assert proc.alive(), f"{pod.name} exited:\n{pod.logs()}"
            for kind in ("livenessProbe", "readinessProbe"):
                assert cluster.probe(pod, c[kind]), f"{pod.name}/{c['name']} {kind} fails:\n{pod.logs()}"


def test_workers_registered_themselves(cluster):
    """No worker URL is configured anywhere: they reached the coordinator through its Service name
    and advertised $(POD_IP) with their own port."""
    coord = cluster.pod("coordinator")
    status, body = _http("GET", f"http://127.0.0.1:{coord.port('http')}/cluster_info")
    assert status == 200, body
    info = json.loads(body)
    assert info["is_ready"] is True, info.get("not_ready_reason")
    for role in ("context", "generation"):
        expected = f"http://127.0.0.1:{cluster.pod(role).port('http')}"
        assert info["server_lists"][role] == [expected], info["server_lists"]
    raw = yaml.safe_load(next(iter(coord.mounts["/etc/splitserve"].glob("cluster.yaml"))).read_text())
    assert raw["context_servers"]["urls"] == [] and raw["generation_servers"]["urls"] == []


def test_completion_through_the_fleet(cluster):
    fleet = f"http://127.0.0.1:{cluster.pod('fleet').port('http')}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    # /health is 503 while a worker's health check is failing; on an overloaded box (a full suite
    # at load ~10 took 2.3x its usual time) one check timed out just before this read once: wait
    # for the servers to be healthy again rather than read one instant.
    deadline = time.monotonic() + 30
    while (got := _http("GET", fleet + "/health"))[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert got[0] == 200, got[1]
    status, _ = _http("GET", fleet + "/cluster_info")
    assert status == 401, "the API key from the Secret is not enforced"
    status, body = _http("GET", fleet + "/cluster_info", headers=auth)
    assert status == 200, body
    info = json.loads(body)
    assert info["is_ready"] is True
    status, body = _http("GET", fleet + "/v1/models", headers=auth)
    assert status == 200, body
    model = json.loads(body)["data"][0]["id"]
    with tempfile.TemporaryDirectory() as tmp:
        notes = C.render_notes(cluster.helm, Path(tmp), cluster.sets, release=RELEASE, namespace=NAMESPACE,
                               values=[CHART / "examples" / "cpu-demo.yaml"])
    assert f'"model": "{model}"' in notes, f"NOTES.txt's example request names another model than {model!r}"
    req = {"model": model, "prompt": "Kubernetes says hello", "max_tokens": 8, "temperature": 0}
    assert _http("POST", fleet + "/v1/completions", req)[0] == 401
    status, body = _http("POST", fleet + "/v1/completions", req, headers=auth, timeout=30)
    assert status == 200, f"{body!r}\n{cluster.all_logs()}"
    out = json.loads(body)
    assert out["object"] == "text_completion"
    assert out["usage"]["completion_tokens"] == 8 and out["usage"]["prompt_tokens"] > 0
    assert isinstance(out["choices"][0]["text"], str)


def _families(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            names.update(name + s for s in {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
                         .get(kind, ()))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_annotated_metrics_ports_serve_the_dashboard_metrics(cluster):
    from tests.helm.test_chart import dashboard_metrics, exported_metric_names

    fleet = f"http://127.0.0.1:{cluster.pod('fleet').port('http')}"
    # Traffic first, so the fleet's labelled series exist in the multiprocess registry.
    _http("POST", fleet + "/v1/completions", {"model": "x", "prompt": "hi", "max_tokens": 2},
          headers={"Authorization": f"Bearer {API_KEY}"})
    live: set[str] = set()
    for pod in cluster.pods:
        ann = pod.workload["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        status, body = _http("GET", f"http://127.0.0.1:{pod.ports[int(ann['prometheus.io/port'])]}"
                                    f"{ann['prometheus.io/path']}")
        assert status == 200, f"{pod.name}: /metrics answered {status}"
        fams = _families(body.decode())
        prefix = {"fleet": "splitserve_fleet_", "coordinator": "splitserve_coordinator_"}.get(
            pod.component, "splitserve_worker_")
        assert any(f.startswith(prefix) for f in fams), f"{pod.name} exports no {prefix}* metric"
        live |= fams
    missing = sorted(dashboard_metrics() - live - exported_metric_names())
    assert not missing, f"the dashboard queries metrics no process exports: {missing}"


def test_sigterm_deregisters_workers_and_stops_everything_cleanly(cluster):
    coord = f"http://127.0.0.1:{cluster.pod('coordinator').port('http')}"
    workers = [p for p in cluster.pods if p.component in ("context", "generation")]
    grace = min(20, max(w["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
                        for w in C.workloads(cluster.docs)))
    codes = cluster.stop(workers, grace=grace)
    assert all(rc == 0 for rc in codes.values()), f"worker exit codes {codes}:\n{cluster.all_logs()}"
    info = json.loads(_http("GET", coord + "/cluster_info")[1])
    assert info["server_lists"] == {"context": [], "generation": []}, "workers did not deregister"
    assert info["is_ready"] is False
    fleet_pod = cluster.pod("fleet")
    readiness = fleet_pod.procs[0][0]["readinessProbe"]
    # The fleet learns of the change on its next view refresh: within the kubelet's window of
    # failureThreshold x periodSeconds it must turn unready.
    deadline = time.monotonic() + readiness["failureThreshold"] * readiness["periodSeconds"]
    while cluster.probe(fleet_pod, readiness):
        assert time.monotonic() < deadline, "the fleet stays Ready with no workers behind it"
        time.sleep(0.2)
    assert cluster.probe(fleet_pod, fleet_pod.procs[0][0]["livenessProbe"]), \
        "the fleet's liveness must not fail just because workers are gone"
    codes = cluster.stop(grace=grace)
    assert all(rc == 0 for rc in codes.values()), f"exit codes {codes}:\n{cluster.all_logs()}"


@pytest.mark.parametrize("name", list(C.VALUE_SETS))
def test_container_args_parse_with_the_real_cli(helm, name, tmp_path):
    """Every container's args are accepted by the `splitserve` subcommand they name (the same
    argparse definitions the image runs), and the fleet's flags plus its cluster.yaml load."""
    import argparse
    import contextlib
    import importlib
    import io

    import splitserve_cli

    docs = C.render_set(helm, name)
    cfg_file = tmp_path / "cluster.yaml"
    cfg_file.write_text(yaml.safe_dump(_cluster_yaml_of(docs)))
    for w in C.workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert c["command"] == ["splitserve"]
            sub, *rest = c["args"]
            assert sub in splitserve_cli.SUBCOMMANDS, f"{c['name']}: unknown subcommand {sub!r}"
            mod = importlib.import_module(splitserve_cli.SUBCOMMANDS[sub][0])
            parser = argparse.ArgumentParser(prog=f"splitserve {sub}")
            mod.add_arguments(parser)
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    args = parser.parse_args(rest)
            except SystemExit:
                pytest.fail(f"{w['metadata']['name']}: `splitserve {' '.join(c['args'])}` rejected:\n{err.getvalue()}")
            if sub == "serve":
                args.config = str(cfg_file)
                cfg = mod.load(args)
                assert cfg.topology == "external_coordinator" and cfg.effective_bind_host == "0.0.0.0"


def _cluster_yaml_of(docs) -> dict:
    from tests.helm.test_chart import _cluster_yaml
    return _cluster_yaml(docs)
