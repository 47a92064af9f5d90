"""The fixed workload of the end-to-end parts: its sizes (``--scale``), the seeded request list
every configuration replays, and the warm-up rounds that walk the CUDA-graph buckets first."""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
from dataclasses import dataclass


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
    "tiny": Scale("tiny", duration_s=1.5, short_rate=4.0, short_prompt=(24, 48), short_max_tokens=6,
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
