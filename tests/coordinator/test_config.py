"""coordinator.config: strict loading, upstream compatibility, overrides, redaction."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from coordinator.config import (
    ClusterConfig,
    ConfigError,
    RouterConfig,
    apply_overrides,
    env_var_name,
    load_config,
)
from coordinator.config_doc import schema_rows

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Modelled on docs/reference/trtllm_disagg.md §4.1: what a TensorRT-LLM user already has on disk.
UPSTREAM_YAML = """
hostname: localhost
port: 8000
model: TinyLlama/TinyLlama-1.1B-Chat-v1.0
backend: pytorch
max_retries: 1
perf_metrics_max_requests: 0
node_id: 7
schedule_style: generation_first
allow_request_chat_template: false
gen_strip_message_history: false
gen_tokids_ctxbytes: false
num_workers: 4
server_keep_alive_timeout: 10
internal_request_auth_key: hmac-secret-value
conditional_disagg_config: {max_local_prefill_length: 64}
otlp_config: {otlp_traces_endpoint: "http://otel:4318/v1/traces"}
free_gpu_memory_fraction: 0.3
context_servers:
  num_instances: 2
  urls: ["host-a:8001", "host-b:8002"]
  router: {type: kv_cache_aware, use_tokens: false}
  max_batch_size: 8
  max_num_tokens: 8192
  tensor_parallel_size: 2
  pipeline_parallel_size: 2
  enable_attention_dp: true
  disable_overlap_scheduler: true
  kv_cache_config: {tokens_per_block: 32, enable_block_reuse: true, event_buffer_max_size: 1024,
                    free_gpu_memory_fraction: 0.4, max_tokens: 100000}
  cache_transceiver_config: {backend: NIXL, max_tokens_in_buffer: 8192}
generation_servers:
  num_instances: 1
  urls: ["host-c:8003"]
  router: {type: load_balancing, use_tokens: true}
  max_batch_size: 256
  cuda_graph_config: {enable_padding: true, batch_sizes: [1, 2, 4]}
  kv_cache_config: {tokens_per_block: 32, enable_block_reuse: true}
