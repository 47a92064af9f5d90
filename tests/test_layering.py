"""Dependency direction between our packages (docs/design.md §1, docs/package-map.md).

`protocol` is at the bottom: it imports no other package of ours, and every package may import it.
Above it `fleet → coordinator → router`, `worker → router`, `worker → transfer`; `router` and
`transfer` import nothing of ours but `protocol`; nothing imports `fleet`. Checked by parsing every module's imports
(including relative ones, imports inside functions, and `importlib.import_module("...")` with a
literal name), so a forbidden import fails this test even if it is never executed.
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, frozenset[str]] = {
    "protocol": frozenset(),
    # The HTTP/1.1 server core under the fleet's and the coordinator's servers: no contract of ours.
    "http1": frozenset(),
    "router": frozenset({"protocol"}),
    "transfer": frozenset({"protocol"}),
    "coordinator": frozenset({"http1", "protocol", "router"}),
    "worker": frozenset({"protocol", "router", "transfer"}),
    "fleet": frozenset({"http1", "protocol", "coordinator", "router"}),
    # The process/port harness of tests/ and bench/: usable by either, imports nothing of ours.
    "splitserve_testing": frozenset(),
}


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    package: str
    imports: str

    def __str__(self) -> str:
        allowed = ", ".join(sorted(ALLOWED.get(self.package, ()))) or "none of ours"
        return (f"{self.file}:{self.line}: {self.package}/ imports {self.imports!r} "
                f"(allowed: {allowed})")


def _module_parts(root: Path, path: Path) -> list[str]:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return parts


def _imported_names(tree: ast.AST, parts: list[str], is_pkg_init: bool) -> list[tuple[int, str]]:
    """(line, absolute dotted name) for every import in the module."""
    out: list[tuple[int, str]] = []
    # The package a relative import is relative to.
    package = parts if is_pkg_init else parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                out.append((node.lineno, node.module or ""))
                continue
            up = node.level - 1
            base = package[: len(package) - up] if up <= len(package) else []
            if up > len(package):
                base = []
            if node.module:
                out.append((node.lineno, ".".join([*base, node.module])))
            else:
                # `from .. import x`: each name may be a module of the base package.
                out.extend((node.lineno, ".".join([*base, a.name])) for a in node.names)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in ("import_module", "__import__") and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                target = node.args[0].value
                if target.startswith("."):
                    pkg_kw = next((k.value.value for k in node.keywords if k.arg == "package"
                                   and isinstance(k.value, ast.Constant)), None)
                    if isinstance(pkg_kw, str):
                        target = pkg_kw + target
                    else:
                        continue
                out.append((node.lineno, target))
    return out


def find_violations(root: Path, allowed: dict[str, frozenset[str]] = ALLOWED) -> list[Violation]:
    ours = set(allowed)
    found: list[Violation] = []
    for pkg in sorted(ours):
        pkg_dir = root / pkg
        if not pkg_dir.is_dir():
            continue
        for path in sorted(pkg_dir.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            parts = _module_parts(root, path)
            for line, name in _imported_names(tree, parts, path.name == "__init__.py"):
                top = name.split(".", 1)[0]
                if top in ours and top != pkg and top not in allowed[pkg]:
                    found.append(Violation(str(path.relative_to(root)), line, pkg, name))
    return found


def test_repository_respects_the_dependency_direction():
    present = [p for p in ALLOWED if (ROOT / p).is_dir()]
    assert set(present) == set(ALLOWED), f"missing packages: {set(ALLOWED) - set(present)}"
    violations = find_violations(ROOT)
    assert not violations, "forbidden imports:\n" + "\n".join(map(str, violations))


def test_nothing_imports_fleet_and_router_transfer_import_only_protocol():
    # The table says it; keep the table honest too.
    assert all("fleet" not in deps for deps in ALLOWED.values())
    assert ALLOWED["protocol"] == frozenset()
    assert ALLOWED["router"] == ALLOWED["transfer"] == frozenset({"protocol"})
    assert all("protocol" in deps for pkg, deps in ALLOWED.items()
               if pkg not in ("protocol", "http1", "splitserve_testing"))


# ------------------------------------------------------------------------ the checker itself

def _write(root: Path, rel: str, src: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(src))


def _synthetic(tmp_path: Path) -> Path:
    for pkg in ALLOWED:
        _write(tmp_path, f"{pkg}/__init__.py", "")
    _write(tmp_path, "coordinator/ok.py", """
        import router.kv_index
        from router import policies
        import numpy, os
        from . import config
        from .config import load_config
    """)
    _write(tmp_path, "worker/ok.py", "import transfer.agent\nfrom router.events import x\n")
    _write(tmp_path, "fleet/ok.py", "from coordinator.config import load_config\nimport router\n")
    _write(tmp_path, "router/ok.py", "from protocol.failures import NoServerAvailable\n")
    _write(tmp_path, "transfer/ok.py", "import protocol.failures\n")
    return tmp_path


def test_checker_accepts_allowed_imports(tmp_path):
    assert find_violations(_synthetic(tmp_path)) == []


def test_checker_flags_each_kind_of_forbidden_import(tmp_path):
    root = _synthetic(tmp_path)
    _write(root, "router/bad_abs.py", "import coordinator.config\n")
    _write(root, "router/sub/bad_rel.py", "from ...fleet import server\n")
    _write(root, "transfer/bad_from.py", "def f():\n    from worker.kv_cache import BlockPool\n")
    _write(root, "coordinator/bad_fleet.py", "from fleet import snowflake\n")
    _write(root, "worker/bad_dyn.py", "import importlib\nimportlib.import_module('fleet.cli')\n")
    _write(root, "worker/bad_coord.py", "from .. import coordinator\n")
    _write(root, "transfer/bad_kw.py",
           "from importlib import import_module\nimport_module('.flow', package='fleet')\n")
    _write(root, "protocol/bad_router.py", "from router.block_keys import block_keys\n")
    got = {(v.file, v.imports) for v in find_violations(root)}
    assert got == {
        ("router/bad_abs.py", "coordinator.config"),
        ("router/sub/bad_rel.py", "fleet"),
        ("transfer/bad_from.py", "worker.kv_cache"),
        ("coordinator/bad_fleet.py", "fleet"),
        ("worker/bad_dyn.py", "fleet.cli"),
        ("worker/bad_coord.py", "coordinator"),
        ("transfer/bad_kw.py", "fleet.flow"),
        ("protocol/bad_router.py", "router.block_keys"),
    }
    msg = str(next(v for v in find_violations(root) if v.file == "router/bad_abs.py"))
    assert "router/ imports 'coordinator.config'" in msg and "(allowed: protocol)" in msg
    msg = str(next(v for v in find_violations(root) if v.file == "protocol/bad_router.py"))
    assert "protocol/ imports 'router.block_keys'" in msg and "none of ours" in msg


def test_relative_imports_inside_a_package_are_not_violations(tmp_path):
    root = _synthetic(tmp_path)
    _write(root, "router/recipes/__init__.py", "from . import vllm\nfrom .. import kv_index\n")
    _write(root, "router/recipes/vllm.py", "from ..block_keys import block_keys\n")
    assert find_violations(root) == []
