"""The cluster configuration: one YAML schema, strictly validated.

Keys and defaults follow `trtllm-serve disaggregated` (TensorRT-LLM's `extract_disagg_cfg`) wherever
that command has them, so an upstream config file loads unchanged. Our additions (routing key scheme,
leases, fallback, auth, coordinator and fleet tuning) are documented field by field below and in
docs/configuration.md (generated from this schema by coordinator/config_doc.py).

Invariants:
- Every value in a `ClusterConfig` was validated; unknown keys and wrong types raise `ConfigError`
  naming the full key path (`context_servers.router.foo`), the expected type and the found value.
- Secrets (`api_keys`, `internal_request_auth_key`) never appear in `repr()`, `str()`,
  `to_public_dict()` or error messages.
- The objects are frozen; mappings inside them are read-only (`MappingProxyType`, tuples for lists).
- `apply_overrides` never mutates: it re-validates the source document with the overrides applied.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import re
import tempfile
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union
from urllib.parse import urlsplit

import yaml

from coordinator.upstream_args import UPSTREAM_ENGINE_ARGS, UPSTREAM_KV_CACHE_ARGS

__all__ = [
    "ConfigError",
    "ClusterConfig",
    "ServerGroupConfig",
    "RouterConfig",
    "KvCacheConfig",
    "KvEventSource",
    "RoutingConfig",
    "LeaseConfig",
    "CoordinatorConfig",
    "EventIngestConfig",
    "FleetConfig",
    "ConditionalDisaggConfig",
    "OtlpConfig",
    "DisaggClusterConfig",
    "MinimalInstances",
    "ROUTER_TYPES",
    "UPSTREAM_ENGINE_ARGS",
    "ENV_PREFIX",
    "load_config",
    "apply_overrides",
    "schema_rows",
    "env_var_name",
]

ENV_PREFIX = "SPLITSERVE_"
ROUTER_TYPES = ("round_robin", "load_balancing", "kv_cache_aware", "conversation")
REDACTED = "<redacted>"

# TensorRT-LLM's own argument names (`UPSTREAM_ENGINE_ARGS`, `UPSTREAM_KV_CACHE_ARGS`: LLM args,
# `trtllm-serve` flags, KvCacheConfig fields) come from upstream's definitions, source commit in
# `coordinator/upstream_args.py`. We keep them in `ServerGroupConfig.engine_args` /
# `KvCacheConfig.extra` so an upstream file loads unchanged, but do not interpret them; anything
# outside those sets is a typo and an error.


class ConfigError(ValueError):
    """An invalid configuration. `path` is the dotted key path (`""` for the document itself)."""

    def __init__(self, path: str, message: str, *, kind: str = "invalid"):
        self.path = path
        self.message = message
        self.kind = kind  # "type" | "unknown_key" | "invalid"
        super().__init__(f"{path}: {message}" if path else message)


def _fld(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING,
         secret: bool = False, upstream: bool = False, ge: float | None = None,
         le: float | None = None, gt: float | None = None, parse: str | None = None,
         engine: bool = False) -> Any:
    """A schema field. `doc` is its one-line meaning; `upstream` marks trtllm-serve keys."""
    md = {"doc": doc, "secret": secret, "upstream": upstream, "ge": ge, "le": le, "gt": gt,
          "parse": parse, "engine": engine}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=md, repr=not secret)
    return field(default=default, metadata=md, repr=not secret)


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return types.MappingProxyType({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


# ----------------------------------------------------------------------------- schema

@dataclass(frozen=True, slots=True)
class RouterConfig:
    """A routing policy: `type` plus its arguments. Both `router: {type, k: v}` (upstream's flat
    form) and `router: {type, args: {k: v}}` normalise to the same object; the argument schema is
    checked by `router.policies.make_policy`, not here."""
    type: Literal["round_robin", "load_balancing", "kv_cache_aware", "conversation"] = _fld(
        "round_robin", "routing policy for this role", upstream=True)
    args: Mapping[str, Any] = _fld(doc="policy arguments (flat keys or nested `args:`)",
                                   factory=lambda: types.MappingProxyType({}), upstream=True)

    @classmethod
    def _normalise(cls, data: dict, path: str) -> dict:
        out = {k: v for k, v in data.items() if k == "type"}
        flat = {k: v for k, v in data.items() if k not in ("type", "args")}
        nested = data.get("args")
        if nested is None:
            nested = {}
        if not isinstance(nested, Mapping):
            raise ConfigError(_join(path, "args"), f"expected a mapping, found {_show(nested)}")
        for k in nested:
            if not isinstance(k, str):
                raise ConfigError(_join(path, "args"), f"keys must be strings, found {_show(k)}")
            if k in flat and flat[k] != nested[k]:
                raise ConfigError(_join(path, k), "given both flat and under `args:` with different "
                                  f"values ({_show(flat[k])} vs {_show(nested[k])})")
        out["args"] = {**flat, **nested}
        return out

    def _check(self, path: str) -> None:
        _validate_router_args(self, path)


def _validate_router_args(rc: RouterConfig, path: str) -> None:
    """Let the policy itself judge its arguments (the schema lives with the policy in
    `router.policies`), so a typo under `router:` is a load-time error with its path."""
    try:
        from router import policies
    except ImportError:  # the routing core is not installed in this build: shape-only checking
        return
    make = getattr(policies, "make_policy", None)
    if make is None:
        return
    try:
        make(rc.type, _thaw(rc.args))
    except (ValueError, TypeError, KeyError) as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        bad = getattr(e, "key", None) or getattr(e, "arg", None)
        if bad is None:
            bad = next((k for k in rc.args if f"'{k}'" in msg or f"`{k}`" in msg), None)
        raise ConfigError(_join(path, bad) if bad in rc.args else path,
                          f"invalid arguments for router type {rc.type!r}: {msg}") from None


@dataclass(frozen=True, slots=True)
class KvCacheConfig:
    """The workers' KV-cache settings (TensorRT-LLM `kv_cache_config`). Keys we do not interpret
    are kept in `extra`."""
    tokens_per_block: Optional[int] = _fld(
        None, "engine KV block size in tokens (null = engine default); must divide or be a "
        "multiple of routing.block_size", upstream=True, gt=0)
    enable_block_reuse: bool = _fld(True, "engine prefix caching; KV-aware routing needs it",
                                    upstream=True)
    event_buffer_max_size: int = _fld(0, "engine KV-event buffer (TensorRT-LLM needs > 0 to "
                                      "publish events)", upstream=True, ge=0)
    extra: Mapping[str, Any] = _fld(doc="other upstream KvCacheConfig keys, kept as given",
                                    factory=lambda: types.MappingProxyType({}), upstream=True)

    _PASSTHROUGH = UPSTREAM_KV_CACHE_ARGS
    _PASSTHROUGH_FIELD = "extra"


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """A static KV-event source for a server, e.g. a stock vLLM, SGLang or TensorRT-LLM worker.
    It takes precedence over what the server's `/server_info` advertises. Our own workers
    advertise theirs and need no entry."""
    server: str = _fld(doc="the server URL this publisher belongs to (one of `urls`)")
    transport: Literal["zmq", "http_poll"] = _fld(
        "zmq", "zmq: subscribe to a PUB socket; http_poll: poll TensorRT-LLM's "
        "`POST /kv_cache_events` (trtllm-serve without a streaming publisher)")
    endpoint: Optional[str] = _fld(
        None, "zmq: the PUB endpoint of DP rank 0, e.g. tcp://10.0.0.5:5557 (null = the publisher "
        "connects to coordinator.event_ingest.bind_endpoint, recognised by `topic`: vLLM's "
        "connect mode); http_poll: the URL to poll (null = <server>/kv_cache_events)")
    replay_endpoint: Optional[str] = _fld(None, "ZMQ ROUTER replay endpoint of DP rank 0 (null = "
                                          "no gap repair; a gap clears the server's index entries)")
    topic: str = _fld("", "ZMQ topic prefix to subscribe to ('' = all); required without "
                      "`endpoint`")
    engine: Literal["vllm", "sglang", "trtllm"] = _fld(
        "vllm", "payload encoding of the events (http_poll: trtllm)")
    dp_size: int = _fld(1, "data-parallel ranks publishing; rank r uses port + r of `endpoint` "
                        "and `replay_endpoint` (as vLLM and SGLang bind them)", ge=1, le=1024)
    poll_interval_s: float = _fld(0.5, "http_poll: seconds between polls (backs off to 30 s while "
                                  "polls fail)", gt=0)
    block_size: Optional[int] = _fld(None, "engine block size of the events (null = "
                                     "kv_cache_config.tokens_per_block or routing.block_size)",
                                     gt=0)

    def _check(self, path: str) -> None:
        if self.transport == "zmq":
            for name in ("endpoint", "replay_endpoint"):
                v = getattr(self, name)
                if v is not None and not re.match(r"^(tcp|ipc|inproc)://.+", v):
                    raise ConfigError(_join(path, name), f"expected a ZMQ endpoint like "
                                      f"'tcp://host:port' or 'ipc:///path', found {v!r}")
            if self.endpoint is None and not self.topic:
                raise ConfigError(_join(path, "topic"), "expected a non-empty topic when "
                                  "`endpoint` is null (the coordinator's bound endpoint tells "
                                  "publishers apart by topic)")
            return
        if self.endpoint is not None and not re.match(r"^https?://[^/]+", self.endpoint):
            raise ConfigError(_join(path, "endpoint"), "expected an http(s) URL like "
                              f"'http://host:port/kv_cache_events', found {self.endpoint!r}")
        if self.engine != "trtllm":
            raise ConfigError(_join(path, "engine"), "http_poll reads TensorRT-LLM's "
                              f"/kv_cache_events JSON: expected 'trtllm', found {self.engine!r}")
        for name in ("replay_endpoint", "topic"):
            if getattr(self, name):
                raise ConfigError(_join(path, name), f"not used with transport http_poll, found "
                                  f"{getattr(self, name)!r}")
        if self.dp_size != 1:
            raise ConfigError(_join(path, "dp_size"), "http_poll splits ranks by the events' "
                              f"attention_dp_rank: expected 1, found {self.dp_size}")


@dataclass(frozen=True, slots=True)
class ServerGroupConfig:
    """One role's servers (`context_servers` or `generation_servers`)."""
    num_instances: Optional[int] = _fld(
        None, "number of servers; must equal len(urls) when both are given (null = len(urls))",
        upstream=True, ge=0)
    urls: tuple[str, ...] = _fld(doc="static servers as host:port or http(s)://host:port; "
                                 "normalised to http://host:port", factory=tuple, upstream=True)
    router: RouterConfig = _fld(doc="routing policy for this role", factory=RouterConfig,
                                upstream=True)
    model: Optional[str] = _fld(None, "model the servers serve (inherited from top-level `model`)",
                                upstream=True, engine=True)
    max_batch_size: Optional[int] = _fld(None, "engine max batch size (informational; upstream "
                                         "copies it into router args)", upstream=True, gt=0,
                                         engine=True)
    max_num_tokens: Optional[int] = _fld(None, "engine max tokens per step (informational)",
                                         upstream=True, gt=0, engine=True)
    kv_cache_config: KvCacheConfig = _fld(doc="engine KV-cache settings", factory=KvCacheConfig,
                                          upstream=True, engine=True)
    tensor_parallel_size: int = _fld(1, "TP ranks per server", upstream=True, ge=1, engine=True)
    pipeline_parallel_size: int = _fld(1, "PP ranks per server", upstream=True, ge=1, engine=True)
    context_parallel_size: int = _fld(1, "CP ranks per server", upstream=True, ge=1, engine=True)
    kv_events: tuple[KvEventSource, ...] = _fld(
        doc="static KV-event sources (they take precedence over what a server's /server_info "
        "advertises)", factory=tuple)
    protocol: Optional[Literal["trtllm", "vllm", "sglang"]] = _fld(
        None, "leg protocol of these servers (fleet/legs/, docs/protocols.md): trtllm disaggregated_params, vllm "
        "kv_transfer_params, sglang bootstrap rendezvous (null = what each server's /server_info "
        "says, else trtllm)")
    bootstrap_port: Optional[int] = _fld(
        None, "SGLang prefill servers' bootstrap port (null = each server's /server_info "
        "disaggregation_bootstrap_port, else 8998)", gt=0, le=65535)
    engine_args: Mapping[str, Any] = _fld(
        doc="every engine-level key of this section as given (upstream `other_args`), including "
        "the ones inherited from the top level", factory=lambda: types.MappingProxyType({}),
        upstream=True)

    _PASSTHROUGH = UPSTREAM_ENGINE_ARGS
    _PASSTHROUGH_FIELD = "engine_args"
    _PASSTHROUGH_ALL_ENGINE = True

    @property
    def instance_num_ranks(self) -> int:
        """GPU ranks per server (tp × pp × cp), as upstream computes it."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def expected_instances(self) -> int:
        return self.num_instances if self.num_instances is not None else len(self.urls)

    @classmethod
    def _normalise(cls, data: dict, path: str) -> dict:
        if "urls" in data and isinstance(data["urls"], (list, tuple)):
            urls = []
            for i, u in enumerate(data["urls"]):
                urls.append(_normalise_url(u, f"{_join(path, 'urls')}[{i}]"))
            data = {**data, "urls": urls}
        if isinstance(data.get("kv_events"), (list, tuple)):
            evs = []
            for i, ev in enumerate(data["kv_events"]):
                if isinstance(ev, Mapping) and "server" in ev:
                    ev = {**ev, "server": _normalise_url(
                        ev["server"], f"{_join(path, 'kv_events')}[{i}].server")}
                evs.append(ev)
            data = {**data, "kv_events": evs}
        return data

    def _check(self, path: str) -> None:
        if self.num_instances is not None and self.urls and self.num_instances != len(self.urls):
            raise ConfigError(_join(path, "num_instances"),
                              f"expected {len(self.urls)} (the number of urls), found "
                              f"{self.num_instances}")
        seen = set()
        for i, u in enumerate(self.urls):
            if u in seen:
                raise ConfigError(f"{_join(path, 'urls')}[{i}]", f"duplicate server {u!r}")
            seen.add(u)
        for i, ev in enumerate(self.kv_events):
            if self.urls and ev.server not in seen:
                raise ConfigError(f"{_join(path, 'kv_events')}[{i}].server",
                                  f"expected one of this section's urls {list(self.urls)}, "
                                  f"found {ev.server!r}")


@dataclass(frozen=True, slots=True)
class ConditionalDisaggConfig:
    max_local_prefill_length: int = _fld(
        0, "skip the context leg when the chosen generation server would prefill at most this "
        "many uncached tokens", upstream=True, ge=0)


@dataclass(frozen=True, slots=True)
class OtlpConfig:
    otlp_traces_endpoint: Optional[str] = _fld(None, "OTLP/HTTP traces endpoint", upstream=True)


@dataclass(frozen=True, slots=True)
class MinimalInstances:
    context_servers: int = _fld(1, "healthy context servers needed for /health = 200",
                                upstream=True, ge=0)
    generation_servers: int = _fld(1, "healthy generation servers needed for /health = 200",
                                   upstream=True, ge=0)


@dataclass(frozen=True, slots=True)
class DisaggClusterConfig:
    """Dynamic membership: servers register themselves instead of (or beside) static `urls`."""
    cluster_uri: str = _fld(doc="registration store: the coordinator URL (http://…) or etcd://…",
                            upstream=True)
    cluster_name: str = _fld("", "namespace of this cluster in the store", upstream=True)
    minimal_instances: MinimalInstances = _fld(doc="readiness minimums", factory=MinimalInstances,
                                               upstream=True)
    heartbeat_interval_sec: float = _fld(5.0, "worker heartbeat period", upstream=True, gt=0)
    inactive_timeout_sec: float = _fld(10.0, "a worker silent this long is removed", upstream=True,
                                       gt=0)

    def _check(self, path: str) -> None:
        if self.inactive_timeout_sec <= self.heartbeat_interval_sec:
            raise ConfigError(_join(path, "inactive_timeout_sec"),
                              f"expected > heartbeat_interval_sec ({self.heartbeat_interval_sec}),"
                              f" found {self.inactive_timeout_sec}")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    block_size: int = _fld(16, "canonical block size (tokens) of routing keys; published in "
                           "/cluster_info", gt=0)
    key_scheme: Literal["xxh3_chain_v1"] = _fld("xxh3_chain_v1", "block-key recipe (kv_events "
                                                "§9.1); published in /cluster_info")
    namespace: Optional[str] = _fld(None, "cache namespace salted into every key (null = the "
                                    "default namespace)")


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    ttl_s: float = _fld(300.0, "a /select lease not finished or renewed within this is expired "
                        "(its load released)", gt=0)
    renew_interval_s: Optional[float] = _fld(None, "how often long streams renew their lease "
                                             "(null = ttl_s / 3)", gt=0)

    @property
    def effective_renew_interval_s(self) -> float:
        return self.renew_interval_s if self.renew_interval_s is not None else self.ttl_s / 3

    def _check(self, path: str) -> None:
        if self.renew_interval_s is not None and self.renew_interval_s >= self.ttl_s:
            raise ConfigError(_join(path, "renew_interval_s"),
                              f"expected < ttl_s ({self.ttl_s}), found {self.renew_interval_s}")


@dataclass(frozen=True, slots=True)
class EventIngestConfig:
    bind_endpoint: Optional[str] = _fld(None, "ZMQ endpoint the coordinator binds (SUB) for "
                                        "publishers that connect to it (null = subscribe only)")
    replay_timeout_s: float = _fld(2.0, "wait for a replay answer before giving up and clearing "
                                   "the server's entries", gt=0)
    rebuild_timeout_s: float = _fld(30.0, "wait for a /kv_snapshot when rebuilding a server's "
                                    "entries", gt=0)

    def _check(self, path: str) -> None:
        v = self.bind_endpoint
        if v is not None and not re.match(r"^(tcp|ipc|inproc)://.+", v):
            raise ConfigError(_join(path, "bind_endpoint"), f"expected a ZMQ endpoint like "
                              f"'tcp://127.0.0.1:5557', found {v!r}")


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    host: str = _fld("127.0.0.1", "coordinator TCP bind address (loopback by default)")
    port: Optional[int] = _fld(None, "coordinator TCP port (null = `port` - 1, as upstream)",
                               ge=0, le=65535)
    uds: bool = _fld(True, "also serve on a Unix socket when the coordinator is local")
    uds_path: Optional[str] = _fld(None, "Unix socket path (null = "
                                   "<tmpdir>/splitserve-coordinator-<coordinator port>.sock)")
    health_check_interval_s: float = _fld(2.0, "period of server /health probes", gt=0)
    health_failure_threshold: int = _fld(3, "consecutive failed probes before a server is "
                                         "unhealthy", ge=1)
    server_info_timeout_s: float = _fld(5.0, "timeout of one /server_info or /health call", gt=0)
    event_ingest: EventIngestConfig = _fld(doc="KV-event subscription settings",
                                           factory=EventIngestConfig)
    identity_ttl_s: float = _fld(60.0, "lease of a fleet process's (node_id, process_id) pair; "
                                 "renewed by the holder", gt=0)
    channel: bool = _fld(True, "offer the fleet processes' persistent pipelined channel "
                         "(`GET /channel` upgrade on the API listeners; docs/coordinator-api.md)")
    max_queue_delay_s: float = _fld(0.1, "placements that waited longer than this behind a "
                                    "saturated event loop are shed: 429 + Retry-After, no lease",
                                    gt=0)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    max_body_bytes: int = _fld(4 * 1024 * 1024, "largest accepted request body (413 beyond); "
                               "an int or '4MiB'", gt=0, parse="bytes")
    keepalive_requests: Optional[int] = _fld(None, "requests served per client connection before "
                                             "it is closed (null = unlimited)", ge=1)
    drain_timeout_s: float = _fld(30.0, "on shutdown, wait this long for in-flight requests",
                                  ge=0)
    retry_backoff_s: float = _fld(0.05, "pause before retrying a connect failure on another "
                                  "server", ge=0)
    coordinator_timeout_s: float = _fld(5.0, "timeout of one coordinator call", gt=0)
    coordinator_channel: bool = _fld(True, "use the coordinator's persistent channel when it "
                                     "offers one (else one HTTP exchange per call)")
    coordinator_max_pending: int = _fld(4096, "coordinator calls one fleet process may have "
                                        "unanswered; beyond it requests are shed with 503 + "
                                        "Retry-After", ge=1)
    max_inflight_requests: Optional[int] = _fld(None, "per fleet process; beyond it requests get "
                                                "429 + Retry-After (null = unlimited)", ge=1)
    header_timeout_s: float = _fld(10.0, "a request head (request line and headers) must arrive "
                                   "within this long once it has started (408 beyond)", gt=0)
    body_timeout_s: float = _fld(30.0, "a request body must arrive within this long once its "
                                 "head is read (408 beyond); a request counts toward "
                                 "max_inflight_requests only once its body is read", gt=0)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The whole cluster. Build with `load_config`; derive variants with `apply_overrides`."""
    hostname: str = _fld("localhost", "address the fleet binds and advertises", upstream=True)
    bind_host: Optional[str] = _fld(None, "bind address when it differs from `hostname` "
                                    "(e.g. 0.0.0.0)", upstream=True)
    port: int = _fld(8000, "public port of the fleet (SO_REUSEPORT across `num_workers`)",
                     upstream=True, ge=0, le=65535)
    model: Optional[str] = _fld(None, "served model name (/v1/models); inherited by both server "
                                "sections", upstream=True)
    num_workers: int = _fld(1, "fleet processes on the public port; > 1 starts an implicit "
                            "coordinator on port - 1", upstream=True, ge=1, le=64)
    disagg_coordinator_url: Optional[str] = _fld(None, "external coordinator (http://h:p or "
                                                 "unix:///path); no coordinator runs here",
                                                 upstream=True)
    node_id: Optional[int] = _fld(None, "snowflake node id 0..255 (null = leased from the "
                                  "coordinator)", upstream=True, ge=0, le=255)
    schedule_style: Literal["context_first", "generation_first"] = _fld(
        "context_first", "which leg is sent first", upstream=True)
    max_retries: int = _fld(1, "retries of a leg after a connect-level failure (on another "
                            "server)", upstream=True, ge=0)
    server_start_timeout: float = _fld(180.0, "seconds to wait for the coordinator/servers at "
                                       "start", upstream=True, gt=0)
    request_timeout: float = _fld(180.0, "seconds one upstream leg may take", upstream=True, gt=0)
    server_keep_alive_timeout: float = _fld(10.0, "idle keep-alive of client connections",
                                            upstream=True, gt=0)
    perf_metrics_max_requests: int = _fld(0, "per-request timing records kept for "
                                          "/perf_metrics (0 = off)", upstream=True, ge=0)
    allow_request_chat_template: bool = _fld(False, "accept a per-request `chat_template`",
                                             upstream=True)
    gen_strip_message_history: bool = _fld(False, "send only the last turn's messages on the "
                                           "generation leg (it has prompt_token_ids)",
                                           upstream=True)
    gen_tokids_ctxbytes: bool = _fld(False, "accepted for compatibility; splitserve always "
                                     "carries prompt ids as JSON ints", upstream=True)
    internal_request_auth_key: Optional[str] = _fld(
        None, "HMAC key for disaggregated fields sent to workers (env "
        "SPLITSERVE_INTERNAL_REQUEST_AUTH_KEY)", upstream=True, secret=True)
    conditional_disagg_config: Optional[ConditionalDisaggConfig] = _fld(
        None, "conditional disaggregation (null = always use the context leg)", upstream=True)
    otlp_config: Optional[OtlpConfig] = _fld(None, "tracing export (null = off)", upstream=True)
    disagg_cluster: Optional[DisaggClusterConfig] = _fld(None, "dynamic membership (null = "
                                                         "static urls only)", upstream=True)
    context_servers: ServerGroupConfig = _fld(doc="context (prefill) servers",
                                              factory=ServerGroupConfig, upstream=True)
    generation_servers: ServerGroupConfig = _fld(doc="generation (decode) servers",
                                                 factory=ServerGroupConfig, upstream=True)
    routing: RoutingConfig = _fld(doc="routing-key scheme", factory=RoutingConfig)
    leases: LeaseConfig = _fld(doc="load leases", factory=LeaseConfig)
    no_context_fallback: Literal["aggregate", "reject"] = _fld(
        "aggregate", "no healthy context server: serve on a generation server alone "
        "(aggregate) or answer 503 (reject)")
    api_keys: tuple[str, ...] = _fld(doc="accepted bearer tokens for the public API (empty and no "
                                     "api_keys_env = no auth)", factory=tuple, secret=True)
    api_keys_env: Optional[str] = _fld(None, "name of an env var holding more API keys, comma "
                                       "separated; it must be set when named")
    log_level: Literal["debug", "info", "warning", "error"] = _fld("info", "log level")
    coordinator: CoordinatorConfig = _fld(doc="coordinator process settings",
                                          factory=CoordinatorConfig)
    fleet: FleetConfig = _fld(doc="front-door tuning", factory=FleetConfig)
    _source: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}),
                                       repr=False, compare=False, metadata={"internal": True})

    # -- derived values ---------------------------------------------------------------------
    @property
    def effective_bind_host(self) -> str:
        return self.bind_host or self.hostname

    @property
    def coordinator_port(self) -> int:
        """The implicit coordinator's port: explicit, else `port - 1` (0 = pick a free one)."""
        if self.coordinator.port is not None:
            return self.coordinator.port
        return self.port - 1 if self.port >= 2 else 0

    @property
    def coordinator_uds_path(self) -> Optional[str]:
        """The coordinator's Unix socket, or None (disabled, or no fixed port to name it by)."""
        if not self.coordinator.uds:
            return None
        if self.coordinator.uds_path:
            return self.coordinator.uds_path
        if self.coordinator_port == 0:
            return None
        return os.path.join(tempfile.gettempdir(),
                            f"splitserve-coordinator-{self.coordinator_port}.sock")

    @property
    def topology(self) -> Literal["single", "implicit_coordinator", "external_coordinator"]:
        """docs/design.md §2: which of the three process topologies this config selects."""
        if self.disagg_coordinator_url:
            return "external_coordinator"
        return "single" if self.num_workers == 1 else "implicit_coordinator"

    @property
    def coordinator_url(self) -> Optional[str]:
        """The URL fleet workers use for the coordinator (None in the one-process topology)."""
        if self.disagg_coordinator_url:
            return self.disagg_coordinator_url
        if self.num_workers == 1:
            return None
        host = self.coordinator.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.coordinator_port}"

    @property
    def served_model(self) -> Optional[str]:
        return self.model or self.generation_servers.model or self.context_servers.model

    def server_groups(self) -> dict[str, ServerGroupConfig]:
        return {"context": self.context_servers, "generation": self.generation_servers}

    @property
    def health_minimums(self) -> MinimalInstances:
        """Healthy servers each role needs for readiness: the one rule behind the coordinator's
        `/health` and `is_ready` and every fleet process's `/health`. `disagg_cluster.
        minimal_instances` when given; else one for each role that lists `urls` (an aggregated
        cluster lists generation servers only), one each when neither lists any (all will
        register), and at least one context server under `no_context_fallback: reject`."""
        dc = self.disagg_cluster
        if dc is not None:
            ctx, gen = dc.minimal_instances.context_servers, dc.minimal_instances.generation_servers
        else:
            listed_ctx, listed_gen = bool(self.context_servers.urls), bool(self.generation_servers.urls)
            neither = not (listed_ctx or listed_gen)
            ctx, gen = int(listed_ctx or neither), int(listed_gen or neither)
        if self.no_context_fallback == "reject":
            ctx = max(1, ctx)
        return MinimalInstances(context_servers=ctx, generation_servers=gen)

    @property
    def aggregated_only(self) -> bool:
        """No context server can ever take part (none needed, none listed, no dynamic
        membership): every request is served on a generation server alone."""
        return self.disagg_cluster is None and self.health_minimums.context_servers == 0

    def to_public_dict(self) -> dict:
        """Plain JSON-able dict of every setting, secrets replaced by '<redacted>' (or null)."""
        return _public(self)

    def __str__(self) -> str:  # repr() already omits secrets; str() is a readable JSON form
        return json.dumps(self.to_public_dict(), sort_keys=True)

    def _check(self, path: str) -> None:
        if self.disagg_coordinator_url is not None:
            u = self.disagg_coordinator_url
            if not re.match(r"^(https?://[^/]+|unix://?/.+)", u):
                raise ConfigError("disagg_coordinator_url", "expected 'http://host:port', "
                                  f"'https://host:port' or 'unix:///path', found {u!r}")
        rb = self.routing.block_size
        for name, grp in (("context_servers", self.context_servers),
                          ("generation_servers", self.generation_servers)):
            tpb = grp.kv_cache_config.tokens_per_block
            if tpb is not None and tpb % rb and rb % tpb:
                raise ConfigError(f"{name}.kv_cache_config.tokens_per_block",
                                  f"expected a divisor or multiple of routing.block_size ({rb}), "
                                  f"found {tpb}")
            for i, ev in enumerate(grp.kv_events):
                if ev.transport == "zmq" and ev.endpoint is None \
                        and not self.coordinator.event_ingest.bind_endpoint:
                    raise ConfigError(f"{name}.kv_events[{i}].endpoint",
                                      "null (the publisher connects to the coordinator) needs "
                                      "coordinator.event_ingest.bind_endpoint; set one or give "
                                      "the publisher's endpoint")
                bs = ev.block_size
                if bs is not None and bs % rb and rb % bs:
                    raise ConfigError(f"{name}.kv_events[{i}].block_size",
                                      f"expected a divisor or multiple of routing.block_size "
                                      f"({rb}), found {bs}")
        cp, gp = self.context_servers.protocol, self.generation_servers.protocol
        if cp is not None and gp is not None and cp != gp:
            # The KV moves between the two engines: both sides must be the same engine family.
            raise ConfigError("generation_servers.protocol", f"expected the context servers' "
                              f"protocol ({cp!r}): a KV transfer needs one engine family on both "
                              f"legs, found {gp!r}")
        if self.api_keys_env is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$",
                                                          self.api_keys_env):
            raise ConfigError("api_keys_env", "expected an environment variable name, found "
                              f"{self.api_keys_env!r}")
        for i, k in enumerate(self.api_keys):
            if not k or k != k.strip():
                raise ConfigError(f"api_keys[{i}]", "expected a non-empty key without "
                                  "surrounding whitespace")
        if (self.num_workers > 1 and self.port == 0 and self.coordinator.port is None
                and not self.disagg_coordinator_url):
            raise ConfigError("coordinator.port", "set it explicitly when port is 0 and "
                              "num_workers > 1 (port - 1 is undefined)")


