"""A multi-turn conversation workload in the Mooncake trace format (bench/routing/_trace.py reads
it like the synthetic trace): seedable, so the same arguments give the same file.

Sessions arrive as a Poisson process. Each picks one of a few shared system prompts and an output
length of its own (log-normal around `output_median`); each turn's prompt is the system prompt,
the whole history (every earlier user message and answer) and the new user message, so it grows
turn by turn, and the next turn arrives a think time (exponential) after the previous one. In the
trace format a prompt is one hash id per 512-token block: a turn keeps the ids of the previous
turn's *full prompt blocks* (equal content: a prefix cache can reuse them) and gets fresh ids for
the rest (the previous answer, the previous prompt's partial last block, the new message).

Usage: python bench/routing/_conversations.py OUT.jsonl [--sessions N] [--seed S] ...
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512


@dataclass(frozen=True)
class ConversationSpec:
    sessions: int = 160
    session_rate_per_s: float = 0.25       # session arrivals (trace time)
    turns_min: int = 2
    turns_max: int = 12
    system_prompts: int = 4                # distinct shared system prompts
    system_tokens: int = 2048
    user_tokens_median: int = 500
    output_median: int = 200               # per-session output lengths scatter around this
    output_sigma: float = 0.6
    think_s_mean: float = 30.0
    max_input_tokens: int = 48_000         # a session ends before its prompt would pass this
    seed: int = 0


def generate(spec: ConversationSpec) -> list[dict]:
    """The trace's requests, sorted by arrival: {timestamp (ms), input_length, output_length,
    hash_ids, session, turn}."""
    rng = np.random.default_rng(spec.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    sys_blocks = spec.system_tokens // TRACE_BLOCK      # full blocks: shared by every session
    systems = [fresh(sys_blocks) for _ in range(spec.system_prompts)]
    out = []
    t = 0.0
    for s in range(spec.sessions):
        t += float(rng.exponential(1.0 / spec.session_rate_per_s))
        system = systems[int(rng.integers(spec.system_prompts))]
        out_mean = spec.output_median * math.exp(spec.output_sigma * float(rng.standard_normal()))
        turns = int(rng.integers(spec.turns_min, spec.turns_max + 1))
        content = spec.system_tokens       # tokens of the conversation so far (before the message)
        ids = list(system)                 # ids of its full blocks that a next prompt shares
        at = t
        for turn in range(turns):
            user = max(16, int(rng.lognormal(math.log(spec.user_tokens_median), 0.5)))
            n_in = content + user
            if n_in > spec.max_input_tokens:
                break
            n_blocks = math.ceil(n_in / TRACE_BLOCK)
            hash_ids = ids + fresh(n_blocks - len(ids))
            n_out = max(1, int(rng.lognormal(math.log(max(1.0, out_mean)), 0.3)))
            out.append({"timestamp": int(at * 1000), "input_length": n_in, "output_length": n_out,
                        "hash_ids": hash_ids, "session": s, "turn": turn})
            # the next prompt shares this prompt's full blocks; its partial last block, the answer
            # and the next message are new content
            ids = hash_ids[:n_in // TRACE_BLOCK]
            content = n_in + n_out
            at += float(rng.exponential(spec.think_s_mean))
    out.sort(key=lambda r: (r["timestamp"], r["session"], r["turn"]))
    return out


def write(spec: ConversationSpec, path: Path) -> Path:
    rows = generate(spec)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return path


def describe(rows: list[dict]) -> dict:
    ins = [r["input_length"] for r in rows]
    return {"requests": len(rows), "sessions": len({r["session"] for r in rows}),
            "mean_input": round(float(np.mean(ins))), "mean_output": round(float(np.mean(
                [r["output_length"] for r in rows]))),
            "span_s": round(rows[-1]["timestamp"] / 1000 - rows[0]["timestamp"] / 1000, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    for k, v in asdict(ConversationSpec()).items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    a = vars(ap.parse_args(argv))
    out = a.pop("out")
    spec = ConversationSpec(**a)
    write(spec, out)
    print(json.dumps({"spec": asdict(spec), **describe(generate(spec))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
