"""bench/RESULTS.md's shape and its upkeep (bench/_common.py).

The file holds one `## ...` section per benchmark, each naming its script, with each
configuration's current run as one `### ...` block, newest first, each dated. A run that replaces
one moves, verbatim, to the section's file in bench/results/history/ (newest first there too).
"""
from __future__ import annotations

import re
from pathlib import Path

from bench._common import history_file, replace_section, replace_subsection

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "RESULTS.md"
# The section each script writes (or whose runs are recorded by hand), and the script.
SECTIONS = {
    "router core": "bench/routing/router_core.py",
    "placement": "bench/routing/placement.py",
    "routing": "bench/routing/routing.py",
    "coordinator": "bench/coordinator/coordinator.py",
    "fleet": "bench/fleet/fleet.py",
    "failover": "bench/fleet/failover.py",
    "engine protocols": "bench/fleet/engine_protocols.py",
    "worker": "bench/worker/worker.py",
    "kv connector": "bench/worker/kv_connector.py",
    "transfer": "bench/transfer/transfer.py",
    "disagg_e2e": "bench/transfer/disagg_e2e.py",
}
DATE = re.compile(r"(20\d\d-\d\d-\d\d)(?:[ ,~]*(\d\d:\d\d|morning|afternoon|evening|late))?")
WORDS = {"morning": "09:00", "afternoon": "15:00", "evening": "20:00", "late": "23:00"}


def _date(text: str) -> tuple[str, str] | None:
    """The first date (and time of day, when given) in a heading or the lines under it."""
    m = DATE.search(text)
    return (m[1], WORDS.get(m[2], m[2] or "")) if m else None


def _sections(text: str) -> list[tuple[str, str, list[str]]]:
    """[(name, lead text, [### blocks])] of a results file."""
    out = []
    for part in re.split(r"(?m)^(?=## )", text)[1:]:
        name, body = part.split("\n", 1)
        lead, *blocks = re.split(r"(?m)^(?=### )", body)
        out.append((name[3:].strip(), lead, blocks))
    return out


def _when(block: str) -> tuple[str, str] | None:
    head, *rest = block.split("\n")
    return _date(head) or _date(" ".join(line.strip() for line in rest[:15]))


def test_one_section_per_benchmark_each_naming_its_script():
    secs = _sections(RESULTS.read_text())
    names = [name for name, _, _ in secs]
    assert len(names) == len(set(names)), f"a section appears twice: {names}"
    assert set(names) <= set(SECTIONS), f"sections {names}: each must be one of {sorted(SECTIONS)}"
    for name, lead, blocks in secs:
        assert (ROOT / SECTIONS[name]).is_file(), SECTIONS[name]
        # a section a script creates has no lead: its run's command names the script instead
        assert SECTIONS[name] in lead + "".join(blocks), f"## {name} never names {SECTIONS[name]}"


def test_current_runs_are_dated_and_newest_first():
    for name, lead, blocks in _sections(RESULTS.read_text()):
        dates = []
        for block in blocks:
            # a section a script writes whole (router core, routing) dates its blocks in its lead
            when = _when(block) or _date(lead)
            assert when, f"## {name}: {block.splitlines()[0]} has no date"
            dates.append(when)
        assert dates == sorted(dates, reverse=True), f"## {name}: not newest first: {dates}"


def test_history_files_belong_to_sections_and_run_newest_first():
    files = sorted((ROOT / "bench" / "results" / "history").glob("*.md"))
    assert files
    known = {history_file(RESULTS, name): name for name in SECTIONS}
    for f in files:
        assert f in known, f"{f.name} is no section's history ({sorted(p.name for p in known)})"
        text = f.read_text()
        assert text.startswith(f"# {known[f]}: earlier runs\n")
        dates = [d for d in (_when(b) for b in re.split(r"(?m)^(?=### )", text)[1:]) if d]
        assert dates == sorted(dates, reverse=True), f"{f.name}: not newest first"
    # every history file is linked from its section, so a reader finds it
    text = RESULTS.read_text()
    for f in files:
        assert f"results/history/{f.name}" in text, f"bench/RESULTS.md never links {f.name}"


def test_a_second_run_goes_first_and_its_predecessor_to_history(tmp_path):
    p = tmp_path / "RESULTS.md"
    p.write_text("# r\n\n## worker\n\nScript: x\n\n### other · cpu\n\nkeep me\n\n## fleet\n\nand me\n")
    replace_subsection(p, "worker", "### tiny · cpu", "run 1")
    text = p.read_text()
    assert text.index("Script: x") < text.index("### tiny · cpu") < text.index("### other · cpu")
    replace_subsection(p, "worker", "### tiny · cpu", "run 2")
    text = p.read_text()
    assert text.count("### tiny · cpu") == 1 and "run 2" in text and "run 1" not in text
    assert "keep me" in text and "## fleet\n\nand me" in text
    assert text.index("### tiny · cpu") < text.index("### other · cpu") < text.index("## fleet")
    hist = tmp_path / "results" / "history" / "worker.md"
    assert hist == history_file(p, "worker")
    assert hist.read_text() == ("# worker: earlier runs\n\nRuns that a newer one replaced in "
                                "bench/RESULTS.md, newest first, verbatim.\n\n### tiny · cpu\n\nrun 1\n")
    replace_subsection(p, "worker", "### tiny · cpu", "run 3")
    h = hist.read_text()
    assert h.index("run 2") < h.index("run 1") and "run 3" not in h and "run 3" in p.read_text()


def test_a_missing_section_or_file_is_created(tmp_path):
    p = tmp_path / "RESULTS.md"
    replace_subsection(p, "coordinator", "### 2 cores", "numbers")
    assert p.read_text() == "# Benchmark results\n\n## coordinator\n\n### 2 cores\n\nnumbers\n"
    replace_subsection(p, "fleet", "### 16 cores", "more")
    assert p.read_text().endswith("## fleet\n\n### 16 cores\n\nmore\n")
    assert not (tmp_path / "results").exists()   # nothing was replaced


def test_a_whole_section_replaced_keeps_the_old_one_in_history(tmp_path):
    p = tmp_path / "RESULTS.md"
    replace_section(p, ["## routing", "", "run 1", "", "### 8 workers", "", "table 1"])
    p.write_text(p.read_text() + "\n## other\n\nkeep me\n")
    replace_section(p, ["## routing", "", "run 2"])
    text = p.read_text()
    assert "run 2" in text and "run 1" not in text and "keep me" in text
    h = history_file(p, "routing").read_text()
    assert re.search(r"^### routing · replaced 20\d\d-\d\d-\d\d \d\d:\d\d UTC\n", h, re.M)
    assert "run 1" in h and "#### 8 workers\n\ntable 1" in h and "keep me" not in h


def test_a_replaced_section_s_link_to_its_own_history_is_not_kept_as_a_broken_link(tmp_path):
    # bench/RESULTS.md's sections open with an "earlier runs" link to their history file, relative to
    # bench/; moved into that history file the link would name a file that does not exist
    # (tests/test_doc_citations.py failed on it after a real replacement, 2026-12-07)
    p = tmp_path / "RESULTS.md"
    replace_section(p, ["## routing", "", "earlier runs: [results/history/routing.md](results/history/routing.md).",
                        "", "run 1"])
    replace_section(p, ["## routing", "", "run 2"])
    h = history_file(p, "routing").read_text()
    assert "earlier runs: `results/history/routing.md`." in h and "](results/history/" not in h
    assert "run 1" in h