# ----------------------------------------------------------------------------- validation

_NoneType = type(None)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(v: Any, secret: bool = False) -> str:
    if secret:
        return f"{type(v).__name__} {REDACTED}"
    r = repr(v)
    if len(r) > 80:
        r = r[:77] + "..."
    return f"{type(v).__name__} {r}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any value"
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "number"
    if tp is str:
        return "string"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NoneType]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null"
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp) or origin in (Mapping, dict) or tp is Mapping:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = _HINTS[cls] = typing.get_type_hints(cls)
    return h


def _schema_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


_BYTES_RE = re.compile(r"^\s*(\d+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?\s*$", re.I)
_BYTES_UNITS = {None: 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2,
                "mb": 1000 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gb": 1000 ** 3,
                "gib": 1024 ** 3}


def _convert(tp: Any, v: Any, path: str, md: Mapping[str, Any]) -> Any:
    secret = bool(md.get("secret"))
    origin = typing.get_origin(tp)

    def bad() -> ConfigError:
        return ConfigError(path, f"expected {_type_name(tp)}, found {_show(v, secret)}",
                           kind="type")

    if tp is Any:
        return _freeze(v)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and _NoneType in args:
            return None
        inner = [a for a in args if a is not _NoneType]
        if len(inner) != 1:
            raise TypeError(f"unsupported schema type {tp}")
        try:
            return _convert(inner[0], v, path, md)
        except ConfigError as e:
            if e.path == path and e.kind == "type" and not dataclasses.is_dataclass(inner[0]):
                raise bad() from None
            raise
    if origin is Literal:
        if isinstance(v, bool) or v not in typing.get_args(tp):
            raise bad()
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise bad()
        return v
    if tp is int:
        if md.get("parse") == "bytes" and isinstance(v, str):
            m = _BYTES_RE.match(v)
            if not m:
                raise ConfigError(path, f"expected a byte size like 4194304 or '4MiB', found "
                                  f"{_show(v)}")
            v = int(m.group(1)) * _BYTES_UNITS[(m.group(2) or "").lower() or None]
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad()
        return _bounds(v, path, md)
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise bad()
        return _bounds(float(v), path, md)
    if tp is str:
        if not isinstance(v, str):
            raise bad()
        return v
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise bad()
        (item_tp, _ell) = typing.get_args(tp)
        return tuple(_convert(item_tp, x, f"{path}[{i}]", md) for i, x in enumerate(v))
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, path)
    if origin is Mapping or tp is Mapping or origin is dict:
        if not isinstance(v, Mapping):
            raise bad()
        for k in v:
            if not isinstance(k, str):
                raise ConfigError(path, f"keys must be strings, found {_show(k)}")
        return _freeze(v)
    raise TypeError(f"unsupported schema type {tp!r} at {path}")


