"""bench/transfer/disagg_e2e.py end to end on the CPU with the tiny model: real coordinator, fleet and worker
processes, real KV transfer between two processes, streaming requests through the fleet.

One smoke run (module fixture) feeds the section checks; the interrupt test starts its own run and
stops it with SIGINT part-way, then checks that no process it started is left.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.transfer import disagg_e2e as bench
from bench.transfer.disagg import report, workload
from splitserve_testing import clean_env
from splitserve_testing.proctable import alive

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "transfer" / "disagg_e2e.py"
# tcp: the NIXL agent (UCX) takes seconds to start per process on a busy 2-core CI machine.
SMOKE = ["--device", "cpu", "--model", "tiny", "--scale", "tiny", "--transfer-agent", "tcp"]
SCALE = workload.SCALES["tiny"]
N_SHORT = int(SCALE.duration_s * SCALE.short_rate)
N_LONG = SCALE.long_count


def _env() -> dict:
    return clean_env(PYTHONUNBUFFERED=1)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("disagg_e2e")
    out, logs, results = d / "out.json", d / "logs", d / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## worker\n\nkept as is\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMOKE, "--out", str(out), "--log-dir", str(logs),
                           "--write-results", "--results", str(results)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    wall = time.monotonic() - t0
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return {"result": json.loads(out.read_text()), "stdout": proc.stdout, "logs": logs, "results": results,
            "wall": wall}


def _check_run(run: dict, mode: str) -> None:
    """A configuration's stats: every request answered with its exact token count, sane latencies."""
    assert run["modes"] == {mode: N_SHORT + N_LONG}, run["modes"]
    assert run["error_samples"] == []
    for kind, n, max_tokens in (("short", N_SHORT, SCALE.short_max_tokens), ("long", N_LONG, SCALE.long_max_tokens)):
        s = run[kind]
        assert (s["requests"], s["ok"], s["errors"]) == (n, n, 0), s
        assert s["completion_tokens"] == n * max_tokens, s
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] < 60_000, s
        assert 0 <= s["tpot_p50_ms"] <= s["tpot_p99_ms"] < 60_000, s
        assert 0 < s["tpot_req_p50_ms"] <= s["tpot_req_p99_ms"], s
        assert 0 < s["timed_token_coverage"] <= 1.0, s
    assert run["output_tokens_per_s"] > 0
    total = N_SHORT * SCALE.short_max_tokens + N_LONG * SCALE.long_max_tokens
    # Tokens/s is measured over the run's span, which covers at least the arrival window.
    assert run["output_tokens_per_s"] <= total / (SCALE.duration_s * (N_SHORT - 1) / N_SHORT) + 1e-6
    assert run["startup_s"] > 0


def test_meta_and_logs(smoke):
    r = smoke["result"]
    m = r["meta"]
    assert (m["model"], m["device"], m["dtype"], m["scale"], m["gpus"]) == ("tiny", "cpu", "float32", "tiny", "")
    assert m["command"].startswith("python bench/transfer/disagg_e2e.py --device cpu")
    assert m["dry_run"] and "CPU" in m["dry_run"]
    logs = smoke["logs"]
    assert m["logs"] == str(logs)
    assert f"logs in {logs}" in smoke["stdout"]
    names = {p.name for p in logs.iterdir()}
    assert {"aggregated-both0.log", "aggregated-both1.log", "aggregated-fleet.log", "aggregated-coordinator.log",
            "pids"} <= names, names


def test_every_started_process_is_gone(smoke):
    pids = [int(line.split()[0]) for line in (smoke["logs"] / "pids").read_text().splitlines()]
    # two transfer peers, then clusters of 2 workers + coordinator + fleet (aggregated, disaggregated, …)
    assert len(pids) >= 2 + 4 + 4, pids
    assert _alive(pids, wait_s=10) == []


