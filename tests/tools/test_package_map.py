"""docs/package-map.md is what `python -m tools.package_map` draws from the code: every module has
an opening docstring, and no import circle spans two packages."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools import package_map

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_in_map_matches_the_code():
    r = subprocess.run([sys.executable, "-m", "tools.package_map", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + "(run `make docs` or `python -m tools.package_map`)"


def test_every_module_opens_with_a_docstring():
    text = package_map.render()
    missing = [line for line in text.splitlines() if "(no docstring)" in line]
    assert not missing, "modules without an opening docstring:\n" + "\n".join(missing)


def test_no_import_circle_spans_two_packages():
    packages = {p: package_map._modules(p, set(package_map.top_packages()))
                for p in package_map.top_packages()}
    graph = package_map.package_graph(packages)
    assert {"protocol", "router", "coordinator", "fleet", "worker", "transfer"} <= set(graph)
    assert package_map.circles(graph) == []


def test_the_circle_finder_sees_circles_and_only_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert package_map.circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert package_map.circles({"a": {"b"}, "b": set()}) == []
    assert package_map.bottom_up({"x": {"y"}, "y": set(), "z": set()}) == ["y", "z", "x"]


def test_the_map_lists_every_module_with_its_summary(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""The package.\n\nMore."""\n')
    (pkg / "mod.py").write_text('"""What mod does | in one line.\n\nDetails."""\nimport pkg\nfrom other import x\n')
    (pkg / "bare.py").write_text("x = 1\n")
    old = package_map.ROOT
    package_map.ROOT = tmp_path
    try:
        mods = {m.path: m for m in package_map._modules("pkg", {"pkg", "other"})}
    finally:
        package_map.ROOT = old
    assert mods["pkg/__init__.py"].summary == "The package."
    assert mods["pkg/mod.py"].summary == "What mod does \\| in one line."
    assert mods["pkg/mod.py"].imports == {"other"}          # its own package is no arrow
    assert mods["pkg/bare.py"].summary == "(no docstring)"
