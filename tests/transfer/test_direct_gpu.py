"""KV moved between two real processes on one GPU by the NIXL agent's direct path (CUDA IPC and one
batched-copy kernel per transfer): the generation side's blocks equal the context side's bit for
bit, for random permutations of both pools, partial last blocks, a cached prefix (only the tail
moves), pipelined slices, and every block size the worker is commonly run with."""
from __future__ import annotations

import itertools
import multiprocessing as mp

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.nixl]


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("nixl")


class Peer:
    def __init__(self, role, geo, cfg=None):
        from tests.transfer.gpu_peer import gpu_peer

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=gpu_peer, args=(child, role, geo, cfg or {}), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), f"{role} peer did not start"
        _, self.endpoint, self.kind = self.conn.recv()

    def __call__(self, cmd, *a, timeout=60):
        self.conn.send((cmd, a))
        assert self.conn.poll(timeout), f"peer did not answer {cmd}"
        st, out = self.conn.recv()
        assert st == "ok", out
        return out

    def close(self):
        try:
            self("exit", timeout=20)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


REQ = itertools.count(1)   # request ids, unique across the tests sharing a pair of peers


@pytest.fixture(scope="module", params=[1, 4, 16, 32], ids=lambda t: f"tpb{t}")
def pair(request):
    _cuda()
    geo = dict(layers=4, heads=2, head_bytes=64 * 2, tpb=request.param, num_blocks=160, seed=3)
    ctx, gen = Peer("context", geo), Peer("generation", geo)
    yield ctx, gen, geo
    ctx.close()
    gen.close()


def _untouched(gen, geo, written):
    rest = sorted(set(range(geo["num_blocks"])) - set(written))
    return int(np.count_nonzero(gen("blocks", rest)))


