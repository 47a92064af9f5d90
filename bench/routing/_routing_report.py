"""bench/routing/routing.py's bench/RESULTS.md section and PNG plot (matplotlib: the `bench` extra, never a
runtime dependency)."""
from __future__ import annotations

from pathlib import Path


def _row(r: dict, rr: dict, oracle: dict | None) -> str:
    lo, hi = r["per_server_min_max"]
    vs_rr = rr["ttft_p50_ms"] / r["ttft_p50_ms"] if r["ttft_p50_ms"] else float("nan")
    tpot = r["tpot_p99_ms"] / rr["tpot_p99_ms"] - 1 if rr["tpot_p99_ms"] else float("nan")
    of_oracle = (f"{r['hit_ratio'] / oracle['hit_ratio']:.0%}"
                 if oracle and oracle["hit_ratio"] else "–")
    return (f"| {r['name']} | {r['hit_ratio']:.3f} | {of_oracle} | {r['ttft_p50_ms']:,.0f} | "
            f"{r['ttft_p99_ms']:,.0f} | {vs_rr:.2f}× | {r['tpot_p50_ms']:.2f} | "
            f"{r['tpot_p99_ms']:.2f} | {tpot:+.0%} | {r['throughput_tok_s']:,.0f} | "
            f"{r['throughput_req_s']:.1f} | {lo}–{hi} | {r['hotspot']:.2f} | "
            f"{r['inflight_max_over_mean_mean']:.2f} | {r['errors']} |")


def section(out: dict) -> list[str]:
    m = out["meta"]
    lat = m["latency_model"]
    lines = [
        "## routing", "",
        f"`{m['command']}` · {m['date']} · {m['machine']} · trace `{Path(m['trace']).name}`", "",
        "Mooncake's FAST'25 synthetic trace replayed open-loop through one fleet process and an "
        "external coordinator onto `--engine sim` workers (aggregated: generation servers only). "
        f"Arrivals compressed {m['compress']:g}× at 8 workers (trace time / {m['compress']:g}; "
        "scaled with the worker count, per size below); each 512-token "
        f"trace block is {m['tokens_per_block']} synthetic tokens (per-token costs × "
        f"{512 // m['tokens_per_block']}); every latency runs {m['dilation']:g}× slower on the wall "
        "clock and is reported divided by that (H200-equivalent), so this 2-core host's overhead "
        "counts that much less. Latency model (bench/routing/_trace.py, from the H200 `1b` rows of the "
        f"worker section): prefill {lat['prefill_us_per_token']} µs/token + "
        f"{lat['prefill_us_per_token_per_kctx']} µs/token per 1000 tokens of context (FLOP "
        f"estimate), decode step {lat['decode_us_per_step']:.0f} µs + {lat['decode_us_per_seq']} "
        f"µs/sequence + {lat['decode_us_per_ctx_token']} µs/context token, chunked prefill "
        f"budget {lat['max_num_tokens']} tokens/step, batch ≤ {m['max_batch_size']}. KV "
        f"capacity (LRU): `--kv-ratio {m['kv_ratio']:g}` of the sampled working set over the "
        "cluster, floored at twice the longest prompt per worker (the effective share is given "
        "per size below). Hit ratio = Σ worker-reported cached tokens / Σ prompt tokens. Hotspot = the most "
        "loaded worker's time-averaged in-flight requests / the mean's; \"inst.\" = the mean over "
        "time of max/mean in-flight. TPOT Δ = p99 against round_robin's. Oracle: outside the "
        "product (bench/routing/_routing_oracle.py), placed with the workers' true caches and loads and "
        "sent to the worker directly (no fleet hop).", ""]
    for run in out["runs"]:
        rows = run["rows"]
        rr = next(r for r in rows if r["policy"] == "round_robin")
        oracle = next((r for r in rows if r["policy"] == "oracle"), None)
        lines += [
            f"### {run['workers']} workers · {run['requests']} requests (1/{run['sample']} of the "
            f"prefix trees) · working set {run['working_set_blocks']:,} blocks of 16 · "
            f"{run['blocks_per_worker']:,} blocks per worker (the cluster holds "
            f"{run.get('kv_ratio_effective', out['meta']['kv_ratio']):.0%} of the working set)", "",
            f"Arrivals compressed {run['compress']:g}×, dilation {run['dilation']:g}.", "",
            "| policy | hit ratio | of oracle | TTFT p50 ms | TTFT p99 ms | TTFT p50 vs RR | "
            "TPOT p50 ms | TPOT p99 ms | TPOT p99 Δ | tokens/s | req/s | requests/worker | "
            "hotspot | inst. | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [_row(r, rr, oracle) for r in rows]
        bad = [r for r in rows if r["errors"] or any(r["leases_in_flight"].values())
               or r["workers_after"]["pinned"] or r["workers_after"]["running"]]
        lines += ["", "After every policy: leases in flight, running requests and pinned blocks "
                  + ("were all 0." if not bad else
                     "NOT all 0: " + "; ".join(f"{r['name']}: leases {r['leases_in_flight']}, "
                                               f"workers {r['workers_after']}, errors "
                                               f"{r['errors']} {r['error_samples']}" for r in bad)),
                  ""]
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
    fig, axes = plt.subplots(2, len(runs), figsize=(7 * len(runs), 10), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for k, run in enumerate(runs):
        rows = run["rows"]
        ax = axes[0][k]
        names = [_short(r["name"]) for r in rows]
        ax.barh(range(len(rows)), [r["hit_ratio"] for r in rows],
                color=[colors[i % len(colors)] for i in range(len(rows))])
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("prefix-hit ratio (worker-reported cached / prompt tokens)")
        ax.set_title(f"{run['workers']} workers, {run['requests']} requests")
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
