"""Where a server's KV events come from: a static `kv_events` entry, or the descriptor the server
advertises under `kv_events` in its `/server_info`, read as each engine writes it.

Precedence: an explicit static entry for the server wins over anything advertised (an operator
who names the publisher knows better than a descriptor built from wildcard binds).

Advertised shapes (the payload `format` is always explicit in the result):
- splitserve workers (`worker/server.py`): `{"publisher": "tcp://h:p" | null, "replay": ...,
  "topic": ..., "snapshot": "/kv_snapshot", "format": "vllm"}`; `format` is required.
- SGLang 0.5.23 (`sglang/srt/runtime_context.py` `describe_kv_events_publisher`, wrapped by
  `sglang/srt/utils/common.py` `build_server_info`): `{"publisher": "zmq", "endpoint_host": "*",
  "endpoint_port_base": 5557, "topic": "", "block_size": 64, "dp_size": 2,
  "replay_endpoint_port_base": 5558, ...}`. `publisher` names the publisher kind, not an
  endpoint; DP rank r publishes on port base + r; a wildcard host means the worker's own host;
  the events are SGLang-encoded.
A descriptor in neither shape is reported (the feed shows why it is not ready), never guessed.
"""
from __future__ import annotations

from typing import Any

from coordinator.kv_feed import FeedSource

_WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")
_OURS = {"publisher", "replay", "topic", "snapshot", "format"}


def static_source(src: Any) -> FeedSource:
    """A `KvEventSource` config entry as a feed source."""
    endpoint = src.endpoint
    if src.transport == "http_poll" and endpoint is None:
        endpoint = src.server + "/kv_cache_events"
    return FeedSource(endpoint=endpoint, replay_endpoint=src.replay_endpoint, topic=src.topic,
                      engine=src.engine, snapshot_url=None, transport=src.transport,
                      dp_size=src.dp_size, poll_interval_s=src.poll_interval_s, origin="config")


def server_host(url: str) -> str:
    return url.split("://", 1)[1].rsplit(":", 1)[0]


def advertised_endpoint(endpoint: Any, host: str) -> str | None:
    """A publisher endpoint as advertised, with a wildcard host replaced by the server's host."""
    if not isinstance(endpoint, str) or not endpoint:
        return None
    for wild in ("*", "0.0.0.0", "[::]", "::"):
        prefix = f"tcp://{wild}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:{endpoint[len(prefix):]}"
    return endpoint


def _port(v: Any) -> int | None:
    return v if type(v) is int and 0 < v <= 65535 else None


def advertised_source(info: dict, url: str, *, snapshot_ok: bool) -> FeedSource | None:
    """The feed source a server's `/server_info` advertises; None when it advertises none.
    `snapshot_ok`: the server's snapshot keys are our canonical keys (same block size/scheme)."""
    kv = info.get("kv_events")
    if kv is None:
        return None
    if not isinstance(kv, dict):
        return _problem(f"kv_events: expected an object, found {type(kv).__name__}")
    host = server_host(url)
    if "endpoint_port_base" in kv or "endpoint_host" in kv:
        return _sglang(kv, host)
    pub = kv.get("publisher")
    if pub is None and not kv.get("topic") and set(kv) <= _OURS:
        return None   # a splitserve worker with its publisher switched off
    if (isinstance(pub, str) and "://" in pub) or (pub is None and kv.get("topic")):
        fmt = kv.get("format")
        if fmt not in ("vllm", "sglang", "trtllm"):
            return _problem(f"kv_events.format: expected 'vllm', 'sglang' or 'trtllm', found "
                            f"{fmt!r}")
        snap = kv.get("snapshot")
        if isinstance(snap, str) and snap.startswith("/"):
            snap = url + snap
        elif not (isinstance(snap, str) and snap.startswith(("http://", "https://"))):
            snap = None
        return FeedSource(endpoint=advertised_endpoint(pub, host),
                          replay_endpoint=advertised_endpoint(kv.get("replay"), host),
                          topic=str(kv.get("topic") or ""), engine=fmt,
                          snapshot_url=snap if snapshot_ok else None)
    return _problem("kv_events: unrecognised descriptor (expected a splitserve publisher "
                    "endpoint or SGLang's endpoint_host/endpoint_port_base), found keys "
                    f"{sorted(map(str, kv))[:12]}")


def _sglang(kv: dict, host: str) -> FeedSource:
    if kv.get("publisher") != "zmq":
        return _problem(f"kv_events.publisher: SGLang descriptor with publisher "
                        f"{kv.get('publisher')!r}; only 'zmq' publishes")
    port = _port(kv.get("endpoint_port_base"))
    if port is None:
        return _problem(f"kv_events.endpoint_port_base: expected a TCP port, found "
                        f"{kv.get('endpoint_port_base')!r}")
    ehost = kv.get("endpoint_host")
    if not isinstance(ehost, str):
        return _problem(f"kv_events.endpoint_host: expected a string, found {ehost!r}")
    h = host if ehost in _WILDCARDS else ehost   # IPv6 hosts arrive bracketed already
    rport = _port(kv.get("replay_endpoint_port_base"))
    dp = kv.get("dp_size", 1)
    if type(dp) is not int or not 1 <= dp <= 1024:
        return _problem(f"kv_events.dp_size: expected an int in 1..1024, found {dp!r}")
    topic = kv.get("topic") or ""
    if not isinstance(topic, str):
        return _problem(f"kv_events.topic: expected a string, found {topic!r}")
    return FeedSource(endpoint=f"tcp://{h}:{port}",
                      replay_endpoint=f"tcp://{h}:{rport}" if rport else None, topic=topic,
                      engine="sglang", dp_size=dp)


def _problem(reason: str) -> FeedSource:
    return FeedSource(endpoint=None, problem=reason)
