"""bench/routing/routing.py's bench/RESULTS.md section and PNG plot (matplotlib: the `bench` extra, never a
runtime dependency)."""
from __future__ import annotations

from pathlib import Path


def _ratios(r) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in r.items()) if isinstance(r, dict) else f"{r:g}"


def _pct(a: float, b: float | None) -> str:
    return f"{a / b:.0%}" if b else "–"


def _x(a: float, b: float | None) -> str:
    return f"{a / b:.2f}×" if b else "–"


def _row(r: dict, rr: dict, oracle: dict | None, bound: dict | None) -> str:
    o = oracle or {}
    tpot = r["tpot_p99_ms"] / rr["tpot_p99_ms"] - 1 if rr["tpot_p99_ms"] else float("nan")
    return (f"| {r['name']} | {r['hit_ratio']:.3f} | {_pct(r['hit_ratio'], o.get('hit_ratio'))} | "
            f"{_pct(r['hit_ratio'], (bound or {}).get('hit_ratio'))} | {r['ttft_p50_ms']:,.0f} | "
            f"{r['ttft_p99_ms']:,.0f} | {_x(r['ttft_p50_ms'], o.get('ttft_p50_ms'))} | "
            f"{r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} | {tpot:+.0%} | "
            f"{r['hotspot']:.2f} | {_moves(r)} | {_pred(r)} | {r['errors']} |")


def _moves(r: dict) -> str:
    return f"{r['moves']:.2f}" if "moves" in r else "–"     # runs before the column: none


def _pred(r: dict) -> str:
    """Actual over predicted cached tokens on the worst server (– where nothing was predicted:
    round robin, the load policies; runs from before the figure was kept)."""
    w = r.get("prediction_worst")
    return "–" if w is None else f"{w:.2f}"


TRACE_TITLES = {"synthetic": "Mooncake FAST'25 synthetic trace",
                "conversations": "multi-turn conversations (bench/routing/_conversations.py)"}


