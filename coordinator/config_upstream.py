"""Upstream compatibility of the cluster config: what makes a `trtllm-serve disaggregated` file load
unchanged, applied to the document before the schema (coordinator/config_schema.py) converts it.

- Top-level engine keys are inherited by both server sections; a key given both at the top and in
  a section with a different value is an error (`inherit`).
- TensorRT-LLM's own argument names (`UPSTREAM_ENGINE_ARGS`, `UPSTREAM_KV_CACHE_ARGS`: LLM args,
  `trtllm-serve` flags, KvCacheConfig fields; source commit in `coordinator/upstream_args.py`) are
  kept in `ServerGroupConfig.engine_args` / `KvCacheConfig.extra` but not interpreted; anything
  outside those sets is a typo and an error (left for the schema's strictness to report).
- `router:` in upstream's flat form (`{type, k: v}`) or nested (`{type, args: {k: v}}`) gives the
  same `RouterConfig`.
- `urls` (and `kv_events[].server`) as `host:port` or `http(s)://host:port` become
  `http(s)://host:port`.
- Byte sizes may be written '4MiB' (our addition, parsed here as well).
"""
from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from typing import Any

import msgspec.inspect as mi

from coordinator.config_base import (SOURCE_KEY, ConfigError, field_specs, join, non_null, show,
                                     struct_of)
from coordinator.config_schema import ClusterConfig, RouterConfig, ServerGroupConfig
from coordinator.registry import canonical_url
from coordinator.upstream_args import UPSTREAM_ENGINE_ARGS

GROUPS = ("context_servers", "generation_servers")

_BYTES_RE = re.compile(r"^\s*(\d+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?\s*$", re.I)
_BYTES_UNITS = {None: 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2,
                "mb": 1000 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gb": 1000 ** 3,
                "gib": 1024 ** 3}


def allowed_keys(cls: type) -> list[str]:
    """The keys a section accepts: its fields (not the pass-through collector) and the upstream
    names it keeps."""
    pt_field = getattr(cls, "_PASSTHROUGH_FIELD", None)
    return [f.name for f in field_specs(cls) if f.name != pt_field] + \
        sorted(getattr(cls, "_PASSTHROUGH", ()))


def unknown_key(path: str, key: Any, allowed: list[str]) -> ConfigError:
    if not isinstance(key, str):
        return ConfigError(path, f"keys must be strings, found {show(key)}")
    hint = difflib.get_close_matches(key, allowed, n=1)
    msg = "unknown key"
    if hint:
        msg += f" (did you mean {hint[0]!r}?)"
    shown = ", ".join(sorted(allowed)) if len(allowed) <= 30 else f"{len(allowed)} known keys"
    return ConfigError(join(path, key), f"{msg}; expected one of: {shown}", kind="unknown_key")


def _engine_keys() -> frozenset:
    return frozenset({f.name for f in field_specs(ServerGroupConfig) if f.engine}
                     | UPSTREAM_ENGINE_ARGS)


def inherit(doc: dict) -> tuple[dict, dict[str, set]]:
    """Upstream rule: top-level engine keys are inherited by both server sections; a key given
    both at the top and in a section with a different value is an error. Returns the document
    and, per section, the keys it inherited (their errors are reported at the top level)."""
    doc = dict(doc)
    engine = _engine_keys()
    inherited: dict[str, set] = {g: set() for g in GROUPS}
    # Keys the disaggregated server declares itself (`extract_disagg_cfg` parameters, e.g.
    # `perf_metrics_max_requests`) stay at the top level even when they are also LLM args.
    own = {f.name for f in field_specs(ClusterConfig)} - {"model"}
    top = {k: v for k, v in doc.items() if k in engine and k not in own}
    for g in GROUPS:
        sec = doc.get(g)
        if sec is None:
            sec = {}
        if not isinstance(sec, Mapping):
            raise ConfigError(g, f"expected a mapping, found {show(sec)}")
        sec = dict(sec)
        for k, v in top.items():
            if k in sec:
                if sec[k] != v:
                    raise ConfigError(f"{g}.{k}", f"given at the top level ({show(v)}) and in "
                                      f"{g} ({show(sec[k])}) with different values")
            else:
                sec[k] = copy.deepcopy(v)
                inherited[g].add(k)
        doc[g] = sec
    for k in top:
        if k != "model":  # `model` is also the served model name at the top level
            del doc[k]
    return doc, inherited


