"""Helpers the bench scripts share: the host's CPU name and RESULTS.md section upkeep.

Imported as `from bench._common import ...`; each script puts the repository root first on
sys.path before importing it (see the top of any bench script).
"""
from __future__ import annotations

import platform
import re
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else whatever `platform` knows."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


def replace_subsection(path: Path, section: str, title: str, body: str) -> None:
    """Put `title` + `body` under the `## {section}` heading of the results file at `path`.

    The subsection headed exactly `title` (a `### ...` line) is replaced in place; otherwise it is
    appended to the section, and a missing section (or file) is created. Text outside that one
    subsection is kept as it was, so each configuration owns only its own block.
    """
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    found = re.search(rf"^## {re.escape(section)}\s*$.*?(?=^## |\Z)", text, flags=re.M | re.S)
    block = f"{title}\n\n{body}\n"
    if found is None:
        text = text.rstrip("\n") + f"\n\n## {section}\n\n" + block
    else:
        sec = found.group(0)
        sub = re.search(rf"^{re.escape(title)}\s*$.*?(?=^### |\Z)", sec, flags=re.M | re.S)
        new_sec = sec.replace(sub.group(0), block) if sub else sec.rstrip("\n") + "\n\n" + block
        text = text[:found.start()] + new_sec + text[found.end():]
    path.write_text(text.rstrip("\n") + "\n")
