#!/usr/bin/env python3
"""Disaggregation benchmark on one host: KV transfer across GPUs, and the end-to-end TTFT/TPOT
benefit of context/generation disaggregation over aggregated serving (issue 8).

    python bench/disagg_e2e.py --gpus 0,1                    # the real run: ctx on GPU 0, gen on GPU 1
    python bench/disagg_e2e.py --gpus 0                      # one-GPU dry run: both workers share GPU 0
    python bench/disagg_e2e.py --device cpu --model tiny     # CPU smoke run (CI), --scale tiny implied

Every cluster is real processes started here: a ``splitserve coordinator``, a ``splitserve serve``
fleet that uses it, and ``splitserve worker`` processes pinned to GPUs with ``CUDA_VISIBLE_DEVICES``
(the random-weight ``--model`` preset, bf16 on CUDA). Three parts:

1. **transfer** — KV bytes, time, GB/s and descriptors per transfer for each ``--sizes`` prompt: a
   context pool on the first GPU and a generation pool on the last, each in its own process, moved by
   the ``KvTransceiver`` the workers use (``--transfer-agent``), every copy checked byte-exact. Next
   to it the ceiling, measured in the same run: a torch copy of the same bytes from the first GPU to
   the last (peer-to-peer with two GPUs; a device-local copy when both share one GPU, so one-GPU
   percentages are not the cross-GPU target; on the CPU bench/transfer.py's memcpy baseline).
   bench/transfer.py's rank processes are not reused because their pools are fixed to the 1b shape;
   here the pools are real ``ModelRunner`` pools of ``--model`` (tiny, 1b or 8b), pinned per GPU.
2. **end to end** — one fixed workload (seeded, fixed arrival times): a steady stream of short chat
   requests decoding while long-prompt requests (8k–32k tokens at ``--scale full``) arrive, sent as
   streaming requests through the fleet, against (a) *aggregated*: two ``both`` workers, one per
   GPU, ``load_balancing``; (b) *disaggregated* 1P1D: a context and a generation worker,
   ``kv_cache_aware``. Per request the client records the arrival time of every streamed token.
   A disaggregated run whose generation worker cannot receive KV (501) is reported as skipped.
3. **pipelined vs monolithic** — (b) with the context worker sending each finished prefill chunk's
   KV right away (pipelined) and again with one transfer after the whole prefill (monolithic); the
   mode each context worker reports in ``/server_info`` is checked (``--transfer-pipeline on|off``).

Metrics (all client-side, from token arrival times):

- TTFT: request sent → first token received.
- ITL, reported as *TPOT*: the gap before each token after the first (a chunk carrying k tokens
  contributes k gaps of 1/k of its interval, so the gaps of one request sum to its decode time);
  p50/p99 over all tokens of a class. ``tpot_req_*`` is the per-request mean (decode time / (n-1)).
  Requests ask for ``return_token_ids``; a worker that streams only text chunks (none for tokens
  without text) leaves tokens untimed: ``timed_token_coverage`` says how many were timed alone.
- output tokens/s: completion tokens of all requests / (last token − first send).

The targets line compares to issue 8: transfer ≥ 80% of the ceiling at 16k tokens; short-request
TPOT p99 disaggregated ≤ ½ of aggregated at equal or better output tokens/s (not judged when fewer
than 95% of the tokens were timed alone).

Every process started here is stopped on exit (also on Ctrl-C, SIGTERM and errors; their pids are
listed in ``<logs>/pids``); logs go to a new temporary directory (or ``--log-dir``) whose path is
printed. ``--out FILE`` writes every number as JSON; ``--write-results`` replaces (or appends) the
``## disagg_e2e`` section of bench/RESULTS.md with the command, machine, date and the tables.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as `python bench/x.py`, sys.path[0] is bench/, whose worker.py would shadow the worker
# package: the repository root goes first and bench/ itself is dropped.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]

from bench._common import replace_subsection  # noqa: E402
from splitserve_testing import Proc, clean_env, free_port, stop_all  # noqa: E402

import aiohttp  # noqa: E402
import yaml  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## disagg_e2e"
HOST = "127.0.0.1"
TARGET_TRANSFER_PCT = 80.0
TARGET_TRANSFER_TOKENS = 16384
TARGET_TPOT_RATIO = 2.0
MIN_TOKEN_COVERAGE = 0.95   # below this share of individually timed tokens, TPOT is not judged


class BenchError(RuntimeError):
    """The benchmark cannot go on (a process died, a cluster never became ready, bad flags)."""


# ============================================================================ workload scales

@dataclass(frozen=True)
class Scale:
    """One workload size. Prompt lengths are in tokens; times in seconds from the workload start."""

    name: str
    duration_s: float            # short requests arrive during [0, duration_s)
    short_rate: float            # short requests per second (fixed spacing)
    short_prompt: tuple[int, int]  # chat prompt length range (characters ≈ byte tokens)
    short_max_tokens: int
    long_count: int              # long requests, evenly spread over the middle of the run
    long_prompt: tuple[int, int]   # prompt tokens range (token ids, exact lengths)
    long_max_tokens: int
    transfer_sizes: tuple[int, ...]
    transfer_repeats: int
    warmup_burst: int            # concurrent short warm-up requests per generation worker

    def scaled(self, factor: float) -> "Scale":
        """``full`` with long prompts and (up to 1×) the duration times ``factor``; the transfer sizes
        stay (``--sizes`` sets them)."""
        def s(x: int) -> int:
            return max(16, int(round(x * factor / 16)) * 16)
        return dataclasses.replace(
            self, name=f"x{factor:g}", duration_s=max(5.0, self.duration_s * min(1.0, factor)),
            long_prompt=(s(self.long_prompt[0]), s(self.long_prompt[1])))


SCALES: dict[str, Scale] = {
    # Issue 8's sizes, for the two-GPU run.
    "full": Scale("full", duration_s=60.0, short_rate=4.0, short_prompt=(200, 400), short_max_tokens=128,
                  long_count=10, long_prompt=(8192, 32768), long_max_tokens=32,
                  transfer_sizes=(1024, 4096, 16384, 65536), transfer_repeats=5, warmup_burst=32),
    # The one-GPU dry run: same shapes, shorter, half-size long prompts (both workers share a GPU).
    "dry": Scale("dry", duration_s=30.0, short_rate=4.0, short_prompt=(200, 400), short_max_tokens=96,
                 long_count=6, long_prompt=(4096, 16384), long_max_tokens=32,
                 transfer_sizes=(1024, 4096, 16384, 65536), transfer_repeats=3, warmup_burst=16),
    # CPU smoke run with the tiny model (CI): every code path, seconds.
    "tiny": Scale("tiny", duration_s=3.0, short_rate=2.0, short_prompt=(24, 48), short_max_tokens=6,
                  long_count=2, long_prompt=(192, 384), long_max_tokens=4,
                  transfer_sizes=(64, 256), transfer_repeats=2, warmup_burst=2),
}


def parse_scale(value: str) -> Scale:
    if value in SCALES:
        return SCALES[value]
    try:
        f = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--scale: expected one of {', '.join(SCALES)} or a positive number, found {value!r}") from None
    if not (0 < f <= 4):
        raise argparse.ArgumentTypeError(f"--scale: a factor must be in (0, 4], found {f:g}")
    return SCALES["full"].scaled(f)


# ============================================================================ the workload

@dataclass(frozen=True)
class Req:
    """One request of the workload; ``body`` is sent unchanged to every configuration."""

    idx: int
    kind: str          # "short" | "long"
    arrival_s: float
    path: str          # /v1/chat/completions | /v1/completions
    body: dict
    prompt_tokens: int  # exact for long (token ids); the character count for short chat prompts
    max_tokens: int


_WORDS = [w for w in (
    "the of and to in is was for on that with as by at from his her an were are which this be or "
    "has had not but what all when there can who been one more if out so about into than them only "
    "other its time new some could these two may first then do any like my now over such our man "
    "me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three").split()]


def _chat_text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def build_workload(scale: Scale, seed: int, model: str, block_size: int = 16) -> list[Req]:
    """The fixed request list: same seed → same bodies and arrival times, for every configuration.

    Short requests are chat prompts of random words, evenly spaced at ``short_rate``; long requests are
    completions with random token ids (< 256: a valid id for every preset's byte-level tokenizer) of
    block-aligned lengths, evenly spread over the middle 80% of the run so that they land while short
    requests decode. Every prompt is distinct from its first block, so no prefix is shared.
    """
    rng = random.Random(seed)
    reqs: list[Req] = []
    n_short = max(1, int(scale.duration_s * scale.short_rate))
    for i in range(n_short):
        chars = rng.randint(*scale.short_prompt)
        text = f"[{seed}:{i}] " + _chat_text(rng, chars)
        body = {"model": model, "messages": [{"role": "user", "content": text}],
                "max_tokens": scale.short_max_tokens, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        reqs.append(Req(i, "short", i / scale.short_rate, "/v1/chat/completions", body, len(text),
                        scale.short_max_tokens))
    lo, hi = scale.long_prompt
    for j in range(scale.long_count):
        n = rng.randint(lo, hi) // block_size * block_size
        ids = [rng.randrange(256) for _ in range(n)]
        at = scale.duration_s * (0.1 + 0.8 * (j + 0.5) / scale.long_count)
        body = {"model": model, "prompt": ids, "max_tokens": scale.long_max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        reqs.append(Req(n_short + j, "long", round(at, 3), "/v1/completions", body, n, scale.long_max_tokens))
    reqs.sort(key=lambda r: (r.arrival_s, r.idx))
    return reqs


def workload_summary(reqs: list[Req]) -> dict:
    short = [r for r in reqs if r.kind == "short"]
    long_ = [r for r in reqs if r.kind == "long"]
    return {
        "short": {"count": len(short), "prompt_chars": [min(r.prompt_tokens for r in short),
                                                         max(r.prompt_tokens for r in short)] if short else [],
                  "max_tokens": short[0].max_tokens if short else 0,
                  "arrivals_s": [short[0].arrival_s, short[-1].arrival_s] if short else []},
        "long": {"count": len(long_), "prompt_tokens": [r.prompt_tokens for r in long_],
                 "max_tokens": long_[0].max_tokens if long_ else 0,
                 "arrivals_s": [r.arrival_s for r in long_]},
    }


# ============================================================================ the streaming client

@dataclass
class Result:
    idx: int
    kind: str
    prompt_tokens: int
    sent: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)   # (arrival, tokens in the chunk)
    completion_tokens: int = 0
    finish_reason: str | None = None
    status: int = 0
    error: str | None = None
    mode: str | None = None
    token_ids_seen: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and bool(self.chunks)

    @property
    def end(self) -> float:
        return self.chunks[-1][0] if self.chunks else self.sent


def _chunk_tokens(obj: dict) -> tuple[int, bool, str | None]:
    """(tokens carried, whether the count is exact, finish_reason) of one SSE chunk."""
    choices = obj.get("choices") or []
    if not choices:
        return 0, True, None
    c = choices[0]
    fin = c.get("finish_reason")
    ids = c.get("token_ids")
    if isinstance(ids, list):
        return len(ids), True, fin
    text = c.get("text")
    if text is None:
        text = (c.get("delta") or {}).get("content")
    # Without token ids a chunk with text is one token; a text-less final chunk closes the stream.
    return (1 if text else 0), False, fin


async def send_one(session: aiohttp.ClientSession, base: str, req: Req, start: float,
                   timeout_s: float, first: asyncio.Event | None = None) -> Result:
    loop = asyncio.get_running_loop()
    res = Result(req.idx, req.kind, req.prompt_tokens)
    delay = start + req.arrival_s - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    res.sent = loop.time()
    try:
        async with session.post(base + req.path, json=req.body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            route = resp.headers.get("x-splitserve-route")
            if route:
                with contextlib.suppress(ValueError):
                    res.mode = json.loads(route).get("mode")
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                now = loop.time()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error'].get('message')}"
                    break
                usage = obj.get("usage")
                if usage:
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                n, exact, fin = _chunk_tokens(obj)
                res.token_ids_seen |= exact and n > 0
                if fin is not None:
                    res.finish_reason = fin
                if n or (fin is not None and not res.token_ids_seen):
                    res.chunks.append((now, n))
                    if first is not None:
                        first.set()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if first is not None:
            first.set()
    if res.error is None and res.finish_reason is None:
        res.error = "stream ended without a finish_reason"
    return res


async def run_requests(base: str, reqs: list[Req], timeout_s: float, lead_s: float = 0.5) -> list[Result]:
    """Send every request at its arrival time (relative to one shared start) and collect the streams."""
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = asyncio.get_running_loop().time() + lead_s
        return list(await asyncio.gather(*(send_one(session, base, r, start, timeout_s) for r in reqs)))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def class_stats(results: list[Result]) -> dict:
    """TTFT, ITL (TPOT) and per-request TPOT percentiles of one request class, in milliseconds."""
    ok = [r for r in results if r.ok]
    ttft, itl, tpot_req = [], [], []
    exact = bool(ok) and all(r.token_ids_seen for r in ok)
    timed = sum(n for r in ok for _, n in r.chunks)
    total = sum(r.completion_tokens for r in ok)
    for r in ok:
        toks = [(t, n) for t, n in r.chunks if n > 0] or r.chunks[:1]
        ttft.append(toks[0][0] - r.sent)
        prev = toks[0][0]
        # The first chunk may carry several tokens; only the first of them is the "first token".
        for t, n in toks[1:]:
            itl.extend([(t - prev) / n] * n)
            prev = t
        ntok = r.completion_tokens or sum(n for _, n in toks)
        if ntok > 1:
            tpot_req.append((toks[-1][0] - toks[0][0]) / (ntok - 1))
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "tpot_p50_ms": _ms(_pct(itl, 50)), "tpot_p99_ms": _ms(_pct(itl, 99)),
        "tpot_req_p50_ms": _ms(_pct(tpot_req, 50)), "tpot_req_p99_ms": _ms(_pct(tpot_req, 99)),
        "token_timing": "token_ids" if exact else "text_chunks",
        # Tokens whose arrival was seen on its own / all completion tokens. Below 1 the worker merged
        # tokens into one chunk (or sent none for tokens without text) and the percentiles are per chunk.
        "timed_token_coverage": round(timed / total, 3) if total else None,
    }


def run_stats(results: list[Result]) -> dict:
    ok = [r for r in results if r.ok]
    out: dict = {k: class_stats([r for r in results if r.kind == k]) for k in ("short", "long")}
    if ok:
        span = max(r.end for r in ok) - min(r.sent for r in results)
        toks = sum(r.completion_tokens for r in ok)
        out["output_tokens_per_s"] = round(toks / span, 2) if span > 0 else None
        out["span_s"] = round(span, 3)
    else:
        out["output_tokens_per_s"] = None
        out["span_s"] = None
    modes: dict[str, int] = {}
    for r in results:
        modes[str(r.mode)] = modes.get(str(r.mode), 0) + 1
    out["modes"] = modes
    out["error_samples"] = [f"#{r.idx} {r.kind}: {r.error or 'no tokens'}" for r in results if not r.ok][:10]
    return out


# ============================================================================ processes

class Registry:
    """Every process this benchmark started; ``stop_all`` ends them. Each pid is also appended to
    ``<logdir>/pids`` (``pid name`` per line) so an operator or a test can check nothing outlived us."""

    def __init__(self, logdir: Path) -> None:
        self.procs: list[Proc] = []
        self.pid_file = logdir / "pids"
        self.pids: list[int] = []

    def note(self, pid: int, name: str) -> None:
        self.pids.append(pid)
        with open(self.pid_file, "a") as f:
            f.write(f"{pid} {name}\n")

    def start(self, name: str, argv: list[str], log: Path, env: dict) -> Proc:
        # group: SIGTERM reaches a fleet launcher's children too, and none outlives the stop
        p = Proc(name, argv, log, env, group=True, header=True)
        self.procs.append(p)
        self.note(p.p.pid, name)
        return p

    def stop(self, procs: list[Proc], grace: float = 10.0) -> None:
        """SIGTERM all of ``procs`` at once (workers drain in parallel), then reap each."""
        stop_all(procs, grace)
        for p in procs:
            with contextlib.suppress(ValueError):
                self.procs.remove(p)

    def stop_all(self, grace: float = 10.0) -> None:
        self.stop(list(self.procs), grace)


def _http(url: str, timeout: float = 3.0, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


def _child_env(gpu: str | None) -> dict:
    env = clean_env(PYTHONUNBUFFERED=1)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


# ============================================================================ clusters

@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str                       # context | generation | both
    gpu: str | None                 # CUDA_VISIBLE_DEVICES value; None = inherit (cpu runs)
    extra: tuple[str, ...] = ()


@dataclass
class RunningWorker:
    spec: WorkerSpec
    url: str
    proc: Proc


class Cluster:
    """A coordinator, the workers (static ``urls`` in the cluster YAML) and a fleet using that
    coordinator, on loopback ports picked by the OS. ``start`` returns once the fleet serves a probe."""

    def __init__(self, name: str, args, reg: Registry, logdir: Path, workers: list[WorkerSpec],
                 ctx_router: str | None, gen_router: str):
        self.name, self.args, self.reg, self.logdir = name, args, reg, logdir
        self.specs, self.ctx_router, self.gen_router = workers, ctx_router, gen_router
        self.workers: list[RunningWorker] = []
        self.procs: list[Proc] = []
        self.url = ""
        self.model = ""

    def _worker_argv(self, spec: WorkerSpec, port: int) -> list[str]:
        a = self.args
        extra = list(spec.extra)
        head = [sys.executable, "-m", "splitserve_cli", "worker"]
        argv = [*head, "--role", spec.role, "--engine", "torch",
                "--model", a.model, "--device", a.device, "--host", HOST, "--port", str(port),
                "--num-blocks", str(a.num_blocks), "--transfer-agent", a.transfer_agent,
                "--drain-timeout", "2", "--log-level", a.log_level.upper()]
        if a.dtype:
            argv += ["--dtype", a.dtype]
        return argv + list(a.worker_arg) + extra

    def start(self, timeout: float) -> None:
        a = self.args
        cport, fport = free_port(), free_port()
        for spec in self.specs:
            port = free_port()
            p = self.reg.start(f"{self.name}/{spec.name}", self._worker_argv(spec, port),
                               self.logdir / f"{self.name}-{spec.name}.log", _child_env(spec.gpu))
            self.procs.append(p)
            self.workers.append(RunningWorker(spec, f"http://{HOST}:{port}", p))
        ctx = [w.url for w in self.workers if w.spec.role == "context"]
        gen = [w.url for w in self.workers if w.spec.role in ("generation", "both")]
        # `model` names the tokenizer the fleet computes KV-aware routing keys with (the fleet starts
        # before the workers answer /server_info).
        cfg = {"hostname": HOST, "port": fport, "num_workers": a.fleet_workers, "model": a.model,
               "server_start_timeout": timeout, "request_timeout": a.request_timeout,
               "log_level": a.log_level.lower(),
               "coordinator": {"host": HOST, "port": cport, "uds": False, "health_check_interval_s": 0.5},
               "context_servers": {"urls": [u.split("//", 1)[1] for u in ctx],
                                   "router": {"type": self.ctx_router or "round_robin"}},
               "generation_servers": {"urls": [u.split("//", 1)[1] for u in gen],
                                      "router": {"type": self.gen_router}}}
        cfg_path = self.logdir / f"{self.name}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = _child_env(None)
        env["CUDA_VISIBLE_DEVICES"] = ""   # neither the coordinator nor the fleet touch a GPU
        # Everything starts at once: the fleet probes the coordinator with retries, and the coordinator
        # health-checks the workers until they answer.
        self.procs.append(self.reg.start(
            f"{self.name}/coordinator", [sys.executable, "-m", "splitserve_cli", "coordinator", "-c", str(cfg_path),
                                         "--port", str(cport), "--no-uds"],
            self.logdir / f"{self.name}-coordinator.log", env))
        self.procs.append(self.reg.start(
            f"{self.name}/fleet", [sys.executable, "-m", "splitserve_cli", "serve", "-c", str(cfg_path),
                                   "--coordinator-url", f"http://{HOST}:{cport}"],
            self.logdir / f"{self.name}-fleet.log", env))
        self.url = f"http://{HOST}:{fport}"
        deadline = time.monotonic() + timeout
        self._wait([w.url + "/health" for w in self.workers], deadline)
        # The coordinator admits a server after its own health probe; until then the fleet would
        # serve the probe below by a fallback (e.g. aggregated on the generation server).
        want = {"context": set(ctx), "generation": set(gen)}
        cinfo = f"http://{HOST}:{cport}/cluster_info"
        while True:
            self._check_alive()
            status, body = _http(cinfo)
            lists = json.loads(body).get("server_lists", {}) if status == 200 else {}
            if all(want[r] <= set(lists.get(r, [])) for r in want):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: the coordinator did not admit every worker within {timeout:g}s "
                                 f"(healthy: {lists}); see {self.logdir}")
            time.sleep(0.2)
        status, body = _http(self.workers[0].url + "/v1/models")
        self.model = json.loads(body)["data"][0]["id"] if status == 200 else a.model
        probe = {"model": self.model, "prompt": "probe", "max_tokens": 2, "ignore_eos": True}
        while True:
            self._check_alive()
            status, _ = _http(self.url + "/v1/completions", timeout=max(5.0, a.request_timeout), body=probe)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: the fleet at {self.url} did not answer a completion within "
                                 f"{timeout:g}s (last HTTP status {status}); see {self.logdir}")
            time.sleep(0.2)

    def _check_alive(self) -> None:
        for p in self.procs:
            if not p.alive():
                raise BenchError(f"{p.name} exited with code {p.p.returncode}; {p.log_path} ends with:\n{p.tail()}")

    def _wait(self, urls: list[str], deadline: float) -> None:
        pending = list(urls)
        while pending:
            self._check_alive()
            pending = [u for u in pending if _http(u)[0] != 200]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: not ready before the start timeout: {', '.join(pending)}; "
                                 f"logs in {self.logdir}")
            time.sleep(0.3)

    def stop(self) -> None:
        self.reg.stop(self.procs, grace=10.0)
        self.procs = []

    def route_mode(self) -> str | None:
        """The placement mode of one short non-streaming request (``disaggregated``, ``no_kv_transfer``…)."""
        req = urllib.request.Request(
            self.url + "/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": self.model, "prompt": "which way?", "max_tokens": 2,
                             "ignore_eos": True}).encode())
        try:
            with urllib.request.urlopen(req, timeout=self.args.request_timeout) as r:
                route = r.headers.get("x-splitserve-route")
        except (OSError, ValueError) as e:
            raise BenchError(f"{self.name}: probe request failed: {e}") from None
        return json.loads(route).get("mode") if route else None

    def worker_metrics(self) -> dict[str, dict[str, float]]:
        return {w.spec.name: parse_metrics(_http(w.url + "/metrics")[1].decode(errors="replace"))
                for w in self.workers}


_METRIC_KEEP = re.compile(r"transfer|kv_recv|kv_send|preemption|prefix_cache_hit|prefill_tokens_total|"
                          r"decode_tokens_total|generation_tokens_total")


def parse_metrics(text: str) -> dict[str, float]:
    """The worker's counters and histogram sums/counts this benchmark reports (Prometheus text)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if not _METRIC_KEEP.search(name) or "_bucket" in name or name.endswith("_created"):
            continue
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    return {w: {k: round(v - before.get(w, {}).get(k, 0.0), 6) for k, v in m.items()
                if v != before.get(w, {}).get(k, 0.0)}
            for w, m in after.items()}


# ============================================================================ part 1: transfer

def _transfer_peer(conn, spec: dict) -> None:
    """One end of the transfer measurement, in its own process (``CUDA_VISIBLE_DEVICES`` set by the
    parent, so ``cuda`` is the pinned GPU). The KV pool is a real ``ModelRunner`` pool of ``spec['model']``
    (the worker's geometry and page-table code), wrapped in a ``KvTransceiver`` exactly as
    ``splitserve worker`` does; the model weights are dropped once the pool exists.

    Commands arrive as ``(name, args)`` tuples; every answer is ``("ok", value)`` or ``("err", text)``.
    Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the host)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import logging
    import traceback

    try:
        import torch

        dev = torch.device(spec["device"])
        if spec["role"] == "ceiling":
            conn.send(("ok", {"device": str(dev)}))
        else:
            from transfer.page_table import PageTable
            from transfer.session import KvTransceiver, RankTopology, TransferConfig
            from worker.loader import load_model
            from worker.runner import ModelRunner

            logging.basicConfig(level=logging.WARNING)
            model, _tok, cfg = load_model(spec["model"], dev, spec["dtype"])
            runner = ModelRunner(model, spec["num_blocks"], spec["block_size"], dev, model.dtype,
                                 cuda_graphs=False)
            runner.model = None
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            kv = runner.kv_cache.view(runner.num_blocks + 1, -1)     # row b = block b's bytes, all layers
            tx = KvTransceiver(PageTable.from_runner_dict(runner.page_table()),
                               RankTopology(role=spec["role"], num_layers=cfg.num_hidden_layers,
                                            total_kv_heads=cfg.num_key_value_heads, model=spec["model"]),
                               TransferConfig(agent=spec["agent"], pipeline=False))
            conn.send(("ok", {"endpoint": tx.endpoint, "agent": tx.info.agent_kind,
                              "block_bytes": runner.block_stride, "device": str(dev)}))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def checksum(nb: int) -> int:
        words = kv[:nb].view(torch.int32)
        sync()
        return int(words.sum(dtype=torch.int64).item()) ^ int((words[:, ::97].to(torch.int64) * 31).sum().item())

    def wait(status, req: int, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            st = status(req)
            if st.quiescent:
                return time.monotonic(), st
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {req}: transfer not finished after {timeout:g}s (state {st.state})")
            time.sleep(0.0001)

    while True:
        cmd, a = conn.recv()
        try:
            if cmd == "quiet":
                # The other end going away first is expected from here on, not worth a warning.
                logging.getLogger("splitserve.transfer").setLevel(logging.ERROR)
                out = None
            elif cmd == "exit":
                if spec["role"] != "ceiling":
                    tx.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "fill":                     # context: random bytes in the blocks to send
                gen = torch.Generator(device=dev).manual_seed(a["seed"])
                kv[:a["blocks"]].view(torch.int32).random_(generator=gen)
                out = checksum(a["blocks"])
            elif cmd == "zero":                   # generation: stale bytes must not pass the checksum
                kv[:a["blocks"]].zero_()
                sync()
                out = None
            elif cmd == "checksum":
                out = checksum(a["blocks"])
            elif cmd == "begin_receive":
                tx.begin_receive(a["req"], a["endpoint"], a["tokens"], list(range(a["blocks"])))
                out = None
            elif cmd == "begin_send":
                tx.begin_send(a["req"], a["tokens"], list(range(a["blocks"])))
                deadline = time.monotonic() + 30
                while tx.send_status(a["req"]).state == "waiting":   # until the receive is attached
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"request {a['req']}: no receiver attached after 30s")
                    time.sleep(0.0005)
                out = None
            elif cmd == "finish_send":            # the data moves from here on
                t0 = time.monotonic()
                tx.finish_send(a["req"])
                t1, st = wait(tx.send_status, a["req"], a["timeout"])
                tx.release_send(a["req"])
                out = {"t0": t0, "t_send_done": t1, "state": st.state, "error": st.error,
                       "bytes": st.bytes, "descriptors": st.descriptors}
            elif cmd == "wait_receive":
                t1, st = wait(tx.recv_status, a["req"], a["timeout"])
                tx.release_receive(a["req"])
                out = {"t_recv_done": t1, "state": st.state, "error": st.error}
            elif cmd == "copy":   # the ceiling (cuda): first visible GPU → last visible GPU, same bytes
                n, reps = a["bytes"], a["repeats"]
                d0, d1 = torch.device("cuda", 0), torch.device("cuda", torch.cuda.device_count() - 1)
                src = torch.empty(n, dtype=torch.uint8, device=d0).fill_(7)
                dst = torch.empty(n, dtype=torch.uint8, device=d1)
                times = []
                for i in range(reps + 1):
                    torch.cuda.synchronize(d0)
                    torch.cuda.synchronize(d1)
                    t = time.perf_counter()
                    dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize(d0)
                    torch.cuda.synchronize(d1)
                    if i:   # the first copy enables peer access and warms the allocator
                        times.append(time.perf_counter() - t)
                del src, dst
                torch.cuda.empty_cache()
                out = {"seconds": sorted(times)[len(times) // 2],
                       "kind": "peer-to-peer copy GPU→GPU" if d0 != d1 else "device-local copy on one GPU"}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception:
            conn.send(("err", traceback.format_exc()))


class _Peer:
    """A ``_transfer_peer`` process and its pipe; ``call`` raises BenchError on a peer error or death."""

    def __init__(self, name: str, spec: dict, gpus: str | None, reg: "Registry"):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:   # a spawned child copies os.environ when it starts: pin it to its GPU(s) this way
            if gpus is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            self.p = ctx.Process(target=_transfer_peer, args=(child, spec), name=name, daemon=True)
            self.p.start()
        finally:
            if gpus is not None:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
        child.close()
        reg.note(self.p.pid, name)

    def result(self, timeout: float):
        if not self.conn.poll(timeout):
            raise BenchError(f"transfer peer {self.name} did not answer within {timeout:g}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise BenchError(f"transfer peer {self.name} died (exit code {self.p.exitcode})") from None
        if status != "ok":
            raise BenchError(f"transfer peer {self.name} failed:\n{value}")
        return value

    def send(self, cmd: str, **a) -> None:
        self.conn.send((cmd, a))

    def call(self, cmd: str, wait_s: float = 120.0, **a):
        self.send(cmd, **a)
        return self.result(wait_s)

    def close(self) -> None:
        if self.p.is_alive():
            with contextlib.suppress(OSError, BenchError, BrokenPipeError):
                self.call("exit", wait_s=10)
        self.p.join(5)
        if self.p.is_alive():
            self.p.kill()
            self.p.join(5)


def transfer_part(args, reg: "Registry", logdir: Path) -> dict:
    """KV transfer of one prompt per size (``--sizes``), context pool on the first GPU and generation pool
    on the last, ``transfer_repeats`` times each (median reported), through the same ``KvTransceiver``
    the workers use with ``--transfer-agent``; each landed copy is checked byte-exact by checksum. Time
    = context ``finish_send`` → the generation side sees the receive done (data plus the result
    message). The ceiling peer copies the same bytes in the same run, interleaved per size."""
    sizes = sorted(set(args.sizes))
    block = 16
    blocks = {n: math.ceil(n / block) for n in sizes}
    base = {"model": args.model, "dtype": args.dtype, "device": args.device, "block_size": block,
            "num_blocks": max(blocks.values()) + 1, "agent": args.transfer_agent}
    g0, g1 = args.gpu_list[0], args.gpu_list[-1]
    peers: list[_Peer] = []
    try:
        ctx = _Peer("transfer-ctx", {**base, "role": "context"}, g0, reg)
        gen = _Peer("transfer-gen", {**base, "role": "generation"}, g1, reg)
        peers += [ctx, gen]
        if args.device == "cuda":
            ceil = _Peer("transfer-ceiling", {**base, "role": "ceiling"}, ",".join(dict.fromkeys(args.gpu_list)), reg)
            peers.append(ceil)
        else:
            ceil = None   # a host memcpy: bench/transfer.py's baseline, in this process
        infos = [p.result(args.start_timeout) for p in peers]
        cinfo = infos[0]
        _say("transfer", f"peers up: agent {cinfo['agent']}, {cinfo['block_bytes']:,} bytes per block")
        rows = []
        req = 1000
        for n in sizes:
            nb = blocks[n]
            want = ctx.call("fill", blocks=nb, seed=n)
            samples = []
            for _ in range(args.scale.transfer_repeats + 1):   # the first run connects the peers
                req += 1
                gen.call("zero", blocks=nb)
                gen.call("begin_receive", req=req, endpoint=cinfo["endpoint"], tokens=n, blocks=nb)
                ctx.call("begin_send", req=req, tokens=n, blocks=nb)
                gen.send("wait_receive", req=req, timeout=args.request_timeout)
                s = ctx.call("finish_send", wait_s=args.request_timeout + 10, req=req, timeout=args.request_timeout)
                r = gen.result(args.request_timeout + 10)
                if s["state"] != "done" or r["state"] != "done":
                    raise BenchError(f"transfer of {n} tokens failed: send {s['state']} ({s['error']}), "
                                     f"receive {r['state']} ({r['error']})")
                got = gen.call("checksum", blocks=nb)
                if got != want:
                    raise BenchError(f"transfer of {n} tokens: the received KV differs from the sent KV "
                                     f"(checksum {got:#x} != {want:#x})")
                samples.append({"seconds": r["t_recv_done"] - s["t0"], "send_seconds": s["t_send_done"] - s["t0"],
                                "bytes": s["bytes"], "descriptors": s["descriptors"]})
            samples = samples[1:]
            med = sorted(samples, key=lambda x: x["seconds"])[len(samples) // 2]
            nbytes = med["bytes"]
            reps = max(3, args.scale.transfer_repeats)
            if ceil is not None:
                copy = ceil.call("copy", wait_s=args.request_timeout, bytes=nbytes, repeats=reps)
            else:
                from bench.transfer import copy_baseline
                copy = {"seconds": copy_baseline("cpu", nbytes, reps), "kind": "host memcpy"}
            gbps = nbytes / med["seconds"] / 1e9
            cgbps = nbytes / copy["seconds"] / 1e9
            rows.append({"tokens": n, "blocks": nb, "bytes": nbytes, "seconds": med["seconds"],
                         "send_seconds": med["send_seconds"], "gbps": gbps,
                         "ceiling_seconds": copy["seconds"], "ceiling_gbps": cgbps,
                         "pct_of_ceiling": 100.0 * gbps / cgbps, "descriptors": med["descriptors"],
                         "repeats": len(samples),
                         "seconds_all": [x["seconds"] for x in samples]})
            _say("transfer", f"{n:>6} tokens: {nbytes / 1e6:,.1f} MB in {med['seconds'] * 1e3:,.2f} ms = "
                             f"{gbps:,.2f} GB/s ({rows[-1]['pct_of_ceiling']:.1f}% of {cgbps:,.2f} GB/s), "
                             f"{med['descriptors']} descriptors")
        where = f"GPU {g0} → GPU {g1}" if args.device == "cuda" else "cpu → cpu"
        return {"path": where + (", two processes" if g0 == g1 else ""), "agent": cinfo["agent"],
                "ceiling_kind": copy["kind"], "block_bytes": cinfo["block_bytes"], "rows": rows,
                "verified": "byte checksum of every transfer"}
    finally:
        for p in peers:
            with contextlib.suppress(OSError, BenchError):
                p.call("quiet", wait_s=10)
        for p in peers:
            p.close()


# ============================================================================ part 2/3: end to end

def _with_model(reqs: list[Req], model: str) -> list[Req]:
    return [dataclasses.replace(r, body={**r.body, "model": model}) for r in reqs]


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def warmup_plan(scale: Scale, reqs: list[Req], n_gen: int, seed: int, model: str,
                block_size: int = 16) -> list[tuple[Req | None, list[Req]]]:
    """Warm-up rounds: ``(long request or None, short requests)``.

    The workers capture a CUDA graph the first time they decode a (batch bucket, blocks bucket) pair
    (powers of two) and the first time they prefill a lone short prompt of a new 128-token bucket; a
    capture in the middle of the measured run would show up as a latency spike. So the warm-up walks
    the buckets the workload will touch: ``warmup_burst × n_gen`` short requests at once with
    max_tokens 2, 3, … (the decode batch shrinks through every size), first alone, then while one long
    request per distinct long-request blocks bucket decodes (its max_tokens outlasts the burst). Its
    prompts use their own seed: no prefix is shared with the workload."""
    k = scale.warmup_burst * n_gen
    rng = random.Random(seed + 7919)
    burst = build_workload(dataclasses.replace(scale, duration_s=k / 1000.0, short_rate=1000.0, long_count=0),
                           seed + 7919, model)

    def staggered(tag: int) -> list[Req]:
        out = []
        for i, r in enumerate(burst):
            body = {**r.body, "max_tokens": 2 + i,
                    "messages": [{"role": "user", "content": f"<w{tag}> " + r.body["messages"][0]["content"]}]}
            out.append(dataclasses.replace(r, arrival_s=0.0, body=body, max_tokens=2 + i))
        return out

    rounds: list[tuple[Req | None, list[Req]]] = [(None, staggered(0))]
    sizes: dict[int, int] = {}
    for r in reqs:
        if r.kind == "long":
            b = _bucket(math.ceil((r.prompt_tokens + r.max_tokens) / block_size))
            sizes[b] = max(sizes.get(b, 0), r.prompt_tokens)
    for j, (_, n) in enumerate(sorted(sizes.items())):
        max_tokens = k + 40
        ids = [rng.randrange(256) for _ in range(n)]
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        rounds.append((Req(-1 - j, "long", 0.0, "/v1/completions", body, n, max_tokens), staggered(j + 1)))
    return rounds


async def _warm_round(url: str, long: Req | None, shorts: list[Req], timeout_s: float) -> list[Result]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.get_running_loop()
        if long is None:
            return list(await asyncio.gather(*(send_one(session, url, r, loop.time(), timeout_s) for r in shorts)))
        first = asyncio.Event()
        lt = asyncio.create_task(send_one(session, url, long, loop.time(), timeout_s, first))
        # Start the burst once the long request decodes; without a streamed first token (a worker that
        # sends no chunk for text-less tokens) after a generous prefill estimate.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(first.wait(), 0.5 + long.prompt_tokens / 20_000)
        rest = await asyncio.gather(*(send_one(session, url, r, loop.time(), timeout_s) for r in shorts))
        return [await lt, *rest]


def _warmup(cluster: Cluster, scale: Scale, reqs: list[Req], seed: int, timeout_s: float) -> dict:
    n_gen = max(1, sum(1 for w in cluster.workers if w.spec.role in ("generation", "both")))
    t0 = time.monotonic()
    plan = warmup_plan(scale, reqs, n_gen, seed, cluster.model)
    for long, shorts in plan:
        res = asyncio.run(_warm_round(cluster.url, long, shorts, timeout_s))
        bad = [r.error for r in res if not r.ok]
        if bad:
            raise BenchError(f"{cluster.name}: a warm-up request failed: {bad[0]}; logs in {cluster.logdir}")
    return {"rounds": len(plan), "requests": sum(len(s) + (long is not None) for long, s in plan),
            "long_prompt_tokens": [long.prompt_tokens for long, _ in plan if long is not None],
            "seconds": round(time.monotonic() - t0, 1)}


_T0 = time.monotonic()


def _say(label: str, msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s {label}] {msg}", flush=True)


def run_config(label: str, args, reg: Registry, logdir: Path, specs: list[WorkerSpec], ctx_router: str | None,
               gen_router: str, reqs: list[Req], need_disagg: bool, pipeline: bool | None = None) -> dict:
    """Start one cluster, warm it up, replay the workload, stop it. ``{"skipped": why}`` when a
    disaggregated cluster turns out not to move KV (the generation worker answers 501)."""
    cluster = Cluster(label, args, reg, logdir, specs, ctx_router, gen_router)
    t0 = time.monotonic()
    info = {"workers": [{"name": s.name, "role": s.role, "gpu": s.gpu, "extra_args": list(s.extra)} for s in specs],
            "context_router": ctx_router, "generation_router": gen_router}
    try:
        _say(label, f"starting {len(specs)} workers, coordinator and fleet")
        cluster.start(args.start_timeout)
        info["startup_s"] = round(time.monotonic() - t0, 1)
        ctx_info = [w for w in cluster.workers if w.spec.role == "context"]
        if ctx_info:
            st, body = _http(ctx_info[0].url + "/server_info")
            tinfo = (json.loads(body).get("transfer") or {}) if st == 200 else {}
            info["transfer"] = tinfo
            info["transfer_pipeline"] = tinfo.get("pipeline")
            if pipeline is not None and tinfo.get("pipeline") is not pipeline:
                raise BenchError(f"{label}: the context worker reports transfer pipeline="
                                 f"{tinfo.get('pipeline')!r} in /server_info; this run needs {pipeline}")
        if need_disagg:
            mode = cluster.route_mode()
            if mode == "no_kv_transfer":
                why = ("the generation worker cannot receive KV (it answers 501 to generation_only: no KV "
                       "transfer in this worker build)")
                _say(label, f"skipped: {why}")
                return {**info, "skipped": why}
            if mode != "disaggregated":
                raise BenchError(f"{label}: the fleet placed a probe request as {mode!r}, not 'disaggregated'; "
                                 f"see {logdir}")
        info["warmup"] = _warmup(cluster, args.scale, reqs, args.seed, args.request_timeout)
        before = cluster.worker_metrics()
        _say(label, f"up in {info['startup_s']:g}s, warmed up in {info['warmup']['seconds']:g}s; running "
                    f"{len(reqs)} requests over {args.scale.duration_s:g}s")
        results = asyncio.run(run_requests(cluster.url, _with_model(reqs, cluster.model), args.request_timeout))
        stats = run_stats(results)
        stats["worker_metrics_delta"] = metrics_delta(before, cluster.worker_metrics())
        if need_disagg and stats["modes"].get("disaggregated", 0) < len(results):
            stats["warning"] = f"not every request was disaggregated: {stats['modes']}"
        return {**info, **stats}
    finally:
        cluster.stop()
        _say(label, "stopped")


def e2e_specs(args) -> dict[str, list[WorkerSpec]]:
    """Workers of each configuration. With two GPUs: aggregated = one ``both`` worker per GPU;
    disaggregated = context on the first GPU, generation on the last. With one GPU both processes share
    it; on the CPU ``gpu`` is None."""
    g0, g1 = args.gpu_list[0], args.gpu_list[-1]
    return {"aggregated": [WorkerSpec("both0", "both", g0), WorkerSpec("both1", "both", g1)],
            "disaggregated": [WorkerSpec("ctx", "context", g0), WorkerSpec("gen", "generation", g1)]}


# The worker's switch for pipelined KV transfer (``splitserve worker --transfer-pipeline on|off``).
PIPELINE_SWITCH = {"how": "flag", "pipelined": ["--transfer-pipeline", "on"],
                   "monolithic": ["--transfer-pipeline", "off"]}


# ============================================================================ report

def _f(x, fmt: str = "{:,.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def transfer_table(t: dict) -> str:
    if "skipped" in t:
        return f"Transfer: skipped — {t['skipped']}\n"
    lines = [f"Transfer ({t['path']}, agent {t['agent']}; ceiling: {t['ceiling_kind']})", "",
             "| prompt tokens | KV bytes | time ms | GB/s | ceiling GB/s | % of ceiling | descriptors |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in t["rows"]:
        lines.append(f"| {r['tokens']:,} | {r['bytes']:,} | {_f(r['seconds'] * 1e3, '{:,.2f}')} | "
                     f"{_f(r['gbps'], '{:,.2f}')} | {_f(r['ceiling_gbps'], '{:,.2f}')} | "
                     f"{_f(r['pct_of_ceiling'])}% | {r['descriptors']} |")
    return "\n".join(lines) + "\n"


def e2e_table(runs: dict) -> str:
    if not runs:
        return "skipped — not selected (--parts)\n"
    lines = ["| configuration | class | requests | errors | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | output tok/s | tokens timed |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    skipped = []
    for name, r in runs.items():
        if "skipped" in r:
            skipped.append(f"{name}: skipped — {r['skipped']}")
            continue
        for k in ("short", "long"):
            s = r[k]
            lines.append(f"| {name} | {k} | {s['requests']} | {s['errors']} | {_f(s['ttft_p50_ms'])} | "
                         f"{_f(s['ttft_p99_ms'])} | {_f(s['tpot_p50_ms'], '{:,.2f}')} | "
                         f"{_f(s['tpot_p99_ms'], '{:,.2f}')} | "
                         f"{_f(r['output_tokens_per_s']) if k == 'short' else ''} | "
                         f"{_f(s['timed_token_coverage'] and 100 * s['timed_token_coverage'], '{:.0f}')}% |")
    return "\n".join(lines + ([""] + skipped if skipped else [])) + "\n"


def targets(result: dict) -> dict:
    out: dict = {}
    t = result.get("transfer", {})
    rows = t.get("rows") or []
    if rows:
        row = min(rows, key=lambda r: abs(r["tokens"] - TARGET_TRANSFER_TOKENS))
        pct = row["pct_of_ceiling"]
        out["transfer"] = {"tokens": row["tokens"], "pct_of_ceiling": pct, "target_pct": TARGET_TRANSFER_PCT,
                           "met": pct is not None and pct >= TARGET_TRANSFER_PCT}
    else:
        out["transfer"] = {"met": None, "why": t.get("skipped", "not measured")}
    runs = result.get("e2e", {}).get("runs", {})
    agg, dis = runs.get("aggregated", {}), runs.get("disaggregated", {})
    if "short" in agg and "short" in dis:
        a99, d99 = agg["short"]["tpot_p99_ms"], dis["short"]["tpot_p99_ms"]
        at, dt = agg.get("output_tokens_per_s"), dis.get("output_tokens_per_s")
        ratio = (a99 / d99) if a99 and d99 else None
        tput = (dt / at) if at and dt else None
        cov = min(agg["short"]["timed_token_coverage"] or 0.0, dis["short"]["timed_token_coverage"] or 0.0)
        out["tpot"] = {"aggregated_p99_ms": a99, "disaggregated_p99_ms": d99, "ratio": ratio and round(ratio, 3),
                       "target_ratio": TARGET_TPOT_RATIO, "throughput_ratio": tput and round(tput, 3),
                       "timed_token_coverage": cov,
                       "met": bool(ratio and tput and ratio >= TARGET_TPOT_RATIO and tput >= 1.0)}
        if cov < MIN_TOKEN_COVERAGE:
            out["tpot"]["met"] = None
            out["tpot"]["why"] = (f"per-token arrival times cover only {cov:.0%} of the tokens: the worker "
                                  f"streams text chunks without token ids, so these are per-chunk gaps")
    else:
        out["tpot"] = {"met": None, "why": dis.get("skipped") or agg.get("skipped") or "not measured"}
    return out


def targets_line(tg: dict, dry: str | None) -> str:
    def verdict(m):
        return "n/a" if m is None else ("PASS" if m else "FAIL")
    t, p = tg["transfer"], tg["tpot"]
    a = (f"transfer at {t['tokens']:,} tokens {_f(t['pct_of_ceiling'])}% of ceiling (target ≥{TARGET_TRANSFER_PCT:g}%): "
         f"{verdict(t['met'])}" if "tokens" in t else f"transfer: n/a ({t['why']})")
    b = (f"short TPOT p99 aggregated/disaggregated {_f(p['ratio'], '{:.2f}')}× (target ≥{TARGET_TPOT_RATIO:g}×) at "
         f"{_f(p['throughput_ratio'], '{:.2f}')}× output tok/s (target ≥1×): {verdict(p['met'])}"
         + (f" ({p['why']})" if p.get("why") else "")
         if "ratio" in p else f"TPOT: n/a ({p['why']})")
    return f"targets: {a}; {b}" + (f"  [{dry}]" if dry else "")


def pipeline_table(pl: dict) -> str:
    if "skipped" in pl:
        return f"Pipelined vs monolithic: skipped — {pl['skipped']}\n"
    lines = ["| transfer | long TTFT p50 ms | long TTFT p99 ms | short TPOT p99 ms | output tok/s |",
             "|---|---:|---:|---:|---:|"]
    for name in ("pipelined", "monolithic"):
        r = pl.get(name, {})
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | |")
            continue
        lines.append(f"| {name} | {_f(r['long']['ttft_p50_ms'])} | {_f(r['long']['ttft_p99_ms'])} | "
                     f"{_f(r['short']['tpot_p99_ms'], '{:,.2f}')} | {_f(r['output_tokens_per_s'])} |")
    return "\n".join(lines) + "\n"


def render(result: dict) -> str:
    m = result["meta"]
    parts = [f"`{m['command']}`", "",
             f"{m['date']} · {m['machine']} · model {m['model']} ({m['dtype']}) on {m['device']} · "
             f"GPUs {m['gpus'] or 'none'} · scale {m['scale']} · seed {m['seed']}", "",
             transfer_table(result["transfer"]),
             "End to end (same requests, same run; TPOT = inter-token latency over all tokens):", "",
             e2e_table(result["e2e"]["runs"]),
             "Pipelined vs monolithic KV transfer (disaggregated):", "",
             pipeline_table(result["pipeline"]),
             result["targets_line"]]
    return "\n".join(parts) + "\n"


def results_title(result: dict) -> str:
    """The subsection one configuration owns under ``## disagg_e2e`` (a two-GPU run does not replace
    the one-GPU dry run)."""
    m = result["meta"]
    gpus = [g for g in (m.get("gpus") or "").split(",") if g]
    where = "CPU smoke run" if m["device"] == "cpu" else (
        f"{len(set(gpus))} GPUs" if len(set(gpus)) > 1 else "one GPU (dry run)")
    return f"### {m['model']} · {where} · scale {m['scale']}"


def write_results(path: Path, body: str, title: str) -> None:
    """Replace ``title``'s subsection of ``## disagg_e2e`` (or add it, or the section), keeping the rest."""
    replace_subsection(path, SECTION[3:], title, body)