"""


def err(src, env=None) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        load_config(src, env={} if env is None else env)
    return ei.value


# ------------------------------------------------------------------------ upstream compatibility

def test_upstream_file_loads_unchanged(tmp_path):
    p = tmp_path / "disagg.yaml"
    p.write_text(UPSTREAM_YAML)
    cfg = load_config(str(p), env={})
    assert cfg.hostname == "localhost" and cfg.port == 8000 and cfg.num_workers == 4
    assert cfg.node_id == 7 and cfg.schedule_style == "generation_first"
    assert cfg.conditional_disagg_config.max_local_prefill_length == 64
    assert cfg.otlp_config.otlp_traces_endpoint == "http://otel:4318/v1/traces"
    ctx, gen = cfg.context_servers, cfg.generation_servers
    assert ctx.urls == ("http://host-a:8001", "http://host-b:8002")
    assert gen.urls == ("http://host-c:8003",)
    assert ctx.router == RouterConfig("kv_cache_aware", {"use_tokens": False})
    assert gen.router.type == "load_balancing" and dict(gen.router.args) == {"use_tokens": True}
    assert ctx.instance_num_ranks == 4 and gen.instance_num_ranks == 1
    assert ctx.kv_cache_config.tokens_per_block == 32
    assert ctx.kv_cache_config.event_buffer_max_size == 1024
    assert dict(ctx.kv_cache_config.extra) == {"free_gpu_memory_fraction": 0.4, "max_tokens": 100000}
    # Engine args are kept, and top-level engine keys are inherited by both sections (upstream rule).
    for grp in (ctx, gen):
        assert grp.model == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
        assert grp.engine_args["backend"] == "pytorch"
        assert grp.engine_args["free_gpu_memory_fraction"] == 0.3
    assert ctx.engine_args["cache_transceiver_config"]["backend"] == "NIXL"
    assert gen.engine_args["cuda_graph_config"]["batch_sizes"] == (1, 2, 4)
    assert cfg.model == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    assert cfg.topology == "implicit_coordinator" and cfg.coordinator_port == 7999


def test_example_files_load():
    cfg = load_config(EXAMPLES / "cluster.yaml", env={})
    assert cfg.context_servers.urls == ("http://127.0.0.1:8101",)
    assert cfg.generation_servers.urls == ("http://127.0.0.1:8102",)
    assert cfg.context_servers.router.type == "kv_cache_aware"
    assert cfg.generation_servers.router.type == "load_balancing"
    up = load_config(EXAMPLES / "upstream_trtllm.yaml", env={})
    assert up.context_servers.num_instances == 2 and len(up.context_servers.urls) == 2
    v = load_config(EXAMPLES / "vllm_pd.yaml", env={})
    assert v.context_servers.protocol == v.generation_servers.protocol == "vllm"
    assert v.context_servers.kv_events[0].server == v.context_servers.urls[0]
    s = load_config(EXAMPLES / "sglang_pd.yaml", env={})
    assert s.context_servers.protocol is None and s.context_servers.bootstrap_port is None  # inferred


def test_yaml_text_dict_and_path_are_equivalent(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(UPSTREAM_YAML)
    a = load_config(p, env={})
    b = load_config(UPSTREAM_YAML, env={})
    c = load_config(yaml.safe_load(UPSTREAM_YAML), env={})
    assert a == b == c


def test_defaults_match_upstream():
    cfg = load_config(None, env={})
    assert (cfg.port, cfg.num_workers, cfg.max_retries) == (8000, 1, 1)
    assert (cfg.server_start_timeout, cfg.request_timeout) == (180.0, 180.0)
    assert cfg.schedule_style == "context_first"
    assert cfg.conditional_disagg_config is None
    assert cfg.context_servers.router == RouterConfig("round_robin", {})
    assert cfg.coordinator.host == "127.0.0.1"
    assert cfg.routing.block_size == 16 and cfg.routing.key_scheme == "xxh3_chain_v1"
    assert cfg.topology == "single" and cfg.coordinator_url is None
    dc = load_config({"disagg_cluster": {"cluster_uri": "http://coord:7999"}}, env={}).disagg_cluster
    assert (dc.heartbeat_interval_sec, dc.inactive_timeout_sec) == (5.0, 10.0)
    assert (dc.minimal_instances.context_servers, dc.minimal_instances.generation_servers) == (1, 1)


def test_flat_and_nested_router_forms_are_equal():
    flat = load_config({"context_servers": {"router": {"type": "kv_cache_aware", "use_tokens": True,
                                                       "max_batch_size": 32}}}, env={})
    nested = load_config({"context_servers": {"router": {"type": "kv_cache_aware", "args": {
        "use_tokens": True, "max_batch_size": 32}}}}, env={})
    mixed = load_config({"context_servers": {"router": {"type": "kv_cache_aware", "use_tokens": True,
                                                        "args": {"max_batch_size": 32}}}}, env={})
    assert flat == nested == mixed
    assert flat.context_servers.router.args == {"use_tokens": True, "max_batch_size": 32}
    e = err({"context_servers": {"router": {"type": "round_robin", "x": 1, "args": {"x": 2}}}})
    assert e.path == "context_servers.router.x"
    e = err({"context_servers": {"router": {"type": "round_robin", "args": [1]}}})
    assert e.path == "context_servers.router.args" and "mapping" in str(e)


def test_router_arguments_are_checked_by_the_policy_with_their_path():
    pytest.importorskip("router.policies")
    e = err({"context_servers": {"router": {"type": "kv_cache_aware", "use_tokenz": True}}})
    assert e.path == "context_servers.router.use_tokenz" and "kv_cache_aware" in str(e)
    e = err({"generation_servers": {"router": {"type": "load_balancing", "args": {
        "use_tokens": "yes"}}}})
    assert e.path == "generation_servers.router.use_tokens"


def test_router_args_are_read_only():
    cfg = load_config({"generation_servers": {"router": {"type": "conversation", "args": {
        "max_sessions": 10}}}}, env={})
    with pytest.raises(TypeError):
        cfg.generation_servers.router.args["new"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):   # frozen
        cfg.port = 1  # type: ignore[misc]


# ------------------------------------------------------------------------ strictness

@pytest.mark.parametrize("src,path", [
    ({"prot": 1}, "prot"),
    ({"context_servers": {"urlz": []}}, "context_servers.urlz"),
    ({"generation_servers": {"kv_cache_config": {"tokens_per_blok": 16}}},
     "generation_servers.kv_cache_config.tokens_per_blok"),
    ({"coordinator": {"event_ingest": {"replay_timeout": 1}}},
     "coordinator.event_ingest.replay_timeout"),
    ({"disagg_cluster": {"cluster_uri": "x", "minimal_instances": {"ctx": 1}}},
     "disagg_cluster.minimal_instances.ctx"),
    ({"fleet": {"max_body": 10}}, "fleet.max_body"),
    ({"routing": {"blocksize": 16}}, "routing.blocksize"),
    ({"context_servers": {"kv_events": [{"server": "h:1", "endpoint": "tcp://h:2", "topc": ""}],
                          "urls": ["h:1"]}}, "context_servers.kv_events[0].topc"),
    ({"context_servers": {"engine_args": {"backend": "x"}}}, "context_servers.engine_args"),
    # the internal source-document field is renamed to this key: still not a key of the file
    ({"<source document>": {"port": 1}}, "<source document>"),
])
def test_unknown_keys_name_their_full_path(src, path):
    e = err(src)
    assert e.path == path and e.kind == "unknown_key"
    assert str(e).startswith(path + ": unknown key")


def test_unknown_key_suggests_the_close_match():
    e = err({"context_servers": {"tensor_paralel_size": 2}})
    assert "did you mean 'tensor_parallel_size'" in str(e)


@pytest.mark.parametrize("src,path,expected,found", [
    ({"port": "8000"}, "port", "int", "str '8000'"),
    ({"port": True}, "port", "int", "bool True"),
    ({"num_workers": 2.0}, "num_workers", "int", "float 2.0"),
    ({"request_timeout": "soon"}, "request_timeout", "number", "str 'soon'"),
    ({"allow_request_chat_template": "yes"}, "allow_request_chat_template", "bool", "str 'yes'"),
    ({"schedule_style": "ctx_first"}, "schedule_style", "one of 'context_first'", "str 'ctx_first'"),
    ({"node_id": "3"}, "node_id", "int or null", "str '3'"),
    ({"context_servers": {"urls": "h:1"}}, "context_servers.urls", "list of string", "str 'h:1'"),
    ({"context_servers": {"urls": ["h:1", 5]}}, "context_servers.urls[1]", "string", "int 5"),
    ({"generation_servers": {"kv_cache_config": {"enable_block_reuse": 1}}},
     "generation_servers.kv_cache_config.enable_block_reuse", "bool", "int 1"),
    ({"coordinator": {"health_failure_threshold": 2.5}}, "coordinator.health_failure_threshold",
     "int", "float 2.5"),
    ({"context_servers": {"router": {"type": 3}}}, "context_servers.router.type", "one of",
     "int 3"),
    ({"context_servers": []}, "context_servers", "a mapping", "list []"),
    ({"leases": {"ttl_s": None}}, "leases.ttl_s", "number", "NoneType None"),
])
def test_wrong_types_name_field_expected_and_found(src, path, expected, found):
    e = err(src)
    assert e.path == path
    assert f"expected {expected}" in str(e) and f"found {found}" in str(e), str(e)


@pytest.mark.parametrize("src,path", [
    ({"port": 70000}, "port"),
    ({"num_workers": 0}, "num_workers"),
    ({"node_id": 256}, "node_id"),
    ({"node_id": -1}, "node_id"),
    ({"max_retries": -1}, "max_retries"),
    ({"context_servers": {"tensor_parallel_size": 0}}, "context_servers.tensor_parallel_size"),
    ({"routing": {"block_size": 0}}, "routing.block_size"),
    ({"leases": {"ttl_s": 10, "renew_interval_s": 10}}, "leases.renew_interval_s"),
    ({"disagg_cluster": {"cluster_uri": "http://c:1", "heartbeat_interval_sec": 10}},
     "disagg_cluster.inactive_timeout_sec"),
    ({"disagg_cluster": {"cluster_uri": "x"}}, "disagg_cluster.cluster_uri"),
    ({"disagg_cluster": {"cluster_uri": "etcd://h:99999"}}, "disagg_cluster.cluster_uri"),
    ({"disagg_cluster": {"cluster_uri": "etcd:///path"}}, "disagg_cluster.cluster_uri"),
    ({"context_servers": {"urls": ["h:1", "http://h:1"]}}, "context_servers.urls[1]"),
    ({"context_servers": {"urls": ["no-port"]}}, "context_servers.urls[0]"),
    ({"context_servers": {"urls": ["ftp://h:1"]}}, "context_servers.urls[0]"),
    ({"context_servers": {"urls": ["h:1/v1"]}}, "context_servers.urls[0]"),
    ({"context_servers": {"kv_cache_config": {"tokens_per_block": 24}}},
     "context_servers.kv_cache_config.tokens_per_block"),
    ({"context_servers": {"urls": ["h:1"], "kv_events": [{"server": "h:2", "endpoint": "tcp://h:3"}]}},
     "context_servers.kv_events[0].server"),
    ({"context_servers": {"kv_events": [{"server": "h:2", "endpoint": "h:3"}]}},
     "context_servers.kv_events[0].endpoint"),
    ({"coordinator": {"event_ingest": {"bind_endpoint": "5557"}}},
     "coordinator.event_ingest.bind_endpoint"),
    ({"disagg_coordinator_url": "coord:7999"}, "disagg_coordinator_url"),
    ({"port": 0, "num_workers": 2}, "coordinator.port"),
    ({"api_keys_env": "not a name"}, "api_keys_env"),
    ({"fleet": {"max_body_bytes": "4 parsecs"}}, "fleet.max_body_bytes"),
    ({"disagg_cluster": {"cluster_name": "x"}}, "disagg_cluster.cluster_uri"),
])
def test_invalid_values_name_their_path(src, path):
    assert err(src).path == path


@pytest.mark.parametrize("src,message", [
    ({"port": 70000}, "port: expected a value <= 65535, found 70000"),
    ({"num_workers": 0}, "num_workers: expected a value >= 1, found 0"),
    ({"leases": {"ttl_s": 0}}, "leases.ttl_s: expected a value > 0, found 0"),
    ({"context_servers": {"kv_events": [{"server": "h:1", "endpoint": "tcp://h:2", "dp_size": 2000}]}},
     "context_servers.kv_events[0].dp_size: expected a value <= 1024, found 2000"),
    ({"disagg_cluster": {"cluster_name": "x"}},
     "disagg_cluster.cluster_uri: required key missing (registration store: the coordinator URL"),
    ({"coordinator": {"event_ingest": None}}, "coordinator.event_ingest: expected a mapping, found NoneType None"),
])
def test_bounds_and_missing_keys_say_expected_and_found(src, message):
    """msgspec checks them; the message is restated in the schema's words (coordinator/config.py)."""
    assert str(err(src)).startswith(message), str(err(src))


