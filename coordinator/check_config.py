"""`splitserve check-config FILE`: validate a cluster config without starting anything.

Prints the normalised config (every default filled in, URLs normalised, top-level engine keys
inherited into both server sections, secrets replaced by "<redacted>") as JSON on stdout and exits
0; on an invalid file prints the error (full key path, what was expected, what was found) on
stderr and exits 1. Secrets come from the environment exactly as at start-up, so a config naming
an unset `api_keys_env` fails here as it would there.
"""
from __future__ import annotations

import argparse
import json
import sys

from coordinator.config import ConfigError, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="cluster config (YAML or JSON), e.g. an upstream "
                   "trtllm-serve disaggregated config")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing on success (exit status only)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        print(f"{args.file}: invalid config: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        json.dump(cfg.to_public_dict(), sys.stdout, indent=2, sort_keys=True, default=str)
        sys.stdout.write("\n")
    print(f"{args.file}: OK", file=sys.stderr)
    return 0
