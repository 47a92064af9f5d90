"""`splitserve worker` as real processes: flags and environment, readiness line, SIGTERM drain,
startup errors, a torch worker end to end (prefix hits and KV events vs snapshot), many sim workers."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from router.events import decode_zmq
from router.kv_index import KvIndex
from tests.worker.conftest import REPO, metric, spawn_worker, stop_worker


async def test_sim_worker_flags_env_and_sigterm_drain(http):
    proc, url = spawn_worker("--engine", "sim", "--role", "context", "--max-batch-size", "7",
                             "--drain-timeout", "1.5",
                             env={"SPLITSERVE_BLOCK_SIZE": "8", "SPLITSERVE_MAX_BATCH_SIZE": "3",
                                  "SPLITSERVE_SIM_DECODE_US_PER_STEP": "20000"})
    try:
        async with http.get(url + "/server_info") as r:
            info = await r.json()
        assert info["block_size"] == 8, "the environment sets a flag"
        assert info["max_batch_size"] == 7, "the command line beats the environment"
        assert info["role"] == "context" and info["engine"] == "sim"
        async with http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 4
        # SIGTERM: a short request in flight finishes, a long one is aborted at the drain
        # timeout, new requests and /health get 503 meanwhile, and the process exits 0
        short = await http.post(url + "/v1/completions", json={
            "prompt": "short", "max_tokens": 20, "stream": True})
        long = await http.post(url + "/v1/completions", json={
            "prompt": "long", "max_tokens": 5000, "stream": True})
        await short.content.readline()
        await long.content.readline()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with http.get(url + "/health") as r:
            assert r.status == 503
        async with http.post(url + "/v1/completions", json={"prompt": "late"}) as r:
            assert r.status == 503 and "draining" in (await r.json())["error"]["message"]
        short_body = (await asyncio.wait_for(short.read(), 10)).decode()
        long_body = (await asyncio.wait_for(long.read(), 10)).decode()
        assert '"finish_reason":"length"' in short_body
        assert '"finish_reason":"abort"' in long_body
        assert await asyncio.to_thread(proc.wait, 20) == 0
        assert b"shutting down" in proc.output
    finally:
        stop_worker(proc)


def test_repeated_sigterm_still_exits_0():
    """A supervisor that signals twice (the second landing after the drain, while the interpreter
    tears down) gets exit 0, not death by SIGTERM (splitserve_cli.entry ignores signals once the
    subcommand returned). Signals 0-50 ms apart, the idle sim worker's whole shutdown being a few
    ms: the later ones hit the teardown window."""
    for gap in (0.0, 0.01, 0.05):
        proc, _ = spawn_worker("--engine", "sim", "--role", "context")
        try:
            proc.send_signal(signal.SIGTERM)
            time.sleep(gap)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, (gap, bytes(proc.output)[-2000:])
        finally:
            stop_worker(proc)


def test_startup_errors_exit_2_with_a_message():
    procs = []
    for args, want in [(["--model", "/no/such/dir", "--engine", "sim"], b"neither a preset"),
                       (["--engine", "sim", "--block-size", "0"], b"--block-size must be >= 1"),
                       (["--engine", "torch", "--tp-size", "3"], b"--tp-size 3 must divide"),
                       (["--engine", "torch", "--tp-size", "2", "--async-scheduling", "on"],
                        b"--async-scheduling on needs a single-rank worker"),
                       (["--engine", "sim", "--async-scheduling", "sometimes"], b"invalid choice")]:
        # all at once: each is a Python start (two import torch), and a 2-core box runs two together
        procs.append((args, want, subprocess.Popen(
            [sys.executable, "-m", "splitserve_cli", "worker", "--port", "0", *args], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})))
    try:
        for args, want, p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 2, (args, out, err)
            assert want in err, err
    finally:   # a worker that did start (a check gone) must not outlive the test
        for *_, p in procs:
            p.kill()
            p.wait()


async def test_torch_worker_prefix_hits_and_events_match_snapshot(http):
    proc, url = spawn_worker("--engine", "torch", "--model", "tiny", "--num-blocks", "24",
                             "--block-size", "16", timeout=120)
    ctx = zmq.asyncio.Context()
    try:
        async with http.get(url + "/server_info") as r:
            info = await r.json()
        assert info["engine"] == "torch" and info["model"] == "tiny"
        assert info["attention_backend"] == "torch", "auto picks the torch path on the CPU"
        assert info["async_scheduling"] is False, "auto: no async scheduling on the CPU"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(info["kv_events"]["publisher"])
        await asyncio.sleep(0.3)
        body = {"prompt": "A paged KV cache with a prefix cache on top, keyed by block keys.",
                "max_tokens": 10, "temperature": 0}
        outs = []
        for _ in range(2):
            async with http.post(url + "/v1/completions", json=body) as r:
                outs.append(await r.json())
        assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
        assert outs[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        # more distinct prompts than 24 blocks hold: stores and evictions
        for i in range(5):
            async with http.post(url + "/v1/completions", json={
                    "prompt": f"{i} " * 40, "max_tokens": 8, "temperature": 0}) as r:
                assert r.status == 200
        index = KvIndex(block_size=16)
        while True:
            try:
                frames = await asyncio.wait_for(sub.recv_multipart(), 0.5)
            except asyncio.TimeoutError:
                break
            assert index.apply_batch("torch-worker", decode_zmq(frames)) == "applied"
        async with http.get(url + "/kv_snapshot") as r:
            snap = msgpack.unpackb(await r.read())
        assert index.keys_of("torch-worker") == set(snap["block_keys"])
        assert snap["seq"] == index.expected_seq("torch-worker") - 1
        assert await metric(http, url, "kv_blocks", {"state": "used"}) == 0
        assert await metric(http, url, "prefix_cache_hit_tokens_total") >= 64
    finally:
        ctx.destroy(linger=0)
        assert stop_worker(proc) == 0


@pytest.mark.parametrize("N_SIMS", [8, pytest.param(100, marks=pytest.mark.slow)])
async def test_many_sim_workers_start_and_answer(N_SIMS):
    # 100 take ~30 s on an idle 2-core machine (0.5 s of imports each), minutes when it is busy;
    # an idle sim worker uses ~0.1% of a core.
    t0 = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "splitserve_cli", "worker", "--engine", "sim",
                               "--port", "0", "--log-level", "WARNING",
                               "--sim-decode-us-per-step", "1000"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(N_SIMS)]
    try:
        urls = []
        for p in procs:
            line = await asyncio.to_thread(p.stdout.readline)
            assert b"ready at" in line, line
            urls.append(line.split(b"ready at ")[1].split()[0].decode())
        started = time.monotonic() - t0
        async with aiohttp.ClientSession() as s:
            async def ask(u):
                async with s.post(u + "/v1/completions",
                                  json={"prompt": "ping", "max_tokens": 3}) as r:
                    return (await r.json())["usage"]["completion_tokens"]
            assert await asyncio.gather(*(ask(u) for u in urls)) == [3] * N_SIMS
        print(f"{N_SIMS} sim workers ready in {started:.1f}s, answered in "
              f"{time.monotonic() - t0 - started:.1f}s")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_sim_preset_table_matches_the_presets():
    from worker.cli import SIM_PRESET_MAX_LEN, SIM_PRESET_VOCAB
    from worker.presets import PRESETS

    assert SIM_PRESET_VOCAB == {n: c.vocab_size for n, c in PRESETS.items()}
    assert SIM_PRESET_MAX_LEN == {n: c.max_position_embeddings for n, c in PRESETS.items()}


def test_bad_choice_from_the_environment_is_rejected():
    r = subprocess.run([sys.executable, "-m", "splitserve_cli", "worker", "--port", "0"],
                       cwd=REPO, capture_output=True, timeout=60,
                       env={**os.environ, "SPLITSERVE_ENGINE": "simulated"})
    assert r.returncode == 2 and b"--engine must be one of" in r.stderr, r.stderr