def _bounds(v: float, path: str, md: Mapping[str, Any]) -> Any:
    ge, le, gt = md.get("ge"), md.get("le"), md.get("gt")
    if ge is not None and v < ge:
        raise ConfigError(path, f"expected a value >= {ge:g}, found {v!r}")
    if gt is not None and v <= gt:
        raise ConfigError(path, f"expected a value > {gt:g}, found {v!r}")
    if le is not None and v > le:
        raise ConfigError(path, f"expected a value <= {le:g}, found {v!r}")
    return v


def _unknown(path: str, key: Any, allowed: list[str]) -> ConfigError:
    if not isinstance(key, str):
        return ConfigError(path, f"keys must be strings, found {_show(key)}")
    hint = difflib.get_close_matches(key, allowed, n=1)
    msg = "unknown key"
    if hint:
        msg += f" (did you mean {hint[0]!r}?)"
    shown = ", ".join(sorted(allowed)) if len(allowed) <= 30 else f"{len(allowed)} known keys"
    return ConfigError(_join(path, key), f"{msg}; expected one of: {shown}", kind="unknown_key")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping, found {_show(data)}")
    data = dict(data)
    norm = getattr(cls, "_normalise", None)
    if norm is not None:
        data = norm(data, path)
    flds = {f.name: f for f in _schema_fields(cls)}
    hints = _hints(cls)
    passthrough: frozenset = getattr(cls, "_PASSTHROUGH", frozenset())
    pt_field = getattr(cls, "_PASSTHROUGH_FIELD", None)
    pt_all_engine = getattr(cls, "_PASSTHROUGH_ALL_ENGINE", False)
    kwargs: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    allowed = [n for n in flds if n != pt_field] + sorted(passthrough)
    for key, value in data.items():
        if key in flds and key != pt_field:
            f = flds[key]
            kwargs[key] = _convert(hints[key], value, _join(path, key), f.metadata)
            if pt_all_engine and f.metadata.get("engine"):
                kept[key] = value
        elif isinstance(key, str) and key in passthrough:
            kept[key] = value
        else:
            raise _unknown(path, key, allowed)
    if pt_field is not None:
        kwargs[pt_field] = _convert(hints[pt_field], kept, _join(path, pt_field), {})
    for name, f in flds.items():
        if name not in kwargs and f.default is dataclasses.MISSING \
                and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), f"required key missing ({f.metadata['doc']})")
    obj = cls(**kwargs)
    check = getattr(obj, "_check", None)
    if check is not None:
        check(path)
    return obj


