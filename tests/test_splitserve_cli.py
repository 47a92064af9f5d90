"""The `splitserve` command: its help lists exactly the subcommands that exist, and every
subcommand's `--help` works (run as real processes, as an operator would)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import splitserve_cli

ROOT = Path(__file__).resolve().parents[1]


def _module_exists(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (ROOT / rel.with_suffix(".py")).is_file() or (ROOT / rel / "__init__.py").is_file()


EXISTING = [name for name, (mod, _h) in splitserve_cli.SUBCOMMANDS.items() if _module_exists(mod)]
MISSING = [name for name in splitserve_cli.SUBCOMMANDS if name not in EXISTING]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve_cli", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _listed(help_text: str) -> set[str]:
    # argparse prints each subcommand as an indented "name   help" row.
    return {name for name in splitserve_cli.SUBCOMMANDS
            if re.search(rf"^\s+{re.escape(name)}\s+\S", help_text, re.M)}


def test_top_level_help_lists_exactly_the_existing_subcommands():
    for args in (("--help",), ()):
        r = _run(*args)
        assert r.returncode == 0, r.stderr
        assert "usage: splitserve" in r.stdout
        assert _listed(r.stdout) == set(EXISTING), r.stdout
        for name in MISSING:
            assert not re.search(rf"^\s+{name}\s", r.stdout, re.M)


def test_every_existing_subcommand_help_exits_zero():
    assert EXISTING, "no subcommand module exists"
    # Start them all at once: each imports its own package (some import torch).
    procs = {name: subprocess.Popen([sys.executable, "-m", "splitserve_cli", name, "--help"],
                                    cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name in EXISTING}
    failures = []
    for name, p in procs.items():
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            failures.append(f"{name}: --help timed out")
            continue
        if p.returncode != 0:
            failures.append(f"{name}: exit {p.returncode}\n{err[-2000:]}")
        elif f"usage: splitserve {name}" not in out:
            failures.append(f"{name}: no usage line in --help output:\n{out[:500]}")
    assert not failures, "\n".join(failures)


def test_unknown_subcommand_is_an_error_that_lists_the_known_ones():
    r = _run("no-such-command")
    assert r.returncode == 2
    assert "unknown command 'no-such-command'" in r.stderr
    for name in EXISTING:
        assert name in r.stderr


def test_console_script_entry_point_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^splitserve\s*=\s*"splitserve_cli:entry"', text, re.M)
    assert importlib.util.find_spec("splitserve_cli") is not None


@pytest.mark.skipif(not (Path(sys.executable).parent / "splitserve").exists(),
                    reason="console script not installed in this interpreter's environment")
def test_installed_console_script_runs():
    exe = Path(sys.executable).parent / "splitserve"
    r = subprocess.run([str(exe), "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and _listed(r.stdout) == set(EXISTING)
