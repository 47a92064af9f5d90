"""CPU affinity of the launcher's processes (`fleet.cpu_affinity`), as nginx's `worker_cpu_affinity`.

- `none` (default): the kernel places every process anywhere.
- `auto`: each process is pinned to one CPU of the launcher's own affinity mask (so a cgroup
  cpuset, a Kubernetes CPU-manager allocation or a `taskset` around `splitserve serve` bounds it):
  the coordinator started here to the first, fleet process i to the next ones, in turn.
- a CPU list such as `0-7,12`: the same over those CPUs, each of which must be in the mask.

Why pin: a process the kernel moves between cores, or places beside other busy tenants, pays for
it in CPU per request. On the 16-core bench host one pinned fleet process ran at a steady 82-84
µs per request against 95-126 unpinned; eight pinned ones, with wrk and the mock backends held to
the other six cores, cost more (125-141 against 111-121) (bench/RESULTS.md, "Scaling · 16 cores",
the pinning table). So it is a deployment choice, for nodes whose CPUs are the fleet's own; with
fewer CPUs than processes they share CPUs in turn, which is worse than leaving the kernel free.
The launcher refuses a list naming CPUs it may not use.
"""
from __future__ import annotations

import logging
import os

from coordinator.config_schema import cpu_list

log = logging.getLogger("splitserve.fleet.affinity")


class AffinityError(ValueError):
    """`fleet.cpu_affinity` names CPUs this process may not run on."""


def cpus_for(setting: str, allowed: set[int] | None = None) -> list[int] | None:
    """The CPUs to pin to in turn for `setting` (None = do not pin), checked against `allowed`
    (default: this process's affinity mask)."""
    if setting == "none":
        return None
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    if setting == "auto":
        return sorted(allowed)
    cpus = cpu_list(setting)
    missing = [c for c in cpus if c not in allowed]
    if missing:
        raise AffinityError(f"fleet.cpu_affinity {setting!r}: CPU(s) {missing} are not in this "
                            f"process's affinity mask {sorted(allowed)}")
    return cpus


def plan(cpus: list[int] | None, workers: int, with_coordinator: bool) -> tuple[int | None, list[int | None]]:
    """(coordinator's CPU, each fleet process's CPU): the coordinator first, then the fleet in turn."""
    if not cpus:
        return None, [None] * workers
    off = 1 if with_coordinator else 0
    return (cpus[0] if with_coordinator else None), [cpus[(i + off) % len(cpus)] for i in range(workers)]


def pin(pid: int, cpu: int | None) -> None:
    """Pin `pid` (0: this process) to `cpu`; a CPU gone since start-up leaves it unpinned."""
    if cpu is None:
        return
    try:
        os.sched_setaffinity(pid, {cpu})
    except OSError as e:     # offline since the launcher read its mask, or the process has exited
        log.warning("could not pin pid %d to CPU %d (%s): it runs unpinned", pid, cpu, e)