def _normalise_url(u: Any, path: str) -> Any:
    if not isinstance(u, str):
        return u  # the type check reports it
    raw = u.strip()
    s = raw if "://" in raw else f"http://{raw}"
    try:
        parts = urlsplit(s)
        port = parts.port
    except ValueError as e:
        raise ConfigError(path, f"expected host:port or http(s)://host:port, found {u!r} ({e})")
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None \
            or parts.path not in ("", "/") or parts.query or parts.fragment or port == 0:
        raise ConfigError(path, f"expected host:port or http(s)://host:port, found {u!r}")
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}"


# ----------------------------------------------------------------------------- loading

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for knode, vnode in node.value:
        key = loader.construct_object(knode, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise ConfigError("", f"line {knode.start_mark.line + 1}: unhashable mapping key")
        if key in out:
            raise ConfigError("", f"line {knode.start_mark.line + 1}: duplicate key {key!r}")
        out[key] = loader.construct_object(vnode, deep=deep)
    return out


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, origin: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except ConfigError as e:
        raise ConfigError("", f"{origin}: {e.message}") from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"{origin}: invalid YAML: {e}") from None


def _parse_document(text: str, origin: str, where: str) -> dict:
    """The config mapping in YAML `text` (an empty document is an empty config); `where` prefixes
    the error when the document is not a mapping."""
    doc = _parse_yaml(text, origin)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError("", f"{where}expected the config document to be a mapping, found "
                          f"{_show(doc)}")
    return doc


