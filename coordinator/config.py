"""The cluster configuration: one YAML file, strictly validated (`load_config`), and the names every
package imports from here.

Loading: the document (a file, YAML text or a mapping) gets its secrets from the environment, the
upstream forms are normalised (coordinator/config_upstream.py), msgspec converts it into the schema
(coordinator/config_schema.py: types, bounds and unknown keys), then each section's `_check` runs.
A msgspec error is restated as a `ConfigError` in the schema's own words: the key path, what was
expected (from the schema) and what was found (the value in the document), never a secret.
Overrides from the environment and CLI flags: coordinator/config_overrides.py; the documentation
table: coordinator/config_doc.py.
"""
from __future__ import annotations

import copy
import difflib
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import msgspec
import msgspec.inspect as mi
import yaml

from coordinator.config_base import (ENV_PREFIX, ROUTER_TYPES, ConfigError, Section, field_specs,
                                     freeze, non_null, show, struct_of, thaw, type_name)
from coordinator.config_schema import (
    ClusterConfig, ConditionalDisaggConfig, CoordinatorConfig, DisaggClusterConfig,
    EventIngestConfig, FleetConfig, KvCacheConfig, KvEventSource, LeaseConfig, MinimalInstances,
    OtlpConfig, RouterConfig, RoutingConfig, ServerGroupConfig)
from coordinator.config_upstream import GROUPS, allowed_keys, inherit, prepare, unknown_key
from coordinator.upstream_args import UPSTREAM_ENGINE_ARGS

__all__ = [
    "ConfigError", "ClusterConfig", "ServerGroupConfig", "RouterConfig", "KvCacheConfig",
    "KvEventSource", "RoutingConfig", "LeaseConfig", "CoordinatorConfig", "EventIngestConfig",
    "FleetConfig", "ConditionalDisaggConfig", "OtlpConfig", "DisaggClusterConfig",
    "MinimalInstances", "ROUTER_TYPES", "UPSTREAM_ENGINE_ARGS", "ENV_PREFIX", "load_config",
    "read_document", "apply_overrides", "env_var_name",
]


# ----------------------------------------------------------------------------- reading

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
                          f"{show(doc)}")
    return doc


def read_document(src: Any) -> dict:
    """The config document of `src` (a path, YAML text or a mapping), parsed but not validated:
    a copy the caller may change (`splitserve check-config` sets bad keys aside in it)."""
    return _read_source(src)


