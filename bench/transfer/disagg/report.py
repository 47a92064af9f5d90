"""The tables, the targets line against issue 8, and the ``## disagg_e2e`` section of
bench/RESULTS.md."""
from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from bench._common import replace_subsection

SECTION = "## disagg_e2e"
TARGET_TRANSFER_PCT = 80.0
TARGET_TRANSFER_TOKENS = 16384
TARGET_TPOT_RATIO = 2.0
MIN_TOKEN_COVERAGE = 0.95   # below this share of individually timed tokens, TPOT is not judged


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
    if "ttft" in result:
        from bench.transfer.disagg.ttft import ttft_target

        out["ttft"] = ttft_target(result["ttft"]) or {"met": None, "why": "not measured"}
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
    c = ""
    if "ttft" in tg:
        q = tg["ttft"]
        c = (f"; TTFT alone at {q['size']:,} tokens disaggregated/aggregated {q['ratio']:.3f}× "
             f"(target ≤{q['target']:g}×): {verdict(q['met'])}" if "ratio" in q
             else f"; TTFT alone: n/a ({q['why']})")
    return f"targets: {a}; {b}{c}" + (f"  [{dry}]" if dry else "")


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
    from bench.transfer.disagg.ttft import ttft_table

    m = result["meta"]
    parts = [f"`{m['command']}`", "",
             f"{m['date']} · {m['machine']} · model {m['model']} ({m['dtype']}) on {m['device']} · "
             f"GPUs {m['gpus'] or 'none'} · scale {m['scale']} · seed {m['seed']}", "",
             transfer_table(result["transfer"]),
             "End to end (same requests, same run; TPOT = inter-token latency over all tokens):", "",
             e2e_table(result["e2e"]["runs"]),
             "Pipelined vs monolithic KV transfer (disaggregated):", "",
             pipeline_table(result["pipeline"]),
             *([ttft_table(result["ttft"])] if "ttft" in result else []),
             result["targets_line"]]
    return "\n".join(parts) + "\n"


def results_title(result: dict) -> str:
    """The subsection one configuration owns under ``## disagg_e2e`` (a two-GPU run does not replace
    the one-GPU dry run)."""
    m = result["meta"]
    gpus = [g for g in (m.get("gpus") or "").split(",") if g]
    where = "CPU smoke run" if m["device"] == "cpu" else (
        f"{len(set(gpus))} GPUs" if len(set(gpus)) > 1 else "one GPU (dry run)")
    if m.get("parts") == ["ttft"]:   # its own subsection: it does not replace a workload run
        return f"### {m['model']} · {where} · TTFT alone"
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
