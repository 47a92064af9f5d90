"""Comments, docstrings and docs cite only files that are in the repository.

A citation is a path ending in `.md` inside a comment or a docstring of any Python file here, or a
`docs/….md` path or a relative Markdown link (with its `#heading`) in a Markdown file
(docs/reference/ quotes other projects' paths, so only its links are checked). It resolves against the repository
root or the citing file's directory. `docs/design.md §N` must also name a section that exists.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {".venv", ".git", "node_modules", "splitserve.egg-info", ".bench_out", "build",
        ".aiperf-venv"}  # bench/routing/routing_aiperf.py's own virtualenv (gitignored)
MD_PATH = re.compile(r"(?<![\w./-])((?:\.\./|\./)?[\w-]+(?:/[\w.-]+)*\.md)\b")
DESIGN_SECTION = re.compile(r"docs/design\.md ?§ ?(\d+)")
MD_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def _files(ext: str) -> list[Path]:
    """The repository's files (git's view: tracked or new, never ignored ones such as virtualenvs);
    without git, a walk that skips the usual build and environment folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
        return [ROOT / n for n in out.decode().split("\0") if n.endswith(ext) and (ROOT / n).is_file()]
    except (OSError, subprocess.SubprocessError):
        return [p for p in ROOT.rglob(f"*{ext}")
                if not SKIP & set(p.relative_to(ROOT).parts)]


# Cached: three checks read every Python file's comments and docstrings (this file's and two of
# tests/test_code_citations.py's); tokenizing and parsing them was ~5 s per check on a 2-core box.
@lru_cache(maxsize=None)
def _comments_and_docstrings(path: Path) -> tuple[tuple[int, str], ...]:
    src = path.read_text(encoding="utf-8")
    out = [(tok.start[0], tok.string)
           for tok in tokenize.generate_tokens(io.StringIO(src).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:   # docstrings and other bare string statements
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                out.append((stmt.lineno, stmt.value.value))
    return tuple(out)


def _resolves(cited: str, citing: Path) -> bool:
    return (ROOT / cited).is_file() or (citing.parent / cited).is_file()


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"^```.*?^```", "", md.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def _design_sections() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return set(re.findall(r"^## (\d+)\.", text, re.M))


def test_python_comments_and_docstrings_cite_files_that_exist():
    sections = _design_sections()
    missing = []
    for path in _files(".py"):
        for line, text in _comments_and_docstrings(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            missing += [f"{where}: {m}" for m in MD_PATH.findall(text) if not _resolves(m, path)]
            missing += [f"{where}: docs/design.md §{n} (no such section)"
                        for n in DESIGN_SECTION.findall(text) if n not in sections]
    assert not missing, "citations of files not in the repository:\n" + "\n".join(missing)


def test_markdown_cites_files_that_exist():
    sections = _design_sections()
    missing = []
    for path in _files(".md"):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        for target, anchor in MD_LINK.findall(text):
            if "://" in target or (target and not target.endswith(".md")):
                continue
            md = path.parent / target if target else path
            if not md.is_file():
                missing.append(f"{rel}: link {target}")
            elif anchor and anchor not in _anchors(md):
                missing.append(f"{rel}: link {target}#{anchor} (no such heading)")
        # docs/reference/ restates other projects, whose own docs/… paths it quotes.
        ours = [] if rel.parts[:2] == ("docs", "reference") else re.findall(
            r"(?<![\w./-])(docs/[\w./-]+\.md)", text)
        for m in ours:
            if not (ROOT / m).is_file():
                missing.append(f"{rel}: {m}")
        missing += [f"{rel}: docs/design.md §{n} (no such section)"
                    for n in DESIGN_SECTION.findall(text) if n not in sections]
    assert not missing, "Markdown citations of files not in the repository:\n" + "\n".join(missing)


def test_the_scanner_sees_a_missing_file(tmp_path):
    # The check above must be able to fail: a docstring citing a file that does not exist.
    p = tmp_path / "m.py"
    p.write_text('"""See docs/no-such-page.md and docs/design.md §99."""\n# and README.md\n')
    found = [m for _, t in _comments_and_docstrings(p) for m in MD_PATH.findall(t)]
    assert sorted(found) == ["README.md", "docs/design.md", "docs/no-such-page.md"]
    assert not _resolves("docs/no-such-page.md", p) and _resolves("README.md", p)
    assert "99" not in _design_sections() and "1" in _design_sections()