def test_num_instances_must_match_urls():
    e = err({"generation_servers": {"num_instances": 3, "urls": ["a:1", "b:2"]}})
    assert e.path == "generation_servers.num_instances"
    assert "expected 2" in str(e) and "found 3" in str(e)
    ok = load_config({"generation_servers": {"urls": ["a:1", "b:2"]}}, env={})
    assert ok.generation_servers.num_instances is None
    assert ok.generation_servers.expected_instances == 2
    dyn = load_config({"generation_servers": {"num_instances": 3}}, env={})
    assert dyn.generation_servers.expected_instances == 3


def test_top_level_engine_key_conflicting_with_section_is_an_error():
    e = err({"max_batch_size": 8, "context_servers": {"max_batch_size": 16}})
    assert e.path == "context_servers.max_batch_size" and "different values" in str(e)
    same = load_config({"max_batch_size": 8, "context_servers": {"max_batch_size": 8}}, env={})
    assert same.context_servers.max_batch_size == same.generation_servers.max_batch_size == 8


def test_inherited_value_errors_point_at_the_top_level_key():
    e = err({"tensor_parallel_size": "two"})
    assert e.path == "tensor_parallel_size" and "expected int" in str(e)
    e = err({"kv_cache_config": {"tokens_per_blok": 4}})
    assert e.path == "kv_cache_config.tokens_per_blok"


