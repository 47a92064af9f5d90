"""CI smoke of bench/routing/routing.py: a few hundred requests of each workload — the Mooncake
trace and the generated multi-turn conversations — on 4 sim workers through a real fleet and
coordinator, asserting behaviour only (no timings): kv_cache_aware's worker-reported prefix-hit
ratio above round_robin's, no errors, every lease, running request and pinned block back to zero
afterwards, and the fleet's first-token reports reaching the coordinator (its lease phases)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.routing import _conversations as C
from bench.routing._trace import DEFAULT_TRACE

ROOT = Path(__file__).resolve().parents[2]


def _replay(tmp_path, traces: str) -> list[dict]:
    out = tmp_path / "routing.json"
    cmd = [sys.executable, "bench/routing/routing.py", "--traces", traces, "--workers", "4",
           "--loads", "light", "--sample", "8", "--limit", "240", "--conv-sessions", "48",
           "--max-output", "4", "--tokens-per-block", "16", "--compress", "300", "--dilation", "0.5",
           "--no-per-worker-load", "--policies", "round_robin,kv_cache_aware", "--quick",
           "--no-write", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(out.read_text())["runs"]


def _check(run: dict) -> None:
    rows = {r["policy"]: r for r in run["rows"]}
    rr, kv = rows["round_robin"], rows["kv_cache_aware"]
    for r in (rr, kv):
        assert r["requests"] == run["requests"] and r["errors"] == 0, r["error_samples"]
        assert r["leases_in_flight"] == {"context": 0, "generation": 0}
        assert r["workers_after"] == {"running": 0, "pinned": 0, "used": 0}
        assert r["prompt_tokens"] > 0
    assert kv["hit_ratio"] > rr["hit_ratio"], (run["trace"], kv["hit_ratio"], rr["hit_ratio"])
    # what the coordinator predicted is what the workers then reported, roughly
    kv_pred = sum(v["predicted_tokens"] for v in kv["coordinator_prediction"].values() if v)
    kv_act = sum(v["actual_cached_tokens"] for v in kv["coordinator_prediction"].values() if v)
    assert kv_pred > 0 and kv_act >= 0.5 * kv_pred
    # every streamed leg's first token was reported: its lease left prefill by the report
    assert kv["coordinator_leases"]["first_tokens_total"] == kv["requests"]
    assert kv["coordinator_leases"]["prefill_timeouts_total"] == 0


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(),
                    reason=f"the Mooncake trace is read from {DEFAULT_TRACE} (outside the repository, "
                           "never copied into it), absent here")
def test_both_workloads_kv_aware_beats_round_robin(tmp_path):
    runs = _replay(tmp_path, "synthetic,conversations")
    assert [r["trace"] for r in runs] == ["synthetic", "conversations"]
    for run in runs:
        assert run["requests"] == 240
        _check(run)
    assert 0 < runs[1]["affinity_bound"]["hit_ratio"] <= 1


def test_conversation_generator_is_seeded_and_grows_each_session(tmp_path):
    spec = C.ConversationSpec(sessions=12, seed=3)
    a, b = C.generate(spec), C.generate(spec)
    assert a == b and a != C.generate(C.ConversationSpec(sessions=12, seed=4))
    assert [r["timestamp"] for r in a] == sorted(r["timestamp"] for r in a)
    by_session: dict = {}
    for r in a:
        by_session.setdefault(r["session"], []).append(r)
        assert len(r["hash_ids"]) == -(-r["input_length"] // C.TRACE_BLOCK)
    system = {tuple(s[0]["hash_ids"][:spec.system_tokens // C.TRACE_BLOCK]) for s in by_session.values()}
    assert 1 < len(system) <= spec.system_prompts          # shared system prompts
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt["input_length"] > prev["input_length"] + prev["output_length"]
            shared = prev["input_length"] // C.TRACE_BLOCK  # the previous prompt's full blocks
            assert nxt["hash_ids"][:shared] == prev["hash_ids"][:shared]
            assert nxt["hash_ids"][shared] not in prev["hash_ids"]
            assert nxt["timestamp"] >= prev["timestamp"]
    path = C.write(spec, tmp_path / "c.jsonl")              # the Mooncake format, one object a line
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == a and {"timestamp", "input_length", "output_length", "hash_ids"} <= set(rows[0])
