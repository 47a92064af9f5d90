"""`splitserve status [URL]`: a one-screen summary of a running cluster.

URL is a fleet (`http://host:8000`, the default) or a coordinator. What is shown comes from its
`/cluster_info` (a fleet answers with its coordinator's view plus its own section) and, for the
coordinator replicas, from each replica's `GET /replica`: servers per role with their health,
load (leases, tokens, queued prefill tokens), KV usage (the index's blocks against the worker's
`kv_capacity_blocks`), predicted vs reported cached tokens, and the KV-event feed's state; the
readiness, the alarms and the coordinator replicas. Plain text by default, `--json` for the same
summary as one object, `--watch [S]` to redraw it every S seconds (2) until Ctrl-C.

Exit status: 0 the cluster is ready, 1 it answered but is not ready, 2 it could not be read.

`summarize` and `render` are pure (a `/cluster_info` in, a summary and its text out); `fetch` and
`run` are the shell.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from .launcher import probe   # GET over http(s) or a Unix socket, JSON body

ROLES = ("context", "generation")
EXIT_READY, EXIT_NOT_READY, EXIT_UNREACHABLE = 0, 1, 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", default=os.environ.get("SPLITSERVE_URL", "http://127.0.0.1:8000"),
                   help="a fleet or a coordinator [SPLITSERVE_URL]")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="redraw every SECONDS (2 when no value is given) until Ctrl-C")
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"),
                   help="bearer key, when the fleet's /cluster_info needs one [SPLITSERVE_API_KEY]")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP request")


# --------------------------------------------------------------------------- shell: reading

class Unreachable(Exception):
    pass


def _get(url: str, timeout: float, api_key: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Accept": "application/json", **(
        {"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None
    except (OSError, ValueError) as e:
        raise Unreachable(f"{url}: {getattr(e, 'reason', None) or e}") from None


def fetch(url: str, timeout: float = 5.0, api_key: str | None = None) -> tuple[dict, list[dict]]:
    """(`/cluster_info` of `url`, each coordinator replica's `/replica` answer with its url)."""
    base = url.rstrip("/")
    st, ci = _get(base + "/cluster_info", timeout, api_key)
    if st != 200 or not isinstance(ci, dict):
        err = (ci or {}).get("error") if isinstance(ci, dict) else None
        msg = err.get("message") if isinstance(err, dict) else err
        raise Unreachable(f"{base}/cluster_info answered {st}" + (f": {msg}" if msg else ""))
    coord = base
    fleet = ci.get("fleet")
    if isinstance(fleet, dict):      # a fleet: its coordinator (http, or its Unix socket on this host)
        label = str(fleet.get("coordinator") or "")
        coord = label.rstrip("/") if label.startswith(("http://", "https://", "unix:")) else None
    replicas: list[dict] = []
    if coord is not None:
        ok, detail, rep = probe(coord, "/replica", timeout)
        urls = rep.get("replicas") if ok else None
        for u in urls or ([coord] if ok else ()):
            ok, detail, r = (True, "", rep) if u == coord or not urls else probe(u.rstrip("/"), "/replica", timeout)
            replicas.append({"url": u, **(r if ok else {"error": detail})})
    return ci, replicas


# --------------------------------------------------------------------------- core: pure

def _feed_state(feed: dict | None) -> dict | None:
    if not isinstance(feed, dict):
        return None
    if feed.get("error"):
        state = "error"
    elif feed.get("repairing"):
        state = "repairing"
    elif feed.get("connected") is False:
        state = "disconnected"
    elif feed.get("ready"):
        state = "synced"
    else:
        state = "syncing"
    return {"state": state, "lag_s": feed.get("lag_s"), "age_s": feed.get("age_s"),
            "events": feed.get("events_applied"), "error": feed.get("error")}


def _server(s: dict) -> dict:
    load = s.get("load") or {}
    info = s.get("server_info") or {}
    cap = info.get("kv_capacity_blocks")
    blocks = s.get("kv_index_blocks") or 0
    pred = s.get("routing_prediction") or {}
    recent = pred.get("recent") or {}
    return {
        "url": s.get("url"), "state": s.get("state"), "healthy": bool(s.get("healthy")),
        "reason": s.get("reason"),
        "load": {"requests": load.get("requests", 0), "tokens": load.get("tokens", 0),
                 "queued_prefill_tokens": load.get("queued_prefill_tokens", 0)},
        "kv": {"index_blocks": blocks, "capacity_blocks": cap,
               "usage": round(blocks / cap, 4) if isinstance(cap, int) and cap > 0 else None},
        "prediction": ({"predicted_tokens": recent.get("predicted_tokens", 0),
                        "actual_cached_tokens": recent.get("actual_cached_tokens", 0),
                        "ratio": recent.get("ratio"), "alarm": bool(pred.get("alarm"))}
                       if pred else None),
        "kv_mismatch": s.get("kv_mismatch"),
        "feed": _feed_state(s.get("kv_events")),
    }


def summarize(ci: dict, replicas: list[dict] | None = None, url: str | None = None) -> dict:
    """The summary of one `/cluster_info` (and the replicas' `/replica` answers)."""
    servers = ci.get("servers") or {}
    mins = ci.get("minimal_instances") or {}
    routers = ci.get("routers") or {}
    roles = {}
    for role in ROLES:
        rows = [_server(s) for s in servers.get(role) or ()]
        roles[role] = {"healthy": sum(r["healthy"] for r in rows), "servers": rows,
                       "min": mins.get(f"{role}_servers", 0),
                       "router": (routers.get(role) or {}).get("type")}
    fleet = ci.get("fleet")
    diag = ci.get("routing_diagnostics") or {}
    leases = ci.get("leases") or {}
    return {
        "url": url, "cluster_id": ci.get("cluster_id") or None, "version": ci.get("version"),
        "uptime_s": ci.get("uptime_s"), "ready": bool(ci.get("is_ready")),
        "not_ready_reason": ci.get("not_ready_reason"),
        "answered_by": "fleet" if isinstance(fleet, dict) else "coordinator",
        "fleet": ({"pid": fleet.get("pid"), "process_index": fleet.get("process_index"),
                   "coordinator": fleet.get("coordinator"),
                   "coordinator_reachable": fleet.get("coordinator_reachable"),
                   "inflight_requests": fleet.get("inflight_requests"),
                   "ejected_servers": fleet.get("ejected_servers") or []}
                  if isinstance(fleet, dict) else None),
        "roles": roles,
        "leases_in_flight": leases.get("in_flight") or {},
        "alarms": {"prediction_alarm": diag.get("prediction_alarm") or [],
                   "kv_mismatch": diag.get("kv_mismatch") or []},
        "replicas": [{"url": r.get("url"), "index": r.get("index"), "serving": r.get("serving"),
                      "ready": r.get("ready"), "error": r.get("error")} for r in replicas or ()],
    }


def _dur(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _row(r: dict) -> str:
    ld, kv, pr, fd = r["load"], r["kv"], r["prediction"], r["feed"]
    state = r["state"] or "?"
    load = f"{ld['requests']} req {ld['tokens']} tok"
    if ld["queued_prefill_tokens"]:
        load += f" q{ld['queued_prefill_tokens']}"
    kvs = f"{kv['index_blocks']}" + (f"/{kv['capacity_blocks']} {kv['usage']:.0%}" if kv["usage"] is not None
                                     else "")
    if pr is None or not pr["predicted_tokens"]:
        hit = "-"
    else:
        hit = f"{pr['actual_cached_tokens']}/{pr['predicted_tokens']}" + (" ALARM" if pr["alarm"] else "")
    if fd is None:
        feed = "-"
    else:
        feed = fd["state"] + (f" lag {fd['lag_s'] * 1000:.0f}ms" if fd["lag_s"] is not None else "")
    line = f"  {r['url']:<28} {state:<10} {load:<20} {kvs:<16} {hit:<14} {feed}"
    if not r["healthy"] and r["reason"]:
        line += f"\n    reason: {r['reason'][:100]}"
    if r["kv_mismatch"]:
        line += f"\n    KV key mismatch: {r['kv_mismatch']}"
    return line


def render(s: dict) -> str:
    """The summary as one screen of text."""
    out = []
    head = f"splitserve {s['version'] or '?'}"
    if s["cluster_id"]:
        head += f"  cluster {s['cluster_id']}"
    head += f"  at {s['url']}  up {_dur(s['uptime_s'])}"
    out.append(head)
    out.append("ready" if s["ready"] else f"NOT READY: {s['not_ready_reason']}")
    f = s["fleet"]
    if f is not None:
        out.append(f"fleet process {f['process_index']} (pid {f['pid']}): {f['inflight_requests']} in flight; "
                   f"coordinator {f['coordinator']} "
                   + ("reachable" if f["coordinator_reachable"] else "UNREACHABLE (placing locally)")
                   + (f"; ejected here: {', '.join(f['ejected_servers'])}" if f["ejected_servers"] else ""))
    lf = s["leases_in_flight"]
    if lf:
        out.append("leases in flight: " + ", ".join(f"{k} {v}" for k, v in sorted(lf.items())))
    for role in ROLES:
        r = s["roles"][role]
        out.append("")
        out.append(f"{role.upper()}  {r['healthy']}/{len(r['servers'])} healthy (min {r['min']}), "
                   f"router {r['router']}")
        if r["servers"]:
            out.append(f"  {'server':<28} {'state':<10} {'load':<20} {'kv blocks':<16} {'cached/pred':<14} feed")
            out.extend(_row(x) for x in r["servers"])
    al = s["alarms"]
    if al["prediction_alarm"] or al["kv_mismatch"]:
        out.append("")
        if al["prediction_alarm"]:
            out.append("ALARM predicted cached tokens not reused on: " + ", ".join(al["prediction_alarm"]))
        if al["kv_mismatch"]:
            out.append("ALARM KV key mismatch on: " + ", ".join(al["kv_mismatch"]))
    if s["replicas"]:
        out.append("")
        out.append("coordinator replicas:")
        for rep in s["replicas"]:
            if rep["error"]:
                out.append(f"  {rep['url']}  unreachable: {rep['error']}")
            else:
                role = "serving" if rep["serving"] else "standby"
                idx = f"#{rep['index']} " if rep["index"] is not None else ""
                out.append(f"  {idx}{rep['url']}  {role}, {'warm' if rep['ready'] else 'warming'}")
    return "\n".join(out)


# --------------------------------------------------------------------------- shell: the command

def _once(args) -> int:
    try:
        ci, replicas = fetch(args.url, args.timeout, args.api_key)
    except Unreachable as e:
        print(f"splitserve status: cannot read the cluster: {e}", file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    s = summarize(ci, replicas, args.url.rstrip("/"))
    print(json.dumps(s, sort_keys=True) if args.json else render(s), flush=True)
    return EXIT_READY if s["ready"] else EXIT_NOT_READY


def run(args) -> int:
    if args.watch is None:
        return _once(args)
    if args.watch <= 0:
        print("splitserve status: --watch needs a positive number of seconds", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rc = EXIT_UNREACHABLE
    try:
        while True:
            if not args.json and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")   # redraw in place on a terminal
            rc = _once(args)
            if args.json or not sys.stdout.isatty():
                print("", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return rc
