"""Upstream TensorRT-LLM disaggregated configs load unchanged; typos still fail.

Fixtures in tests/fixtures/trtllm_disagg/ are verbatim copies of NVIDIA/TensorRT-LLM files (path and
commit per file in tests/fixtures/trtllm_disagg/SOURCES.md); the allow-lists come from that repository's
tensorrt_llm/llmapi/llm_args.py (commit in coordinator/upstream_args.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config import ConfigError, load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "trtllm_disagg"
UPSTREAM_FILES = sorted(FIXTURES.glob("*.yaml"))
ROOT = Path(__file__).resolve().parents[2]


def _check_config(path, env=None):
    return subprocess.run([sys.executable, str(ROOT / "splitserve_cli.py"), "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_fixtures_present_and_cited():
    sources = (FIXTURES / "SOURCES.md").read_text()
    assert len(UPSTREAM_FILES) >= 8
    for f in UPSTREAM_FILES + sorted((FIXTURES / "llm_api").glob("*.yaml")):
        assert f.name in sources, f"{f.name} has no upstream path/commit in SOURCES.md"


# The one upstream key splitserve refuses rather than ignores (no /perf_metrics here).
PERF_METRICS_FILES = {"disagg_config_gen_only_kv_cache_aware.yaml"}


@pytest.mark.parametrize("path", UPSTREAM_FILES, ids=lambda p: p.name)
def test_upstream_file_loads(path):
    if path.name in PERF_METRICS_FILES:
        with pytest.raises(ConfigError) as ei:
            load_config(path)
        assert ei.value.path == "perf_metrics_max_requests"
        assert "/perf_metrics" in ei.value.message and "found 1000" in ei.value.message
        path = yaml_without(path, "perf_metrics_max_requests")
    cfg = load_config(path)
    assert cfg.served_model


def yaml_without(path, key):
    import yaml
    doc = yaml.safe_load(path.read_text())
    del doc[key]
    return doc


@pytest.mark.parametrize("path", sorted((FIXTURES / "llm_api").glob("*.yaml")), ids=lambda p: p.name)
def test_upstream_llm_api_options_load_as_a_server_section(path):
    import yaml
    opts = yaml.safe_load(path.read_text())
    cfg = load_config({"context_servers": {"urls": ["h:1"], **opts}})
    assert set(opts) <= set(cfg.context_servers.engine_args)


def test_keys_the_old_allow_list_rejected_are_kept():
    cfg = load_config(yaml_without(FIXTURES / "disagg_config_gen_only_kv_cache_aware.yaml",
                                   "perf_metrics_max_requests"))
    # an LLM arg inside the sections (the engines' own setting) is kept for them
    assert cfg.perf_metrics_max_requests == 0
    assert cfg.context_servers.engine_args["perf_metrics_max_requests"] == 1000
    assert cfg.generation_servers.engine_args["return_perf_metrics"] is True
    cfg = load_config(FIXTURES / "disagg_config_mamba_bs1_concurrency2.yaml")
    assert cfg.context_servers.kv_cache_config.extra["use_kv_cache_manager_v2"] is True
    assert cfg.generation_servers.kv_cache_config.extra["mamba_ssm_cache_dtype"] == "float16"


def test_top_level_llm_arg_is_inherited():
    # BaseLlmArgs.gather_generation_logits (llm_args.py); no upstream disagg YAML in the code index
    # sets it, so this one is written here.
    cfg = load_config("gather_generation_logits: true\ncontext_servers: {urls: [h:1]}\n")
    assert cfg.context_servers.engine_args["gather_generation_logits"] is True
    assert cfg.generation_servers.engine_args["gather_generation_logits"] is True


@pytest.mark.parametrize("doc, path, hint", [
    ("context_servers:\n  max_batch_sise: 4\n", "context_servers.max_batch_sise", "max_batch_size"),
    ("generation_servers:\n  kv_cache_config:\n    use_kv_cache_manager_v3: true\n",
     "generation_servers.kv_cache_config.use_kv_cache_manager_v3", "use_kv_cache_manager_v2"),
    ("perf_metrics_max_request: 10\n", "perf_metrics_max_request", "perf_metrics_max_requests"),
])
def test_typos_are_still_errors(doc, path, hint):
    with pytest.raises(ConfigError) as ei:
        load_config(doc)
    assert ei.value.path == path and ei.value.kind == "unknown_key"
    assert hint in ei.value.message


def test_check_config_cli_ok_prints_normalised_config(tmp_path):
    src = (FIXTURES / "disagg_config_cache_aware_balance.yaml").read_text()
    f = tmp_path / "c.yaml"
    f.write_text(src + "api_keys: [sk-live-123]\ninternal_request_auth_key: hunter2\n")
    r = _check_config(f)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["context_servers"]["urls"] == ["http://localhost:8001", "http://localhost:8002"]
    assert out["context_servers"]["router"]["type"] == "kv_cache_aware"
    assert out["context_servers"]["engine_args"]["free_gpu_memory_fraction"] == 0.1
    assert out["api_keys"] == ["<redacted>"]
    assert out["internal_request_auth_key"] == "<redacted>"
    assert "sk-live-123" not in r.stdout + r.stderr and "hunter2" not in r.stdout + r.stderr


def test_check_config_cli_rejects_with_path(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("internal_request_auth_key: hunter2\ngeneration_servers:\n  max_num_tokns: 8\n")
    r = _check_config(f)
    assert r.returncode == 1
    assert "generation_servers.max_num_tokns" in r.stderr and "max_num_tokens" in r.stderr
    assert r.stdout == "" and "hunter2" not in r.stderr
