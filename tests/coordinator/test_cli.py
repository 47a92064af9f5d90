"""`splitserve coordinator` as a real process: URL on stdout when ready, flags and env, SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _start(args, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "splitserve_cli", "coordinator", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _ready_line(proc, timeout=30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("splitserve coordinator listening on "):
            return line.strip()
        if not line and proc.poll() is not None:
            raise AssertionError(f"coordinator exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError("no ready line")


def test_serves_prints_url_and_stops_on_sigterm(tmp_path):
    conf = tmp_path / "cluster.yaml"
    conf.write_text("context_servers:\n  urls: ['127.0.0.1:9']\n  router: {type: kv_cache_aware}\n"
                    "generation_servers:\n  urls: ['127.0.0.1:9']\n"
                    "coordinator:\n  health_check_interval_s: 0.2\n")
    sock = tmp_path / "c.sock"
    proc = _start(["-c", str(conf), "--uds", str(sock)], {"SPLITSERVE_PORT": "0",
                                                          "SPLITSERVE_LOG_LEVEL": "warning"})
    try:
        line = _ready_line(proc)
        urls = line.split("listening on ", 1)[1].split(" and ")
        assert urls[0].startswith("http://127.0.0.1:") and urls[1] == f"unix://{sock}"
        assert sock.exists() and (sock.stat().st_mode & 0o777) == 0o660
        with urllib.request.urlopen(urls[0] + "/cluster_info", timeout=5) as r:
            ci = json.load(r)
        assert ci["is_ready"] is False and ci["routers"]["context"]["type"] == "kv_cache_aware"
        assert ci["servers"]["context"][0]["state"] == "pending"
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(urls[0] + "/health", timeout=5)
        assert ei.value.code == 503
        with urllib.request.urlopen(urls[0] + "/version", timeout=5) as r:
            assert json.load(r)["version"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_invalid_config_exits_with_the_key_path(tmp_path):
    conf = tmp_path / "bad.yaml"
    conf.write_text("coordinator:\n  health_check_interval_s: -1\n")
    proc = _start(["-c", str(conf), "--port", "0", "--no-uds"])
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "coordinator.health_check_interval_s" in err


def test_port_in_use_is_reported(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = _start(["--port", str(port), "--no-uds"])
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 4   # EXIT_ADDRESS_IN_USE: the launcher does not restart it
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_warns_when_cluster_uri_is_not_its_address(tmp_path):
    """An http:// disagg_cluster.cluster_uri is where workers register: a coordinator listening
    elsewhere says so (issue 39: no key accepted and silently meaningless)."""
    conf = tmp_path / "cluster.yaml"
    conf.write_text("disagg_cluster: {cluster_uri: 'http://127.0.0.1:1'}\n")
    proc = _start(["-c", str(conf), "--port", "0", "--no-uds"])
    try:
        line = _ready_line(proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    port = int(line.rsplit(":", 1)[1])
    assert f"names port 1, but this coordinator listens on {port}" in err
