"""Multi-rank workers compute what the single-rank worker computes, and their per-rank KV pools
hold exactly the expected shard of its KV cache.

Real processes throughout: each multi-rank worker's followers are `python -m worker.parallel.rank_worker`
processes joined over gloo; steps go through the real scheduler, HTTP through real sockets, KV
transfer through real tcp agents. One module-wide set of workers (startup dominates the cost):
TP1 (reference), TP2, PP2 on the `tiny` preset, and TP2 over a Hugging Face checkpoint with a
single KV head (so both TP ranks hold a replica of it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import torch

from tests.worker_parallel.conftest import complete, start_worker

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [
    "Tensor parallel ranks each hold a slice of the heads.",
    "PP",
    "A longer prompt that needs several prefill chunks of the small step budget used here, "
    "so chunked prefill runs across steps on every rank at once. " * 2,
]
N_NEW = 12


@pytest.fixture(scope="module")
def kv1_dir(tmp_path_factory):
    """An HF checkpoint with one KV head (four query heads): TP2 must replicate the head."""
    from worker.loader import save_hf_checkpoint
    from worker.model import LlamaForCausalLM
    from worker.presets import init_random_weights, preset_config

    cfg = dataclasses.replace(preset_config("tiny"), num_key_value_heads=1, name="tiny-kv1")
    m = LlamaForCausalLM(cfg)
    init_random_weights(m, seed=0, namespace="tiny-kv1")
    return str(save_hf_checkpoint(m, tmp_path_factory.mktemp("tiny-kv1")))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ws(kv1_dir):
    """name -> Worker. Multi-rank workers start concurrently (their followers import torch)."""
    specs = {"tp2": dict(tp=2), "pp2": dict(pp=2), "kv1_tp2": dict(tp=2, hf_dir=kv1_dir)}
    multi = await asyncio.gather(*(start_worker(transfer="tcp", **kw) for kw in specs.values()))
    out = dict(zip(specs, multi))
    out["ref"] = await start_worker(transfer="tcp")
    out["kv1_ref"] = await start_worker(transfer="tcp", hf_dir=kv1_dir)
    yield out
    for w in out.values():
        await w.close()


_ids = itertools.count(1)


async def generate(engine, prompt_ids, n=N_NEW):
    from worker.engine import EngineRequest, SamplingParams

    req = EngineRequest(request_id=f"t{next(_ids)}", prompt_token_ids=list(prompt_ids),
                        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    toks = []
    async for ev in await engine.submit(req):
        assert ev.error is None, ev.error
        toks.extend(ev.token_ids)
    return toks


def encode(engine, text):
    return engine.tokenizer.encode(text)


@pytest.mark.parametrize("name,ref", [("tp2", "ref"), ("pp2", "ref"), ("kv1_tp2", "kv1_ref")])
async def test_greedy_tokens_equal_single_rank(ws, name, ref):
    w, r = ws[name], ws[ref]
    prompts = [encode(r.engine, p) for p in PROMPTS]
    # Concurrent requests: batched decode rows next to chunked prefill in the same steps.
    want = await asyncio.gather(*(generate(r.engine, p) for p in prompts))
    got = await asyncio.gather(*(generate(w.engine, p) for p in prompts))
    assert got == want
    assert all(len(t) == N_NEW for t in got)
    # Again: now the prompts hit the prefix cache (blocks reused on every rank alike).
    again = await asyncio.gather(*(generate(w.engine, p) for p in prompts))
    assert again == want
    assert w.engine.stats()["prefix_hit_tokens_total"] > 0


def _rank_blocks(w, rank, ids):
    """A rank's blocks as float32 ``[n, layers, 2, block_size, heads, head_dim]``."""
    if rank == 0:
        return w.engine.runner.read_blocks(ids).float()
    r = w.engine.rank_group.rpc(rank, "read_blocks", ids=list(ids))
    return torch.from_numpy(np.frombuffer(r["data"], dtype=np.float32).copy()).view(r["shape"])


