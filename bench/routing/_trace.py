"""Mooncake-format request traces for bench/routing/routing.py (and the CI smoke test): loading, root
sampling, deterministic token synthesis, the H200 `1b` latency model and the per-policy summary.

Trace format (Mooncake's; the trace files are not part of this repository): one JSON object a
line with `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one id per 512-token
block; equal ids at equal positions mean equal content, and so an equal prefix).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512          # tokens per hash id in the trace format
_ROOT = Path(__file__).resolve().parents[2]
# ../shared beside the checkout (a worktree one level deeper also finds it); never copied here
DEFAULT_TRACE = next((p for p in (_ROOT / "shared", _ROOT.parent / "shared", _ROOT.parent.parent / "shared")
                      if (p / "traces" / "synthetic_trace.jsonl").is_file()),
                     _ROOT.parent / "shared") / "traces" / "synthetic_trace.jsonl"

# H200, model `1b`, bfloat16, CUDA graphs on (bench/RESULTS.md "worker" section, 2026-11-29):
#   prefill ~200k tokens/s at 1024 tokens -> 5.0 µs/token;
#   decode 494 / 3,374 / 9,106 tokens/s at batch 1 / 8 / 32 (1024-token prompt + 64 steps)
#   -> 2.024 / 2.371 / 3.514 ms per step = 1976 µs + 48.1 µs per sequence. Of the 48.1 µs, the
#   K/V read of ~1056 context tokens (32 KiB each) at the measured ~27% of 4126 GB/s is
#   0.0297 µs per context token (31.4 µs), leaving 16.7 µs per sequence.
#   Prefill attention is not in that measurement (1024 tokens): from FLOPs, 4·16 layers·2048 ·ctx
#   against 2·1.236 GFLOP of GEMMs per token, +5.3% per 1000 context tokens -> 0.265 µs per
#   token per 1000 tokens of context (an estimate, not a measurement).
H200_1B = {"prefill_us_per_token": 5.0, "prefill_us_per_token_per_kctx": 0.265,
           "decode_us_per_step": 1976.0, "decode_us_per_seq": 16.7,
           "decode_us_per_ctx_token": 0.0297, "max_num_tokens": 8192}


@dataclass(slots=True)
class Req:
    i: int
    t_s: float                  # arrival, seconds of trace time
    input_length: int
    output_length: int
    hash_ids: list
    session: int | None = None  # a generated conversation's session (bench/routing/_conversations.py)


def load(path: Path, sample: int = 1, offset: int = 0, limit: int | None = None) -> list[Req]:
    """The trace's requests whose first block id is `offset` mod `sample` (root sampling: whole
    prefix trees are kept or dropped together, so the sharing inside a kept tree is intact)."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if r["hash_ids"] and r["hash_ids"][0] % sample != offset % sample:
                continue
            out.append(Req(len(out), r["timestamp"] / 1000.0, int(r["input_length"]),
                           max(1, int(r["output_length"])), list(r["hash_ids"]), r.get("session")))
            if limit is not None and len(out) >= limit:
                break
    if out:
        t0 = out[0].t_s
        for r in out:
            r.t_s -= t0
    return out


class Tokens:
    """Prompt token ids from hash ids: `per_block` ids drawn from a generator seeded by the id,
    so equal ids give equal tokens (the trace's sharing, exactly) and the prompt is cut to
    `input_length` scaled by per_block/512."""

    def __init__(self, per_block: int, vocab: int = 128000):
        self.per_block = per_block
        self.vocab = vocab
        self._memo: dict[int, list[int]] = {}

    def block(self, h: int) -> list[int]:
        b = self._memo.get(h)
        if b is None:
            b = self._memo[h] = np.random.default_rng(h + 1).integers(
                1, self.vocab, self.per_block).tolist()
        return b

    def prompt(self, r: Req) -> list[int]:
        n = max(1, math.ceil(r.input_length * self.per_block / TRACE_BLOCK))
        ids: list[int] = []
        for h in r.hash_ids:
            ids.extend(self.block(h))
            if len(ids) >= n:
                break
        return ids[:n]


def working_set_blocks(reqs: list[Req], per_block: int, block_size: int) -> int:
    """Distinct routing blocks (of `block_size` tokens) over all prompts."""
    return len({h for r in reqs for h in r.hash_ids}) * per_block // block_size


