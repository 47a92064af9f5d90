"""Capture the leg requests a router sends for the same client requests: recording mock engines
(tests/fleet/peers/recorder.py) behind vllm-router, sglang-router or splitserve's fleet, all real
processes on loopback.

`python -m tests.fleet.peers.capture vllm-router|sglang-router` rewrites that router's fixture in
tests/fleet/peers/fixtures/ (the router binaries come from the peers venv: `make peers-venv`, or
`SPLITSERVE_PEERS_VENV`). tests/fleet/test_peer_parity.py compares splitserve's legs with the
fixtures, and re-captures from the router itself when its binary is installed.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from splitserve_testing import Proc, free_port, stop_all, wait_for, wait_http

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PEERS_VENV = Path(os.environ.get("SPLITSERVE_PEERS_VENV") or ROOT / ".venv-peers")
VERSIONS = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
ENGINE = {"vllm-router": "vllm", "sglang-router": "sglang"}
PREFILL_DELAY_S = 0.4   # the prefill answers this late: a concurrent router sends the decode meanwhile

# The same client requests for every router.
CASES = {
    "chat_stream": ("/v1/chat/completions", {
        "model": "mock", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}),
    "completion": ("/v1/completions", {"model": "mock", "prompt": "hi there", "max_tokens": 5,
                                       "temperature": 0, "stream": False, "min_tokens": 2}),
    # The client hangs up after the first streamed event (the decode mock streams 150 tokens, 1.5 s).
    "hangup": ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "bye"}],
                                        "max_tokens": 300, "temperature": 0, "stream": True}),
}
ABORT_PATHS = ("/abort_request", "/v1/abort", "/abort_requests", "/inference/v1/abort_requests")


def router_bin(router: str) -> Path | None:
    p = PEERS_VENV / "bin" / ("vllm-router" if router == "vllm-router" else "python")
    if not p.exists():
        return None
    if router == "sglang-router" and not (PEERS_VENV / "bin" / "smg").exists():
        return None
    return p


def _post(url: str, body: dict, timeout: float = 20.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _legs(recs: list[dict]) -> list[dict]:
    # The generation legs, the abort calls and closed connections (routers also probe health,
    # models, render endpoints: left out).
    return [r for r in recs if r["method"] == "POST" and (
        r["path"] in ("/v1/completions", "/v1/chat/completions") or r["path"] in ABORT_PATHS)]


def _hang_up(url: str, path: str, body: dict) -> int:
    """Send a streaming request, read until the first event arrived, close the socket."""
    import socket
    from urllib.parse import urlsplit
    u = urlsplit(url)
    data = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), u.netloc.encode(), len(data)) + data)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    s.close()
    return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/") else 0


def capture(router: str, tmp: Path, *, engine: str | None = None, log=None) -> dict:
    """{case: {"prefill": [leg], "decode": [leg], "answer_status": int}} for `router` in
    ("vllm-router", "sglang-router", "splitserve"); `engine` picks the mocks' protocol for splitserve."""
    engine = engine or ENGINE[router]
    tmp.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    procs: list[Proc] = []

    def spawn(argv):
        # one log for all of them (each appends)
        p = Proc(f"{router}-{len(procs)}", argv, tmp / f"{router}-{engine}.log", group=True)
        procs.append(p)
        return p

    pp, dp, bp, rp = free_port(), free_port(), free_port(), free_port()
    rec = {"prefill": tmp / f"{router}-prefill.jsonl", "decode": tmp / f"{router}-decode.jsonl"}
    for f in rec.values():
        f.unlink(missing_ok=True)
    try:
        for role, port in (("prefill", pp), ("decode", dp)):
            argv = [py, "-m", "tests.fleet.peers.recorder", "--port", str(port), "--record", str(rec[role]),
                    "--engine", engine, "--role", role, "--tokens", "150"]
            if role == "prefill":
                argv += ["--delay-s", str(PREFILL_DELAY_S)]
                if engine == "sglang":
                    argv += ["--bootstrap-port", str(bp)]
            spawn(argv)
        for port in (pp, dp):
            wait_http(f"http://127.0.0.1:{port}/health", 20, procs)
        P, D = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
        if router == "vllm-router":
            spawn([str(router_bin(router)), "--host", "127.0.0.1", "--port", str(rp), "--vllm-pd-disaggregation",
                   "--prefill", P, "--decode", D, "--prometheus-port", str(free_port()),
                   "--policy", "round_robin"])
            ready = f"http://127.0.0.1:{rp}/health"
        elif router == "sglang-router":
            spawn([str(router_bin(router)), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                   "--port", str(rp), "--pd-disaggregation", "--prefill", P, str(bp), "--decode", D,
                   "--prometheus-port", str(free_port()), "--policy", "round_robin"])
            ready = f"http://127.0.0.1:{rp}/health"
        else:
            import yaml
            cfg = tmp / f"splitserve-{engine}.yaml"
            doc = {"hostname": "127.0.0.1", "port": rp, "model": "mock",
                   "context_servers": {"urls": [P.split("//")[1]], "router": {"type": "load_balancing"}},
                   "generation_servers": {"urls": [D.split("//")[1]], "router": {"type": "load_balancing"}}}
            if engine == "vllm":   # a stock vLLM has no /server_info: say it; SGLang's is inferred
                doc["context_servers"]["protocol"] = doc["generation_servers"]["protocol"] = "vllm"
            cfg.write_text(yaml.safe_dump(doc))
            spawn([py, "-m", "splitserve_cli", "serve", "-c", str(cfg)])
            ready = f"http://127.0.0.1:{rp}/health"
        wait_http(ready, 60, procs)
        if router != "splitserve":
            # the Rust routers finish their worker health checks after /health turns 200; the
            # fleet's /health is already the cluster's readiness (tests/fleet/test_ready.py)
            time.sleep(1.0)
        out = {}
        for name, (path, body) in CASES.items():
            n = {r: len(_legs(_records(f))) for r, f in rec.items()}
            if name == "hangup":
                status = _hang_up(f"http://127.0.0.1:{rp}", path, body)
                # Until the decode stream ended (the mock logs it: closed early, or run to completion
                # in 1.5 s), then 0.5 s for whatever else the hang-up sends (abort calls).
                wait_for(lambda: any(r.get("event") for r in _legs(_records(rec["decode"]))[n["decode"]:]),
                         10, "the decode stream to end after the hang-up", procs)
                time.sleep(0.5)
            else:
                status, answer = _post(f"http://127.0.0.1:{rp}{path}", body)
                time.sleep(0.3)
            legs = {r: _legs(_records(f))[n[r]:] for r, f in rec.items()}
            out[name] = {"answer_status": status, "bootstrap_port": bp if engine == "sglang" else None, **legs}
            if name != "hangup":
                out[name]["answer"] = answer.decode("utf-8", "replace")
        return out
    finally:
        stop_all(procs, grace=10)


def fixture_path(router: str) -> Path:
    return FIXTURES / f"{router}-{VERSIONS[router]}.json"


def main(argv=None) -> None:
    import tempfile
    routers = (argv or sys.argv[1:]) or list(VERSIONS)
    for router in routers:
        if router_bin(router) is None:
            raise SystemExit(f"{router} is not installed in {PEERS_VENV} (make peers-venv)")
        with tempfile.TemporaryDirectory() as d:
            got = capture(router, Path(d))
        FIXTURES.mkdir(exist_ok=True)
        doc = {"router": router, "version": VERSIONS[router], "captured_utc": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "prefill_delay_s": PREFILL_DELAY_S, "cases": got}
        fixture_path(router).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {fixture_path(router)}")


if __name__ == "__main__":
    main()
