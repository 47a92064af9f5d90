"""The `splitserve` command: one entry point, one subcommand per process kind.

Subcommands are imported lazily so `splitserve coordinator --help` does not import torch.
Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

# name -> (module, one-line help). A subcommand is listed only once its module exists.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("fleet.cli", "run the OpenAI front door (fleet), with its coordinator when local"),
    "coordinator": ("coordinator.cli", "run the coordinator: registry, health, KV index, leases"),
    "worker": ("worker.cli", "run a reference inference worker (torch model or sim engine)"),
    "local": ("fleet.local", "start a complete local cluster (coordinator, fleet, ctx + gen workers)"),
    "status": ("fleet.status", "one-screen summary of a running cluster (servers per role, health, load, "
               "KV, predicted/actual cached tokens, feeds, coordinator replicas); --json, --watch"),
    "check-config": ("coordinator.check_config", "validate a cluster config file and the environment's "
                     "SPLITSERVE_* overrides, print it normalised, secrets redacted (exit 0 valid, "
                     "1 invalid: every error listed)"),
}


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (mod, help_) in SUBCOMMANDS.items():
        if importlib.util.find_spec(mod.rsplit(".", 1)[0]) is None:
            continue
        try:
            if importlib.util.find_spec(mod) is None:
                continue
        except ModuleNotFoundError:
            continue
        out[name] = (mod, help_)
    return out


def version_line() -> str:
    from protocol.version import VERSION
    return f"splitserve {VERSION}"


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    avail = _available()
    for name, (mod, help_) in avail.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=mod)
    return parser, avail


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, avail = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    name = argv[0]
    if name not in avail:
        parser.error(f"unknown command {name!r}; expected one of: {', '.join(avail) or '(none installed)'}")
    mod = importlib.import_module(avail[name][0])
    # every flag's default in its help: what runs when it is not given
    sp = argparse.ArgumentParser(prog=f"splitserve {name}", description=avail[name][1],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("--version", action="version", version=version_line())
    mod.add_arguments(sp)
    args = sp.parse_args(argv[1:])
    if getattr(mod, "NEEDS_FLAG_ENV", False):
        args.flag_env_names = flag_env_names(avail)
    return int(mod.run(args) or 0)


def flag_env_names(avail: dict[str, tuple[str, str]] | None = None) -> set[str]:
    """SPLITSERVE_<FLAG> for every flag of every command: each one reads its variable (the
    `check-config` check for variables that nothing reads)."""
    out = set()
    for mod_name, _help in (avail or _available()).values():
        p = argparse.ArgumentParser()
        importlib.import_module(mod_name).add_arguments(p)
        out.update("SPLITSERVE_" + a.dest.upper() for a in p._actions if a.dest not in ("help", "version"))
    return out


def entry() -> None:
    """The program (console script and `python -m splitserve_cli`): `main`, then exit.

    Once the subcommand returned, its shutdown is done and its event loop closed (which restored
    the default signal handlers); a supervisor's repeated SIGTERM/SIGINT must not turn that exit
    into death by signal while the interpreter tears down its threads."""
    code = main()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