def sim_model(per_block: int, dilation: float) -> dict:
    """The workers' latency model as `routing_model` reads it (seconds on the wall clock, per
    synthetic token): what `sim_flags` configures, less the per-kctx prefill term."""
    s, m, d = TRACE_BLOCK / per_block, H200_1B, dilation
    return {"prefill_s_per_token": m["prefill_us_per_token"] * s * d / 1e6,
            "chunk_tokens": max(16, int(m["max_num_tokens"] / s) // 16 * 16),
            "decode_s_per_step": m["decode_us_per_step"] * d / 1e6,
            "decode_s_per_request": m["decode_us_per_seq"] * d / 1e6,
            "decode_s_per_context_token": m["decode_us_per_ctx_token"] * s * d / 1e6}


def sim_flags(per_block: int, dilation: float) -> list[str]:
    """Worker flags for the H200 `1b` latency model. One synthetic token stands for
    512/per_block real tokens, so per-token costs scale by that; `dilation` slows everything
    (wall time = model time x dilation) so the 2-core host's own overhead stays small."""
    s = TRACE_BLOCK / per_block
    m, d = H200_1B, dilation
    return ["--sim-prefill-us-per-token", f"{m['prefill_us_per_token'] * s * d:.4f}",
            "--sim-prefill-us-per-token-per-kctx", f"{m['prefill_us_per_token_per_kctx'] * s * s * d:.4f}",
            "--sim-decode-us-per-step", f"{m['decode_us_per_step'] * d:.2f}",
            "--sim-decode-us-per-seq", f"{m['decode_us_per_seq'] * d:.3f}",
            "--sim-decode-us-per-ctx-token", f"{m['decode_us_per_ctx_token'] * s * d:.5f}",
            "--max-num-tokens", str(max(16, int(m["max_num_tokens"] / s) // 16 * 16))]


@dataclass(slots=True)
class Result:
    i: int
    server: str | None = None
    status: int = 0
    error: str | None = None
    t_send: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    matched_tokens: int | None = None
    extra: dict = field(default_factory=dict)


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


# A server predicted fewer tokens than this is left out of the worst ratio (a handful of
# requests says nothing about the index).
PREDICTION_MIN_TOKENS = 1024


def worst_prediction(per_server: dict) -> float | None:
    """The lowest actual/predicted cached-token ratio over the servers with at least
    PREDICTION_MIN_TOKENS predicted (None: none had): ``per_server`` maps a server to
    ``[predicted, actual]``."""
    ratios = [a / p for p, a in per_server.values() if p >= PREDICTION_MIN_TOKENS]
    return min(ratios) if ratios else None


def summarize(results: list[Result], servers: list[str], dilation: float) -> dict:
    """Per-policy numbers in model time (wall / dilation)."""
    ok = [r for r in results if r.status == 200 and r.error is None and r.t_first is not None]
    d = dilation
    ttft = [(r.t_first - r.t_send) / d for r in ok]
    tpot = [(r.t_end - r.t_first) / d / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    predicted = sum(r.matched_tokens or 0 for r in ok)
    t0 = min((r.t_send for r in results), default=0.0)
    t1 = max((r.t_end or r.t_send for r in results), default=0.0)
    span = max(1e-9, (t1 - t0) / d)
    per = {s: 0 for s in servers}
    for r in ok:
        if r.server in per:
            per[r.server] += 1
    # in-flight per server over time, from each request's [send, end] interval
    grid = np.linspace(t0, t1, 400)
    counts = np.zeros((len(servers), len(grid)))
    idx = {s: k for k, s in enumerate(servers)}
    for r in ok:
        k = idx.get(r.server)
        if k is not None:
            counts[k] += (grid >= r.t_send) & (grid <= r.t_end)
    mean = counts.mean(axis=0)
    busy = mean > 0.5
    ratio = counts.max(axis=0)[busy] / mean[busy] if busy.any() else np.array([float("nan")])
    per_avg = counts.mean(axis=1)       # each server's time-averaged in-flight requests
    hotspot = float(per_avg.max() / per_avg.mean()) if per_avg.size and per_avg.mean() > 0 else float("nan")
    n_tokens = sum(r.completion_tokens for r in ok)
    # predicted (the route receipt's matched tokens) against actual (the worker's cached tokens)
    # per server: the index's prediction quality, which issue 40 wants >= 0.9 on every server
    pred: dict[str, list[int]] = {}
    for r in ok:
        if r.server is not None and r.matched_tokens is not None:
            pa = pred.setdefault(r.server, [0, 0])
            pa[0] += r.matched_tokens
            pa[1] += r.cached_tokens
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({(r.error or str(r.status))[:120] for r in results
                                 if r not in ok})[:3],
        "prompt_tokens": prompt, "cached_tokens": cached, "predicted_tokens": predicted,
        "prediction_per_server": pred, "prediction_worst": worst_prediction(pred),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": _pct(ttft, 50) * 1e3, "ttft_p99_ms": _pct(ttft, 99) * 1e3,
        "tpot_p50_ms": _pct(tpot, 50) * 1e3, "tpot_p99_ms": _pct(tpot, 99) * 1e3,
        "throughput_tok_s": n_tokens / span, "throughput_req_s": len(ok) / span,
        "span_s": span, "per_server": per,
        "per_server_min_max": (min(per.values()) if per else 0, max(per.values()) if per else 0),
        "hotspot": hotspot,
        "inflight_max_over_mean_mean": float(np.mean(ratio)),
        "inflight_max_over_mean_p99": float(np.percentile(ratio, 99)),
        "inflight_peak": float(counts.max()) if counts.size else 0.0,
        "ttft_ms_sorted": sorted(x * 1e3 for x in ttft),
    }
