"""The Dockerfile the chart's image is built from. It cannot be built here (no Docker, no
registry), so: hadolint, plus the facts the chart and the package rely on."""
from __future__ import annotations

import re
import subprocess
import tomllib

import yaml

from tests.helm.conftest import CHART, REPO

DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_hadolint_clean(hadolint):
    proc = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_runs_as_the_chart_user_with_the_chart_command():
    ins = _instructions()
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    users = [rest for op, rest in final if op == "USER"]
    assert users, "the runtime stage has no USER"
    uid, _, gid = users[-1].partition(":")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"] != 0
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]
    (entry,) = [rest for op, rest in final if op == "ENTRYPOINT"]
    assert entry == '["splitserve"]'
    for tpl in ("_coordinator_pod.tpl", "fleet.yaml", "workers.yaml"):   # the coordinator pod of both its workloads
        assert 'command: ["splitserve"]' in (CHART / "templates" / tpl).read_text()
    exposed = {int(p) for op, rest in final if op == "EXPOSE" for p in rest.split()}
    ports = {values["fleet"]["port"], values["coordinator"]["port"], *values["workers"]["defaults"]["ports"].values()}
    assert ports <= exposed, f"chart ports {sorted(ports - exposed)} not EXPOSEd"


def test_copies_every_package_and_pins_the_cpu_torch():
    py = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in py["tool"]["setuptools"]["packages"]["find"]["include"]}
    modules = set(py["tool"]["setuptools"].get("py-modules", []))
    copied = set()
    for op, rest in _instructions():
        if op == "COPY" and "--from" not in rest:
            copied |= {s.rstrip("/").removesuffix(".py") for s in rest.split()[:-1]}
    assert packages <= copied, f"packages not copied into the image: {sorted(packages - copied)}"
    assert modules <= copied, f"modules not copied into the image: {sorted(modules - copied)}"
    assert {"pyproject.toml", "README"} <= {c.removesuffix(".md") for c in copied}
    make_pin = re.search(r"torch==([0-9.]+)", (REPO / "Makefile").read_text()).group(1)
    df_pin = re.search(r"ARG TORCH_VERSION=([0-9.]+)", DOCKERFILE.read_text()).group(1)
    assert df_pin == make_pin, f"Dockerfile torch {df_pin} != Makefile torch {make_pin}"
    assert "download.pytorch.org/whl/cpu" in DOCKERFILE.read_text()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_build_check_runs_here():
    """The build stage's `python -c` check (every native router module built) runs as written in
    this checkout's environment, where `make install` built the same extensions: a renamed module
    (it once imported router.kv_query after that module had gone) fails here, not in an image build."""
    import sys

    (script,) = [m.group(1) for op, rest in _instructions() if op == "RUN"
                 for m in [re.search(r'python -c "([^"]+)"', rest)] if m]
    imported = re.findall(r"router\.(\w+) as", script)
    native_c = sorted(p.stem for p in (REPO / "router").glob("_*.c"))
    assert len(imported) == len(native_c), \
        f"expected one NATIVE check per router/_*.c ({native_c}), found imports of {imported}"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the Dockerfile's build check failed here:\n{proc.stderr[-2000:]}"
