"""The process and port harness the tests (tests/) and the benchmarks (bench/) share.

- ``ports``: free loopback ports (one, n consecutive, a pair for an implicit coordinator).
- ``process``: ``Proc`` (a child in its own session, output in a log file, stopped with its
  process group), ``stop_all``, ``wait_for`` / ``wait_http`` (poll until ready, failing with the
  log of a child that died; ``served_by``: until that child, not another holder of the port, answers),
  ``serves``, ``clean_env``.
- ``proctable``: what /proc says about a process tree (children, listening sockets, CPU ticks).
- ``etcd``: a real etcd on loopback (``EtcdServer``, ``ETCD_MISSING``), imported by its users.

Imports nothing of ours (tests/test_layering.py), so any test or benchmark can use it.
"""
from splitserve_testing.ports import free_port, free_port_pair, free_ports
from splitserve_testing.process import (ROOT, Proc, clean_env, http_status, serves, stop_all, wait_for,
                                        wait_http)

__all__ = ["ROOT", "Proc", "clean_env", "free_port", "free_port_pair",
           "free_ports", "http_status", "serves", "stop_all", "wait_for", "wait_http"]
