"""KV connector overhead: the worker's side of KV transfer, one process, two tiny torch engines.

Measures what the connector (worker/kv_connector_transfer.py) adds around the transceiver:

- idle CPU: a context engine holding N finished context legs whose KV waits for a generation
  worker (pinned, send sessions open, nobody fetches) — CPU ms per wall second of this process
  while nothing else happens;
- release latency: after a generation leg received the KV, how long until the context engine's
  pin is released (the transfer's completion reaching the engine);
- the generation leg's time (receive + first token) for a 64-token prompt, context_first.

`--tree DIR` runs the same measurement against another checkout (e.g. 3578ad9, the tree before
the connector existed, whose transfer-side engine link polled every send every 2 ms): the script
adapts to either API. Usage: `python bench/worker/kv_connector.py [--tree DIR] [--pinned 256] [--requests 30]`.
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def _setup_path(tree: str | None) -> None:
    root = Path(tree).resolve() if tree else Path(__file__).resolve().parents[2]
    bench = Path(__file__).resolve().parent
    sys.path[:] = [str(root)] + [p for p in sys.path
                                 if Path(p or ".").resolve() not in (root, bench, bench.parent)]


def _engine(model, role: str, *, pin_timeout: float, claim_timeout: float):
    from protocol.tokenizer import ByteTokenizer
    from worker.engine import TorchEngine
    from worker.runner import ModelRunner

    ns = SimpleNamespace(transfer_agent="tcp", host="127.0.0.1", transfer_port=0, role=role,
                         pin_timeout=pin_timeout, transfer_timeout=60.0,
                         transfer_claim_timeout=claim_timeout)
    runner = ModelRunner(model, num_blocks=2048, block_size=16)
    tok = ByteTokenizer(vocab_size=model.config.vocab_size)
    kw = dict(max_num_tokens=4096, max_batch_size=256, pin_timeout_s=pin_timeout)
    try:
        from worker.cli import build_kv_connector   # the connector passed at construction
    except ImportError:                              # before: a link set on the built engine
        from worker.cli import _build_transfer

        engine = TorchEngine(runner, tok, **kw)
        return engine, _build_transfer(ns, engine, "tiny", None), "engine_link (2 ms poll)"
    conn = build_kv_connector(ns, "tiny", None)
    return TorchEngine(runner, tok, kv_connector=conn, **kw), conn, "kv_connector (callbacks)"


async def _run(stream):
    last = None
    async for ev in stream:
        last = ev
    return last


async def main(a) -> dict:
    import torch

    torch.set_num_threads(1)
    from worker.presets import build_preset
    from protocol.disagg import encode_opaque_state
    from worker.requests import CONTEXT_ONLY, GENERATION_ONLY, EngineRequest, SamplingParams

    model = build_preset("tiny")
    ctx, ctx_link, api = _engine(model, "context", pin_timeout=600.0, claim_timeout=0.0)
    gen, gen_link, _ = _engine(model, "generation", pin_timeout=600.0, claim_timeout=0.0)
    await ctx.start()
    await gen.start()
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompt(i, n):
        return [256] + [(j * 31 + i * 17) % 200 + 40 for j in range(n - 1)]

    # --- idle CPU with N pinned sends nobody fetches
    for i in range(a.pinned):
        await _run(await ctx.submit(EngineRequest(f"p{i}", prompt(i, 48), sp,
                                                  request_type=CONTEXT_ONLY,
                                                  ctx_request_id=10_000 + i)))
    assert len(ctx.pinned_transfers()) == a.pinned
    await asyncio.sleep(0.5)
    c0, w0 = time.process_time(), time.monotonic()
    await asyncio.sleep(a.idle_s)
    idle_cpu = (time.process_time() - c0) / (time.monotonic() - w0) * 1000
    for i in range(a.pinned):
        ctx.abort(str(10_000 + i))
    while ctx.pool.num_pinned:
        await asyncio.sleep(0.01)

    # --- context_first round trips
    gen_s, release_s = [], []
    for i in range(a.requests):
        p = prompt(1000 + i, 64)
        cid = 20_000 + i
        last = await _run(await ctx.submit(EngineRequest(f"c{i}", p, sp, request_type=CONTEXT_ONLY,
                                                         ctx_request_id=cid)))
        dp = {"ctx_request_id": cid, "first_gen_tokens": last.context.first_gen_tokens,
              "encoded_opaque_state": encode_opaque_state(last.context.opaque_state)}
        t0 = time.perf_counter()
        await _run(await gen.submit(EngineRequest(f"g{i}", p, sp, request_type=GENERATION_ONLY,
                                                  disaggregated_params=dp,
                                                  first_gen_tokens=dp["first_gen_tokens"])))
        t1 = time.perf_counter()
        while ctx.pinned_transfer(cid) is not None:
            await asyncio.sleep(0)
        release_s.append(time.perf_counter() - t1)
        gen_s.append(t1 - t0)
    for e, link in ((ctx, ctx_link), (gen, gen_link)):
        await e.stop()
        await link.close()
    ms = lambda xs: round(statistics.median(xs) * 1000, 3)  # noqa: E731
    return {"api": api, "pinned": a.pinned, "idle_cpu_ms_per_s": round(idle_cpu, 1),
            "requests": a.requests, "gen_leg_ms_p50": ms(gen_s), "release_ms_p50": ms(release_s),
            "release_ms_max": round(max(release_s) * 1000, 3)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", help="checkout to measure (default: this one)")
    ap.add_argument("--pinned", type=int, default=256)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--requests", type=int, default=30)
    args = ap.parse_args()
    _setup_path(args.tree)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(asyncio.run(main(args))))