def _read_source(src: Any) -> dict:
    if isinstance(src, Mapping):
        return copy.deepcopy(_thaw(src))
    if isinstance(src, os.PathLike):
        path = Path(src)
    elif isinstance(src, str):
        # One line without a mapping colon is a file name, not a YAML document.
        looks_like_path = "\n" not in src and src.strip() != "" and (
            os.path.exists(src) or src.endswith((".yaml", ".yml", ".json"))
            or (":" not in src and not src.lstrip().startswith(("{", "[", "#"))))
        if not looks_like_path:
            return _parse_document(src, "<config text>", "")
        path = Path(src)
    else:
        raise ConfigError("", f"expected a path, a mapping or YAML text, found {_show(src)}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("", f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
    return _parse_document(text, str(path), f"{path}: ")


_GROUPS = ("context_servers", "generation_servers")


def _engine_keys() -> frozenset:
    engine_fields = {f.name for f in _schema_fields(ServerGroupConfig) if f.metadata.get("engine")}
    return frozenset(engine_fields | UPSTREAM_ENGINE_ARGS)


def _inherit(doc: dict) -> tuple[dict, dict[str, set]]:
    """Upstream rule: top-level engine keys are inherited by both server sections; a key given
    both at the top and in a section with a different value is an error."""
    doc = dict(doc)
    engine = _engine_keys()
    inherited: dict[str, set] = {g: set() for g in _GROUPS}
    # Keys the disaggregated server declares itself (`extract_disagg_cfg` parameters, e.g.
    # `perf_metrics_max_requests`) stay at the top level even when they are also LLM args.
    own = {f.name for f in _schema_fields(ClusterConfig)} - {"model"}
    top = {k: v for k, v in doc.items() if k in engine and k not in own}
    for g in _GROUPS:
        sec = doc.get(g)
        if sec is None:
            sec = {}
        if not isinstance(sec, Mapping):
            raise ConfigError(g, f"expected a mapping, found {_show(sec)}")
        sec = dict(sec)
        for k, v in top.items():
            if k in sec:
                if sec[k] != v:
                    raise ConfigError(f"{g}.{k}", f"given at the top level ({_show(v)}) and in "
                                      f"{g} ({_show(sec[k])}) with different values")
            else:
                sec[k] = copy.deepcopy(v)
                inherited[g].add(k)
        doc[g] = sec
    for k in top:
        if k != "model":  # `model` is also the served model name at the top level
            del doc[k]
    return doc, inherited


def _secrets_from_env(doc: dict, env: Mapping[str, str]) -> dict:
    key_env = env.get(f"{ENV_PREFIX}INTERNAL_REQUEST_AUTH_KEY")
    if key_env:
        doc["internal_request_auth_key"] = key_env
    name = doc.get("api_keys_env")
    if isinstance(name, str) and name:
        if name not in env:
            raise ConfigError("api_keys_env", f"names environment variable {name!r}, which is "
                              "not set (refusing to start without the API keys it should hold)")
        extra = [k.strip() for k in env[name].split(",") if k.strip()]
        keys = doc.get("api_keys") or []
        if not isinstance(keys, (list, tuple)):
            return doc  # the type check reports it
        doc["api_keys"] = list(dict.fromkeys([*keys, *extra]))
    return doc


def load_config(src: Any = None, *, env: Optional[Mapping[str, str]] = None) -> ClusterConfig:
    """Load and validate a cluster config.

    `src` is a file path (str or PathLike), a mapping, YAML text, or None (all defaults). `env`
    (default: `os.environ`) supplies secrets only: `SPLITSERVE_INTERNAL_REQUEST_AUTH_KEY` and the
    variable named by `api_keys_env`; every other env override goes through `apply_overrides`.
    Raises ConfigError.
    """
    doc = _read_source({} if src is None else src)
    source = copy.deepcopy(doc)
    for k in doc:
        if not isinstance(k, str):
            raise ConfigError("", f"keys must be strings, found {_show(k)}")
    doc = _secrets_from_env(doc, os.environ if env is None else env)
    doc, inherited = _inherit(doc)
    try:
        cfg = _build(ClusterConfig, doc, "")
    except ConfigError as e:
        # Report an inherited value where the operator wrote it: at the top level.
        for g in _GROUPS:
            pre = f"{g}."
            if e.path.startswith(pre):
                first = re.split(r"[.\[]", e.path[len(pre):], maxsplit=1)[0]
                if first in inherited[g]:
                    raise ConfigError(e.path[len(pre):], e.message, kind=e.kind) from None
        raise
    return dataclasses.replace(cfg, _source=_freeze(source))


# ----------------------------------------------------------------------------- overrides

# CLI flag names that differ from the config key they set.
_ALIASES = {
    "host": "hostname",
    "coordinator_url": "disagg_coordinator_url",
}
_ENV_ALIASES = {f"{ENV_PREFIX}COORDINATOR_URL": "disagg_coordinator_url"}


def env_var_name(path: str) -> str:
    """`coordinator.port` → `SPLITSERVE_COORDINATOR__PORT` (nesting uses a double underscore)."""
    return ENV_PREFIX + path.upper().replace(".", "__")


def _scalar_paths(cls: type, prefix: str = "") -> dict[str, tuple[Any, Mapping]]:
    """Every overridable key path → (type, metadata): scalars and lists of strings, at any depth
    of nested mappings (not inside lists)."""
    out: dict[str, tuple[Any, Mapping]] = {}
    hints = _hints(cls)
    for f in _schema_fields(cls):
        tp = hints[f.name]
        path = _join(prefix, f.name)
        inner = tp
        if typing.get_origin(tp) in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not _NoneType]
            inner = args[0] if len(args) == 1 else tp
        if dataclasses.is_dataclass(inner):
            out.update(_scalar_paths(inner, path))
        elif inner in (int, float, str, bool) or typing.get_origin(inner) is Literal:
            out[path] = (tp, f.metadata)
        elif typing.get_origin(inner) is tuple and typing.get_args(inner)[0] is str:
            out[path] = (tp, f.metadata)
    return out


