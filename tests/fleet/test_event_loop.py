"""`fleet.event_loop`: every fleet process runs the configured loop and serves on it.

asyncio is the default (a saturated uvloop process leaves some connections unserved for over a
second: bench/results/history/fleet.md, 'fleet event loop'); uvloop stays selectable. The loop a process really
runs is read from its own startup log line, which names the running loop's module.
"""
from __future__ import annotations

import re

import pytest

from .conftest import free_port, free_port_pair, group, http, wait_for

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}


@pytest.mark.parametrize("event_loop,num_workers", [(None, 1), ("uvloop", 1), ("uvloop", 2),
                                                    ("asyncio", 2)])
def test_fleet_processes_run_the_configured_loop(cluster, event_loop, num_workers):
    _, gen = cluster.worker("generation")
    port = free_port_pair() if num_workers > 1 else free_port()
    doc = {"port": port, "num_workers": num_workers, "generation_servers": group([gen])}
    if event_loop:
        doc["fleet"] = {"event_loop": event_loop}
    fleet = cluster.fleet(cluster.config(**doc))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http("GET", url + "/health")[0] == 200, 60, "fleet", fleet)
    status, _, body = http("POST", url + "/v1/completions", BODY)
    assert status == 200, body
    want = event_loop or "asyncio"

    def loops():
        return re.findall(r"fleet process \d+ listening on \S+ \(event loop (\w+)\)", fleet.log())
    wait_for(lambda: len(loops()) == num_workers, 30, "every fleet process's listening line", fleet)
    assert loops() == [want] * num_workers, fleet.tail()


def test_unknown_event_loop_is_a_config_error(cluster):
    import subprocess

    from .conftest import PY, clean_env
    cfg = cluster.config(port=free_port(), fleet={"event_loop": "trio"})
    r = subprocess.run([PY, "-m", "splitserve_cli", "serve", "-c", str(cfg)], capture_output=True,
                       text=True, timeout=60, env=clean_env())
    assert r.returncode == 2, r.stderr[-2000:]
    assert "fleet.event_loop" in r.stderr and "trio" in r.stderr and "Traceback" not in r.stderr
