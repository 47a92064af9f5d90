"""Helpers the bench scripts share: the host's CPU name and interpreter speed, CPU pinning of the
processes a bench starts, and bench/RESULTS.md section upkeep (each configuration's current run
there, newest first; the runs they replace in bench/results/history/).

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
    between runs minutes apart, with no steal time reported (bench/results/history/coordinator.md, "coordinator ·
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


def history_file(path: Path, section: str) -> Path:
    """Where the runs that a newer one replaced in the `## {section}` section of the results file at
    `path` go: `results/history/<section, spaces as _>.md` beside it (bench/results/history/)."""
    return path.parent / "results" / "history" / (section.replace(" ", "_") + ".md")


def _to_history(path: Path, section: str, block: str) -> None:
    """Put `block` (a `### ...` run, verbatim) first in `section`'s history file: newest first."""
    hist = history_file(path, section)
    hist.parent.mkdir(parents=True, exist_ok=True)
    text = hist.read_text() if hist.exists() else (
        f"# {section}: earlier runs\n\nRuns that a newer one replaced in bench/RESULTS.md, newest "
        "first, verbatim.\n")
    first = re.search(r"^### ", text, flags=re.M)
    at = first.start() if first else len(text.rstrip("\n")) + 1
    head = text[:at].rstrip("\n") + "\n\n"
    hist.write_text(head + block.rstrip("\n") + "\n" + ("\n" + text[at:] if first else ""))


def replace_section(path: Path, section: list[str]) -> None:
    """Replace the whole `## ...` section whose heading is `section[0]` (or append it) in the
    results file at `path`; every other section is kept as it was. The replaced run goes first in
    the section's history file, its heading kept as a `### ... · replaced <date>` line."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = "\n".join(section).rstrip() + "\n"
    pat = re.compile(rf"^{re.escape(section[0].rstrip())}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pat.search(text)
    if old:
        name = section[0].rstrip()[3:]
        body = re.sub(r"^###", "####", old.group(0).split("\n", 1)[1], flags=re.M)
        # the section's own "earlier runs" link to its own history file is relative to bench/:
        # in the history file it would point at itself under a path that does not exist
        body = re.sub(r"\[([^\]]*)\]\(results/history/[^)]*\)", r"`\1`", body)
        _to_history(path, name, f"### {name} · replaced {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                    f"\n{body}")
        text = pat.sub(lambda _: block + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text.rstrip() + "\n")


def replace_subsection(path: Path, section: str, title: str, body: str) -> None:
    """Put `title` + `body` first under the `## {section}` heading of the results file at `path`.

    Sections hold each configuration's current run, newest first: the new block goes right after
    the section's lead text (before its first `### ...`). The subsection headed exactly `title` (this
    configuration's previous run) leaves the section and goes, verbatim, first in the section's
    history file (`history_file`). A missing section (or file) is created; other subsections are
    kept as they were.
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
        if sub:
            _to_history(path, section, sub.group(0))
            old = old[:sub.start()] + old[sub.end():]
        first = re.search(r"^### ", old, flags=re.M)
        lead, rest = (old[:first.start()], old[first.start():]) if first else (old, "")
        new = lead.rstrip("\n") + "\n\n" + block + ("\n" + rest if rest else "")
        after = text[sec.end():]
        text = text[:sec.start()] + new.rstrip("\n") + "\n" + ("\n" if after else "") + after
    path.write_text(text.rstrip("\n") + "\n")
