"""Every listening socket of a `splitserve local` cluster is on the configured host (issue 15, item 6).

The cluster runs as `make serve` runs it (disaggregated, `--transfer-agent auto`: NIXL/UCX when the
wheel is installed). After a request has gone through both workers (so every lazily opened socket
exists), every TCP socket in LISTEN state and every bound UDP socket of every process in the tree is
read from /proc (splitserve_testing/proctable.py) and must be bound to the configured address —
UCX's TCP transport included, which by default listens on every interface of the machine.
"""
from __future__ import annotations

import importlib.util
import json
import re
import signal

import openai
import pytest

from splitserve_testing import free_port_pair
from splitserve_testing.proctable import alive, children, listening_sockets, tree

from .conftest import PY, clean_env, http, wait_for

HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu13", "nixl_cu12"))


def _loopback_alias_usable(host: str) -> bool:
    import socket
    try:
        with socket.socket() as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _worker_ports(pids) -> dict[str, int]:
    out = {}
    for pid in pids:
        argv = _cmdline(pid)
        if "worker" in argv and "--role" in argv:
            out[argv[argv.index("--role") + 1]] = int(argv[argv.index("--port") + 1])
    return out


@pytest.mark.parametrize("engine,host", [("torch", "127.0.0.1"), ("sim", "127.0.0.1"),
                                         ("torch", "127.0.0.2")])
def test_every_listener_is_on_the_configured_host(cluster, engine, host):
    if not _loopback_alias_usable(host):
        pytest.skip(f"{host} cannot be bound on this machine")
    port = free_port_pair(host)
    argv = [PY, "-m", "splitserve_cli", "local", "--engine", engine, "--model", "tiny", "--host", host,
            "--port", str(port)]
    p = cluster.spawn(f"local-{engine}-{host}", argv, env=clean_env())
    wait_for(lambda: "splitserve is up" in p.log(), 150, "the local cluster", p)
    url = f"http://{host}:{port}"
    for i in range(3):  # several requests: both workers, the KV transfer, every fleet process
        st, _, raw = http("POST", url + "/v1/completions",
                          {"model": "tiny", "prompt": f"listener check {i} " * 8, "max_tokens": 4})
        assert st == 200, raw

    pids = tree(p.pid)
    ports = _worker_ports(pids)
    assert set(ports) == {"context", "generation"}, pids
    found = {pid: listening_sockets(pid) for pid in pids}
    names = {pid: " ".join(_cmdline(pid))[:120] for pid in pids}
    listeners = [(names[pid], s) for pid, socks in found.items() for s in socks]
    assert listeners, "no listening sockets found at all"
    wrong = [(n, s) for n, s in listeners if s[1] != host]
    assert not wrong, f"listeners not on {host}: {wrong}"
    # the public port and the implicit coordinator are among them (the scan sees what it should)
    assert any(s[2] == port for _, s in listeners) and any(s[2] == port - 1 for _, s in listeners)
    if engine == "torch":
        per_worker = [len(found[pid]) for pid in pids if "worker" in _cmdline(pid)]
        assert all(n >= 3 for n in per_worker), found   # HTTP, KV events PUB + replay, transfer

    if engine == "torch":
        for role, wport in ports.items():
            st, _, raw = http("GET", f"http://{host}:{wport}/server_info")
            agent = json.loads(raw)["transfer"]["agent"]
            if host == "127.0.0.1" and HAVE_NIXL:
                # the default really is NIXL here, pinned to loopback
                assert agent["kind"] == "nixl" and agent.get("ucx") == {"NET_DEVICES": "lo"}, agent
            elif HAVE_NIXL:
                # UCX cannot bind 127.0.0.2 (no interface has it): auto falls back, saying why
                assert agent["kind"] == "tcp" and "no interface has 127.0.0.2" in agent["fallback"]

    # Also `make serve`'s cluster on this engine (tests/fleet/test_local.py runs the sim one):
    # the OpenAI client gets an answer, and SIGTERM stops every process it started, cleanly.
    r = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.usage.completion_tokens >= 1
    kids = children(p.pid)
    assert len(kids) == 3          # context worker, generation worker, fleet launcher
    p.kill(signal.SIGTERM)
    p.p.wait(60)
    assert re.search(r"stopping", p.log())
    assert p.p.returncode == 0, p.log()[-2000:]
    assert not [k for k in kids if alive(k)]
    with pytest.raises(OSError):
        http("GET", url + "/health", timeout=1)
