"""`splitserve coordinator -c cluster.yaml [--host H] [--port P] [--uds PATH] [--log-level L]`.

Every flag also reads `SPLITSERVE_<FLAG>` (`SPLITSERVE_CONFIG`, `SPLITSERVE_HOST`, `SPLITSERVE_PORT`,
`SPLITSERVE_UDS`, `SPLITSERVE_NO_UDS`, `SPLITSERVE_HTTP`, `SPLITSERVE_LOG_LEVEL`); config keys can be overridden with their own env names
(`SPLITSERVE_COORDINATOR__HEALTH_CHECK_INTERVAL_S`, ...). Precedence: file < env < flags.

Once both listeners are up and the first health round is done, one line goes to stdout:
`splitserve coordinator listening on <tcp url>[ and <unix url>]`. SIGTERM / SIGINT stop it
gracefully: listeners close, in-flight calls finish (bounded), subscriptions and probes stop.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys

ENV = "SPLITSERVE_"
# Exit status when a listener's address is taken: restarting cannot help (fleet/launcher.py stops).
EXIT_ADDRESS_IN_USE = 4


def _env(name: str, default=None):
    return os.environ.get(ENV + name, default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", default=_env("CONFIG"),
                   help="cluster YAML (env SPLITSERVE_CONFIG); without it, defaults and env only")
    p.add_argument("--host", default=_env("HOST"),
                   help="TCP bind address (default: coordinator.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=_env("PORT"),
                   help="TCP port; 0 picks a free one (default: coordinator.port, else port - 1)")
    p.add_argument("--uds", default=_env("UDS"),
                   help="also listen on this Unix socket (default: coordinator.uds_path, or "
                        "<tmpdir>/splitserve-coordinator-<port>.sock when coordinator.uds is true)")
    p.add_argument("--no-uds", action="store_true", default=_env("NO_UDS", "") in ("1", "true"),
                   help="serve on TCP only")
    p.add_argument("--http", default=_env("HTTP", "fast"), choices=["fast", "aiohttp"],
                   help="HTTP server: fast (the API's own HTTP/1.1 protocol on httptools, default) "
                        "or aiohttp (its low-level server; same API)")
    p.add_argument("--cluster-id", default=_env("CLUSTER_ID"),
                   help="the cluster's id, reported by /cluster_info and /version so fleet processes can "
                        "tell their coordinator from another cluster's (default: a random one; the "
                        "launcher of `splitserve serve` mints one per cluster)")
    p.add_argument("--log-level", default=_env("LOG_LEVEL"),
                   choices=["debug", "info", "warning", "error"],
                   help="log level (default: the config's log_level, info)")


def _configure(args):
    from coordinator.config import ConfigError, apply_overrides, load_config

    try:
        cfg = load_config(args.config)
        cfg = apply_overrides(cfg, coordinator__host=args.host, log_level=args.log_level)
    except ConfigError as exc:
        raise SystemExit(f"splitserve coordinator: invalid configuration: {exc}") from None
    port = int(args.port) if args.port is not None else cfg.coordinator_port
    if port < 0 or port > 65535:
        raise SystemExit(f"splitserve coordinator: --port must be 0..65535, got {port}")
    if args.no_uds:
        uds = None
    elif args.uds:
        uds = args.uds
    elif cfg.coordinator.uds_path and cfg.coordinator.uds:
        uds = cfg.coordinator.uds_path
    elif cfg.coordinator.uds and port:
        import tempfile
        uds = os.path.join(tempfile.gettempdir(), f"splitserve-coordinator-{port}.sock")
    else:
        uds = None
    if args.http not in ("fast", "aiohttp"):
        raise SystemExit(f"splitserve coordinator: --http must be fast or aiohttp, got {args.http!r}")
    return cfg, cfg.coordinator.host, port, uds


async def _serve(cfg, host: str, port: int, uds: str | None, http: str = "fast",
                 cluster_id: str | None = None) -> int:
    from coordinator.gc_tuning import settle_heap
    from coordinator.listeners import CoordinatorServer
    from coordinator.service import Coordinator

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    coord = Coordinator(cfg, cluster_id=cluster_id)
    server = CoordinatorServer(coord, host=host, port=port, uds_path=uds, http=http)
    try:
        urls = await server.start()
    except OSError as exc:
        await coord.stop()
        if exc.errno == errno.EADDRINUSE:
            print(f"splitserve coordinator: {exc.strerror}: another process (another splitserve "
                  f"cluster?) listens there; stop it or pick another coordinator port or socket "
                  f"(coordinator.port, coordinator.uds_path, or the cluster's port)",
                  file=sys.stderr, flush=True)
            return EXIT_ADDRESS_IN_USE
        print(f"splitserve coordinator: {exc}", file=sys.stderr, flush=True)
        return 2
    settle_heap()   # coordinator/gc_tuning.py: the collector's pauses were a select's p99 stall
    print("splitserve coordinator listening on " + " and ".join(urls), flush=True)
    logging.getLogger("splitserve.coordinator").info(
        "ready=%s (%s)", coord.is_ready(), coord.not_ready_reason() or "all minimums met")
    try:
        await stop.wait()
    finally:
        logging.getLogger("splitserve.coordinator").info("shutting down")
        await server.stop()
    return 0


def run(args) -> int:
    cfg, host, port, uds = _configure(args)
    from protocol import logs
    logs.setup(cfg.log_level, cfg.log_format)
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; plain asyncio still works without it
        return asyncio.run(_serve(cfg, host, port, uds, args.http, args.cluster_id))
    return uvloop.run(_serve(cfg, host, port, uds, args.http, args.cluster_id))
