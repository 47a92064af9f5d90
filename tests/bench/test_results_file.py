"""bench/_common.py `replace_subsection`: each benchmark configuration owns one `### ...` block of
its `## ...` section of bench/RESULTS.md; a second run replaces that block in place."""
from __future__ import annotations

from bench._common import replace_subsection


def test_a_second_run_replaces_its_block_and_keeps_the_rest(tmp_path):
    p = tmp_path / "RESULTS.md"
    p.write_text("# r\n\n## worker\n\n### other · cpu\n\nkeep me\n\n## fleet\n\nand me\n")
    replace_subsection(p, "worker", "### tiny · cpu", "run 1")
    replace_subsection(p, "worker", "### tiny · cpu", "run 2")
    text = p.read_text()
    assert text.count("### tiny · cpu") == 1 and "run 2" in text and "run 1" not in text
    assert "keep me" in text and "## fleet\n\nand me" in text
    assert text.index("### other · cpu") < text.index("### tiny · cpu") < text.index("## fleet")


def test_a_missing_section_or_file_is_created(tmp_path):
    p = tmp_path / "RESULTS.md"
    replace_subsection(p, "coordinator", "### 2 cores", "numbers")
    assert p.read_text() == "# Benchmark results\n\n## coordinator\n\n### 2 cores\n\nnumbers\n"
    replace_subsection(p, "fleet", "### 16 cores", "more")
    assert p.read_text().endswith("## fleet\n\n### 16 cores\n\nmore\n")
