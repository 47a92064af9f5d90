"""`splitserve status URL` (issue 39): a one-screen summary of a running cluster, as text, as
JSON, and redrawn with --watch. A real cluster on loopback: sim workers, a launcher with its
coordinator and two fleet processes."""
from __future__ import annotations

import json
import signal
import subprocess

import pytest

from .conftest import PY, clean_env, free_port_pair, group, http, wait_for


@pytest.fixture(scope="module")
def running(module_cluster):
    c = module_cluster
    (_, ctx), (_, gen) = c.workers(("context", {"name": "st-ctx"}), ("generation", {"name": "st-gen"}))
    port = free_port_pair()
    cfg = c.config("status.yaml", port=port, num_workers=2,
                   context_servers=group([ctx], "kv_cache_aware"), generation_servers=group([gen], "load_balancing"))
    f = c.fleet(cfg, name="st-fleet")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http("GET", url + "/health", timeout=2)[0] == 200, 90, "cluster", f)
    for _ in range(3):
        http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "one two three " * 20, "max_tokens": 2})
    return url, f"http://127.0.0.1:{port - 1}", ctx, gen


def _status(*args, timeout=60):
    return subprocess.run([PY, "-m", "splitserve_cli", "status", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env())


def test_text_summary_of_a_fleet(running):
    url, coord, ctx, gen = running
    r = _status(url)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert len(out.splitlines()) <= 40          # one screen
    assert "\nready\n" in out and "cluster " in out
    assert "CONTEXT  1/1 healthy (min 1), router kv_cache_aware" in out
    assert "GENERATION  1/1 healthy (min 1), router load_balancing" in out
    assert ctx in out and gen in out and "healthy" in out and "synced" in out
    # the launcher's fleet processes reach their coordinator over its Unix socket; so does status
    import tempfile
    sock = f"unix://{tempfile.gettempdir()}/splitserve-coordinator-{int(coord.rsplit(':', 1)[1])}.sock"
    assert f"coordinator {sock} reachable" in out
    assert f"coordinator replicas:\n  {sock}  serving, warm" in out, out


def test_json_summary_of_the_coordinator(running):
    url, coord, ctx, gen = running
    r = _status(coord, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ready"] is True and s["answered_by"] == "coordinator"
    (c,) = s["roles"]["context"]["servers"]
    assert c["url"] == ctx and c["healthy"] and c["feed"]["state"] == "synced"
    assert c["kv"]["index_blocks"] > 0 and c["kv"]["capacity_blocks"] > 0 and 0 < c["kv"]["usage"] <= 1
    assert s["roles"]["generation"]["router"] == "load_balancing"
    assert s["replicas"] and s["replicas"][0]["serving"] is True
    # the fleet's own summary is the same cluster
    assert json.loads(_status(url, "--json").stdout)["cluster_id"] == s["cluster_id"]


def test_watch_redraws_until_interrupted(running):
    url = running[0]
    p = subprocess.Popen([PY, "-m", "splitserve_cli", "status", url, "--watch", "0.3", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    lines = []
    try:
        while len(lines) < 2:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            if line.strip():
                lines.append(json.loads(line))
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(20)
    assert rc == 0 and all(s["ready"] for s in lines)


def test_unreachable_and_not_ready(cluster):
    r = _status("http://127.0.0.1:9")
    assert r.returncode == 2 and "cannot read the cluster" in r.stderr
    # a coordinator whose servers are all down answers, but is not ready
    port = free_port_pair()
    cfg = cluster.config("down.yaml", port=port, generation_servers=group(["127.0.0.1:9"]))
    p = cluster.coordinator(cfg, port - 1)
    coord = f"http://127.0.0.1:{port - 1}"
    wait_for(lambda: http("GET", coord + "/version", timeout=2)[0] == 200, 30, "coordinator", p)
    r = _status(coord)
    assert r.returncode == 1 and "NOT READY" in r.stdout and "GENERATION  0/1 healthy" in r.stdout
