"""`splitserve check-config FILE`: validate a cluster config, and the environment that would
override it, without starting anything.

Prints the normalised config (every default filled in, URLs normalised, top-level engine keys
inherited into both server sections, `SPLITSERVE_*` overrides applied, secrets replaced by
"<redacted>") as JSON on stdout and exits 0. Otherwise it reports every problem it finds in one
run, each with its full key path (or variable name), what was expected and what was found, and
exits 1:
- the file's errors: after each one the offending key is set aside and the rest validated again,
  so independent mistakes are all reported (a mistake that hides others, such as a YAML syntax
  error, stops there);
- each `SPLITSERVE_*` override validated as `serve` would apply it (`SPLITSERVE_NUM_WORKERS=abc`);
- and, as a warning (exit status unchanged: an environment may carry other tools' variables),
  each `SPLITSERVE_*` variable that nothing reads (no config key, no flag of a `splitserve`
  command, not the `api_keys_env` variable), with the closest known name.
Secrets come from the environment exactly as at start-up, so a config naming an unset
`api_keys_env` fails here as it would there.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from typing import Any, Mapping

from coordinator.config import ClusterConfig, ConfigError, apply_overrides, load_config
from coordinator.config_base import ENV_PREFIX
from coordinator.config_overrides import PROCESS_ENV, override_env_names

# The `splitserve` entry point hands this module the env names its commands' flags read
# (splitserve_cli.py `flag_env_names`): SPLITSERVE_<FLAG>.
NEEDS_FLAG_ENV = True
MAX_ERRORS = 50
_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="cluster config (YAML or JSON), e.g. an upstream "
                   "trtllm-serve disaggregated config")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing on success (exit status only)")
    p.add_argument("--no-env", action="store_true",
                   help="validate the file alone: ignore SPLITSERVE_* overrides (secrets are still read)")


def _set_aside(doc: Any, path: str) -> bool:
    """Remove the key or list item at `path` (`a.b[2].c`) from `doc`; False when it is not there."""
    parts = [int(i) if i else k for k, i in _PART.findall(path)]
    if not parts:
        return False
    cur = doc
    for p in parts[:-1]:
        try:
            cur = cur[p]
        except (KeyError, IndexError, TypeError):
            return False
    last = parts[-1]
    if isinstance(cur, dict) and last in cur:
        del cur[last]
        return True
    if isinstance(cur, list) and isinstance(last, int) and last < len(cur):
        del cur[last]
        return True
    return False


def file_errors(src: Any, env: Mapping[str, str]) -> tuple[ClusterConfig | None, list[ConfigError]]:
    """(the config once every reported key is set aside, or None; the file's errors in order)."""
    from coordinator.config import read_document
    try:
        doc = read_document(src)
    except ConfigError as e:
        return None, [e]
    errors: list[ConfigError] = []
    while len(errors) < MAX_ERRORS:
        try:
            return load_config(doc, env=env), errors
        except ConfigError as e:
            if errors and (e.path, e.message) == (errors[-1].path, errors[-1].message):
                return None, errors
            errors.append(e)
            if not _set_aside(doc, e.path):
                return None, errors
    return None, errors


def env_errors(cfg: ClusterConfig, env: Mapping[str, str]) -> list[ConfigError]:
    """Every `SPLITSERVE_*` override that `serve` would reject."""
    overrides = override_env_names()
    mine = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    errors = []
    for name in sorted(n for n in mine if n in overrides):
        try:
            apply_overrides(cfg, env={name: mine[name]})
        except ConfigError as e:
            errors.append(e if e.path == name else ConfigError(name, f"{e.path}: {e.message}"))
    if not errors:
        try:   # together: conflicting aliases
            cfg = apply_overrides(cfg, env={n: v for n, v in mine.items() if n in overrides})
        except ConfigError as e:
            errors.append(e)
    return errors


def unknown_env(cfg: ClusterConfig, env: Mapping[str, str], flag_env: set[str]) -> list[ConfigError]:
    """Every `SPLITSERVE_*` name that nothing reads, with the closest known one."""
    errors = []
    mine = {k for k in env if k.startswith(ENV_PREFIX)}
    known = set(override_env_names()) | set(flag_env) | set(PROCESS_ENV)
    if cfg.api_keys_env:
        known.add(cfg.api_keys_env)
    for name in sorted(mine - known):
        # compared without the common prefix, which would make every name look alike
        n = len(ENV_PREFIX)
        hint = difflib.get_close_matches(name[n:], sorted(k[n:] for k in known), n=1)
        errors.append(ConfigError(name, "unknown variable: no config key or flag reads it"
                                  + (f" (did you mean {ENV_PREFIX}{hint[0]}?)" if hint else "")))
    return errors


def run(args: argparse.Namespace) -> int:
    env = os.environ
    cfg, errors = file_errors(args.file, env)
    if not args.no_env:
        base = cfg if cfg is not None else load_config({}, env={})
        env_errs = env_errors(base, env)
        errors += env_errs
        if cfg is not None and not env_errs:
            cfg = apply_overrides(cfg, env=env)
        for w in unknown_env(cfg or base, env, set(getattr(args, "flag_env_names", ()) or ())):
            print(f"{args.file}: warning: {w}", file=sys.stderr)
    if errors:
        n = len(errors)
        print(f"{args.file}: invalid config ({n} error{'s' if n > 1 else ''}):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        json.dump(cfg.to_public_dict(), sys.stdout, indent=2, sort_keys=True, default=str)
        sys.stdout.write("\n")
    print(f"{args.file}: OK", file=sys.stderr)
    return 0