def test_transfer_section(smoke):
    t = smoke["result"]["transfer"]
    assert t["agent"] == "tcp"
    assert t["ceiling_kind"] == "host memcpy"
    assert [row["tokens"] for row in t["rows"]] == list(SCALE.transfer_sizes)
    # tiny: 4 layers x (K, V) x 16 tokens x 2 KV heads x 32 dims x fp32
    assert t["block_bytes"] == 4 * 2 * 16 * 2 * 32 * 4
    for row in t["rows"]:
        assert row["bytes"] == -(-row["tokens"] // 16) * t["block_bytes"], row
        assert row["seconds"] > 0 and row["ceiling_seconds"] > 0
        assert row["gbps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert row["ceiling_gbps"] == pytest.approx(row["bytes"] / row["ceiling_seconds"] / 1e9)
        assert row["pct_of_ceiling"] == pytest.approx(100 * row["gbps"] / row["ceiling_gbps"])
        assert row["descriptors"] >= 1 and row["repeats"] == SCALE.transfer_repeats


def test_aggregated_section(smoke):
    run = smoke["result"]["e2e"]["runs"]["aggregated"]
    assert run["generation_router"] == "load_balancing"
    assert [w["role"] for w in run["workers"]] == ["both", "both"]
    _check_run(run, "aggregated")
    deltas = run["worker_metrics_delta"]
    # load_balancing spreads the requests: both workers generated tokens during the workload
    for w in ("both0", "both1"):
        assert deltas[w].get("splitserve_worker_generation_tokens_total", 0) > 0, deltas


def _disagg(runs: dict) -> dict:
    run = runs["disaggregated"]
    # The torch worker moves KV itself now: a skipped disaggregated run is a failure.
    assert "skipped" not in run, run["skipped"]
    return run


def test_disaggregated_section(smoke):
    run = _disagg(smoke["result"]["e2e"]["runs"])
    assert [w["role"] for w in run["workers"]] == ["context", "generation"]
    assert run["context_router"] == run["generation_router"] == "kv_cache_aware"
    _check_run(run, "disaggregated")
    d = run["worker_metrics_delta"]
    # Prompts are prefilled on the context worker, tokens decoded on the generation worker.
    assert d["ctx"].get("splitserve_worker_prefill_tokens_total", 0) > 0, d
    assert d["ctx"].get("splitserve_worker_decode_tokens_total", 0) == 0, d
    assert d["gen"].get("splitserve_worker_decode_tokens_total", 0) > 0, d
    assert d["gen"].get("splitserve_worker_prefill_tokens_total", 0) == 0, d


def test_pipeline_section(smoke):
    r = smoke["result"]
    pl = r["pipeline"]
    if "skipped" in pl:
        pytest.fail(f"pipelined vs monolithic was skipped: {pl['skipped']}")
    assert pl["pipelined"] == r["e2e"]["runs"]["disaggregated"]
    _check_run(pl["monolithic"], "disaggregated")
    assert pl["monolithic"]["workers"][0]["extra_args"] == pl["switch"]["monolithic"]
    assert pl["pipelined"]["workers"][0]["extra_args"] == pl["switch"]["pipelined"]
    # what the context workers themselves reported in /server_info
    assert (pl["pipelined"]["transfer_pipeline"], pl["monolithic"]["transfer_pipeline"]) == (True, False)
    assert "| pipelined |" in smoke["stdout"] and "| monolithic |" in smoke["stdout"]


def test_report_table_and_results_file(smoke):
    out, r = smoke["stdout"], smoke["result"]
    assert "| prompt tokens | KV bytes |" in out and "| configuration | class |" in out
    assert r["targets_line"] in out and r["targets_line"].startswith("targets: ")
    assert set(r["targets"]) == {"transfer", "tpot"}
    assert r["targets"]["transfer"]["tokens"] == max(SCALE.transfer_sizes)   # the size nearest 16k
    text = smoke["results"].read_text()
    assert text.startswith("# Benchmark results\n\n## worker\n\nkept as is\n")
    assert text.count("## disagg_e2e") == 1 and "### tiny · CPU smoke run · scale tiny" in text
    assert "`python bench/transfer/disagg_e2e.py --device cpu" in text and r["targets_line"] in text


def test_write_results_replaces_only_its_subsection(tmp_path):
    p = tmp_path / "RESULTS.md"
    p.write_text("# Benchmark results\n\n## a\n\none\n\n## disagg_e2e\n\n### x\n\nold x\n\n### y\n\nold y\n\n"
                 "## b\n\ntwo\n")
    report.write_results(p, "new x\n", "### x")
    assert p.read_text() == ("# Benchmark results\n\n## a\n\none\n\n## disagg_e2e\n\n### x\n\nnew x\n\n"
                             "### y\n\nold y\n\n## b\n\ntwo\n")
    report.write_results(p, "new y\n", "### y")
    report.write_results(p, "z\n", "### z")
    # newest first; the replaced runs went to bench/results/history/disagg_e2e.md's stand-in
    assert p.read_text() == ("# Benchmark results\n\n## a\n\none\n\n## disagg_e2e\n\n### z\n\nz\n\n"
                             "### y\n\nnew y\n\n### x\n\nnew x\n\n## b\n\ntwo\n")
    hist = (tmp_path / "results" / "history" / "disagg_e2e.md").read_text()
    assert hist.index("old y") < hist.index("old x") and "new x" not in hist and "new y" not in hist
    q = tmp_path / "missing.md"
    report.write_results(q, "first\n", "### t")
    assert q.read_text() == "# Benchmark results\n\n## disagg_e2e\n\n### t\n\nfirst\n"


def test_from_json_renders_and_records_a_saved_run(smoke, tmp_path, capsys):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(smoke["result"]))
    results = tmp_path / "RESULTS.md"
    assert bench.main(["--from-json", str(saved), "--write-results", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert report.render(smoke["result"]) in out and smoke["result"]["targets_line"] in out
    text = results.read_text()
    assert "### tiny · CPU smoke run · scale tiny" in text
    assert text == smoke["results"].read_text().replace("## worker\n\nkept as is\n\n", "")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench.main(["--from-json", str(bad)]) == 2
    assert "not a saved result" in capsys.readouterr().err


def test_workload_is_fixed_by_the_seed():
    a = workload.build_workload(workload.SCALES["dry"], 3, "m")
    assert a == workload.build_workload(workload.SCALES["dry"], 3, "m")
    b = workload.build_workload(workload.SCALES["dry"], 4, "m")
    assert [r.body for r in a] != [r.body for r in b]
    longs = [r for r in a if r.kind == "long"]
    assert len(longs) == workload.SCALES["dry"].long_count
    lo, hi = workload.SCALES["dry"].long_prompt
    for r in longs:
        assert len(r.body["prompt"]) == r.prompt_tokens and r.prompt_tokens % 16 == 0
        assert lo - 16 <= r.prompt_tokens <= hi and all(0 <= t < 256 for t in r.body["prompt"])
        assert 0 < r.arrival_s < workload.SCALES["dry"].duration_s
    # no two prompts share their first block (no accidental prefix-cache hits across requests)
    firsts = {tuple(r.body["prompt"][:16]) for r in longs}
    assert len(firsts) == len(longs)
    shorts = [r for r in a if r.kind == "short"]
    assert [r.arrival_s for r in shorts] == sorted(r.arrival_s for r in shorts)
    assert all(r.body["stream"] and r.body["ignore_eos"] for r in a)


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "a,b"], "--gpus: expected one or two GPU ids"),
    (["--gpus", "0,1,2"], "--gpus: expected one or two GPU ids"),
    (["--parts", "transfer,nope"], "--parts: expected a subset"),
    (["--sizes", "8"], "--sizes: every size must be at least 16"),
    (["--sizes", "1k"], "--sizes: expected comma separated token counts"),
    (["--parts", "ttft", "--ttft-sizes", "2k"], "--ttft-sizes: expected comma separated token counts"),
    (["--parts", "ttft", "--ttft-sizes", "8"], "--ttft-sizes / --ttft-repeats: expected sizes ≥ 16"),
])
def test_bad_flags_are_clear_errors(argv, message, capsys):
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_scale_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--scale", "huge"])
    assert e.value.code == 2
    assert "--scale: expected one of full, dry, tiny" in capsys.readouterr().err


