"""docs/package-map.md, generated from the code: every package and module with its opening
docstring, the subcommands, and the import arrows between packages.

`python -m tools.package_map` rewrites the page (`make docs`); `--check` exits 1 when the checked-in
page differs from what the code gives. tests/tools/test_package_map.py runs the check, so the page
changes with the docstrings it quotes. The map reads the code as text (`ast`), never imports it.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "package-map.md"
NOT_PACKAGES = {"tests", "examples", "helm", "docs", "build"}   # folders that are no package of ours
SKIP_DIRS = {"__pycache__", "build"}


def top_packages() -> list[str]:
    """Every top-level package of the repository (a folder with an `__init__.py`)."""
    return sorted(d.name for d in ROOT.iterdir()
                  if (d / "__init__.py").is_file() and d.name not in NOT_PACKAGES)


@dataclass
class Module:
    path: str                  # relative to the repository root
    name: str                  # dotted
    summary: str               # the docstring's first paragraph, one line
    imports: set[str] = field(default_factory=set)   # our top-level packages it imports


def _summary(doc: str | None) -> str:
    if not doc:
        return "(no docstring)"
    first = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    return " ".join(first.split()).replace("|", "\\|")


def _imports(tree: ast.AST, name: str, is_init: bool, ours: set[str]) -> set[str]:
    """Our top-level packages the module imports anywhere in its body (relative imports resolved)."""
    package = name.split(".") if is_init else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - (node.level - 1)] if node.level else []
            targets = [".".join([*base, node.module] if node.module else base)]
        else:
            continue
        out |= {t.split(".")[0] for t in targets if t.split(".")[0] in ours}
    return out


def _modules(pkg: str, ours: set[str]) -> list[Module]:
    mods = []
    for path in sorted((ROOT / pkg).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_init else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        mods.append(Module(str(rel), name, _summary(ast.get_docstring(tree)),
                           _imports(tree, name, is_init, ours) - {pkg}))
    # by (sub-)package, the package's own `__init__` first, then its modules
    def key(m: Module):
        init = m.path.endswith("__init__.py")
        return (m.name.split(".") if init else m.name.split(".")[:-1], not init, m.name)
    return sorted(mods, key=key)


def package_graph(packages: dict[str, list[Module]]) -> dict[str, set[str]]:
    """package -> the packages of ours it imports."""
    return {p: set().union(*(m.imports for m in mods)) for p, mods in packages.items()}


def bottom_up(graph: dict[str, set[str]]) -> list[str]:
    """The packages by level (0: imports none of ours; n: imports some of level n-1 and none above),
    by name within a level; the members of an import circle come last, by name."""
    level: dict[str, int] = {}
    while True:
        ready = {p: 1 + max((level[q] for q in graph[p]), default=-1)
                 for p in graph if p not in level and graph[p] <= set(level)}
        if not ready:
            break
        level.update(ready)
    last = max(level.values(), default=0) + 1
    return sorted(graph, key=lambda p: (level.get(p, last), p))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle between two or more packages (each once, from its smallest name)."""
    found = set()
    def walk(start, node, trail):
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.add(tuple(trail))
            elif nxt not in trail and nxt > start:
                walk(start, nxt, trail + [nxt])
    for p in sorted(graph):
        walk(p, p, [p])
    return [list(c) for c in sorted(found)]


def _subcommands() -> list[tuple[str, str, str]]:
    tree = ast.parse((ROOT / "splitserve_cli.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "SUBCOMMANDS":
            table = ast.literal_eval(node.value)
            return [(name, mod, help_) for name, (mod, help_) in table.items()]
    raise SystemExit("splitserve_cli.py: no SUBCOMMANDS table")


def render() -> str:
    ours = set(top_packages())
    found = {p: _modules(p, ours) for p in sorted(ours)}
    order = bottom_up(package_graph(found))
    packages = {p: found[p] for p in order}
    graph = package_graph(packages)
    users = {p: sorted(q for q in graph if p in graph[q]) for p in graph}
    out = [
        "# Package map",
        "",
        "<!-- generated by `python -m tools.package_map` (`make docs`) from the modules' opening",
        "docstrings; tests/tools/test_package_map.py fails when it is stale. Edit the docstrings. -->",
        "",
        "Every package and module of the repository with the first paragraph of its docstring, and",
        "the imports between packages, read from the code. What a package promises its users is on",
        "its topic page ([design.md](design.md) for the external contract and the glossary,",
        "[configuration.md](configuration.md), [fleet.md](fleet.md),",
        "[coordinator-api.md](coordinator-api.md), [worker.md](worker.md),",
        "[kv-transfer.md](kv-transfer.md), [kv-events.md](kv-events.md), [routing.md](routing.md),",
        "[benchmarks.md](benchmarks.md)).",
        "",
        "## Imports between packages",
        "",
        "Which of our packages each one imports (any import in any of its modules, including those",
        "inside functions), bottom up: each package after those it imports. The allowed arrows are",
        "decided in tests/test_layering.py.",
        "",
        "| package | imports | imported by |",
        "|---|---|---|",
    ]
    for p in graph:
        out.append(f"| `{p}/` | {', '.join(f'`{q}`' for q in sorted(graph[p])) or '—'} | "
                   f"{', '.join(f'`{q}`' for q in users[p]) or '—'} |")
    loops = circles(graph)
    out += ["", "Import circles spanning two or more packages: "
            + ("; ".join(" → ".join(c + [c[0]]) for c in loops) if loops else "none."), ""]
    out += ["## The `splitserve` command", "",
            "`splitserve_cli.py` (console script `splitserve`) — "
            + _summary(ast.get_docstring(ast.parse((ROOT / "splitserve_cli.py").read_text()))), "",
            "| subcommand | module | what it runs |", "|---|---|---|"]
    out += [f"| `splitserve {n}` | `{m}` | {h} |" for n, m, h in _subcommands()]
    out.append("")
    for p, mods in packages.items():
        head = next((m for m in mods if m.name == p), None)
        out += [f"## {p}/", ""]
        if head:
            out += [head.summary, ""]
        for m in mods:
            if m is head:
                continue
            out.append(f"- `{m.path}` — {m.summary}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/package-map.md is stale")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        if not DOC.exists() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run `python -m tools.package_map`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
