"""Creating a transfer agent by kind: the one place that imports every implementation.

Kept apart from `transfer/agent.py` (the interface) because the implementations import the
interface: a factory there made `agent` and `nixl_agent`/`tcp_agent`/`shm_agent` import each other.
"""
from __future__ import annotations

import logging

from .agent import TransferAgent, unique_agent_name
from .errors import AgentUnavailable

log = logging.getLogger("splitserve.transfer.agent")

AGENT_KINDS = ("auto", "nixl", "shm", "tcp")


def make_agent(kind: str = "auto", name: str | None = None, *, host: str = "127.0.0.1",
               advertise_host: str | None = None, port: int = 0, **options) -> TransferAgent:
    """Create a transfer agent of `kind` and log the choice.

    `auto` prefers NIXL (UCX backend) and falls back to the TCP agent — which works between any two
    hosts and for any memory — logging why. An explicit kind that cannot be created raises
    `AgentUnavailable` (an operator who asked for NIXL must not silently get something slower).
    `options` go to the implementation (e.g. `progress_thread`, `telemetry` for NIXL).
    """
    if kind not in AGENT_KINDS:
        raise ValueError(f"transfer agent kind must be one of {AGENT_KINDS}; found {kind!r}")
    name = name or unique_agent_name()
    requested, fallback = kind, None
    if kind in ("auto", "nixl"):
        try:
            from .nixl_agent import NixlAgent

            agent = NixlAgent(name, host=host, **{k: v for k, v in options.items()
                                                  if k in NixlAgent.OPTIONS and k != "host"})
            agent.selection = {"requested": requested, "fallback": None}
            log.info("transfer agent: nixl (UCX) name=%s requested=%s", name, kind)
            return agent
        except AgentUnavailable as e:
            if kind == "nixl":
                raise
            fallback = f"nixl unavailable: {e}"
            log.warning("transfer agent: nixl unavailable (%s); falling back to tcp", e)
            kind = "tcp"
    if kind == "shm":
        from .shm_agent import ShmAgent

        agent = ShmAgent(name, host=host, advertise_host=advertise_host, port=port)
    else:
        from .tcp_agent import TcpAgent

        agent = TcpAgent(name, host=host, advertise_host=advertise_host, port=port)
    agent.selection = {"requested": requested, "fallback": fallback}
    log.info("transfer agent: %s name=%s endpoint=%s", agent.kind, name,
             getattr(agent, "endpoint", None))
    return agent