@pytest.mark.parametrize("name,ref", [("tp2", "ref"), ("pp2", "ref"), ("kv1_tp2", "kv1_ref")])
async def test_logits_close_and_rank_pools_hold_their_shard(ws, name, ref):
    from worker.runner import Chunk

    w, r = ws[name], ws[ref]
    prompt = encode(r.engine, PROMPTS[0])
    nblk = -(-(len(prompt) + 3) // w.engine.block_size)
    ids_w, ids_r = w.engine.pool.allocate(nblk), r.engine.pool.allocate(nblk)
    try:
        loop = asyncio.get_running_loop()

        def run(runner, ids):
            out, toks = [], list(prompt)
            out.append(runner.step([Chunk(toks[:20], 0, ids)]))
            out.append(runner.step([Chunk(toks[20:], 20, ids)]))  # chunked prefill
            for _ in range(3):
                toks.append(int(out[-1].argmax()))
                out.append(runner.step([Chunk(toks[-1:], len(toks) - 1, ids)]))
            return torch.cat(out), toks

        # The engines are idle; their executors keep steps off the event loop and in order.
        lw, tw = await loop.run_in_executor(w.engine._executor, run, w.engine.runner, ids_w)
        lr, tr = await loop.run_in_executor(r.engine._executor, run, r.engine.runner, ids_r)
        assert tw == tr
        torch.testing.assert_close(lw, lr, rtol=0, atol=1e-4)

        written = len(tw) - 1  # the last sampled token was never fed back

        def positions(kv):  # [n, L, 2, bs, H, D] -> [L, 2, written, H, D]
            n, L, two, bs, H, D = kv.shape
            return kv.permute(1, 2, 0, 3, 4, 5).reshape(L, two, n * bs, H, D)[:, :, :written]

        ref_kv = positions(r.engine.runner.read_blocks(ids_r).float())
        tables = w.engine.rank_page_tables()
        for rank, pt in enumerate(tables):
            got = positions(_rank_blocks(w, rank, ids_w))
            want = ref_kv[pt["layer_start"]:pt["layer_end"], :, :,
                          pt["head_start"]:pt["head_start"] + pt["kv_heads"]]
            assert got.shape == want.shape, (rank, pt)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    finally:
        w.engine.pool.free(ids_w)
        r.engine.pool.free(ids_r)


async def test_rank_page_tables_geometry(ws):
    tiny = ws["ref"].engine.runner.cfg
    elt, hd, bs = 4, tiny.head_dim, ws["tp2"].engine.block_size
    expect = {
        "tp2": [dict(tp_rank=t, pp_rank=0, layer_start=0, layer_end=4, head_start=t, kv_heads=1,
                     duplicate_head_factor=1) for t in range(2)],
        "pp2": [dict(tp_rank=0, pp_rank=p, layer_start=2 * p, layer_end=2 * p + 2, head_start=0,
                     kv_heads=2, duplicate_head_factor=1) for p in range(2)],
        "kv1_tp2": [dict(tp_rank=t, pp_rank=0, layer_start=0, layer_end=4, head_start=0, kv_heads=1,
                         duplicate_head_factor=2) for t in range(2)],
    }
    for name, ranks in expect.items():
        w = ws[name]
        tables = w.engine.rank_page_tables()
        assert [pt["pid"] for pt in tables] == w.engine.rank_group.pids()
        assert len(set(pt["pid"] for pt in tables)) == len(tables)
        for rank, (pt, want) in enumerate(zip(tables, ranks)):
            assert {k: pt[k] for k in want} == want, (name, rank)
            assert pt["rank"] == rank and pt["world_size"] == len(ranks)
            assert (pt["tp_size"], pt["pp_size"]) == {"tp2": (2, 1), "pp2": (1, 2), "kv1_tp2": (2, 1)}[name]
            assert pt["total_layers"] == 4
            assert pt["block_size"] == bs and pt["num_blocks"] == w.engine.pool.num_blocks
            pool = pt["pools"][0]
            layers = want["layer_end"] - want["layer_start"]
            assert pool["layers"] == list(range(layers)) and pt["num_layers"] == layers
            assert pool["num_kv_heads"] == want["kv_heads"]
            assert pool["layer_stride"] == 2 * bs * want["kv_heads"] * hd * elt
            assert pool["block_stride"] == layers * pool["layer_stride"]
            assert pool["base_ptr"] > 0
        # The leader's own view is rank 0's table.
        assert w.engine.page_table()["pools"][0]["base_ptr"] == tables[0]["pools"][0]["base_ptr"]


async def _context_first(http, ctx, gen, prompt, n, did):
    st, c = await complete(http, ctx.url, {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did}})
    assert st == 200, c
    dp = dict(c["choices"][0]["disaggregated_params"], request_type="generation_only")
    st, g = await complete(http, gen.url, {"prompt": c["prompt_token_ids"], "max_tokens": n,
                                           "temperature": 0, "ignore_eos": True,
                                           "disaggregated_params": dp})
    assert st == 200, g
    return g["choices"][0]["text"]