def _alive(pids: list[int], wait_s: float) -> list[int]:
    deadline = time.monotonic() + wait_s
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_interrupt_stops_every_process(tmp_path):
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *SMOKE, "--parts", "e2e", "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    try:
        pid_file = logs / "pids"
        deadline = time.monotonic() + 120
        # Interrupt once the first cluster's four processes exist and one worker answers.
        while time.monotonic() < deadline and proc.poll() is None:
            if pid_file.exists() and len(pid_file.read_text().splitlines()) >= 4 and any(
                    "worker ready" in p.read_text(errors="replace") for p in logs.glob("aggregated-both*.log")):
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (out, err)
    assert "interrupted; stopping every started process" in err
    pids = [int(line.split()[0]) for line in pid_file.read_text().splitlines()]
    assert len(pids) == 4
    assert _alive(pids, wait_s=10) == []


def test_ttft_part_one_request_at_a_time(tmp_path):
    """--parts ttft: aggregated, disaggregated (generation_first, pipelined) and monolithic, each its
    own cluster; every measured request of every size placed as its configuration says."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMOKE, "--parts", "ttft", "--ttft-sizes", "64,256",
                           "--ttft-repeats", "2", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    t = json.loads(out.read_text())["ttft"]
    assert t["sizes"] == [64, 256] and t["repeats"] == 2
    for name, mode in (("aggregated", "aggregated"), ("disaggregated", "disaggregated"),
                       ("monolithic", "disaggregated")):
        run = t["runs"][name]
        for size in ("64", "256"):
            row = run["sizes"][size]
            assert row["modes"] == {mode: 2} and len(row["ttft_ms"]) == 2, (name, row)
            assert 0 < row["p50_ms"] < 60_000
    assert t["runs"]["disaggregated"]["schedule_style"] == "generation_first"
    assert "| 256 |" in proc.stdout and "TTFT of one request alone" in proc.stdout
    assert "TTFT alone at" not in proc.stdout   # 8k not measured: no verdict


@pytest.mark.gpu
def test_one_gpu_dry_run_with_the_tiny_model(tmp_path):
    """The one-GPU path (both workers and both transfer ends on GPU 0, device-local ceiling)."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--gpus", "0", "--model", "tiny",
                           "--scale", "tiny", "--out", str(out), "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["meta"]["gpus"] == "0" and r["meta"]["dtype"] == "bfloat16"
    assert r["transfer"]["ceiling_kind"] == "device-local copy on one GPU"
    assert all(row["gbps"] > 0 and row["descriptors"] >= 1 for row in r["transfer"]["rows"])
    _check_run(r["e2e"]["runs"]["aggregated"], "aggregated")
    _check_run(r["e2e"]["runs"]["disaggregated"], "disaggregated")
