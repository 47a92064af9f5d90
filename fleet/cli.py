"""`splitserve serve -c cluster.yaml`: the fleet, in whichever topology the config selects.

Precedence: config file < `SPLITSERVE_*` environment < flags. Every flag also reads
`SPLITSERVE_<FLAG_UPPER_SNAKE>` (e.g. `SPLITSERVE_NUM_WORKERS`, `SPLITSERVE_COORDINATOR_URL`,
`SPLITSERVE_CONFIG` for `-c`).

- `num_workers == 1`, no coordinator URL: one process, coordinator in-process.
- `num_workers == 1` with a coordinator URL: one process using the external coordinator.
- otherwise: the launcher (`fleet.launcher`) runs the coordinator (unless external) and N processes.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

def _env(name: str, default=None):
    return os.environ.get(f"SPLITSERVE_{name.upper()}", default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", default=_env("config"),
                   help="cluster YAML (trtllm-serve disaggregated keys accepted) [SPLITSERVE_CONFIG]")
    p.add_argument("--host", default=None, help="address to bind and advertise (config: hostname)")
    p.add_argument("--port", type=int, default=None, help="public port shared by all fleet processes")
    p.add_argument("--num-workers", type=int, default=None,
                   help="fleet processes on the port (SO_REUSEPORT); > 1 starts an implicit coordinator on port-1")
    p.add_argument("--coordinator-url", default=None,
                   help="external coordinator (http://h:p or unix:///path); none is started here")
    p.add_argument("--node-id", type=int, default=None,
                   help="snowflake node id 0..255 (default: leased from the coordinator)")
    p.add_argument("--schedule-style", choices=("context_first", "generation_first"), default=None)
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    p.add_argument("--keepalive-requests", type=int, default=None,
                   help="close a client connection after this many requests, so long-lived client pools "
                        "spread over the fleet processes (config: fleet.keepalive_requests)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds to let in-flight requests finish on shutdown (config: fleet.drain_timeout_s)")
    # Internal: set by the launcher for its fleet processes.
    p.add_argument("--child-index", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cluster-id", default=None, help=argparse.SUPPRESS)


def load(args) -> "object":
    from coordinator.config import apply_overrides, load_config
    cfg = load_config(args.config)
    host = args.host if args.host is not None else _env("host")
    return apply_overrides(cfg, host=host, port=args.port, num_workers=args.num_workers,
                           coordinator_url=args.coordinator_url, node_id=args.node_id,
                           schedule_style=args.schedule_style, log_level=args.log_level,
                           fleet__keepalive_requests=args.keepalive_requests,
                           fleet__drain_timeout_s=args.drain_timeout)


def _child_argv(args) -> list[str]:
    """The flags each fleet process gets again (the launcher adds --port, --coordinator-url, --child-index)."""
    out = []
    if args.config:
        out += ["-c", os.path.abspath(args.config)]
    for flag, v in (("--host", args.host), ("--node-id", args.node_id), ("--schedule-style", args.schedule_style),
                    ("--log-level", args.log_level), ("--keepalive-requests", args.keepalive_requests),
                    ("--drain-timeout", args.drain_timeout)):
        if v is not None:
            out += [flag, str(v)]
    return out


def setup_logging(level: str, fmt: str = "text") -> None:
    from protocol import logs
    logs.setup(level, fmt)


def run(args) -> int:
    from coordinator.config import ConfigError
    if not args.config:
        print("splitserve serve: a cluster config is required: -c cluster.yaml (or SPLITSERVE_CONFIG)",
              file=sys.stderr)
        return 2
    try:
        cfg = load(args)
    except ConfigError as e:
        print(f"splitserve serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    from .server import run_process
    run = loop_runner(cfg.fleet.event_loop)
    if args.child_index is not None:   # pinned, if at all, by the launcher
        return run(run_process(cfg, coordinator_url=cfg.disagg_coordinator_url,
                               process_index=args.child_index, reuse_port=True,
                               ready_fd=args.ready_fd, cluster_id=args.cluster_id))
    from . import affinity
    try:
        cpus = affinity.cpus_for(cfg.fleet.cpu_affinity)
    except affinity.AffinityError as e:
        print(f"splitserve serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    if cfg.num_workers == 1:
        if cpus:
            affinity.pin(0, cpus[0])
            logging.getLogger("splitserve.fleet").info("fleet.cpu_affinity %s: pinned to CPU %d",
                                                       cfg.fleet.cpu_affinity, cpus[0])
        try:
            return run(run_process(cfg, coordinator_url=cfg.disagg_coordinator_url))
        except ConnectionError as e:   # the in-process coordinator's etcd never answered
            print(f"splitserve serve: {e}", file=sys.stderr)
            return 1
    from .launcher import Launcher
    return Launcher(cfg, _child_argv(args), cpus=cpus).run()


def loop_runner(event_loop: str):
    """`asyncio.run` or `uvloop.run` for `fleet.event_loop`.

    asyncio is the default although uvloop is cheaper per request: a saturated uvloop process
    serves some of its connections more than a second late (p99 1.1-1.3 s and client timeouts
    with one process at 256 connections; asyncio: p99 44-162 ms, no errors), reproduced without
    aiohttp and without any TCP loss (bench/results/history/fleet.md, 'fleet event loop').
    """
    if event_loop == "uvloop":
        import uvloop
        return uvloop.run
    return asyncio.run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitserve serve")
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
