"""Multi-rank workers on CUDA (NCCL, one GPU per rank): outputs equal the single-GPU worker, and
each rank's VRAM pool holds its shard. Needs at least two GPUs (`device` kind nvidia-h200-x2):

    python3 -m pytest tests/worker_parallel/test_gpu.py -q -s   (the machine's CUDA torch)
"""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _steps(runner, prompt, ids, n_decode):
    from worker.runner import Chunk

    logits, toks = [runner.step([Chunk(prompt, 0, ids)])], list(prompt)
    for _ in range(n_decode):
        toks.append(int(logits[-1].argmax()))
        logits.append(runner.step([Chunk(toks[-1:], len(toks) - 1, ids)]))
    torch.cuda.synchronize()
    return torch.cat(logits).float().cpu(), toks


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_nccl_ranks_equal_single_gpu_fp32(tp, pp):
    from worker.presets import build_preset, preset_config
    from worker.parallel.rank_group import RankGroup
    from worker.runner import ModelRunner

    ref = ModelRunner(build_preset("tiny", device="cuda:0"), 64, 16, device="cuda:0", cuda_graphs=False)
    g = RankGroup.launch("tiny", preset_config("tiny"), tp_size=tp, pp_size=pp, device="cuda",
                         dtype=torch.float32, num_blocks=64, block_size=16)
    try:
        prompt = [(7 * j + 3) % 250 for j in range(100)]
        ids = list(range(3, 3 + 8))
        lr, tr = _steps(ref, prompt, ids, 20)
        lg, tg = _steps(g.runner, prompt, ids, 20)
        assert tg == tr
        torch.testing.assert_close(lg, lr, rtol=0, atol=1e-3)
        tables = g.rank_page_tables()
        assert [pt["device"] for pt in tables] == [f"cuda:{r}" for r in range(tp * pp)]
        assert all(pt["mem_type"] == "VRAM" for pt in tables)
        ref_kv = ref.read_blocks(ids).float().cpu()
        import numpy as np

        for rank, pt in enumerate(tables):
            if rank == 0:
                got = g.runner.read_blocks(ids).float().cpu()
            else:
                r = g.rpc(rank, "read_blocks", ids=ids)
                got = torch.from_numpy(np.frombuffer(r["data"], dtype=np.float32).copy()).view(r["shape"])
            want = ref_kv[:, pt["layer_start"]:pt["layer_end"], :, :,
                          pt["head_start"]:pt["head_start"] + pt["kv_heads"]]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    finally:
        g.shutdown()


def test_nccl_tp2_1b_bf16_decode_timing():
    """Not a pass/fail benchmark: prints TP1 vs TP2 step times for the 1b shape in bf16 and checks
    the TP2 worker generates (bf16 sums in another order may flip near-tied tokens)."""
    from worker.presets import build_preset, preset_config
    from worker.parallel.rank_group import RankGroup
    from worker.runner import ModelRunner

    prompt = [(11 * j + 5) % 30000 for j in range(1024)]
    ids = list(range(0, 72))
    ref = ModelRunner(build_preset("1b", device="cuda:0", dtype=torch.bfloat16), 80, 16,
                      device="cuda:0", cuda_graphs=False)
    _steps(ref, prompt, ids, 4)
    t = time.perf_counter()
    _, tr = _steps(ref, prompt, ids, 64)
    t_ref = time.perf_counter() - t
    del ref
    torch.cuda.empty_cache()
    g = RankGroup.launch("1b", preset_config("1b"), tp_size=2, pp_size=1, device="cuda",
                         dtype=torch.bfloat16, num_blocks=80, block_size=16)
    try:
        _steps(g.runner, prompt, ids, 4)
        t = time.perf_counter()
        _, tg = _steps(g.runner, prompt, ids, 64)
        t_tp2 = time.perf_counter() - t
    finally:
        g.shutdown()
    same = sum(a == b for a, b in zip(tr[len(prompt):], tg[len(prompt):]))
    print(f"\n1b bf16, 1024-token prefill + 64 decode steps (eager): TP1 {t_ref * 1e3:.1f} ms, "
          f"TP2 {t_tp2 * 1e3:.1f} ms; {same}/64 greedy tokens identical")
    assert len(tg) == len(prompt) + 65
    assert tg[len(prompt)] == tr[len(prompt)]  # the first token's margin dwarfs bf16 noise


def test_nccl_ranks_listen_on_loopback_only():
    """Issue 15 item 6: NCCL's bootstrap listens on the first non-loopback interface unless told
    otherwise; a multi-rank worker keeps every rank's sockets on loopback (worker/parallel/comm.py)."""
    import ipaddress
    import os

    from splitserve_testing.proctable import listening_sockets, tree
    from worker.presets import preset_config
    from worker.parallel.rank_group import RankGroup
    from worker.runner import Chunk

    me = os.getpid()
    before = set(listening_sockets(me))
    g = RankGroup.launch("tiny", preset_config("tiny"), tp_size=2, pp_size=1, device="cuda",
                         dtype=torch.float32, num_blocks=64, block_size=16)
    try:
        g.runner.step([Chunk([5, 6, 7], 0, [3])])   # communicators exist after a collective
        torch.cuda.synchronize()
        socks = [(p, s) for p in tree(me) for s in listening_sockets(p)
                 if p != me or s not in before]
        assert socks, "no rank socket found (the scan would prove nothing)"
        bad = [(p, s) for p, s in socks if not ipaddress.ip_address(s[1]).is_loopback]
        assert not bad, bad
    finally:
        g.shutdown()
