#!/usr/bin/env python3
"""Instructions per request of the fleet's Python work, per source tree, counted by callgrind.

On a shared box a fleet's CPU per request moves by ±10–15% between runs (bench/fleet/fleet_ab.py), which
hides changes of a few percent. This counts the interpreter's instructions instead (valgrind
`--tool=callgrind`): one fleet process's code path of a two-leg request, in process, from
`FleetServer._generate` through `Flow`, `Placer`, `Relay` and the request's scope to the answer's
bytes (fleet/http_messages.py `reply_bytes`), with the metrics in multiprocess mode as in a fleet of
several processes. The sockets are stubbed so every await completes at once and the coroutine is
driven by `send()`: the request body is there, the upstream legs answer bench/fleet/fleet.py's mock
bodies, and the coordinator channel's `_call` answers a two-candidate `select_pair` (both legs'
`KvChoice` numbers, encoded and decoded as msgpack) while the rest of the channel client (checks,
kv explanations, lease ends) runs as is. Not counted: the HTTP parser, the upstream client, the
channel's frames and the event loop.

Each tree and path runs twice (`--requests A,B`); the difference over B − A requests leaves out
start-up. Even with `PYTHONHASHSEED=0` two copies of one tree differed by up to 3% (round robin,
2026-12-02, 2-core box, Python 3.11; object hashes and the garbage collector still vary), against
±10–15% for bench/fleet/fleet_ab.py on the same box: a change below ~3% needs several runs.

Usage: `python bench/fleet/fleet_instructions.py [--trees /tmp/base,.] [--paths kv_cache_aware,round_robin]
[--requests 200,1000]` (a baseline tree: `git archive REV | tar -x -C /tmp/base`). Needs valgrind.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()


def child(tree: str, policy: str, n: int) -> None:
    sys.path.insert(0, tree)
    import importlib.util
    import msgspec
    import orjson
    from multidict import CIMultiDict, CIMultiDictProxy

    # bench/fleet/fleet.py since the bench scripts were grouped by subject; one level up in older trees
    script = os.path.join(tree, "bench", "fleet", "fleet.py")
    if not os.path.isfile(script):
        script = os.path.join(tree, "bench", "fleet.py")
    spec = importlib.util.spec_from_file_location("bench_fleet", script)
    bf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bf)
    from coordinator import channel_client as cc
    from coordinator.client import CoordinatorClient, HttpTransport
    from coordinator.config import load_config
    from fleet.flow import Flow
    from fleet.http_messages import FleetRequest, reply_bytes
    from fleet.keys import make_key_builder
    from fleet.placement import Placer
    from fleet.server import FleetServer
    from fleet.snowflake import SnowflakeGenerator

    servers = {"context": ["http://127.0.0.1:18003", "http://127.0.0.1:18004"],
               "generation": ["http://127.0.0.1:18001", "http://127.0.0.1:18002"]}
    cfg = load_config({"hostname": "127.0.0.1", "port": 1, "num_workers": 1, "tokenizer": "tiny",
                       "generation_servers": {"urls": [u[7:] for u in servers["generation"]],
                                              "router": {"type": policy}},
                       "context_servers": {"urls": [u[7:] for u in servers["context"]],
                                           "router": {"type": policy}}})
    answers = {u: bf._ctx_json("completion").encode() for u in servers["context"]}
    answers.update({u: bf._gen_json().encode() for u in servers["generation"]})

    class Resp:
        status, content_type = 200, "application/json"

        def __init__(self, data):
            self.data = data

        async def read(self):
            return self.data

        def release(self):
            pass

        def abort(self):
            pass

    class Pool:
        async def request(self, server, path, body, headers=b"", timeout=None):
            return Resp(answers[server])

    from protocol.channel import KvChoice

    def leg(role, request_id, pick):
        s = servers[role]
        kv = KvChoice(servers=s, matched=[176, 0], loads=[(3, 800), (4, 900)], costs=[1024.5, 1300.0],
                      pick=pick, num_tokens=961)
        return {"server": s[pick], "req_id": request_id, "info": {"kv": kv, "lease_ttl_s": 60.0}}

    chan = cc.ChannelClient("unix:///nonexistent")

    async def call(make):
        request_id = make(1).req_id
        body = {"context": leg("context", request_id, 0), "generation": leg("generation", request_id, 1),
                "mode": "disaggregated", "reason": None}
        return msgspec.msgpack.decode(msgspec.msgpack.encode(body))
    chan._call = call
    chan._proto = object()                     # connected: finishes are queued ...
    chan._schedule_finishes = lambda: None     # ... and never flushed (no socket)

    # The fleet's own client stack over that channel (its HTTP transport is never called: the channel
    # is connected). A tree from before the client had `select_pair_answer` takes it as well.
    placer = Placer(cfg, CoordinatorClient(HttpTransport("http://127.0.0.1:9"), chan))
    keys = make_key_builder(cfg, ["tiny"]) if policy != "round_robin" else None
    srv = FleetServer.__new__(FleetServer)
    srv.flow = Flow(cfg, placer, Pool(), SnowflakeGenerator(1, 1), keys)
    srv.placer, srv.config, srv.max_inflight, srv.keepalive_requests, srv._m_req = placer, cfg, None, None, {}
    srv.api_keys = type("NoKeys", (), {"enabled": False})()
    srv.rate_limit = None                      # fleet.rate_limit off (its default)
    srv.access_log = False                     # fleet.access_log off (its default)
    body = orjson.dumps(bf.BODY)

    async def read_body(request):
        return body
    srv._read_body = read_body
    heads = [("Host", "127.0.0.1:8000"), ("Content-Type", "application/json"),
             ("Content-Length", str(len(body)))]
    conn = type("Conn", (), {"transport": None})()

    def one() -> bytes:
        req = FleetRequest(conn, "POST", b"/v1/completions", "1.1", CIMultiDictProxy(CIMultiDict(heads)),
                           True, False)
        coro = srv._generate(req, "completion")
        try:
            coro.send(None)
        except StopIteration as e:
            out = reply_bytes(e.value, True)
        else:
            raise RuntimeError("a stubbed await suspended")
        chan._fins.clear()
        return out

    first = one()
    if not first.startswith(b"HTTP/1.1 200"):
        raise SystemExit(first[:500].decode(errors="replace"))
    for _ in range(n):
        one()


def count(tree: str, policy: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as mp:
        env = dict(os.environ, PYTHONHASHSEED="0", PROMETHEUS_MULTIPROC_DIR=mp)
        r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                            str(HERE), "--child", tree, policy, str(n)], capture_output=True, text=True, env=env)
    m = re.search(r"Collected : (\d+)", r.stderr)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"{tree} {policy}: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return int(m.group(1))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=".")
    ap.add_argument("--paths", default="kv_cache_aware,round_robin")
    ap.add_argument("--requests", default="200,1000")
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    a, b = (int(x) for x in args.requests.split(","))
    print("| path | " + " | ".join(Path(t).name for t in trees) + " | ratios to the first |")
    print("|---|" + "---:|" * len(trees) + "---|")
    for policy in args.paths.split(","):
        per = [(count(t, policy, b) - count(t, policy, a)) // (b - a) for t in trees]
        ratios = " ".join(f"{x / per[0]:.3f}" for x in per[1:]) or "-"
        print(f"| two-leg {policy} | " + " | ".join(f"{x:,}" for x in per) + f" | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