def test_duplicate_yaml_keys_and_bad_documents():
    assert "duplicate key 'port'" in str(err("port: 1\nhostname: h\nport: 2\n"))
    assert "expected the config document to be a mapping" in str(err("- a\n- b\n"))
    assert "invalid YAML" in str(err("port: [1, 2\n"))
    e = err("/nonexistent/dir/cluster.yaml")
    assert "cannot read config file" in str(e)
    assert "cannot read config file 'clusterr'" in str(err("clusterr"))
    assert load_config("", env={}) == load_config(None, env={})


def test_byte_sizes():
    assert load_config({"fleet": {"max_body_bytes": "1MiB"}}, env={}).fleet.max_body_bytes == 1 << 20
    assert load_config({"fleet": {"max_body_bytes": "2MB"}}, env={}).fleet.max_body_bytes == 2_000_000
    assert load_config({"fleet": {"max_body_bytes": 1234}}, env={}).fleet.max_body_bytes == 1234


def test_url_normalisation():
    cfg = load_config({"context_servers": {"urls": ["h:1", "https://secure:443/", "[::1]:9000",
                                                    " http://x:2 "]}}, env={})
    assert cfg.context_servers.urls == ("http://h:1", "https://secure:443", "http://[::1]:9000",
                                        "http://x:2")