def machine() -> str:
    desc = f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})"
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            if out:
                desc += "; GPUs: " + "; ".join(x.strip() for x in out.splitlines())
    return desc


# ============================================================================ main

def max_context(model: str) -> int:
    """The model's context length (preset or HF ``config.json``)."""
    path = Path(model)
    if path.is_dir():
        return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings") or 1 << 20)
    from worker.presets import preset_config
    return preset_config(model).max_position_embeddings


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K+V bytes of one token across all layers, from the preset or the HF ``config.json``."""
    elt = 2 if dtype == "bfloat16" else 4
    path = Path(model)
    if path.is_dir():
        c = json.loads((path / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * elt
    from worker.presets import preset_config
    c = preset_config(model)
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * elt


def default_num_blocks(args, reqs: list[Req], block_size: int = 16) -> int:
    """KV blocks per worker: the whole workload resident at once (+25%) or the largest transfer size,
    capped at ``--kv-gib`` GiB. Explicit because two workers sharing one GPU must not each size their
    pool from all of its memory."""
    need = sum(math.ceil((r.prompt_tokens + 64 + r.max_tokens) / block_size) for r in reqs)
    if "transfer" in args.parts:
        need = max(need, math.ceil(max(args.sizes) / block_size) + 16)
    need = int(need * 1.25) + 64
    cap = int(args.kv_gib * (1 << 30) // (kv_bytes_per_token(args.model, args.dtype) * block_size))
    if need > cap:
        print(f"note: the workload would use {need} KV blocks per worker; --kv-gib {args.kv_gib:g} caps the pool at "
              f"{cap} (the scheduler evicts cached prefixes and preempts beyond that)", flush=True)
    return max(64, min(need, cap))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="0,1",
                   help="GPU ids: '0,1' = context/first worker on GPU 0, generation/second on GPU 1; '0' = "
                        "one-GPU dry run, both processes share GPU 0; ignored with --device cpu")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="1b", help="worker model: preset (tiny, 1b, 8b) or HF directory")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--scale", type=parse_scale, default=None,
                   help="workload size: full (issue 8's sizes), dry, tiny, or a factor of full "
                        "(default: full with two GPUs, dry with one, tiny on cpu)")
    p.add_argument("--sizes", default=None,
                   help="transfer prompt sizes in tokens, comma separated (default: the scale's, "
                        "1024,4096,16384,65536 on GPUs)")
    p.add_argument("--parts", default="transfer,e2e,pipeline",
                   help="comma separated subset of transfer, e2e, pipeline")
    p.add_argument("--transfer-agent", choices=("auto", "nixl", "tcp", "shm"), default="auto",
                   help="KV transfer agent of the workers and of the transfer part (auto = nixl when installed)")
    p.add_argument("--fleet-workers", type=int, default=None, help="fleet processes (default: 2 on cuda, 1 on cpu)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: sized from the workload)")
    p.add_argument("--kv-gib", type=float, default=None,
                   help="cap of one worker's KV pool in GiB when sizing it (default 24 on cuda, 1 on cpu)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument for every worker (repeat; e.g. --worker-arg=--max-num-tokens=4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=None, help="seconds for a cluster to come up")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="log level of the started processes")
    p.add_argument("--log-dir", default=None, help="where process logs go (default: a new temp directory)")
    p.add_argument("--out", default=None, help="write every number as JSON to this file")
    p.add_argument("--write-results", action="store_true",
                   help="replace (or append) the '## disagg_e2e' section of bench/RESULTS.md")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="run nothing: print (and with --write-results record) the tables of a saved --out file")
    p.add_argument("--results", default=str(RESULTS), help=argparse.SUPPRESS)
    return p


def resolve_args(args) -> None:
    """Fill the defaults that depend on other flags; BenchError on inconsistent flags."""
    if args.device == "cpu":
        args.gpu_list = [None]
    else:
        gl = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if not gl or len(gl) > 2 or not all(g.isdigit() for g in gl):
            raise BenchError(f"--gpus: expected one or two GPU ids like '0' or '0,1', found {args.gpus!r}")
        args.gpu_list = gl
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.scale is None:
        args.scale = SCALES["tiny" if args.device == "cpu" else ("full" if len(args.gpu_list) == 2 else "dry")]
    try:
        args.sizes = ([int(x) for x in args.sizes.split(",") if x.strip()] if args.sizes
                      else list(args.scale.transfer_sizes))
    except ValueError:
        raise BenchError(f"--sizes: expected comma separated token counts, found {args.sizes!r}") from None
    if not args.sizes or any(s < 16 for s in args.sizes):
        raise BenchError(f"--sizes: every size must be at least 16 tokens, found {args.sizes}")
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in ("transfer", "e2e", "pipeline")]
    if bad or not parts:
        raise BenchError(f"--parts: expected a subset of transfer,e2e,pipeline, found {args.parts!r}")
    args.parts = parts
    if args.fleet_workers is None:
        args.fleet_workers = 2 if args.device == "cuda" else 1
    if args.kv_gib is None:
        args.kv_gib = 24.0 if args.device == "cuda" else 1.0
    if args.start_timeout is None:
        args.start_timeout = 600.0 if args.device == "cuda" else 120.0


def check_model(args) -> None:
    """The model exists and holds the workload's longest request (BenchError otherwise)."""
    try:
        limit = max_context(args.model)
    except (KeyError, OSError, ValueError) as e:
        raise BenchError(f"--model {args.model!r}: {e}") from None
    if "e2e" in args.parts or "pipeline" in args.parts:
        longest = max(r.prompt_tokens + 64 + r.max_tokens for r in build_workload(args.scale, args.seed, ""))
        if longest > limit:
            raise BenchError(f"--model {args.model}: its context is {limit} tokens, but the workload's longest "
                             f"request needs about {longest} (--scale {args.scale.name}); pick a smaller --scale "
                             f"factor or another model")


