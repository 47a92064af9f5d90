"""The streaming client: sends every request at its arrival time, records the arrival of every
streamed token, and turns those times into TTFT / TPOT percentiles and output tokens/s."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import dataclass, field

import aiohttp

from bench.transfer.disagg.workload import Req


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