def prepare(cls: type, data: Any, path: str) -> Any:
    """The document of one section made ready for conversion into `cls` (and its subsections):
    upstream forms normalised, kept upstream arguments moved into their collector field, byte
    sizes parsed. A value that is not a mapping is left for the schema to report."""
    if not isinstance(data, Mapping):
        return data
    for k in data:
        if not isinstance(k, str):
            raise ConfigError(path, f"keys must be strings, found {show(k)}")
    data = dict(data)
    if SOURCE_KEY in data:
        raise unknown_key(path, SOURCE_KEY, allowed_keys(cls))
    if cls is RouterConfig:
        data = _router(data, path)
    elif cls is ServerGroupConfig:
        data = _server_group(data, path)
    pt_field = getattr(cls, "_PASSTHROUGH_FIELD", None)
    specs = {f.name: f for f in field_specs(cls)}
    if pt_field is not None:
        if pt_field in data:     # an attribute, not a key
            raise unknown_key(path, pt_field, allowed_keys(cls))
        passthrough = getattr(cls, "_PASSTHROUGH", frozenset())
        all_engine = getattr(cls, "_PASSTHROUGH_ALL_ENGINE", False)
        kept: dict[str, Any] = {}
        for key in list(data):
            f = specs.get(key)
            if f is not None:
                if all_engine and f.engine:
                    kept[key] = copy.deepcopy(data[key])
            elif key in passthrough:
                kept[key] = data.pop(key)
        data[pt_field] = kept
    for name, value in data.items():
        f = specs.get(name)
        if f is None or name == pt_field:
            continue
        if f.parse == "bytes" and isinstance(value, str):
            data[name] = _byte_size(value, join(path, name))
            continue
        sub = struct_of(f.type)
        if sub is not None:
            data[name] = prepare(sub, value, join(path, name))
            continue
        t = non_null(f.type)
        if isinstance(t, mi.VarTupleType) and isinstance(value, list):
            item = struct_of(t.item_type)
            if item is not None:
                data[name] = [prepare(item, v, f"{join(path, name)}[{i}]")
                              for i, v in enumerate(value)]
    return data


def _byte_size(v: str, path: str) -> int:
    m = _BYTES_RE.match(v)
    if not m:
        raise ConfigError(path, f"expected a byte size like 4194304 or '4MiB', found {show(v)}")
    return int(m.group(1)) * _BYTES_UNITS[(m.group(2) or "").lower() or None]


def _router(data: dict, path: str) -> dict:
    """Upstream's flat `router: {type, k: v}` and the nested `router: {type, args: {k: v}}`."""
    out = {k: v for k, v in data.items() if k == "type"}
    flat = {k: v for k, v in data.items() if k not in ("type", "args")}
    nested = data.get("args")
    if nested is None:
        nested = {}
    if not isinstance(nested, Mapping):
        raise ConfigError(join(path, "args"), f"expected a mapping, found {show(nested)}")
    for k in nested:
        if not isinstance(k, str):
            raise ConfigError(join(path, "args"), f"keys must be strings, found {show(k)}")
        if k in flat and flat[k] != nested[k]:
            raise ConfigError(join(path, k), "given both flat and under `args:` with different "
                              f"values ({show(flat[k])} vs {show(nested[k])})")
    out["args"] = {**flat, **nested}
    return out


def _server_group(data: dict, path: str) -> dict:
    if isinstance(data.get("urls"), (list, tuple)):
        data["urls"] = [_url(u, f"{join(path, 'urls')}[{i}]")
                        for i, u in enumerate(data["urls"])]
    if isinstance(data.get("kv_events"), (list, tuple)):
        evs = []
        for i, ev in enumerate(data["kv_events"]):
            if isinstance(ev, Mapping) and "server" in ev:
                ev = {**ev, "server": _url(
                    ev["server"], f"{join(path, 'kv_events')}[{i}].server")}
            evs.append(ev)
        data["kv_events"] = evs
    return data


def _url(u: Any, path: str) -> Any:
    """A listed server url in its one spelling (coordinator/registry.py `canonical_url`)."""
    if not isinstance(u, str):
        return u  # the type check reports it
    try:
        return canonical_url(u, origin=True)
    except ValueError as e:
        raise ConfigError(path, str(e)) from None
