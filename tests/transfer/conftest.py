"""Fixtures for the transfer tests.

Peer processes come from a forkserver that has already imported numpy, pyzmq, msgspec and the
transfer package (not NIXL: UCX must be initialised after the fork), so each of the many
short-lived peers starts in a fraction of a second instead of re-importing everything.
"""
from __future__ import annotations

import multiprocessing as mp

_CTX = None


def peer_context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["numpy", "zmq", "msgspec", "msgpack", "transfer.session",
                                     "transfer.tcp_agent", "transfer.shm_agent",
                                     "tests.transfer.geometry", "tests.transfer.session_peer",
                                     "tests.transfer.agent_peer"])
    return _CTX