def test_derived_coordinator_values():
    cfg = load_config({"port": 9000, "num_workers": 4}, env={})
    assert cfg.coordinator_port == 8999
    assert cfg.coordinator_url == "http://127.0.0.1:8999"
    assert cfg.coordinator_uds_path.endswith("splitserve-coordinator-8999.sock")
    cfg = load_config({"num_workers": 2, "coordinator": {"port": 7000, "uds": False}}, env={})
    assert cfg.coordinator_port == 7000 and cfg.coordinator_uds_path is None
    ext = load_config({"disagg_coordinator_url": "unix:///run/c.sock", "num_workers": 3}, env={})
    assert ext.topology == "external_coordinator" and ext.coordinator_url == "unix:///run/c.sock"
    assert load_config({"leases": {"ttl_s": 30}}, env={}).leases.effective_renew_interval_s == 10


# ------------------------------------------------------------------------ overrides

def test_env_overrides_file_and_cli_overrides_env():
    base = load_config({"port": 8000, "num_workers": 1, "coordinator": {"port": 5000}}, env={})
    env = {"SPLITSERVE_PORT": "9100", "SPLITSERVE_NUM_WORKERS": "3",
           "SPLITSERVE_COORDINATOR__PORT": "6000", "SPLITSERVE_SCHEDULE_STYLE": "generation_first",
           "SPLITSERVE_CONTEXT_SERVERS__URLS": "a:1, b:2",
           "SPLITSERVE_CONTEXT_SERVERS__ROUTER__TYPE": "kv_cache_aware",
           "SPLITSERVE_CONDITIONAL_DISAGG_CONFIG__MAX_LOCAL_PREFILL_LENGTH": "32",
           "SPLITSERVE_FLEET__MAX_BODY_BYTES": "1MiB", "SPLITSERVE_NODE_ID": "null",
           "UNRELATED": "x"}
    cfg = apply_overrides(base, env=env)
    assert (cfg.port, cfg.num_workers, cfg.coordinator.port) == (9100, 3, 6000)
    assert cfg.schedule_style == "generation_first"
    assert cfg.context_servers.urls == ("http://a:1", "http://b:2")
    assert cfg.context_servers.router.type == "kv_cache_aware"
    assert cfg.conditional_disagg_config.max_local_prefill_length == 32
    assert cfg.fleet.max_body_bytes == 1 << 20 and cfg.node_id is None
    cli = apply_overrides(base, env=env, port=9200, coordinator_url="http://c:1", node_id=None,
                          coordinator__health_check_interval_s="0.5", host="0.0.0.0")
    assert cli.port == 9200 and cli.num_workers == 3  # CLI beats env; env still applies
    assert cli.disagg_coordinator_url == "http://c:1" and cli.hostname == "0.0.0.0"
    assert cli.coordinator.health_check_interval_s == 0.5
    assert base.port == 8000  # never mutated
    assert apply_overrides(base, env={}) == base


