"""The cluster configuration's schema: msgspec Structs, one field doc per key, derived values.

Keys and defaults follow `trtllm-serve disaggregated` (TensorRT-LLM's `extract_disagg_cfg`) wherever
that command has them (`upstream` in a field's metadata), so an upstream config file loads unchanged.
Our additions (routing key scheme, leases, fallback, auth, coordinator and fleet tuning) are
documented field by field below and in docs/configuration.md (generated from this schema by
coordinator/config_doc.py). Loading is coordinator/config.py; upstream compatibility (inherited
engine keys, kept upstream arguments, the two router forms, url normalisation) is
coordinator/config_upstream.py; environment and CLI overrides are coordinator/config_overrides.py.

Invariants:
- Types and bounds are the Structs' (msgspec checks them while converting); rules between fields
  are each Struct's `_check(path)`, run after conversion. Both raise `ConfigError` naming the full
  key path (`context_servers.router.foo`), the expected type and the found value.
- Secrets (`api_keys`, `internal_request_auth_key`) never appear in `repr()`, `str()`,
  `to_public_dict()` or error messages.
- The objects are frozen; mappings inside them are read-only (`MappingProxyType`, tuples for lists).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import types
from typing import Annotated, Any, Literal, Mapping, Optional

import msgspec
from msgspec import Meta

from coordinator.config_base import (ROUTER_TYPES, SOURCE_KEY, ConfigError, NonNegFloat, NonNegInt, Port,
                                     PosFloat, PosInt, Section, doc, field_specs, join, public, thaw)
from coordinator.upstream_args import UPSTREAM_ENGINE_ARGS, UPSTREAM_KV_CACHE_ARGS
from protocol.cluster_store import etcd_endpoints
from router.block_keys import salt_seed


# ----------------------------------------------------------------------------- sections

class RouterConfig(Section):
    """A routing policy: `type` plus its arguments. Both `router: {type, k: v}` (upstream's flat
    form) and `router: {type, args: {k: v}}` normalise to the same object
    (coordinator/config_upstream.py); the argument schema is checked by
    `router.policies.make_policy`, not here."""
    type: Annotated[Literal[ROUTER_TYPES],
                    doc("routing policy for this role", upstream=True)] = "round_robin"
    args: Annotated[Mapping[str, Any], doc("policy arguments (flat keys or nested `args:`)",
                                           upstream=True)] = msgspec.field(default_factory=dict)

    def __post_init__(self):
        self._freeze_fields("args")

    def _check(self, path: str) -> None:
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
            make(self.type, thaw(self.args))
        except (ValueError, TypeError, KeyError) as e:
            msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            bad = getattr(e, "key", None) or getattr(e, "arg", None)
            if bad is None:
                bad = next((k for k in self.args if f"'{k}'" in msg or f"`{k}`" in msg), None)
            raise ConfigError(join(path, bad) if bad in self.args else path,
                              f"invalid arguments for router type {self.type!r}: {msg}") from None


class KvCacheConfig(Section):
    """The workers' KV-cache settings (TensorRT-LLM `kv_cache_config`). Keys we do not interpret
    are kept in `extra`."""
    tokens_per_block: Annotated[Optional[PosInt], doc(
        "engine KV block size in tokens (null = engine default); must divide or be a multiple of "
        "routing.block_size", upstream=True)] = None
    enable_block_reuse: Annotated[bool, doc("engine prefix caching; KV-aware routing needs it",
                                            upstream=True)] = True
    event_buffer_max_size: Annotated[NonNegInt, doc(
        "engine KV-event buffer (TensorRT-LLM needs > 0 to publish events)", upstream=True)] = 0
    extra: Annotated[Mapping[str, Any], doc("other upstream KvCacheConfig keys, kept as given",
                                            upstream=True)] = msgspec.field(default_factory=dict)

    _PASSTHROUGH = UPSTREAM_KV_CACHE_ARGS
    _PASSTHROUGH_FIELD = "extra"

    def __post_init__(self):
        self._freeze_fields("extra")


_ZMQ_ENDPOINT = re.compile(r"^(tcp|ipc|inproc)://.+")


class KvEventSource(Section):
    """A static KV-event source for a server, e.g. a stock vLLM, SGLang or TensorRT-LLM worker.
    It takes precedence over what the server's `/server_info` advertises. Our own workers
    advertise theirs and need no entry."""
    server: Annotated[str, doc("the server URL this publisher belongs to (one of `urls`)")]
    transport: Annotated[Literal["zmq", "http_poll"], doc(
        "zmq: subscribe to a PUB socket; http_poll: poll TensorRT-LLM's `POST /kv_cache_events` "
        "(trtllm-serve without a streaming publisher)")] = "zmq"
    endpoint: Annotated[Optional[str], doc(
        "zmq: the PUB endpoint of DP rank 0, e.g. tcp://10.0.0.5:5557 (null = the publisher "
        "connects to coordinator.event_ingest.bind_endpoint, recognised by `topic`: vLLM's "
        "connect mode); http_poll: the URL to poll (null = <server>/kv_cache_events)")] = None
    replay_endpoint: Annotated[Optional[str], doc(
        "ZMQ ROUTER replay endpoint of DP rank 0 (null = no gap repair; a gap clears the server's "
        "index entries)")] = None
    topic: Annotated[str, doc("ZMQ topic prefix to subscribe to ('' = all); required without "
                              "`endpoint`")] = ""
    engine: Annotated[Literal["vllm", "sglang", "trtllm"], doc(
        "payload encoding of the events (http_poll: trtllm)")] = "vllm"
    dp_size: Annotated[Annotated[int, Meta(ge=1, le=1024)], doc(
        "data-parallel ranks publishing; rank r uses port + r of `endpoint` and `replay_endpoint` "
        "(as vLLM and SGLang bind them)")] = 1
    poll_interval_s: Annotated[PosFloat, doc(
        "http_poll: seconds between polls (backs off to 30 s while polls fail)")] = 0.5
    block_size: Annotated[Optional[PosInt], doc(
        "engine block size of the events (null = kv_cache_config.tokens_per_block or "
        "routing.block_size)")] = None

    def _check(self, path: str) -> None:
        if self.transport == "zmq":
            for name in ("endpoint", "replay_endpoint"):
                v = getattr(self, name)
                if v is not None and not _ZMQ_ENDPOINT.match(v):
                    raise ConfigError(join(path, name), f"expected a ZMQ endpoint like "
                                      f"'tcp://host:port' or 'ipc:///path', found {v!r}")
            if self.endpoint is None and not self.topic:
                raise ConfigError(join(path, "topic"), "expected a non-empty topic when "
                                  "`endpoint` is null (the coordinator's bound endpoint tells "
                                  "publishers apart by topic)")
            return
        if self.endpoint is not None and not re.match(r"^https?://[^/]+", self.endpoint):
            raise ConfigError(join(path, "endpoint"), "expected an http(s) URL like "
                              f"'http://host:port/kv_cache_events', found {self.endpoint!r}")
        if self.engine != "trtllm":
            raise ConfigError(join(path, "engine"), "http_poll reads TensorRT-LLM's "
                              f"/kv_cache_events JSON: expected 'trtllm', found {self.engine!r}")
        for name in ("replay_endpoint", "topic"):
            if getattr(self, name):
                raise ConfigError(join(path, name), f"not used with transport http_poll, found "
                                  f"{getattr(self, name)!r}")
        if self.dp_size != 1:
            raise ConfigError(join(path, "dp_size"), "http_poll splits ranks by the events' "
                              f"attention_dp_rank: expected 1, found {self.dp_size}")


class ServerGroupConfig(Section):
    """One role's servers (`context_servers` or `generation_servers`)."""
    num_instances: Annotated[Optional[NonNegInt], doc(
        "number of servers; must equal len(urls) when both are given (null = len(urls))",
        upstream=True)] = None
    urls: Annotated[tuple[str, ...], doc(
        "static servers as host:port or http(s)://host:port; normalised to http://host:port",
        upstream=True)] = ()
    router: Annotated[RouterConfig, doc("routing policy for this role", upstream=True)] = \
        msgspec.field(default_factory=RouterConfig)
    model: Annotated[Optional[str], doc("model the servers serve (inherited from top-level "
                                        "`model`)", upstream=True, engine=True)] = None
    max_batch_size: Annotated[Optional[PosInt], doc(
        "engine max batch size (informational; upstream copies it into router args)",
        upstream=True, engine=True)] = None
    max_num_tokens: Annotated[Optional[PosInt], doc(
        "engine max tokens per step (informational)", upstream=True, engine=True)] = None
    kv_cache_config: Annotated[KvCacheConfig, doc("engine KV-cache settings", upstream=True,
                                                  engine=True)] = \
        msgspec.field(default_factory=KvCacheConfig)
    tensor_parallel_size: Annotated[Annotated[int, Meta(ge=1)], doc(
        "TP ranks per server", upstream=True, engine=True)] = 1
    pipeline_parallel_size: Annotated[Annotated[int, Meta(ge=1)], doc(
        "PP ranks per server", upstream=True, engine=True)] = 1
    context_parallel_size: Annotated[Annotated[int, Meta(ge=1)], doc(
        "CP ranks per server", upstream=True, engine=True)] = 1
    kv_capacity_blocks: Annotated[Optional[PosInt], doc(
        "KV-cache capacity of each of these servers, in blocks of routing.block_size: the KV "
        "index stops predicting prefixes the blocks routed there since have evicted "
        "(docs/routing.md, 'Capacity-aware prediction'). null = each server's /server_info "
        "kv_capacity_blocks (our worker publishes it), else unknown: no bound; set it for stock "
        "engines")] = None
    kv_events: Annotated[tuple[KvEventSource, ...], doc(
        "static KV-event sources (they take precedence over what a server's /server_info "
        "advertises)")] = ()
    protocol: Annotated[Optional[Literal["trtllm", "vllm", "sglang"]], doc(
        "engine protocol of these servers (fleet/legs/, docs/protocols.md): trtllm "
        "disaggregated_params, vllm kv_transfer_params, sglang bootstrap rendezvous (null = what "
        "each server's /server_info says, else trtllm)")] = None
    bootstrap_port: Annotated[Optional[Annotated[int, Meta(gt=0, le=65535)]], doc(
        "SGLang prefill servers' bootstrap port (null = each server's /server_info "
        "disaggregation_bootstrap_port, else 8998)")] = None
    engine_args: Annotated[Mapping[str, Any], doc(
        "every engine-level key of this section as given (upstream `other_args`), including the "
        "ones inherited from the top level", upstream=True)] = msgspec.field(default_factory=dict)

    _PASSTHROUGH = UPSTREAM_ENGINE_ARGS
    _PASSTHROUGH_FIELD = "engine_args"
    _PASSTHROUGH_ALL_ENGINE = True

    def __post_init__(self):
        self._freeze_fields("engine_args")

    @property
    def instance_num_ranks(self) -> int:
        """GPU ranks per server (tp × pp × cp), as upstream computes it."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def expected_instances(self) -> int:
        return self.num_instances if self.num_instances is not None else len(self.urls)

    def _check(self, path: str) -> None:
        if self.num_instances is not None and self.urls and self.num_instances != len(self.urls):
            raise ConfigError(join(path, "num_instances"),
                              f"expected {len(self.urls)} (the number of urls), found "
                              f"{self.num_instances}")
        seen = set()
        for i, u in enumerate(self.urls):
            if u in seen:
                raise ConfigError(f"{join(path, 'urls')}[{i}]", f"duplicate server {u!r}")
            seen.add(u)
        for i, ev in enumerate(self.kv_events):
            if self.urls and ev.server not in seen:
                raise ConfigError(f"{join(path, 'kv_events')}[{i}].server",
                                  f"expected one of this section's urls {list(self.urls)}, "
                                  f"found {ev.server!r}")


class ConditionalDisaggConfig(Section):
    max_local_prefill_length: Annotated[NonNegInt, doc(
        "skip the context leg when the chosen generation server would prefill at most this many "
        "uncached tokens", upstream=True)] = 0


class OtlpConfig(Section):
    otlp_traces_endpoint: Annotated[Optional[str], doc(
        "OTLP/HTTP (protobuf) traces URL, e.g. http://collector:4318/v1/traces: one trace per "
        "request, traceparent sent on each leg (docs/fleet.md, 'Tracing')", upstream=True)] = None


class MinimalInstances(Section):
    context_servers: Annotated[NonNegInt, doc("healthy context servers needed for /health = 200",
                                              upstream=True)] = 1
    generation_servers: Annotated[NonNegInt, doc(
        "healthy generation servers needed for /health = 200", upstream=True)] = 1


class DisaggClusterConfig(Section):
    """Dynamic membership: servers register themselves instead of (or beside) static `urls`."""
    cluster_uri: Annotated[str, doc("registration store: the coordinator URL (http://…: workers "
                                    "register with it) or etcd://host:port[,etcd://…] (workers put "
                                    "leased keys the coordinator watches)", upstream=True)]
    cluster_name: Annotated[str, doc("namespace of this cluster in the store", upstream=True)] = ""
    minimal_instances: Annotated[MinimalInstances, doc("readiness minimums", upstream=True)] = \
        msgspec.field(default_factory=MinimalInstances)
    heartbeat_interval_sec: Annotated[PosFloat, doc("worker heartbeat period", upstream=True)] = 5.0
    inactive_timeout_sec: Annotated[PosFloat, doc("a worker silent this long is removed",
                                                  upstream=True)] = 10.0

    def _check(self, path: str) -> None:
        uri = self.cluster_uri
        if uri.startswith("etcd://"):
            try:
                etcd_endpoints(uri)
            except ValueError as e:
                raise ConfigError(join(path, "cluster_uri"), str(e)) from None
        elif not re.match(r"^https?://[^/]+", uri):
            raise ConfigError(join(path, "cluster_uri"), "expected 'etcd://host:port[,…]' (workers "
                              "register in etcd) or 'http://host:port' (workers register with the "
                              f"coordinator), found {uri!r}")
        if self.inactive_timeout_sec <= self.heartbeat_interval_sec:
            raise ConfigError(join(path, "inactive_timeout_sec"),
                              f"expected > heartbeat_interval_sec ({self.heartbeat_interval_sec}),"
                              f" found {self.inactive_timeout_sec}")


class RoutingConfig(Section):
    block_size: Annotated[PosInt, doc("canonical block size (tokens) of routing keys; published "
                                      "in /cluster_info")] = 16
    key_scheme: Annotated[Literal["xxh3_chain_v1"], doc(
        "block-key recipe (kv_events §9.1); published in /cluster_info")] = "xxh3_chain_v1"
    namespace: Annotated[Optional[str], doc("cache namespace salted into every key (null = the "
                                            "default namespace)")] = None

    @property
    def ns_seed(self) -> int:
        """The namespace's salt of every routing key (0 for the default namespace): the one value
        the coordinator's index, its key parity probe and the fleet's keys are built with."""
        return salt_seed(self.namespace)


class LeaseConfig(Section):
    ttl_s: Annotated[PosFloat, doc("a /select lease not finished or renewed within this is "
                                   "expired (its load released)")] = 300.0
    renew_interval_s: Annotated[Optional[PosFloat], doc(
        "how often long streams renew their lease (null = ttl_s / 3)")] = None
    prefill_ttl_s: Annotated[PosFloat, doc(
        "a lease whose first token was not reported within this counts as decoding, no longer "
        "as queued prefill (a lost or never-sent report)")] = 60.0

    @property
    def effective_renew_interval_s(self) -> float:
        return self.renew_interval_s if self.renew_interval_s is not None else self.ttl_s / 3

    def _check(self, path: str) -> None:
        if self.renew_interval_s is not None and self.renew_interval_s >= self.ttl_s:
            raise ConfigError(join(path, "renew_interval_s"),
                              f"expected < ttl_s ({self.ttl_s}), found {self.renew_interval_s}")


class EventIngestConfig(Section):
    bind_endpoint: Annotated[Optional[str], doc(
        "ZMQ endpoint the coordinator binds (SUB) for publishers that connect to it (null = "
        "subscribe only)")] = None
    replay_timeout_s: Annotated[PosFloat, doc(
        "wait for a replay answer before giving up and clearing the server's entries")] = 2.0
    rebuild_timeout_s: Annotated[PosFloat, doc(
        "wait for a /kv_snapshot when rebuilding a server's entries")] = 30.0

    def _check(self, path: str) -> None:
        v = self.bind_endpoint
        if v is not None and not _ZMQ_ENDPOINT.match(v):
            raise ConfigError(join(path, "bind_endpoint"), f"expected a ZMQ endpoint like "
                              f"'tcp://127.0.0.1:5557', found {v!r}")


class CoordinatorConfig(Section):
    host: Annotated[str, doc("coordinator TCP bind address (loopback by default)")] = "127.0.0.1"
    port: Annotated[Optional[Port], doc("coordinator TCP port (null = `port` - 1, as "
                                        "upstream)")] = None
    uds: Annotated[bool, doc("also serve on a Unix socket when the coordinator is local")] = True
    uds_path: Annotated[Optional[str], doc(
        "Unix socket path (null = <tmpdir>/splitserve-coordinator-<coordinator port>.sock)")] = None
    health_check_interval_s: Annotated[PosFloat, doc(
        "period of server /health probes (each server once per period; a tick's probes start "
        "spread over its first half)")] = 2.0
    health_failure_threshold: Annotated[Annotated[int, Meta(ge=1)], doc(
        "consecutive failed probes before a server is unhealthy")] = 3
    server_info_timeout_s: Annotated[PosFloat, doc("timeout of one /server_info or /health "
                                                   "call")] = 5.0
    event_ingest: Annotated[EventIngestConfig, doc("KV-event subscription settings")] = \
        msgspec.field(default_factory=EventIngestConfig)
    identity_ttl_s: Annotated[PosFloat, doc(
        "lease of a fleet process's (node_id, process_id) pair; renewed by the holder")] = 60.0
    channel: Annotated[bool, doc(
        "offer the fleet processes' persistent pipelined channel (`GET /channel` upgrade on the "
        "API listeners; docs/coordinator-api.md)")] = True
    max_queue_delay_s: Annotated[PosFloat, doc(
        "placements that waited longer than this behind a saturated event loop are shed: 429 + "
        "Retry-After, no lease")] = 0.1
    replicas: Annotated[tuple[str, ...], doc(
        "the coordinator replicas, in order (http://h:p each; docs/failover.md): the fleet walks "
        "them and uses the first that serves; a replica serves while none ahead of it is up and "
        "warm. Empty = one coordinator")] = ()
    replica_index: Annotated[Optional[NonNegInt], doc(
        "this coordinator's position in `replicas` (env SPLITSERVE_COORDINATOR__REPLICA_INDEX; "
        "null: the entry whose host is this host name, as a StatefulSet pod's)")] = None
    replica_probe_interval_s: Annotated[PosFloat, doc(
        "how often a replica probes the replicas ahead of it (GET /replica)")] = 0.05
    replica_probe_timeout_s: Annotated[PosFloat, doc(
        "a replica ahead that does not answer within this is down")] = 0.25
    election: Annotated[Literal["ordered", "kubernetes", "etcd"], doc(
        "how replicas choose the serving one (docs/failover.md): the ordered `replicas` list "
        "(default), a coordination.k8s.io Lease (`kubernetes`), or an etcd lease on "
        "disagg_cluster.cluster_uri (`etcd`)")] = "ordered"
    election_lease_name: Annotated[str, doc(
        "name of the Lease object (kubernetes) or the key's last part (etcd)")] = "splitserve-coordinator"
    election_namespace: Annotated[Optional[str], doc(
        "the Lease's namespace (null: the pod's own, else default)")] = None
    election_lease_s: Annotated[PosFloat, doc(
        "how long a dead holder keeps the lease (kubernetes: whole seconds; etcd: at least its "
        "minimum TTL): the takeover time of the lease backends")] = 2.0
    election_renew_s: Annotated[PosFloat, doc(
        "how often the holder renews and the others campaign (lease backends)")] = 0.5
    failback_s: Annotated[NonNegFloat, doc(
        "a replica ahead must be up and warm this long before a serving replica defers to it "
        "again")] = 1.0


class CircuitBreakerConfig(Section):
    failure_threshold: Annotated[Annotated[int, Meta(ge=1)], doc(
        "consecutive failures of a server (connect errors, dropped connections, retried 5xx) that "
        "open its breaker in a fleet process: no traffic to it from that process")] = 1
    open_s: Annotated[PosFloat, doc(
        "how long a breaker stays open the first time; then half-open: traffic is let through, "
        "a success closes it, a failure opens it again for twice as long")] = 2.0
    max_open_s: Annotated[PosFloat, doc("cap of the doubling open time")] = 30.0

    def _check(self, path: str) -> None:
        if self.max_open_s < self.open_s:
            raise ConfigError(join(path, "max_open_s"), f"expected >= open_s ({self.open_s}), "
                              f"found {self.max_open_s}")


class RateLimitConfig(Section):
    requests_per_s: Annotated[Optional[PosFloat], doc(
        "token-bucket rate of admitted requests for the whole fleet (each of the num_workers "
        "processes admits its share); null = no rate limit")] = None
    burst: Annotated[Optional[Annotated[int, Meta(ge=1)]], doc(
        "bucket size: requests admitted at once after a quiet period (null = one second's worth, "
        "at least 1), split across processes like the rate")] = None
    max_queue: Annotated[NonNegInt, doc(
        "requests per fleet process that wait (FIFO) for a token when the bucket is empty; "
        "beyond it 429 + Retry-After at once")] = 0
    queue_timeout_s: Annotated[PosFloat, doc(
        "longest wait in that queue; then 429 + Retry-After")] = 1.0


class FleetConfig(Section):
    max_body_bytes: Annotated[PosInt, doc("largest accepted request body (413 beyond); an int or "
                                          "'4MiB'", parse="bytes")] = 4 * 1024 * 1024
    keepalive_requests: Annotated[Optional[Annotated[int, Meta(ge=1)]], doc(
        "requests served per client connection before it is closed (null = unlimited)")] = None
    drain_timeout_s: Annotated[NonNegFloat, doc("on shutdown, wait this long for in-flight "
                                                "requests")] = 30.0
    retry_on_status: Annotated[tuple[Annotated[int, Meta(ge=400, le=599)], ...], doc(
        "worker answers retried on another server (with max_retries and the backoff), besides "
        "connect failures, while nothing was sent to the client yet: any of 408, 429, 500-599. "
        "429 and 503 count as shedding, the others as failures of the server")] = (503,)
    retry_backoff_s: Annotated[NonNegFloat, doc("pause before the first retry on another server "
                                                "(jittered: x0.5-1.5)")] = 0.05
    retry_backoff_multiplier: Annotated[Annotated[float, Meta(ge=1.0)], doc(
        "each further retry of a request waits this much longer")] = 2.0
    retry_backoff_max_s: Annotated[NonNegFloat, doc("cap of the retry pause before jitter")] = 1.0
    circuit_breaker: Annotated[CircuitBreakerConfig, doc(
        "per-server circuit breaker of each fleet process")] = \
        msgspec.field(default_factory=CircuitBreakerConfig)
    rate_limit: Annotated[RateLimitConfig, doc(
        "token-bucket admission with a bounded FIFO queue")] = \
        msgspec.field(default_factory=RateLimitConfig)
    coordinator_timeout_s: Annotated[PosFloat, doc("timeout of one coordinator call")] = 5.0
    failover_wait_s: Annotated[NonNegFloat, doc(
        "with several coordinator replicas: how long a placement waits for one of them to serve "
        "(the serving one died, a standby is taking over) before it is placed locally, blind")] = 1.0
    coordinator_channel: Annotated[bool, doc(
        "use the coordinator's persistent channel when it offers one (else one HTTP exchange per "
        "call)")] = True
    coordinator_max_pending: Annotated[Annotated[int, Meta(ge=1)], doc(
        "coordinator calls one fleet process may have unanswered; beyond it requests are shed "
        "with 503 + Retry-After")] = 4096
    max_inflight_requests: Annotated[Optional[Annotated[int, Meta(ge=1)]], doc(
        "per fleet process; beyond it requests get 429 + Retry-After (null = unlimited)")] = None
    header_timeout_s: Annotated[PosFloat, doc(
        "a request head (request line and headers) must arrive within this long once it has "
        "started (408 beyond)")] = 10.0
    body_timeout_s: Annotated[PosFloat, doc(
        "a request body must arrive within this long once its head is read (408 beyond); a "
        "request counts toward max_inflight_requests only once its body is read")] = 30.0
    event_loop: Annotated[Literal["asyncio", "uvloop"], doc(
        "event loop of each fleet process. asyncio serves the connections of a saturated process "
        "in turn; uvloop costs ~10% less CPU per request but, once a process is saturated, leaves "
        "some connections unserved for over a second (docs/fleet.md, 'Event loop')")] = "asyncio"
    access_log: Annotated[bool, doc(
        "one INFO line per API request on logger splitserve.fleet.access (method, path, status, "
        "duration, request id; with log_format json, as fields)")] = False
    route_header: Annotated[Literal["off", "short", "full"], doc(
        "the x-splitserve-route receipt on answers: off (default: public clients learn nothing of "
        "the cluster), short (request id, mode, retries, each leg's policy and predicted cached "
        "tokens: no server URLs, loads or scores) or full (servers, scores, loads, candidates: "
        "for debugging and tests)")] = "off"
    cpu_affinity: Annotated[str, doc(
        "pin each process to one CPU, as nginx's worker_cpu_affinity: none, auto (the CPUs the "
        "launcher may use: the coordinator started here on the first, fleet processes on the "
        "next in turn) or a CPU list like 0-7,12 (docs/fleet.md, 'CPU affinity')")] = "none"

    def _check(self, path: str) -> None:
        for i, st in enumerate(self.retry_on_status):
            if st != 408 and st != 429 and st < 500:
                raise ConfigError(f"{join(path, 'retry_on_status')}[{i}]", "expected 408, 429 or "
                                  f"a 5xx status (a 4xx answer is the client's), found {st}")
        if self.cpu_affinity not in ("none", "auto"):
            try:
                cpu_list(self.cpu_affinity)
            except ValueError as e:
                raise ConfigError(join(path, "cpu_affinity"), str(e)) from None


def cpu_list(text: str) -> list[int]:
    """`"0-3,8"` → `[0, 1, 2, 3, 8]` (the Linux cpuset list format; order kept, repeats dropped)."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
        raise ValueError(f"expected none, auto or a CPU list like '0-7,12', found {text!r}")
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"expected a CPU range that ends after it starts, found {part!r}")
        out.extend(c for c in range(a, b + 1) if c not in out)
    return out


