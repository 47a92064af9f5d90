"""`fleet.cpu_affinity`: the launcher pins its coordinator and fleet processes one CPU each (nginx's
`worker_cpu_affinity`), a restarted process lands on its CPU again, and a CPU the launcher may not
use is a configuration error. The CPUs are read from the kernel (`sched_getaffinity` of each real
process), and every pinned fleet still serves."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from splitserve_testing.proctable import group_members, splitserve_role

from .conftest import PY, clean_env, free_port, free_port_pair, group, http, wait_for

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
MASK = sorted(os.sched_getaffinity(0))


def _roles(leader: int) -> dict[str, int]:
    """{"coordinator" | "fleet-<i>": pid} of the launcher's children (by their command lines)."""
    roles = {pid: splitserve_role(pid) for pid, _ in group_members(leader)}
    return {r: pid for pid, r in roles.items() if r == "coordinator" or (r or "").startswith("fleet-")}


def _serve(cluster, num_workers: int, affinity: str | None):
    _, gen = cluster.worker("generation")
    port = free_port_pair() if num_workers > 1 else free_port()
    doc = {"port": port, "num_workers": num_workers, "generation_servers": group([gen])}
    if affinity is not None:
        doc["fleet"] = {"cpu_affinity": affinity}
    fleet = cluster.fleet(cluster.config(**doc))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http("GET", url + "/health")[0] == 200, 60, "fleet", fleet)
    return fleet, url


def test_auto_pins_the_coordinator_first_then_each_fleet_process_in_turn(cluster):
    fleet, url = _serve(cluster, 3, "auto")
    want = {"coordinator": MASK[0], **{f"fleet-{i}": MASK[(i + 1) % len(MASK)] for i in range(3)}}
    wait_for(lambda: set(_roles(fleet.pid)) == set(want), 30, "the coordinator and 3 fleet processes", fleet)
    roles = _roles(fleet.pid)
    assert {r: sorted(os.sched_getaffinity(p)) for r, p in roles.items()} == \
        {r: [c] for r, c in want.items()}, fleet.tail()
    for _ in range(6):   # the pinned fleet serves
        status, _, body = http("POST", url + "/v1/completions", BODY)
        assert status == 200, body

    # a fleet process that dies is restarted on the same CPU
    os.kill(roles["fleet-1"], signal.SIGKILL)
    wait_for(lambda: _roles(fleet.pid).get("fleet-1") not in (None, roles["fleet-1"]), 30,
             "fleet-1 restarted", fleet)
    assert os.sched_getaffinity(_roles(fleet.pid)["fleet-1"]) == {want["fleet-1"]}


def test_a_cpu_list_pins_one_process_and_none_leaves_the_mask(cluster):
    fleet, url = _serve(cluster, 1, str(MASK[-1]))
    assert os.sched_getaffinity(fleet.pid) == {MASK[-1]}
    assert http("POST", url + "/v1/completions", BODY)[0] == 200
    fleet.stop()

    fleet, _ = _serve(cluster, 2, None)
    wait_for(lambda: len(_roles(fleet.pid)) == 3, 30, "the coordinator and 2 fleet processes", fleet)
    assert all(sorted(os.sched_getaffinity(p)) == MASK for p in _roles(fleet.pid).values())


@pytest.mark.parametrize("value,expect", [("4095", "not in this process's affinity mask"),
                                          ("3-1", "ends after it starts"),
                                          ("all", "expected none, auto or a CPU list")])
def test_an_unusable_cpu_list_is_a_config_error(cluster, value, expect):
    cfg = cluster.config(port=free_port(), fleet={"cpu_affinity": value})
    r = subprocess.run([PY, "-m", "splitserve_cli", "serve", "-c", str(cfg)], capture_output=True,
                       text=True, timeout=60, env=clean_env())
    assert r.returncode == 2, r.stderr[-2000:]
    assert "fleet.cpu_affinity" in r.stderr and expect in r.stderr and "Traceback" not in r.stderr