def dry_note(args) -> str | None:
    if args.device == "cpu":
        return "CPU smoke run: not a measurement"
    if len(args.gpu_list) == 1:
        return "one-GPU dry run: both workers share GPU 0, the ceiling is a device-local copy"
    return None


def run_all(args, reg: Registry, logdir: Path) -> dict:
    reqs = build_workload(args.scale, args.seed, model="")
    if args.num_blocks is None:
        args.num_blocks = default_num_blocks(args, reqs)
    result: dict = {"meta": {
        "command": "python bench/disagg_e2e.py " + shlex.join(args.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "model": args.model, "dtype": args.dtype, "device": args.device,
        "gpus": ",".join(g for g in args.gpu_list if g is not None), "scale": args.scale.name,
        "scale_params": dataclasses.asdict(args.scale), "seed": args.seed, "num_blocks": args.num_blocks,
        "fleet_workers": args.fleet_workers, "transfer_agent": args.transfer_agent, "logs": str(logdir),
        "dry_run": dry_note(args)}}
    t0 = time.monotonic()
    if "transfer" in args.parts:
        _say("transfer", f"prompt sizes {args.sizes}")
        result["transfer"] = transfer_part(args, reg, logdir)
    else:
        result["transfer"] = {"skipped": "not selected (--parts)"}
    specs = e2e_specs(args)
    switch = PIPELINE_SWITCH if "pipeline" in args.parts else None
    runs: dict = {}
    if "e2e" in args.parts:
        runs["aggregated"] = run_config("aggregated", args, reg, logdir, specs["aggregated"], None,
                                        "load_balancing", reqs, need_disagg=False)

    def disagg(mode: str | None) -> list[WorkerSpec]:
        return [dataclasses.replace(s, extra=tuple(switch[mode])) if mode and s.role == "context" else s
                for s in specs["disaggregated"]]

    if "e2e" in args.parts or "pipeline" in args.parts:
        # (b) is the pipelined run of part 3: its mode is set explicitly and checked, not assumed.
        runs["disaggregated"] = run_config("disaggregated", args, reg, logdir,
                                           disagg("pipelined" if switch else None), "kv_cache_aware",
                                           "kv_cache_aware", reqs, need_disagg=True,
                                           pipeline=True if switch else None)
    result["e2e"] = {"workload": workload_summary(reqs), "runs": runs}
    if "pipeline" not in args.parts:
        result["pipeline"] = {"skipped": "not selected (--parts)"}
    elif "skipped" in runs["disaggregated"]:
        result["pipeline"] = {"skipped": runs["disaggregated"]["skipped"]}
    else:
        mono = run_config("monolithic", args, reg, logdir, disagg("monolithic"), "kv_cache_aware",
                          "kv_cache_aware", reqs, need_disagg=True, pipeline=False)
        result["pipeline"] = {"switch": switch, "pipelined": runs["disaggregated"], "monolithic": mono}
    result["meta"]["wall_s"] = round(time.monotonic() - t0, 1)
    result["targets"] = targets(result)
    result["targets_line"] = targets_line(result["targets"], dry_note(args))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.from_json:
        try:
            result = json.loads(Path(args.from_json).read_text())
            text = render(result)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"disagg_e2e: --from-json {args.from_json}: not a saved result ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        print(text, end="")
        if args.write_results:
            write_results(Path(args.results), text, results_title(result))
            print(f"disagg_e2e: updated '{results_title(result)}' in {args.results}")
        return 0
    try:
        resolve_args(args)
        check_model(args)
    except BenchError as e:
        print(f"disagg_e2e: {e}", file=sys.stderr)
        return 2
    logdir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="splitserve-disagg-e2e-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"disagg_e2e: logs in {logdir}", flush=True)
    reg = Registry(logdir)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        result = run_all(args, reg, logdir)
    except BenchError as e:
        print(f"disagg_e2e: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("disagg_e2e: interrupted; stopping every started process", file=sys.stderr)
        return 130
    finally:
        # A second Ctrl-C must not cut the cleanup short and leave workers holding GPU memory.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            reg.stop_all()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old)
    text = render(result)
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"disagg_e2e: wrote {args.out}")
    if args.write_results:
        write_results(Path(args.results), text, results_title(result))
        print(f"disagg_e2e: updated '{results_title(result)}' in {args.results}")
    print(f"disagg_e2e: logs in {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