class ClusterConfig(Section):
    """The whole cluster. Build with `load_config`; derive variants with `apply_overrides`."""
    hostname: Annotated[str, doc("address the fleet binds and advertises", upstream=True)] = \
        "localhost"
    bind_host: Annotated[Optional[str], doc("bind address when it differs from `hostname` "
                                            "(e.g. 0.0.0.0)", upstream=True)] = None
    port: Annotated[Port, doc("public port of the fleet (SO_REUSEPORT across `num_workers`)",
                              upstream=True)] = 8000
    model: Annotated[Optional[str], doc("served model name (/v1/models); inherited by both server "
                                        "sections", upstream=True)] = None
    num_workers: Annotated[Annotated[int, Meta(ge=1, le=64)], doc(
        "fleet processes on the public port; > 1 starts an implicit coordinator on port - 1",
        upstream=True)] = 1
    disagg_coordinator_url: Annotated[Optional[str], doc(
        "external coordinator (http://h:p or unix:///path); no coordinator runs here",
        upstream=True)] = None
    node_id: Annotated[Optional[Annotated[int, Meta(ge=0, le=255)]], doc(
        "snowflake node id 0..255 (null = leased from the coordinator)", upstream=True)] = None
    schedule_style: Annotated[Literal["context_first", "generation_first"], doc(
        "which leg is sent first", upstream=True)] = "context_first"
    max_retries: Annotated[NonNegInt, doc(
        "retries of a leg after a connect-level failure (on another server)", upstream=True)] = 1
    server_start_timeout: Annotated[PosFloat, doc(
        "seconds to wait for the coordinator/servers at start", upstream=True)] = 180.0
    request_timeout: Annotated[PosFloat, doc("seconds one upstream leg may take",
                                             upstream=True)] = 180.0
    server_keep_alive_timeout: Annotated[PosFloat, doc("idle keep-alive of client connections",
                                                       upstream=True)] = 10.0
    perf_metrics_max_requests: Annotated[NonNegInt, doc(
        "must be 0: splitserve serves no /perf_metrics (upstream's join of the engines' per-request "
        "timings); per-request timings are in traces (`otlp_config`) and /metrics",
        upstream=True)] = 0
    allow_request_chat_template: Annotated[bool, doc(
        "accept a request's own `chat_template` (forwarded to the workers); false: such a request is "
        "a 400 naming the field", upstream=True)] = False
    gen_strip_message_history: Annotated[bool, doc(
        "send only the last message of a chat on the generation leg when it carries the prompt as "
        "token ids (TensorRT-LLM context answers; the worker reads the ids)", upstream=True)] = False
    gen_tokids_ctxbytes: Annotated[bool, doc(
        "must be false: splitserve relays the context answer's prompt ids as JSON ints, never as "
        "upstream's base64 bytes", upstream=True)] = False
    internal_request_auth_key: Annotated[Optional[str], doc(
        "HMAC key for disaggregated fields sent to workers (env "
        "SPLITSERVE_INTERNAL_REQUEST_AUTH_KEY)", upstream=True, secret=True)] = None
    conditional_disagg_config: Annotated[Optional[ConditionalDisaggConfig], doc(
        "conditional disaggregation (null = always use the context leg)", upstream=True)] = None
    otlp_config: Annotated[Optional[OtlpConfig], doc("tracing export (null = off)",
                                                     upstream=True)] = None
    disagg_cluster: Annotated[Optional[DisaggClusterConfig], doc(
        "dynamic membership (null = static urls only)", upstream=True)] = None
    context_servers: Annotated[ServerGroupConfig, doc("context (prefill) servers",
                                                      upstream=True)] = \
        msgspec.field(default_factory=ServerGroupConfig)
    generation_servers: Annotated[ServerGroupConfig, doc("generation (decode) servers",
                                                         upstream=True)] = \
        msgspec.field(default_factory=ServerGroupConfig)
    routing: Annotated[RoutingConfig, doc("routing-key scheme")] = \
        msgspec.field(default_factory=RoutingConfig)
    leases: Annotated[LeaseConfig, doc("load leases")] = msgspec.field(default_factory=LeaseConfig)
    no_context_fallback: Annotated[Literal["aggregate", "reject"], doc(
        "no healthy context server: serve on a generation server alone (aggregate) or answer 503 "
        "(reject)")] = "aggregate"
    api_keys: Annotated[tuple[str, ...], doc(
        "accepted bearer tokens for the public API (empty and no api_keys_env = no auth)",
        secret=True)] = ()
    api_keys_env: Annotated[Optional[str], doc(
        "name of an env var holding more API keys, comma separated; it must be set when named")] \
        = None
    log_level: Annotated[Literal["debug", "info", "warning", "error"], doc("log level")] = "info"
    log_format: Annotated[Literal["text", "json"], doc(
        "log lines of the coordinator, launcher and fleet processes: text (`time LEVEL [pid N] "
        "logger: message`) or json (one object per line: ts, level, pid, logger, msg)")] = "text"
    coordinator: Annotated[CoordinatorConfig, doc("coordinator process settings")] = \
        msgspec.field(default_factory=CoordinatorConfig)
    fleet: Annotated[FleetConfig, doc("front-door tuning")] = msgspec.field(default_factory=FleetConfig)
    # The validated-from document (read-only), for `apply_overrides`; not a key (SOURCE_KEY).
    _source: Any = msgspec.field(default=None, name=SOURCE_KEY)

    # -- derived values ---------------------------------------------------------------------
    @property
    def source(self) -> Mapping[str, Any]:
        return self._source if self._source is not None else types.MappingProxyType({})

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
        """docs/design.md §2: which of the three process topologies this config selects
        (`coordinator.replicas` names external coordinators, as `disagg_coordinator_url` does)."""
        if self.disagg_coordinator_url or self.coordinator.replicas:
            return "external_coordinator"
        return "single" if self.num_workers == 1 else "implicit_coordinator"

    @property
    def coordinator_url(self) -> Optional[str]:
        """The URL fleet workers use for the coordinator (None in the one-process topology)."""
        if self.disagg_coordinator_url:
            return self.disagg_coordinator_url
        if self.coordinator.replicas:
            return self.coordinator.replicas[0]
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
        return public(self)

    def __repr__(self) -> str:  # secrets and the source document left out
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in field_specs(type(self))
                 if not f.secret]
        return f"ClusterConfig({', '.join(parts)})"

    def __rich_repr__(self):
        for f in field_specs(type(self)):
            if not f.secret:
                yield f.name, getattr(self, f.name)

    def __eq__(self, other: object) -> bool:  # the same settings, wherever they were read from
        if type(other) is not ClusterConfig:
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in field_specs(ClusterConfig))

    __hash__ = None   # mappings inside are not hashable anyway

    def __str__(self) -> str:  # a readable JSON form
        return json.dumps(self.to_public_dict(), sort_keys=True)

    @property
    def coordinator_replicas(self) -> tuple[str, ...]:
        """Every coordinator URL the fleet may use, in walking order: `coordinator.replicas`, else
        the one coordinator URL (empty in the one-process topology)."""
        if self.coordinator.replicas:
            return self.coordinator.replicas
        url = self.coordinator_url
        return (url,) if url else ()

    def _check(self, path: str) -> None:
        if self.gen_tokids_ctxbytes:
            # Refused rather than accepted and ignored (issue 39): the context leg is never asked for
            # base64 ids, so the setting could not take effect.
            raise ConfigError("gen_tokids_ctxbytes", "expected false: splitserve relays the context "
                              "answer's prompt token ids as JSON ints and never asks for upstream's "
                              "base64 bytes; remove the key or set it to false, found true")
        if self.perf_metrics_max_requests:
            # Refused rather than accepted and ignored: nothing here would keep those records.
            raise ConfigError("perf_metrics_max_requests", "expected 0: splitserve serves no "
                              "/perf_metrics (TensorRT-LLM's join of the engines' per-request "
                              "timings); per-request timings are in the traces (`otlp_config`) "
                              "and in /metrics. Remove the key or set it to 0, found "
                              f"{self.perf_metrics_max_requests}")
        reps = self.coordinator.replicas
        for i, u in enumerate(reps):
            if not re.match(r"^(https?://[^/]+|unix://?/.+)", u):
                raise ConfigError(f"coordinator.replicas[{i}]", "expected 'http://host:port' or "
                                  f"'unix:///path', found {u!r}")
        if len(set(u.rstrip("/") for u in reps)) != len(reps):
            raise ConfigError("coordinator.replicas", f"expected distinct URLs, found {list(reps)}")
        ri = self.coordinator.replica_index
        if ri is not None and ri >= max(1, len(reps)):
            raise ConfigError("coordinator.replica_index", f"expected an index into "
                              f"coordinator.replicas (< {max(1, len(reps))}), found {ri}")
        if reps and self.disagg_coordinator_url:
            raise ConfigError("disagg_coordinator_url", "expected it unset when "
                              "coordinator.replicas lists the coordinators (the fleet walks the "
                              f"list), found {self.disagg_coordinator_url!r}")
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