def test_scattered_blocks_arrive_bit_for_bit(pair):
    ctx, gen, geo = pair
    rng = np.random.default_rng(geo["tpb"])
    tpb = geo["tpb"]
    for ntok in (1, tpb * 7 + max(1, tpb // 3), tpb * 100):   # partial last blocks, and many
        req = next(REQ)
        nblk = -(-ntok // tpb)
        src = [int(x) for x in rng.permutation(geo["num_blocks"])[:nblk]]
        dst = [int(x) for x in rng.permutation(geo["num_blocks"])[:nblk]]
        gen("clear")
        ctx("send", req, ntok, src)
        assert gen("recv", req, ctx.endpoint, ntok, dst) == ("done", None)
        state, nbytes, _, err, _ = ctx("wait_send", req)
        assert state == "done", err
        assert np.array_equal(gen("blocks", dst), ctx("blocks", src))
        assert _untouched(gen, geo, dst) == 0
    d = ctx("agent")["direct"]
    assert d["peers"] and not d["not_direct"], d    # the writes went through the kernel path


def test_prepared_lists_take_the_strided_kernel(pair):
    """The pump's per-slot lists are planned once at prep (descs.Strided, the peer's mapped
    base): a transfer is one `_copy_strided` launch over the picked slots. Its descriptor count
    is the kernel's rows, one per block even where blocks are contiguous on both sides (NIXL and
    the row-table path would have merged them into one)."""
    ctx, gen, geo = pair
    nblk = 12
    ids = list(range(40, 40 + nblk))
    gen("clear")
    req = next(REQ)
    ctx("send", req, nblk * geo["tpb"], ids)
    assert gen("recv", req, ctx.endpoint, nblk * geo["tpb"], ids) == ("done", None)
    state, _, ndesc, err, _ = ctx("wait_send", req)
    assert state == "done", err
    assert ndesc == nblk
    assert np.array_equal(gen("blocks", ids), ctx("blocks", ids))
    assert _untouched(gen, geo, ids) == 0


def test_a_cached_prefix_is_not_moved(pair):
    ctx, gen, geo = pair
    tpb = geo["tpb"]
    ntok = tpb * 20 + 1
    nblk = -(-ntok // tpb)
    rng = np.random.default_rng(11)
    src = [int(x) for x in rng.permutation(geo["num_blocks"])[:nblk]]
    dst = [int(x) for x in rng.permutation(geo["num_blocks"])[:nblk]]
    cached = 8   # the generation side holds these blocks already: -1 = do not write
    gen("clear")
    req = next(REQ)
    ctx("send", req, ntok, src)
    assert gen("recv", req, ctx.endpoint, ntok, [-1] * cached + dst[cached:]) == ("done", None)
    _, nbytes, _, _, _ = ctx("wait_send", req)
    bb = geo["layers"] * 2 * tpb * geo["heads"] * geo["head_bytes"]
    assert nbytes == (nblk - cached) * bb
    assert np.array_equal(gen("blocks", dst[cached:]), ctx("blocks", src[cached:]))
    assert _untouched(gen, geo, dst[cached:]) == 0


def test_pipelined_slices_equal_the_monolithic_transfer(pair):
    ctx, gen, geo = pair
    tpb = geo["tpb"]
    ntok = tpb * 64 + 3 if tpb > 3 else tpb * 64
    nblk = -(-ntok // tpb)
    rng = np.random.default_rng(5)
    src = [int(x) for x in rng.permutation(geo["num_blocks"])[:nblk]]
    dst = [int(x) for x in rng.permutation(geo["num_blocks"])[:nblk]]
    gen("clear")
    r1, r2 = next(REQ), next(REQ)
    ctx("send", r1, ntok, src)
    assert gen("recv", r1, ctx.endpoint, ntok, dst)[0] == "done"
    ctx("wait_send", r1)
    mono = gen("blocks", dst)
    gen("clear")
    # generation_first: the receive is posted, then the context side sends chunk by chunk
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", gen("recv", r2, ctx.endpoint, ntok, dst)))
    t.start()
    ctx("chunked_send", r2, ntok, src, 5 * tpb + 1)
    t.join(60)
    assert out["r"][0] == "done", out
    state, nbytes, ndesc, err, _ = ctx("wait_send", r2)
    assert state == "done", err
    assert np.array_equal(gen("blocks", dst), mono)
    assert np.array_equal(mono, ctx("blocks", src))


def test_each_chunk_moves_while_the_next_one_computes():
    """The real worker's `1b` model prefills 16k tokens in 2k chunks on the context side: the
    write of chunk k has finished before chunk k+1's compute ends (so only the last chunk's
    transfer is exposed), and the generation side ends with the context side's KV, identical to
    what a monolithic transfer of the same context blocks delivers. (Two prefills of the same
    prompt need not agree bit for bit, so the monolithic transfer re-sends the blocks the
    pipelined run computed instead of computing them again.)"""
    _cuda()
    import threading

    geo = dict(model="1b", tpb=16, num_blocks=1024 + 64)
    ctx, gen = Peer("context", geo), Peer("generation", geo)
    try:
        ntok, chunk = 16384, 2048
        rng = np.random.default_rng(1)
        src = [int(x) for x in rng.permutation(geo["num_blocks"])[:ntok // 16]]
        dst = [int(x) for x in rng.permutation(geo["num_blocks"])[:ntok // 16]]
        for req in (1, 2):   # 1 warms up (kernel compilation)
            gen("clear")
            out = {}
            t = threading.Thread(target=lambda: out.setdefault(
                "r", gen("recv", req, ctx.endpoint, ntok, dst, timeout=120)))
            t.start()
            ends = ctx("prefill_send", req, ntok, src, chunk, timeout=120)
            t.join(120)
            assert out["r"][0] == "done", out
            state, nbytes, _, err, done = ctx("wait_send", req)
            assert state == "done", err
        assert len(done) == len(ends) == ntok // chunk
        late = [k for k in range(len(ends) - 1) if not done[k] < ends[k + 1]]
        assert not late, (f"chunks {late}: write finished after the next chunk's compute",
                          [round((d - e) * 1e3, 2) for d, e in zip(done, ends)])
        pipelined = gen("blocks", dst)
        assert np.array_equal(pipelined, ctx("blocks", src))
        gen("clear")
        ctx("send", 3, ntok, src)                       # the same blocks, in one transfer
        assert gen("recv", 3, ctx.endpoint, ntok, dst, timeout=120)[0] == "done"
        assert ctx("wait_send", 3)[0] == "done"
        assert np.array_equal(gen("blocks", dst), pipelined)
    finally:
        ctx.close()
        gen.close()