def _read_source(src: Any) -> dict:
    if isinstance(src, Mapping):
        return copy.deepcopy(thaw(src))
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
        raise ConfigError("", f"expected a path, a mapping or YAML text, found {show(src)}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("", f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
    return _parse_document(text, str(path), f"{path}: ")


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


# ----------------------------------------------------------------------------- conversion

# msgspec's errors end in " - at `$.a.b[0]`" (the key path); the text before it says which rule
# failed. They are restated from the schema and the document, so the wording is ours.
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_UNKNOWN = re.compile(r"^Object contains unknown field `(.+)`$")
_MISSING = re.compile(r"^Object missing required field `(.+)`$")
_BOUND = re.compile(r"^Expected `[^`]+` (?:>=|>|<=|<) ")
_MISSING_VALUE = object()


def _locate(doc: Any, where: str) -> tuple[str, Any, Any, bool]:
    """For msgspec's path `where`: (our key path, the schema type there, the document's value
    there, whether a secret is on the way)."""
    t: Any = mi.type_info(ClusterConfig)
    value, path, secret = doc, "", False
    for key, index in _SEGMENT.findall(where):
        if key:
            cls = struct_of(t)
            spec = next((f for f in field_specs(cls) if f.name == key), None) if cls else None
            t = spec.type if spec is not None else mi.AnyType()
            secret = secret or bool(spec and spec.secret)
            value = value.get(key, _MISSING_VALUE) if isinstance(value, Mapping) else _MISSING_VALUE
            path = f"{path}.{key}" if path else key
        else:
            inner = non_null(t)
            t = inner.item_type if isinstance(inner, mi.VarTupleType) else mi.AnyType()
            i = int(index)
            value = value[i] if isinstance(value, list) and i < len(value) else _MISSING_VALUE
            path = f"{path}[{i}]"
    return path, t, value, secret


def _bound_message(t: Any, v: Any) -> str:
    n = non_null(t)
    for name, op, bad in (("ge", ">=", lambda b: v < b), ("gt", ">", lambda b: not v > b),
                          ("le", "<=", lambda b: v > b), ("lt", "<", lambda b: not v < b)):
        b = getattr(n, name, None)
        if b is not None and isinstance(v, (int, float)) and bad(b):
            return f"expected a value {op} {b:g}, found {v!r}"
    return f"expected {type_name(t)}, found {show(v)}"


def _restate(exc: msgspec.ValidationError, doc: dict) -> ConfigError:
    m = _AT.match(str(exc))
    what, where = m.group("what"), m.group("path") or ""
    path, t, value, secret = _locate(doc, where)
    u = _UNKNOWN.match(what)
    if u:
        cls = struct_of(t) or ClusterConfig
        return unknown_key(path, u.group(1), allowed_keys(cls))
    r = _MISSING.match(what)
    if r:
        cls = struct_of(t) or ClusterConfig
        spec = next(f for f in field_specs(cls) if f.name == r.group(1))
        return ConfigError(f"{path}.{spec.name}" if path else spec.name,
                           f"required key missing ({spec.doc})")
    if value is _MISSING_VALUE:   # not expected: keep msgspec's words rather than guess
        return ConfigError(path, what, kind="type")
    if _BOUND.match(what) and not secret:
        return ConfigError(path, _bound_message(t, value))
    if struct_of(t) is not None:
        return ConfigError(path, f"expected a mapping, found {show(value, secret)}")
    hint = ""
    lit = non_null(t)
    if isinstance(lit, mi.LiteralType) and isinstance(value, str) and not secret:
        close = difflib.get_close_matches(value, [str(v) for v in lit.values], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(path, f"expected {type_name(t)}, found {show(value, secret)}{hint}", kind="type")


def _check_all(obj: Section, path: str) -> None:
    """Each section's rules between fields, innermost first (a section's `_check` may rely on its
    subsections being valid)."""
    for f in field_specs(type(obj)):
        v = getattr(obj, f.name)
        sub = f"{path}.{f.name}" if path else f.name
        if isinstance(v, Section):
            _check_all(v, sub)
        elif isinstance(v, tuple):
            for i, x in enumerate(v):
                if isinstance(x, Section):
                    _check_all(x, f"{sub}[{i}]")
    check = getattr(obj, "_check", None)
    if check is not None:
        check(path)


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
            raise ConfigError("", f"keys must be strings, found {show(k)}")
    doc = _secrets_from_env(doc, os.environ if env is None else env)
    doc, inherited = inherit(doc)
    try:
        doc = prepare(ClusterConfig, doc, "")
        try:
            cfg = msgspec.convert(doc, ClusterConfig, strict=True)
        except msgspec.ValidationError as exc:
            raise _restate(exc, doc) from None
        _check_all(cfg, "")
    except ConfigError as e:
        # Report an inherited value where the operator wrote it: at the top level.
        for g in GROUPS:
            pre = f"{g}."
            if e.path.startswith(pre):
                first = re.split(r"[.\[]", e.path[len(pre):], maxsplit=1)[0]
                if first in inherited[g]:
                    raise ConfigError(e.path[len(pre):], e.message, kind=e.kind) from None
        raise
    msgspec.structs.force_setattr(cfg, "_source", freeze(source))
    return cfg


from coordinator.config_overrides import apply_overrides, env_var_name  # noqa: E402 - it loads through load_config
