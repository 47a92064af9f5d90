"""Comments, docstrings and our Markdown cite repository files that exist, and the names they cite
next to a path live in that file.

tests/test_doc_citations.py checks `.md` citations (in every Python file) and Markdown; this
checks every other repository path that a comment or docstring in protocol/, router/, transfer/,
coordinator/, worker/, fleet/, bench/, splitserve_testing/ or tests/ names
(`worker/kv_connector.py`, `tests/fleet/peers/fixtures/….json`, `fleet/legs/plan.py:42`), so a
file that moves or is renamed takes its citations with it. A path is ours when it starts with one
of our packages, or with `tests/`, `docs/`, `examples/`, `helm/` followed by a folder or file that
exists here: other projects' paths (`vllm/…`, `tensorrt_llm/…`, vLLM's `tests/v1/…`,
TensorRT-LLM's `examples/disaggregated/…`) cite those projects' sources at a version and are left
alone, and so are paths outside the checkout (`../shared/…`). A `:LINE` must be a line of the
file; a name cited as `path's NAME`, `path (NAME)`, `path::NAME` or ``NAME` in path`` must be
defined (or imported) in that file; a `<page>.md §N` must name a numbered heading of that page.
The same rules hold for our Markdown, except docs/reference/ (other projects' notes) and
bench/RESULTS.md and bench/results/ (dated records: each run cites the tree it ran on).
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

from .test_doc_citations import ROOT, _comments_and_docstrings, _files, _resolves

PACKAGES = ("protocol", "router", "transfer", "coordinator", "worker", "fleet", "bench",
            "splitserve_testing")
SCANNED = (*PACKAGES, "tests")
# Top-level folders that other projects have too: ours only when the next component exists here.
SHARED_TOPS = ("tests", "docs", "examples", "helm")
PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[\w.-]*\w"
                  r"\.(?:py|yaml|yml|sh|json|toml|txt|jinja|tpl))(?::(\d+))?\b")
PATH_NAME = re.compile(r"(?<![\w./-])((?:[A-Za-z_]\w*/)+\w+\.py)(?:(?:'s | \()`{1,2}|::)"
                       r"([A-Za-z_]\w*)")
# `docs/design.md §7`, a Markdown link then `§8`, `docs/reference/kv_events.md §9.1`
MD_SECTION = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.md)(?:\]\([^)]*\))?\)? ?§ ?"
                        r"(\d+(?:\.\d+)?)")
NAME_IN_PATH = re.compile(r"`{1,2}([A-Za-z_]\w*)(?:\(\))?`{1,2} in "
                          r"`?((?:[A-Za-z_]\w*/)+\w+\.py)\b")


def _ours(cited: str, citing: Path) -> bool:
    """Whether a cited path names a file of this repository (as opposed to another project's)."""
    parts = cited.split("/")
    if parts[0] in PACKAGES:
        return True
    if parts[0] in SHARED_TOPS:
        return len(parts) == 2 or (ROOT / parts[0] / parts[1]).exists()
    # relative to the citing module's folder (`legs/plan.py` from fleet/, `pump.py` has no folder)
    return (citing.parent / parts[0]).is_dir()


@lru_cache(maxsize=None)
def _defined(path: Path) -> frozenset[str]:
    """Every name a module defines or imports, at any depth (functions, classes, methods,
    assignments, attributes assigned on self)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return frozenset(names)


def _target(cited: str, citing: Path) -> Path | None:
    for base in (ROOT, citing.parent):
        if (base / cited).is_file():
            return base / cited
    return None


def stale_citations(path: Path, items: list[tuple[int, str]]) -> list[str]:
    """What `items` (line, comment, docstring or Markdown text) of `path` cite that is not true."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for line, text in items:
        where = f"{rel}:{line}"
        for cited, at in PATH.findall(text):
            if not _ours(cited, path):
                continue
            target = _target(cited, path)
            if target is None:
                out.append(f"{where}: {cited} (no such file)")
            elif at and int(at) > len(target.read_text(encoding="utf-8").splitlines()):
                out.append(f"{where}: {cited}:{at} (the file has fewer lines)")
        pairs = PATH_NAME.findall(text) + [(p, n) for n, p in NAME_IN_PATH.findall(text)]
        for cited, name in pairs:
            target = _target(cited, path) if _ours(cited, path) else None
            if target is not None and name not in _defined(target):
                out.append(f"{where}: {name} is not defined in {cited}")
    return out


@lru_cache(maxsize=None)
def _sections(md: Path) -> frozenset[str]:
    """The numbers of a Markdown file's numbered headings (`## 9. …`, `### 9.1 …`)."""
    text = re.sub(r"^```.*?^```", "", md.read_text(encoding="utf-8"), flags=re.S | re.M)
    return frozenset(re.findall(r"^#+ (\d+(?:\.\d+)*)\.? ", text, re.M))


def stale_sections(path: Path, items: list[tuple[int, str]]) -> list[str]:
    """`<page>.md §N` citations in `items` whose page has no section N (the file itself is checked
    by tests/test_doc_citations.py)."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for line, text in items:
        for cited, n in MD_SECTION.findall(text):
            bases = (ROOT, path.parent, ROOT / "docs", ROOT / "docs" / "reference")
            md = next((b / cited for b in bases if (b / cited).is_file()), None)
            if md is not None and _sections(md) and n not in _sections(md):
                out.append(f"{rel}:{line}: {cited} §{n} (no such section)")
    return out


def _our_markdown() -> list[Path]:
    skip = (("docs", "reference"), ("bench", "RESULTS.md"), ("bench", "results"))
    return [p for p in _files(".md") if p.relative_to(ROOT).parts[:2] not in skip]


def _lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))


def test_cited_sections_exist():
    stale = []
    for path in _files(".py"):
        if path.relative_to(ROOT).parts[0] in SCANNED:
            stale += stale_sections(path, _comments_and_docstrings(path))
    for path in _our_markdown():
        stale += stale_sections(path, _lines(path))
    assert not stale, "citations of sections that do not exist:\n" + "\n".join(stale)


def test_markdown_cites_repository_files_that_exist():
    stale = [s for path in _our_markdown() for s in stale_citations(path, _lines(path))]
    assert not stale, "stale citations in Markdown:\n" + "\n".join(stale)


def test_code_comments_cite_repository_files_that_exist():
    stale = []
    for path in _files(".py"):
        if path.relative_to(ROOT).parts[0] in SCANNED:
            assert _resolves(str(path.relative_to(ROOT)), path)
            stale += stale_citations(path, _comments_and_docstrings(path))
    assert not stale, "stale citations in comments and docstrings:\n" + "\n".join(stale)


def test_the_checker_sees_each_kind_of_stale_citation():
    # The check above must be able to fail: a moved module, a line past the end, a moved name.
    here = ROOT / "fleet" / "flow.py"
    text = ("See transfer/engine_link.py, worker/kv_connector.py and fleet/legs/plan.py:99999; "
            "fleet/relay.py's `Relay`, `no_such_function` in fleet/relay.py, "
            "tests/splitserve_testing/test_harness.py::test_gone; vllm/v1/core/"
            "kv_cache_utils.py, tests/v1/kv_connector/toy_proxy_server.py, ../shared/x/y.sh, "
            "tests/fleet/peers/fixtures/vllm_router.json and legs/nowhere.py.")
    found = stale_citations(here, [(1, text)])
    assert found == ["fleet/flow.py:1: transfer/engine_link.py (no such file)",
                     "fleet/flow.py:1: fleet/legs/plan.py:99999 (the file has fewer lines)",
                     "fleet/flow.py:1: tests/fleet/peers/fixtures/vllm_router.json (no such file)",
                     "fleet/flow.py:1: legs/nowhere.py (no such file)",
                     "fleet/flow.py:1: test_gone is not defined in tests/splitserve_testing/test_harness.py",
                     "fleet/flow.py:1: no_such_function is not defined in fleet/relay.py"], found
    text = ("docs/design.md §8, [design.md](design.md) §42, "
            "docs/reference/kv_events.md §9.1, kv_events.md §9.9")
    sections = stale_sections(here, [(2, text)])
    assert sections == [f"fleet/flow.py:2: {page} (no such section)"
                        for page in ("design.md §42", "kv_events.md §9.9")], sections
