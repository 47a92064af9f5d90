"""What an operator reads (issue 39, item 7): `--version`, `--help` with defaults, one log format
with an optional JSON form and an access log, recoveries at INFO, deregistration logged. Real
processes on loopback."""
from __future__ import annotations

import json
import subprocess

from .conftest import PY, clean_env, free_port_pair, group, http, wait_for


def _cli(*args):
    return subprocess.run([PY, "-m", "splitserve_cli", *args], capture_output=True, text=True, timeout=60,
                          env=clean_env())


def test_version_and_help_with_defaults():
    from protocol.version import VERSION
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"splitserve {VERSION}"
    assert _cli("coordinator", "--version").stdout.strip() == f"splitserve {VERSION}"
    out = " ".join(_cli("local", "--help").stdout.split())
    assert "(default: 2)" in out and "(default: 8000)" in out
    assert "(default: kv_cache_aware)" in out


def test_json_log_access_log_and_deregistration(cluster):
    """A dynamic cluster (workers register) with `log_format: json` and `fleet.access_log`: every
    line of the fleet and its coordinator is one JSON object, each API request has an access
    line with its id, and a worker that stops is logged as deregistered, at INFO."""
    port = free_port_pair()
    cfg = cluster.config("json.yaml", port=port, num_workers=2, log_format="json",
                         fleet={"access_log": True},
                         disagg_cluster={"cluster_uri": f"http://127.0.0.1:{port - 1}"})
    f = cluster.fleet(cfg, name="json-fleet")
    url, coord = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port - 1}"
    wait_for(lambda: "processes ready" in f.log(), 90, "fleet", f)
    w, _ = cluster.worker("generation", name="reg-gen", extra=("--coordinator-url", coord, "--register-ttl", 5))
    cluster.worker("context", name="reg-ctx", extra=("--coordinator-url", coord, "--register-ttl", 5))
    wait_for(lambda: http("GET", url + "/health", headers={"Connection": "close"})[0] == 200, 30, "workers", f)
    st, h, _ = http("POST", url + "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                    {"X-Request-Id": "acc-1"})
    assert st == 200
    w.stop()
    wait_for(lambda: "deregistered" in f.log(), 20, "the deregistration logged", f)
    records = []
    for line in f.log().splitlines():
        if line.startswith(("splitserve: fleet of", "splitserve coordinator listening")):
            continue              # the launcher's and the coordinator's one announcement on stdout
        records.append(json.loads(line))     # every log line is one JSON object
    assert {"ts", "level", "pid", "logger", "msg"} <= set(records[0])
    access = [r for r in records if r["logger"] == "splitserve.fleet.access"]
    assert any(r["request_id"] == "acc-1" and r["status"] == 200 and r["path"] == "/v1/chat/completions"
               and r["duration_ms"] > 0 for r in access), access
    dereg = [r for r in records if "deregistered" in r["msg"]]
    assert dereg and all(r["level"] == "INFO" for r in dereg), dereg
    # the coordinator's lines too (it is the launcher's child): JSON, with its own pid
    assert {r["pid"] for r in records if r["logger"].startswith("splitserve.coordinator")}