def test_override_errors_name_their_source():
    base = load_config(None, env={})
    with pytest.raises(ConfigError) as ei:
        apply_overrides(base, env={"SPLITSERVE_PORT": "eighty"})
    assert ei.value.path == "SPLITSERVE_PORT" and "expected int" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        apply_overrides(base, env={"SPLITSERVE_NUM_WORKERS": "0"})
    assert "set by SPLITSERVE_NUM_WORKERS" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        apply_overrides(base, env={}, bogus_flag=1)
    assert ei.value.path == "--bogus-flag"
    with pytest.raises(ConfigError) as ei:
        apply_overrides(base, env={"SPLITSERVE_COORDINATOR_URL": "http://a:1",
                                   "SPLITSERVE_DISAGG_COORDINATOR_URL": "http://b:1"})
    assert "conflicts" in str(ei.value)
    with pytest.raises(ConfigError):
        apply_overrides(base, env={"SPLITSERVE_ALLOW_REQUEST_CHAT_TEMPLATE": "maybe"})


def test_env_var_names():
    assert env_var_name("num_workers") == "SPLITSERVE_NUM_WORKERS"
    assert env_var_name("coordinator.event_ingest.replay_timeout_s") == \
        "SPLITSERVE_COORDINATOR__EVENT_INGEST__REPLAY_TIMEOUT_S"


# ------------------------------------------------------------------------ secrets

SECRETS = ("hmac-secret-value", "sk-file-key", "sk-env-key-1", "sk-env-key-2", "env-hmac-key")


def _assert_no_secret(text: str):
    for s in SECRETS:
        assert s not in text, f"secret {s!r} leaked"


def test_secrets_are_never_shown():
    doc = yaml.safe_load(UPSTREAM_YAML)
    doc["api_keys"] = ["sk-file-key"]
    doc["api_keys_env"] = "MY_KEYS"
    cfg = load_config(doc, env={"MY_KEYS": "sk-env-key-1, sk-env-key-2"})
    assert cfg.api_keys == ("sk-file-key", "sk-env-key-1", "sk-env-key-2")
    assert cfg.internal_request_auth_key == "hmac-secret-value"
    pub = cfg.to_public_dict()
    _assert_no_secret(repr(cfg))
    _assert_no_secret(str(cfg))
    _assert_no_secret(json.dumps(pub))
    assert pub["api_keys"] == ["<redacted>"] * 3
    assert pub["internal_request_auth_key"] == "<redacted>"
    assert pub["context_servers"]["urls"] == ["http://host-a:8001", "http://host-b:8002"]