def section(out: dict) -> list[str]:
    m = out["meta"]
    lat = m["latency_model"]
    lines = [
        "## routing", "",
        "Script: `python bench/routing/routing.py` · earlier runs: "
        "[results/history/routing.md](results/history/routing.md).", "",
        f"`{m['command']}` · {m['date']} · {m['machine']}", "",
        "Each trace replayed open-loop through one fleet process and an external coordinator onto "
        "`--engine sim` workers (aggregated: generation servers only), at two offered loads "
        "(arrival compression per table; scaled with the worker count so the load per worker "
        "stays the same): *light* (round robin's TTFT p50 about 1 s or less) and *heavy* (near "
        f"saturation). Each 512-token trace block is {m['tokens_per_block']} synthetic tokens "
        f"(per-token costs × {512 // m['tokens_per_block']}); every latency runs the table's "
        "dilation × slower on the wall clock and is reported divided by it (H200-equivalent), "
        "so the host's own overhead counts that much less. Latency model (bench/routing/_trace.py, "
        f"H200 `1b`): prefill {lat['prefill_us_per_token']} µs/token + "
        f"{lat['prefill_us_per_token_per_kctx']} µs/token per 1000 tokens of context, decode step "
        f"{lat['decode_us_per_step']:.0f} µs + {lat['decode_us_per_seq']} µs/sequence + "
        f"{lat['decode_us_per_ctx_token']} µs/context token, chunked prefill budget "
        f"{lat['max_num_tokens']} tokens/step, batch ≤ {m['max_batch_size']}. KV capacity "
        f"(LRU): `--kv-ratio` {_ratios(m['kv_ratio'])} of the working set over the cluster, floored at "
        "twice the longest prompt per worker (the share held is per table). Hit ratio = Σ "
        "worker-reported cached tokens / Σ prompt tokens; *of oracle* / *of bound*: against the "
        "oracle's and the affinity bound's. TTFT × oracle: p50 over the oracle's. TPOT Δ: p99 "
        "against round robin's. Hotspot: the most loaded worker's time-averaged in-flight "
        "requests over the mean's. Moves: the share of a prefix tree's (synthetic: requests "
        "with the same first block) or a conversation's next requests placed on another server "
        "than its previous one. Cached / predicted: per server, the worker-reported cached "
        "tokens over the route receipts' `matched_tokens` (the KV index's prediction; the oracle's "
        "own), the lowest over servers with ≥ 1,024 predicted tokens.", "",
        "The **oracle** (outside the product, bench/routing/_routing_oracle.py) places with every "
        "worker's true cache (its KV events: evictions included) and true load: the least "
        f"`(queued prefill + {m.get('oracle_cache_weight', 2.0):g} × uncached) × prefill time + "
        "(queued + uncached) / chunk × decode step (its decoding requests and their context)`, "
        "with the workers' exact latency model, passing over a worker whose KV cannot hold the "
        "prompt's uncached blocks beside the distinct blocks its in-flight prompts hold, and "
        "sends to the worker directly (no fleet hop). "
        "The **affinity bound** (bench/routing/_routing_bound.py) is computed offline: each "
        "prefix tree (the trie cut where a subtree carries ≤ 1/n of the prompt tokens) whole on "
        "one server, each server a sequential LRU of its KV capacity, no concurrency — what the "
        "caches could hold; it is not a latency reference.", ""]
    if m.get("note"):
        lines += [m["note"], ""]
    traces = m.get("traces", {})
    for trace in dict.fromkeys(r["trace"] for r in out["runs"]):
        t = traces.get(trace, {})
        desc = (f"`{Path(t['file']).name}`, 1/{t['sample']} of the prefix trees" if "file" in t
                else f"{t.get('requests')} requests in {t.get('sessions')} sessions, mean input "
                     f"{t.get('mean_input'):,} / output {t.get('mean_output')} tokens, spec "
                     f"`{t.get('spec')}`" if t else "")
        lines += [f"### {TRACE_TITLES.get(trace, trace)}", "", desc, "",
                  "| workers · load | policy | hit ratio | of oracle | of bound | TTFT p50 ms | "
                  "TTFT p99 ms | TTFT p50 × oracle | TPOT p50 ms | TPOT p99 ms | TPOT p99 Δ | "
                  "hotspot | moves | cached / predicted, worst server | errors |",
                  "|---|---|" + "---:|" * 13]
        notes = []
        for run in [r for r in out["runs"] if r["trace"] == trace]:
            rows = run["rows"]
            rr = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
            oracle = next((r for r in rows if r["policy"] == "oracle"), None)
            bound = run.get("affinity_bound")
            head = f"{run['workers']} · {run['load']}"
            for r in rows:
                lines.append(f"| {head} " + _row(r, rr, oracle, bound))
                head = ""
            if bound:
                lines.append(f"| | affinity bound | {bound['hit_ratio']:.3f} | | 100% |" + " |" * 10)
            bad = [r for r in rows if r["errors"] or any(r["leases_in_flight"].values())
                   or r["workers_after"]["pinned"] or r["workers_after"]["running"]]
            notes.append(
                f"- {run['workers']} workers · {run['load']}: {run['requests']} requests, working "
                f"set {run['working_set_blocks']:,} blocks of 16, {run['blocks_per_worker']:,} "
                f"per worker (the cluster holds {run['kv_ratio_effective']:.0%} of it), arrivals "
                f"compressed {run['compress']:g}×, dilation {run['dilation']:g}; after every "
                "policy leases, running requests and pinned blocks "
                + ("were 0." if not bad else "NOT all 0: " + "; ".join(
                    f"{r['name']}: leases {r['leases_in_flight']}, workers {r['workers_after']}, "
                    f"errors {r['errors']} {r['error_samples']}" for r in bad)))
        lines += [""] + notes + [""]
    return lines


def _short(name: str) -> str:
    for a, b in (("kv_cache_aware", "kv"), ("load_tokens_weight", "tok"),
                 ("load_requests_weight", "req"), ("hotspot_factor", "hf"),
                 ("hotspot_slack", "hs"), ('"', ""), ("load_balancing", "lb"),
                 (" (outside the product)", "")):
        name = name.replace(a, b)
    return name


def plot(out: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]); no plot written")
        return False
    runs = out["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(5 * len(runs), 9), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for k, run in enumerate(runs):
        rows = run["rows"]
        ax = axes[0][k]
        names = [_short(r["name"]) for r in rows]
        ax.barh(range(len(rows)), [r["hit_ratio"] for r in rows],
                color=[colors[i % len(colors)] for i in range(len(rows))])
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("prefix-hit ratio (dashed: affinity bound)", fontsize=8)
        ax.set_title(f"{run.get('trace', '')} · {run['workers']} workers · {run.get('load', '')}",
                     fontsize=9)
        b = run.get("affinity_bound")
        if b:
            ax.axvline(b["hit_ratio"], color="k", ls="--", lw=1)
        ax = axes[1][k]
        for i, r in enumerate(rows):
            xs = r.get("ttft_ms_sorted") or []
            if xs:
                ax.plot(xs, [(j + 1) / len(xs) for j in range(len(xs))], label=_short(r["name"]),
                        lw=1.4, color=colors[i % len(colors)])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT ms (H200-equivalent)")
        ax.set_ylabel("CDF")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