async def _baseline(*workers, timeout=15.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        bad = []
        for w in workers:
            s, p = w.engine.stats(), w.link.tx.pending()
            if s["kv_blocks_used"] or s["kv_blocks_pinned"] or p["send"] or p["recv"] or p["inflight_tasks"]:
                bad.append((w.url, s["kv_blocks_used"], s["kv_blocks_pinned"], p))
        if not bad:
            return
        assert asyncio.get_running_loop().time() < deadline, f"not back to baseline: {bad}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("ctx,gen,ref", [("tp2", "ref", "ref"), ("ref", "tp2", "ref"),
                                         ("pp2", "ref", "ref"), ("ref", "pp2", "ref"),
                                         ("pp2", "tp2", "ref"), ("kv1_tp2", "kv1_ref", "kv1_ref")])
async def test_disaggregated_across_layouts_equals_aggregated(ws, ctx, gen, ref):
    """Each rank sends / receives its own shard (MultiRankTransceiver); the generation worker
    decodes the transferred KV to the same tokens as aggregated serving."""
    did = 1 << 41 | hash((ctx, gen)) & 0xFFFFFF
    async with aiohttp.ClientSession() as http:
        for i, p in enumerate(PROMPTS):
            st, a = await complete(http, ws[ref].url, {"prompt": p, "max_tokens": N_NEW,
                                                        "temperature": 0, "ignore_eos": True})
            assert st == 200, a
            got = await _context_first(http, ws[ctx], ws[gen], p, N_NEW, did + i)
            assert got == a["choices"][0]["text"], (ctx, gen, p)
    await _baseline(ws[ctx], ws[gen])
    tx = ws[ctx].link.tx
    if hasattr(tx, "rank_infos"):  # every rank of a multi-rank context worker wrote its shard
        info = tx.server_info()
        assert len(info["ranks"]) == ws[ctx].engine.rank_group.world_size


async def test_call_all_runs_on_every_rank_and_reraises_typed_errors(ws):
    g = ws["pp2"].engine.rank_group
    assert g.call_all("tests.worker_parallel.rank_fns:whoami") == [
        {"rank": r, "pid": pid, "layers": [2 * r, 2 * r + 2]} for r, pid in enumerate(g.pids())]
    assert g.call_all("tests.worker_parallel.rank_fns:echo", per_rank=[[1], [2]]) == [1, 2]
    assert g.call(1, "tests.worker_parallel.rank_fns:echo", {"a": b"\x00"}) == {"a": b"\x00"}
    from transfer.errors import SessionError
    from worker.parallel.rank_group import RankCallError

    with pytest.raises(SessionError, match="rank 1: only on rank 1"):
        g.call_all("tests.worker_parallel.rank_fns:fail_on", 1)
    with pytest.raises(RankCallError) as ei:
        g.call(1, "tests.worker_parallel.rank_fns:boom")
    assert ei.value.rank == 1 and ei.value.type_name == "ZeroDivisionError"
    with pytest.raises(ValueError, match="inside"):
        g.call_all("os:getpid")
    # The group is still healthy after errors.
    assert g.healthy and g.call_all("tests.worker_parallel.rank_fns:echo", 7) == [7, 7]


@pytest.mark.parametrize("ctx,gen", [("pp2", "tp2"), ("tp2", "pp2")])
async def test_generation_first_across_layouts_equals_aggregated(ws, ctx, gen):
    """The generation leg posts its receives (on every rank) before the context leg exists; the
    context ranks adopt them and send pipelined chunks as prefill proceeds."""
    did = 1 << 42 | hash((ctx, gen, "gf")) & 0xFFFFFF
    async with aiohttp.ClientSession() as http:
        async with http.get(ws[ctx].url + "/server_info") as r:
            ep = (await r.json())["disaggregated_params"]["ctx_info_endpoint"]
        for i, p in enumerate(PROMPTS):
            st, a = await complete(http, ws["ref"].url, {"prompt": p, "max_tokens": N_NEW,
                                                          "temperature": 0, "ignore_eos": True})
            assert st == 200, a
            gen_task = asyncio.create_task(complete(http, ws[gen].url, {
                "prompt": p, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True,
                "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": did + i,
                                         "disagg_request_id": did + i, "ctx_info_endpoint": ep,
                                         "schedule_style": "generation_first"}}))
            await asyncio.sleep(0.05)
            st, c = await complete(http, ws[ctx].url, {
                "prompt": p, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True,
                "disaggregated_params": {"request_type": "context_only", "disagg_request_id": did + i}})
            assert st == 200, c
            st, g = await gen_task
            assert st == 200, g
            assert g["choices"][0]["text"] == a["choices"][0]["text"], (ctx, gen, p)
    await _baseline(ws[ctx], ws[gen])