def test_auth_key_from_env_and_wrong_typed_secret_is_not_echoed():
    cfg = load_config({"num_workers": 1}, env={"SPLITSERVE_INTERNAL_REQUEST_AUTH_KEY": "env-hmac-key"})
    assert cfg.internal_request_auth_key == "env-hmac-key"
    _assert_no_secret(repr(cfg))
    e = err({"api_keys": ["ok-key", 12345678]})
    assert e.path == "api_keys[1]" and "12345678" not in str(e) and "<redacted>" in str(e)
    e = err({"internal_request_auth_key": ["hmac-secret-value"]})
    _assert_no_secret(str(e))


def test_api_keys_env_must_be_set():
    e = err({"api_keys_env": "MISSING_KEYS_VAR"}, env={})
    assert e.path == "api_keys_env" and "MISSING_KEYS_VAR" in str(e)


# ------------------------------------------------------------------------ docs stay honest

def test_every_key_is_documented_in_the_schema_and_docs():
    from coordinator import config_doc

    rows = schema_rows()
    assert {r["path"] for r in rows} >= {"port", "context_servers.router.type",
                                         "coordinator.event_ingest.bind_endpoint", "fleet.max_body_bytes"}
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config_doc.render(doc), (
        "docs/configuration.md's key table is stale: run `make docs` (python -m coordinator.config_doc)")
    table = doc[doc.index(config_doc.BEGIN):doc.index(config_doc.END)]
    for r in rows:
        assert r["doc"], f"{r['path']} has no doc"
        # generation_servers shares the context_servers schema; the table documents it once.
        path = r["path"].replace("generation_servers", "context_servers", 1)
        assert f"| `{path}` |" in table, f"docs/configuration.md does not document {r['path']}"
    # The rows are the schema's: a default changed in code changes the table.
    port = next(line for line in table.splitlines() if line.startswith("| `port` |"))
    assert port.split(" | ")[2] == str(ClusterConfig().port) == "8000"
    assert "| `fleet.max_body_bytes` | int or size ('4MiB') | 4MiB |" in table


def test_readme_minimal_config_loads_as_described():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", readme, re.S | re.M)
    assert len(blocks) == 1, "README should show exactly one YAML config"
    cfg = load_config(blocks[0])
    assert cfg.topology == "implicit_coordinator" and cfg.coordinator_port == cfg.port - 1 == 7999
    assert cfg.context_servers.urls == ("http://127.0.0.1:8101",)
    # generation KV arrives by transfer: routed by load, as in the Helm chart and `splitserve local`
    assert (cfg.context_servers.router.type, cfg.generation_servers.router.type) == \
        ("kv_cache_aware", "load_balancing")
    assert len(readme.splitlines()) <= 250


def test_config_doc_check_detects_a_stale_table(tmp_path):
    from coordinator import config_doc

    stale = tmp_path / "configuration.md"
    text = (ROOT / "docs" / "configuration.md").read_text()
    stale.write_text(text.replace("| `port` | int | 8000 |", "| `port` | int | 9000 |"))
    assert config_doc.main(["--check", str(stale)]) == 1
    assert config_doc.main([str(stale)]) == 0 and stale.read_text() == text
    assert config_doc.main(["--check", str(stale)]) == 0



def test_keys_that_could_not_take_effect_are_refused():
    """Issue 39, item 3: gen_tokids_ctxbytes: true would be accepted and ignored (the context leg
    is never asked for base64 ids), so it is an error naming the key; false (the default) loads."""
    with pytest.raises(ConfigError) as ei:
        load_config({"gen_tokids_ctxbytes": True})
    assert ei.value.path == "gen_tokids_ctxbytes" and "expected false" in ei.value.message
    assert load_config({"gen_tokids_ctxbytes": False}).gen_tokids_ctxbytes is False