def _parse_text(tp: Any, text: str, where: str, md: Mapping) -> Any:
    """Turn an env/CLI string into the Python value the schema expects (then validated)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if text.strip().lower() in ("", "null", "none"):
            return None
        inner = [a for a in typing.get_args(tp) if a is not _NoneType][0]
        return _parse_text(inner, text, where, md)
    if tp is bool:
        t = text.strip().lower()
        if t in ("1", "true", "yes", "on"):
            return True
        if t in ("0", "false", "no", "off"):
            return False
        raise ConfigError(where, f"expected a boolean (true/false/1/0), found "
                          f"{_show(text, md.get('secret', False))}")
    if tp is int:
        if md.get("parse") == "bytes":
            return text.strip()
        try:
            return int(text.strip())
        except ValueError:
            raise ConfigError(where, f"expected int, found {_show(text, md.get('secret'))}") \
                from None
    if tp is float:
        try:
            return float(text.strip())
        except ValueError:
            raise ConfigError(where, f"expected number, found {_show(text, md.get('secret'))}") \
                from None
    if origin is tuple:
        return [x.strip() for x in text.split(",") if x.strip()]
    return text


def _set_path(doc: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    cur = doc
    for i, p in enumerate(parts[:-1]):
        nxt = cur.get(p)
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None or not isinstance(nxt, Mapping) else dict(nxt)
            cur[p] = nxt
        cur = nxt
    cur[parts[-1]] = value


def apply_overrides(cfg: ClusterConfig, *, env: Optional[Mapping[str, str]] = None,
                    **values: Any) -> ClusterConfig:
    """Return `cfg` with environment and CLI overrides applied (file < env < CLI).

    - env (default `os.environ`): `SPLITSERVE_<KEY_PATH>` for every scalar key, nesting with `__`
      (`SPLITSERVE_NUM_WORKERS`, `SPLITSERVE_COORDINATOR__PORT`,
      `SPLITSERVE_CONTEXT_SERVERS__URLS=h:1,h:2`); `SPLITSERVE_COORDINATOR_URL` is an alias of
      `SPLITSERVE_DISAGG_COORDINATOR_URL`. Pass `env={}` to ignore the environment.
    - keyword values: key paths with `__` for nesting (`coordinator__port=9000`), plus the CLI
      aliases `host` (= hostname) and `coordinator_url` (= disagg_coordinator_url). None means
      "flag not given". Strings are parsed like env values.
    The result is re-validated from the source document; errors name the env var or flag.
    """
    env = os.environ if env is None else env
    paths = _scalar_paths(ClusterConfig)
    doc = _thaw(cfg._source)
    env_map = {env_var_name(p): p for p in paths}
    env_map.update(_ENV_ALIASES)
    applied: dict[str, tuple[str, Any]] = {}
    for name in sorted(env_map):
        if name not in env:
            continue
        path = env_map[name]
        tp, md = paths[path]
        value = _parse_text(tp, env[name], name, md)
        if path in applied and applied[path][1] != value:
            raise ConfigError(name, f"conflicts with {applied[path][0]} for {path}")
        applied[path] = (name, value)
    cli: dict[str, tuple[str, Any]] = {}
    for key, value in values.items():
        if value is None:
            continue
        path = _ALIASES.get(key, key.replace("__", "."))
        if path not in paths:
            raise ConfigError(f"--{key.replace('_', '-')}", "unknown override; expected one of: "
                              + ", ".join(sorted(set(paths) | set(_ALIASES))))
        tp, md = paths[path]
        if isinstance(value, str):
            value = _parse_text(tp, value, f"--{key.replace('_', '-')}", md)
        elif isinstance(value, list):
            value = list(value)
        if path in cli and cli[path][1] != value:
            raise ConfigError(f"--{key.replace('_', '-')}", f"conflicts with {cli[path][0]}")
        cli[path] = (f"--{key.replace('_', '-')}", value)
    applied.update(cli)
    for path, (_where, value) in applied.items():
        _set_path(doc, path, value)
    try:
        return load_config(doc, env=env)
    except ConfigError as e:
        src = applied.get(e.path)
        if src is not None:
            raise ConfigError(e.path, f"{e.message} (set by {src[0]})") from None
        raise


# ----------------------------------------------------------------------------- introspection

def _public(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in _schema_fields(type(obj)):
            v = getattr(obj, f.name)
            if f.metadata.get("secret"):
                if isinstance(v, tuple):
                    out[f.name] = [REDACTED] * len(v)
                else:
                    out[f.name] = REDACTED if v else None
            else:
                out[f.name] = _public(v)
        return out
    if isinstance(obj, Mapping):
        return {k: _public(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_public(v) for v in obj]
    return obj


def schema_rows(cls: type = ClusterConfig, prefix: str = "") -> list[dict[str, Any]]:
    """Every documented key: `{path, type, default, doc, upstream, parse}`; nested mappings flattened.
    docs/configuration.md is generated from these (coordinator/config_doc.py; tests/test_config.py
    checks it is current)."""
    rows = []
    hints = _hints(cls)
    for f in _schema_fields(cls):
        tp = hints[f.name]
        path = _join(prefix, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        inner = tp
        if typing.get_origin(tp) in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not _NoneType]
            inner = args[0] if len(args) == 1 else tp
        nested = dataclasses.is_dataclass(inner)
        rows.append({"path": path, "type": _type_name(tp),
                     "default": _public(default) if not nested else None,
                     "doc": f.metadata.get("doc", ""), "upstream": bool(f.metadata.get("upstream")),
                     "parse": f.metadata.get("parse")})
        if nested:
            rows.extend(schema_rows(inner, path))
        elif typing.get_origin(inner) is tuple and dataclasses.is_dataclass(
                typing.get_args(inner)[0]):
            rows.extend(schema_rows(typing.get_args(inner)[0], f"{path}[]"))
    return rows
