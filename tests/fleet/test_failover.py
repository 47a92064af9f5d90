"""Coordinator replicas and process deaths, with real processes on loopback (docs/failover.md):

- the serving coordinator killed (-9) under kv_cache_aware load: no client request fails, every
  placement after the kill comes from the standby (none placed blind), and the standby's load
  counters hold the requests that were in flight at the kill (re-registered by the fleet), and
  return to zero when they end;
- a standby refuses placements with the typed 421 (`NotServing`) naming the serving replica;
- a restarted worker is fenced: its old cache is credited to no placement once the coordinator
  sees the new process;
- a worker given every replica registers with each;
- a fleet process killed (-9) with requests in flight: its launcher's announcement ends their
  leases at once, not at `leases.ttl_s`.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import msgpack
import pytest

from .conftest import free_port, group, healthy, http, wait_for

SLOW = {"model": "tiny", "prompt": "a long answer that outlives the coordinator", "max_tokens": 300}
FAST = {"model": "tiny", "prompt": "shared prefix for kv aware placement " * 8, "max_tokens": 2}


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return sorted(out)


def route(h) -> dict:
    return json.loads(h["x-splitserve-route"])


def in_flight(curl: str) -> dict:
    st, _, raw = http("GET", curl + "/cluster_info")
    assert st == 200, raw[:200]
    return json.loads(raw)["leases"]["in_flight"]


class Timeline:
    """Background completions; each outcome recorded with its send time and placement policy."""

    def __init__(self, url: str, body: dict, threads: int = 2):
        self.url, self.body = url, body
        self.rows: list[tuple[float, int, str | None]] = []
        self._stop = threading.Event()
        self._ts = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self):
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                st, h, _ = http("POST", self.url + "/v1/completions", self.body, timeout=20)
            except OSError as e:
                self.rows.append((t, 0, repr(e)))
                continue
            pol = route(h)["generation"]["policy"] if st == 200 else None
            self.rows.append((t, st, pol))

    def __enter__(self):
        for t in self._ts:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._ts:
            t.join(30)


@pytest.fixture(scope="module")
def workers(module_cluster):
    """A context and a generation worker the tests share (those that kill or restart a worker start
    their own): → (context url, generation url)."""
    (_, ctx), (_, gen) = module_cluster.workers(("context", {"name": "f-ctx"}), ("generation", {"name": "f-gen"}))
    return ctx, gen


def _replicas(cluster, ctx, gen, n=2):
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    servers = dict(context_servers=group([ctx], "kv_cache_aware"),
                   generation_servers=group([gen], "kv_cache_aware"))
    procs = []
    for i, p in enumerate(ports):
        cfg = cluster.config(f"coord{i}.yaml", port=p + 1, coordinator={"replicas": urls, "replica_index": i},
                             **servers)
        procs.append(cluster.coordinator(cfg, p, name=f"coordinator-{i}"))
    for u, c in zip(urls, procs):
        wait_for(lambda u=u: http("GET", u + "/health")[0] == 200, 60, u, c)
    # Started together, a standby may serve until the first replica is warm (and failback_s more).
    wait_for(lambda: not any(json.loads(http("GET", u + "/replica")[2])["serving"] for u in urls[1:]),
             10, "the standbys to defer", procs)
    return urls, procs, servers


def test_serving_coordinator_killed_standby_takes_over(cluster, workers):
    ctx, gen = workers
    urls, coords, servers = _replicas(cluster, ctx, gen)
    # The standby refuses a placement with the typed 421, naming the serving replica.
    rep = json.loads(http("GET", urls[1] + "/replica")[2])
    assert rep["serving"] is False and rep["serving_url"] == urls[0] and rep["index"] == 1
    body = msgpack.packb({"role": "generation", "req_id": 1 << 41})
    st, _, raw = http("POST", urls[1] + "/select", body, headers={"Content-Type": "application/msgpack"})
    assert st == 421 and msgpack.unpackb(raw)["serving"] == urls[0], (st, raw[:200])
    http("POST", urls[0] + "/finish", msgpack.packb({"role": "generation", "req_id": 1 << 41}),
         headers={"Content-Type": "application/msgpack"})
    port = free_port()
    fcfg = cluster.config("fleet.yaml", port=port, coordinator={"replicas": urls},
                          fleet={"coordinator_timeout_s": 2}, **servers)
    f = cluster.fleet(fcfg)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)

    slow_done: list[int] = []
    slow = [threading.Thread(target=lambda: slow_done.append(
        http("POST", url + "/v1/completions", SLOW, timeout=60)[0]), daemon=True) for _ in range(3)]
    for t in slow:
        t.start()
    wait_for(lambda: in_flight(urls[0])["generation"] == 3, 20, "three long requests in flight")
    before = json.loads(http("GET", urls[1] + "/replica")[2])["takeovers"]
    with Timeline(url, FAST) as tl:
        time.sleep(0.5)
        coords[0].kill(signal.SIGKILL)
        killed = time.monotonic()
        coords[0].p.wait(10)
        # The standby holds the three long requests (re-registered) before they end.
        wait_for(lambda: in_flight(urls[1])["generation"] >= 3, 5.0, "the standby's load")
        time.sleep(1.0)
    for t in slow:
        t.join(60)
    assert slow_done == [200, 200, 200]
    failed = [r for r in tl.rows if r[1] != 200]
    assert failed == [], failed[:5]
    after = [r for r in tl.rows if r[0] > killed]
    assert after, "no request was sent after the kill"
    assert {r[2] for r in after} == {"kv_cache_aware"}, "a placement after the kill was made blind"
    # Every lease ended on the replica that serves now: its counters are exact again.
    wait_for(lambda: sum(in_flight(urls[1]).values()) == 0, 5, "the standby's leases to end")
    rep = json.loads(http("GET", urls[1] + "/replica")[2])
    assert rep["serving"] is True and rep["takeovers"] == before + 1
    assert "re-registered" in f.log()


def test_killed_fleet_process_leases_end_at_its_announcement(cluster, workers):
    ctx, gen = workers
    cport = free_port()
    curl = f"http://127.0.0.1:{cport}"
    servers = dict(context_servers=group([ctx], "kv_cache_aware"),
                   generation_servers=group([gen], "kv_cache_aware"))
    coord = cluster.coordinator(cluster.config("coord.yaml", port=cport + 1, **servers), cport)
    wait_for(lambda: http("GET", curl + "/health")[0] == 200, 60, "coordinator", coord)
    port = free_port()
    fcfg = cluster.config("fleet.yaml", port=port, num_workers=2, disagg_coordinator_url=curl,
                          leases={"ttl_s": 300}, fleet={"drain_timeout_s": 1}, **servers)
    launcher = cluster.fleet(fcfg, name="launcher")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 90, "fleet of 2", launcher)
    # Long enough (~7 s of 5 ms decode steps) that none ends by itself during the test.
    longer = dict(SLOW, max_tokens=1400)
    outcome: list[str] = []

    def slow_request():
        try:
            http("POST", url + "/v1/completions", longer, timeout=60)
            outcome.append("done")
        except OSError:
            outcome.append("cut")     # a request of the killed process
    threads = [threading.Thread(target=slow_request, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: in_flight(curl)["generation"] == 8, 30, "eight long requests in flight")
    # One fleet process dies with its requests in flight; the other keeps its own.
    children = _children(launcher.p.pid)
    assert len(children) == 2, children
    for pid in children:     # SO_REUSEPORT may have given one process all eight
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 3
        while "cut" not in outcome and time.monotonic() < deadline:
            time.sleep(0.02)
        if "cut" in outcome:
            break
    # The target is 2 s (measured by the failover benchmark); the bound here leaves room for a
    # busy CI box. Without the announcement they would last leases.ttl_s (300 s).
    wait_for(lambda: in_flight(curl)["generation"] == sum(t.is_alive() for t in threads), 5.0,
             "the dead process's leases to end")
    assert outcome.count("cut") >= 1 and outcome.count("done") == 0, outcome
    assert "is gone: ended its" in coord.log()


def test_restarted_worker_is_fenced(cluster, workers):
    """kill -9 a generation worker and start it again at the same url and KV-event ports: the
    coordinator sees the new process (its start id, on its event stream or in /server_info),
    drops its previous cache and leases at once, and credits no placement to that cache."""
    ctx, _ = workers
    gport, eport, rport = free_port(), free_port(), free_port()
    extra = ("--kv-events-port", eport, "--kv-replay-port", rport)
    gproc, gen = cluster.worker("generation", name="w-gen", port=gport, extra=extra)
    cport = free_port()
    curl = f"http://127.0.0.1:{cport}"
    servers = dict(context_servers=group([ctx], "kv_cache_aware"),
                   generation_servers=group([gen], "kv_cache_aware"))
    coord = cluster.coordinator(cluster.config("coord.yaml", port=cport + 1, **servers), cport)
    wait_for(lambda: http("GET", curl + "/health")[0] == 200, 60, "coordinator", coord)
    port = free_port()
    f = cluster.fleet(cluster.config("fleet.yaml", port=port, disagg_coordinator_url=curl, **servers))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)

    def gen_view():
        ci = json.loads(http("GET", curl + "/cluster_info")[2])
        return next(s for s in ci["servers"]["generation"] if s["url"] == gen)

    def matched() -> int:
        st, h, _ = http("POST", url + "/v1/completions", FAST)
        assert st == 200
        return int(route(h)["generation"].get("matched_tokens") or 0)

    matched()
    wait_for(lambda: matched() > 0, 10, "the generation server's cache to be credited")
    old_start = gen_view()["server_info"]["start_id"]
    gproc.kill(signal.SIGKILL)
    gproc.p.wait(10)
    gproc.start()
    wait_for(lambda: healthy(gen), 60, "the restarted worker", gproc)
    # Visible: the coordinator names the new process.
    wait_for(lambda: (gen_view().get("server_info") or {}).get("start_id") not in (None, old_start)
             or (gen_view().get("kv_events") or {}).get("epoch") not in (None, old_start),
             10, "the coordinator to see the new process")
    wait_for(lambda: gen_view().get("healthy"), 10, "the restarted server to be readmitted")
    v = gen_view()
    assert v["kv_events"]["epoch"] != old_start and v.get("kv_index_blocks", 0) == 0, v
    # The first placement after the restart is visible credits nothing to the old cache.
    assert matched() == 0
    log = coord.log()
    # Whichever saw the new process first says so: /server_info's start id ("restarted") or the
    # event stream's publisher epoch ("a new process"; "restarted" then only if leases were held).
    assert "restarted" in log or "a new process" in log, log[-2000:]


def test_worker_registers_with_every_replica(cluster):
    """Dynamic membership with replicas: a worker given every replica (comma separated, as the
    chart renders it) registers with each, so every replica's index is warm."""
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    coords = []
    for i, p in enumerate(ports):
        cfg = cluster.config(f"dyn{i}.yaml", port=p + 1, coordinator={"replicas": urls, "replica_index": i},
                             disagg_cluster={"cluster_uri": urls[i],
                                             "minimal_instances": {"context_servers": 0,
                                                                   "generation_servers": 1}},
                             generation_servers={"router": {"type": "kv_cache_aware"}})
        coords.append(cluster.coordinator(cfg, p, name=f"dyn-coordinator-{i}"))
    for u, c in zip(urls, coords):
        wait_for(lambda u=u: http("GET", u + "/version")[0] == 200, 60, u, c)
    _, gen = cluster.worker("generation", name="dyn-gen", extra=("--coordinator-url", ",".join(urls)))
    for u in urls:
        wait_for(lambda u=u: any(s["url"] == gen and s["healthy"] for s in json.loads(
            http("GET", u + "/cluster_info")[2])["servers"]["generation"]), 20, f"{gen} on {u}")
