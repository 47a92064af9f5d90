"""The context worker's engine sends each prefill chunk's KV right behind its compute, on the GPU.

Two processes on one GPU (bench/transfer/transfer.py's ranks): the context side is the worker's
own `TorchEngine` (async scheduling, 2k-token chunks) with its `TransferKvConnector` over the `1b`
model; the generation side posted its receive first (generation_first). Each chunk's slice is
handed over when the chunk is queued, ordered after it by a CUDA event (no host sync), so the
write of chunk k is done before the host even sees chunk k+1 computed, and the generation side
ends with the context side's blocks bit for bit — as with the monolithic transfer of pipeline off.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.nixl]

NTOK, CHUNK = 16384, 2048


def test_each_chunk_leaves_behind_its_compute_and_the_kv_is_exact():
    # the gpu and nixl markers skip it where either is missing (tests/conftest.py)
    from bench.transfer.transfer import TPB, Rank

    nblk = NTOK // TPB
    nb = 2 * nblk + 64
    ctx = Rank("context", "cuda", "nixl", nb, "bfloat16", real="1b", engine_chunk=CHUNK)
    gen = Rank("generation", "cuda", "nixl", nb, "bfloat16", real="1b")
    try:
        dst = [int(x) for x in np.random.default_rng(2).permutation(nb)[:nblk]]

        def run(req: int, pipeline: bool):
            ctx("pipeline", pipeline)
            gen("post_recv", req, ctx.endpoint, NTOK, dst)
            time.sleep(0.05)     # the receive is parked at the context rank before prefill
            d = ctx("engine_prefill", req, NTOK, True, timeout=120)
            state, _t1, err = gen("wait_recv", req, timeout=120)
            assert state == "done", err
            st = ctx("wait_send", req)
            assert st[0] == "done", st
            assert ctx("digest", d["blocks"]) == gen("digest", dst), \
                f"pipeline={pipeline}: the generation side's blocks differ from the context side's"
            return d, st[4]

        run(1, True)                                   # warm-up: kernels, connections
        d, done = run(2, True)
        chunks = NTOK // CHUNK
        assert len(d["launched"]) == len(d["written"]) == chunks
        assert len(done) == chunks, f"one slice per chunk expected; found {len(done)}"
        wr = d["written"]
        late = [k for k in range(chunks - 1) if not done[k] < wr[k + 1]]
        assert not late, (f"chunks {late}: write seen finished after the next chunk was",
                          [round((w - x) * 1e3, 2) for x, w in zip(done, wr[1:])])
        _, done = run(3, False)                        # monolithic: one transfer after prefill
        assert len(done) == 1
    finally:
        ctx.close()
        gen.close()
