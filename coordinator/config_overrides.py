"""Environment and CLI overrides of a loaded cluster config (file < env < CLI).

Every scalar key (and list of strings) of the schema (coordinator/config_schema.py), at any depth
of nested mappings, can be set as `SPLITSERVE_<KEY_PATH>` or a CLI flag; `apply_overrides` never
mutates: it re-validates the source document with the overrides applied, and an error names the
env var or flag that set the bad value.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import msgspec.inspect as mi

from coordinator.config_base import (ENV_PREFIX, ConfigError, FieldSpec, field_specs, join,
                                     non_null, show, struct_of, thaw, unwrap)
from coordinator.config_schema import ClusterConfig

# CLI flag names that differ from the config key they set.
_ALIASES = {
    "host": "hostname",
    "coordinator_url": "disagg_coordinator_url",
}
_ENV_ALIASES = {f"{ENV_PREFIX}COORDINATOR_URL": "disagg_coordinator_url"}
# Variables read by a process directly, neither a config key nor a command's flag (the flags read
# SPLITSERVE_<FLAG>: splitserve_cli.py `flag_env_names`). `check-config` reports any other
# SPLITSERVE_* name as unknown; tests/coordinator/test_check_config.py keeps this list complete.
PROCESS_ENV = (
    f"{ENV_PREFIX}INTERNAL_REQUEST_AUTH_KEY",    # coordinator/config.py: the HMAC key, a secret
    f"{ENV_PREFIX}CPU_THREADS",                  # worker: torch threads on the CPU
    f"{ENV_PREFIX}CUDA_GRAPHS",                  # worker: CUDA graph capture on/off
    f"{ENV_PREFIX}TRITON_INTERPRET",             # worker: Triton kernels in the interpreter
    f"{ENV_PREFIX}RANK_TIMEOUT_S",               # worker: tensor-parallel rank start-up bound
    f"{ENV_PREFIX}RANK_CALLABLE_PACKAGES",       # worker: what a rank may import by name
)
_SCALARS = (mi.IntType, mi.FloatType, mi.StrType, mi.BoolType, mi.LiteralType)


def env_var_name(path: str) -> str:
    """`coordinator.port` → `SPLITSERVE_COORDINATOR__PORT` (nesting uses a double underscore)."""
    return ENV_PREFIX + path.upper().replace(".", "__")


def override_env_names() -> dict[str, str]:
    """Every `SPLITSERVE_*` override name → the key path it sets (aliases included)."""
    out = {env_var_name(p): p for p in _scalar_paths(ClusterConfig)}
    out.update(_ENV_ALIASES)
    return out


def _scalar_paths(cls: type, prefix: str = "") -> dict[str, FieldSpec]:
    """Every overridable key path → its field: scalars and lists of strings, at any depth of
    nested mappings (not inside lists)."""
    out: dict[str, FieldSpec] = {}
    for f in field_specs(cls):
        path = join(prefix, f.name)
        sub = struct_of(f.type)
        inner = non_null(f.type)
        if sub is not None:
            out.update(_scalar_paths(sub, path))
        elif isinstance(inner, _SCALARS):
            out[path] = f
        elif isinstance(inner, mi.VarTupleType) and isinstance(unwrap(inner.item_type), mi.StrType):
            out[path] = f
    return out


def _parse_text(f: FieldSpec, text: str, where: str) -> Any:
    """Turn an env/CLI string into the Python value the schema expects (then validated)."""
    t = unwrap(f.type)
    if isinstance(t, mi.UnionType):
        if text.strip().lower() in ("", "null", "none"):
            return None
        t = non_null(t)
    if isinstance(t, mi.BoolType):
        v = text.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ConfigError(where, f"expected a boolean (true/false/1/0), found {show(text, f.secret)}")
    if isinstance(t, mi.IntType):
        if f.parse == "bytes":
            return text.strip()
        try:
            return int(text.strip())
        except ValueError:
            raise ConfigError(where, f"expected int, found {show(text, f.secret)}") from None
    if isinstance(t, mi.FloatType):
        try:
            return float(text.strip())
        except ValueError:
            raise ConfigError(where, f"expected number, found {show(text, f.secret)}") from None
    if isinstance(t, mi.VarTupleType):
        return [x.strip() for x in text.split(",") if x.strip()]
    return text


def _set_path(doc: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    cur = doc
    for p in parts[:-1]:
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
    from coordinator.config import load_config   # it imports this module for its public names

    env = os.environ if env is None else env
    paths = _scalar_paths(ClusterConfig)
    doc = thaw(cfg.source)
    env_map = override_env_names()
    applied: dict[str, tuple[str, Any]] = {}
    for name in sorted(env_map):
        if name not in env:
            continue
        path = env_map[name]
        value = _parse_text(paths[path], env[name], name)
        if path in applied and applied[path][1] != value:
            raise ConfigError(name, f"conflicts with {applied[path][0]} for {path}")
        applied[path] = (name, value)
    cli: dict[str, tuple[str, Any]] = {}
    for key, value in values.items():
        if value is None:
            continue
        flag = f"--{key.replace('_', '-')}"
        path = _ALIASES.get(key, key.replace("__", "."))
        if path not in paths:
            raise ConfigError(flag, "unknown override; expected one of: "
                              + ", ".join(sorted(set(paths) | set(_ALIASES))))
        if isinstance(value, str):
            value = _parse_text(paths[path], value, flag)
        elif isinstance(value, list):
            value = list(value)
        if path in cli and cli[path][1] != value:
            raise ConfigError(flag, f"conflicts with {cli[path][0]}")
        cli[path] = (flag, value)
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
