"""`splitserve check-config` reports every problem in one run, the environment's overrides
included, with suggestions (issue 39, item 4). Run as a real process, as an operator would."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("coordinator", "fleet", "worker", "router", "protocol", "transfer", "http1")


def _check(path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    return subprocess.run([sys.executable, "-m", "splitserve_cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env={**base, **env})


def _errors(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.splitlines() if line.startswith("  ")]


FOUR_MISTAKES = """\
port: notanint
num_workrs: 2
context_servers:
  urls: ["127.0.0.1:8101"]
  router: {type: kv_cache_awre}
generation_servers:
  urls: ["127.0.0.1:8102"]
  router: {type: kv_cache_aware, speculative_tl_s: 3}
fleet: {drain_timeout_s: -1}
"""


def test_every_mistake_of_a_file_in_one_run(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(FOUR_MISTAKES)
    r = _check(f)
    assert r.returncode == 1 and r.stdout == ""
    errs = _errors(r.stderr)
    assert "(5 errors)" in r.stderr, r.stderr
    assert errs[0].startswith("port: expected int")
    assert errs[1].startswith("num_workrs: unknown key (did you mean 'num_workers'?)")
    assert errs[2].startswith("context_servers.router.type:") and "did you mean 'kv_cache_aware'" in errs[2]
    assert errs[3].startswith("fleet.drain_timeout_s: expected a value >= 0")
    assert errs[4].startswith("generation_servers.router.speculative_tl_s:") \
        and "did you mean 'speculative_ttl_s'" in errs[4]


def test_env_overrides_are_validated_and_misspellings_suggested(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("port: 8000\n")
    r = _check(f, SPLITSERVE_NUM_WORKERS="abc", SPLITSERVE_FLEET__DRAIN_TIMEOUT_S="-2",
               SPLITSERVE_COORDINATOR__PROT="3")
    assert r.returncode == 1
    errs = _errors(r.stderr)
    assert any(e.startswith("SPLITSERVE_NUM_WORKERS: expected int, found str 'abc'") for e in errs), errs
    assert any(e.startswith("SPLITSERVE_FLEET__DRAIN_TIMEOUT_S:") and ">= 0" in e for e in errs), errs
    assert "warning: SPLITSERVE_COORDINATOR__PROT: unknown variable" in r.stderr
    assert "did you mean SPLITSERVE_COORDINATOR__PORT?" in r.stderr
    # an unknown variable alone is a warning: other tools' variables may share the prefix
    r = _check(f, SPLITSERVE_NUM_WORKRS="2")
    assert r.returncode == 0 and "did you mean SPLITSERVE_NUM_WORKERS?" in r.stderr, r.stderr


def test_valid_overrides_show_in_the_normalised_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("port: 8000\n")
    # a flag's own variable (splitserve worker --cache-dir) is known too: no warning
    r = _check(f, SPLITSERVE_NUM_WORKERS="3", SPLITSERVE_CACHE_DIR="/tmp/x")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_workers"] == 3 and "warning" not in r.stderr


def test_every_variable_the_code_reads_is_known():
    """A SPLITSERVE_* name read anywhere in the code is a config key, a flag's variable or listed
    in PROCESS_ENV: check-config never calls a real variable unknown."""
    import splitserve_cli
    from coordinator.config_overrides import PROCESS_ENV, override_env_names
    known = set(override_env_names()) | splitserve_cli.flag_env_names() | set(PROCESS_ENV)
    found = set()
    for d in SOURCE_DIRS:
        for p in (ROOT / d).rglob("*.py"):
            found |= set(re.findall(r"SPLITSERVE_[A-Z0-9_]*[A-Z0-9]", p.read_text()))
    found |= set(re.findall(r"SPLITSERVE_[A-Z0-9_]*[A-Z0-9]", (ROOT / "splitserve_cli.py").read_text()))
    assert found - known == set()
