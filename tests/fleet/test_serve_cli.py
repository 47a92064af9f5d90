"""`splitserve serve` argument and config errors: a clear message and exit code 2, no traceback."""
from __future__ import annotations

import subprocess

from .conftest import PY, clean_env


def serve(*args, env=None):
    return subprocess.run([PY, "-m", "splitserve_cli", "serve", *args], capture_output=True, text=True,
                          timeout=60, env=env or clean_env())


def test_config_required():
    r = serve()
    assert r.returncode == 2 and "a cluster config is required" in r.stderr


def test_unreadable_and_invalid_config(tmp_path):
    r = serve("-c", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read config file" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: notanint\n")
    r = serve("-c", str(bad))
    assert r.returncode == 2 and "port: expected int" in r.stderr and "Traceback" not in r.stderr


def test_env_override_is_validated(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 8000\n")
    r = serve("-c", str(cfg), env=clean_env(SPLITSERVE_NUM_WORKERS="zero"))
    assert r.returncode == 2 and "SPLITSERVE_NUM_WORKERS" in r.stderr


def test_kv_routing_without_a_tokenizer_fails_fast(tmp_path):
    # The in-process coordinator starts, but nothing names the workers' tokenizer: a clear exit 2.
    cfg = tmp_path / "c.yaml"
    cfg.write_text("hostname: 127.0.0.1\nport: 0\nmodel: /no/such/model/dir\nserver_start_timeout: 5\n"
                   "generation_servers: {urls: ['127.0.0.1:9'], router: {type: kv_cache_aware}}\n")
    r = serve("-c", str(cfg))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot compute routing keys" in r.stderr
