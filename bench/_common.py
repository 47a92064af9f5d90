"""Helpers the bench scripts share: the host's CPU name and interpreter speed, CPU pinning of the
processes a bench starts, and RESULTS.md section upkeep.

Imported as `from bench._common import ...`; each script puts the repository root first on
sys.path before importing it (see the top of any bench script).
"""
from __future__ import annotations

import platform
import re
import sys
import time
import timeit
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


def python_speed(rounds: int = 5, calls: int = 2000) -> float:
    """CPU µs per call of a fixed pure-Python workload, best of `rounds`: the routing key of
    bench/fleet/fleet.py's prompt (`router.block_keys.block_keys_list` over 960 token ids, 60 blocks).

    The 16-core bench host is a shared KVM guest whose speed for the same code swings about 2x
    between runs minutes apart, with no steal time reported (bench/RESULTS.md, "coordinator ·
    health probes spread over the interval"). Taken at a run's start and end, it shows when the
    host moved under a table; it is one core at two moments, not a normaliser."""
    from router.block_keys import block_keys_list
    ids = list(range(1000, 1960))
    return min(timeit.repeat(lambda: block_keys_list(ids, 16), timer=time.thread_time,
                             repeat=rounds, number=calls)) / calls * 1e6


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """`argv` run on the CPUs of the list `cpus` ("0-7,12"; None: unpinned) and every thread and
    child it starts, through an exec of the command (the pid stays the command's)."""
    if not cpus:
        return list(argv)
    from coordinator.config_schema import cpu_list
    return [sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, %r); "
            "os.execvp(sys.argv[1], sys.argv[1:])" % (set(cpu_list(cpus)),), *argv]


def replace_section(path: Path, section: list[str]) -> None:
    """Replace the whole `## ...` section whose heading is `section[0]` (or append it) in the
    results file at `path`; every other section is kept as it was."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = "\n".join(section).rstrip() + "\n"
    pat = re.compile(rf"^{re.escape(section[0].rstrip())}\n.*?(?=^## |\Z)", re.S | re.M)
    if pat.search(text):
        text = pat.sub(lambda _: block + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text.rstrip() + "\n")


def replace_subsection(path: Path, section: str, title: str, body: str) -> None:
    """Put `title` + `body` under the `## {section}` heading of the results file at `path`.

    The subsection headed exactly `title` (a `### ...` line) is replaced in place; otherwise it is
    appended to the section, and a missing section (or file) is created. Text outside that one
    subsection is kept as it was, so each configuration owns only its own block.
    """
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    heading = f"## {section}"
    block = f"{title}\n\n{body.rstrip()}\n"
    sec = re.search(rf"^{re.escape(heading)}\s*$.*?(?=^## |\Z)", text, flags=re.M | re.S)
    if sec is None:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n" + block
    else:
        old = sec.group(0)
        sub = re.search(rf"^{re.escape(title)}\s*$.*?(?=^### |\Z)", old, flags=re.M | re.S)
        new = (old[:sub.start()] + block + ("\n" if old[sub.end():] else "") + old[sub.end():] if sub
               else old.rstrip("\n") + "\n\n" + block)
        rest = text[sec.end():]
        text = text[:sec.start()] + new.rstrip("\n") + "\n" + ("\n" if rest else "") + rest
    path.write_text(text.rstrip("\n") + "\n")
