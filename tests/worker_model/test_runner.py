"""ModelRunner over the paged cache: chunking, batching and block placement change no logit."""
from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys

import pytest
import torch

from worker.model import LlamaForCausalLM
from worker.model_config import ModelConfig, ModelConfigError
from worker.presets import build_preset, init_random_weights, preset_config
from worker.runner import Chunk, ModelRunner, RunnerInputError, kv_bytes_per_block

BS = 8
ATOL = 2e-5


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny")


def make_runner(model, num_blocks=96):
    return ModelRunner(model, num_blocks=num_blocks, block_size=BS)


def prompt(n, salt=0):
    return [(i * 37 + salt * 11 + 5) % 250 for i in range(n)]


def table(first, n_tokens):
    return list(range(first, first + (n_tokens + BS - 1) // BS))


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


def test_chunked_prefill_equals_one_shot(tiny):
    r = make_runner(tiny)
    toks = prompt(45)
    one = r.step([Chunk(toks, 0, table(0, 45))])
    blocks = table(10, 45)
    # Chunk edges both on and off block boundaries.
    for lo, hi in [(0, 8), (8, 13), (13, 30), (30, 45)]:
        out = r.step([Chunk(toks[lo:hi], lo, blocks)])
    close(out, one)


def test_decode_steps_through_cache_equal_prefill(tiny):
    r = make_runner(tiny)
    toks = prompt(30, salt=3)
    blocks = table(0, 30)
    r.step([Chunk(toks[:20], 0, blocks)])
    for p in range(20, 30):
        dec = r.step([Chunk([toks[p]], p, blocks)])
    ref = make_runner(tiny).step([Chunk(toks, 0, table(0, 30))])
    close(dec, ref)


def test_ragged_batch_matches_each_sequence_alone(tiny):
    seqs = [prompt(37, 1), prompt(5, 2), prompt(19, 3), prompt(16, 4)]
    alone = []
    for s in seqs:
        r = make_runner(tiny)
        r.step([Chunk(s[:-1], 0, table(0, len(s)))])
        alone.append(r.step([Chunk(s[-1:], len(s) - 1, table(0, len(s)))])[0])
    r = make_runner(tiny)
    tables = [table(1 + 10 * i, len(s)) for i, s in enumerate(seqs)]
    # Step 1 mixes: a full prompt, a prefix chunk, a 1-token prompt-so-far and another prefix chunk.
    r.step([Chunk(seqs[0][:-1], 0, tables[0]), Chunk(seqs[1][:-1], 0, tables[1]),
            Chunk(seqs[2][:10], 0, tables[2]), Chunk(seqs[3][:1], 0, tables[3])])
    # Step 2 mixes decode tokens with chunked-prefill continuations.
    out = r.step([Chunk(seqs[0][-1:], 36, tables[0]), Chunk(seqs[1][-1:], 4, tables[1]),
                  Chunk(seqs[2][10:], 10, tables[2]), Chunk(seqs[3][1:], 1, tables[3])])
    for i in range(4):
        close(out[i], alone[i])


def test_shared_prefix_blocks_are_read_not_rewritten(tiny):
    """A prefix-cache hit: a second sequence reuses the first's full blocks and computes only the tail."""
    r = make_runner(tiny)
    shared = prompt(16)
    a = shared + prompt(5, 9)
    b = shared + prompt(7, 8)
    r.step([Chunk(a, 0, [0, 1, 2])])
    before = r.read_blocks([0, 1])
    out = r.step([Chunk(b[16:], 16, [0, 1, 5])])
    torch.testing.assert_close(r.read_blocks([0, 1]), before, atol=0, rtol=0)
    close(out, make_runner(tiny).step([Chunk(b, 0, [3, 4, 6])]))


def test_sliding_window_chunked_and_decode_agree():
    cfg = dataclasses.replace(preset_config("tiny"), sliding_window=11, name="tiny-sw")
    model = LlamaForCausalLM(cfg)
    init_random_weights(model)
    toks = prompt(40, 5)
    one = make_runner(model).step([Chunk(toks, 0, table(0, 40))])
    r = make_runner(model)
    blocks = table(0, 40)
    r.step([Chunk(toks[:17], 0, blocks)])
    r.step([Chunk(toks[17:35], 17, blocks)])
    for p in range(35, 40):
        out = r.step([Chunk([toks[p]], p, blocks)])
    close(out, one)
    # The window really restricts attention: without it the logits differ.
    full = make_runner(build_preset("tiny")).step([Chunk(toks, 0, table(0, 40))])
    assert not torch.allclose(full, one, atol=1e-3)


def test_sliding_window_ignores_blocks_outside_window():
    cfg = dataclasses.replace(preset_config("tiny"), sliding_window=8, name="tiny-sw8")
    model = LlamaForCausalLM(cfg)
    init_random_weights(model)
    toks = prompt(33, 2)
    r = make_runner(model)
    blocks = table(0, 33)
    ref = r.step([Chunk(toks, 0, blocks)])
    # Garbage in blocks wholly before the window of every query of the next step must not matter.
    r2 = make_runner(model)
    r2.step([Chunk(toks[:32], 0, blocks)])
    r2.write_blocks([0, 1], torch.full_like(r2.read_blocks([0, 1]), 1e4))
    close(r2.step([Chunk(toks[32:], 32, blocks)]), ref)


def test_page_table_matches_tensor_addresses(tiny):
    r = make_runner(tiny, num_blocks=7)
    pt = r.page_table()
    assert pt["block_size"] == BS and pt["num_blocks"] == 7 and pt["mem_type"] == "DRAM"
    (pool,) = pt["pools"]
    cfg = tiny.config
    elt = 4
    assert pool["layers"] == list(range(cfg.num_hidden_layers))
    assert pool["block_bytes"] == 2 * BS * cfg.num_key_value_heads * cfg.head_dim * elt
    assert pool["block_stride"] == pool["block_bytes"] * cfg.num_hidden_layers
    assert pool["block_stride"] == kv_bytes_per_block(cfg, BS, torch.float32)
    assert pool["total_bytes"] == 7 * pool["block_stride"]
    assert pool["layout"] == "NHD" and pool["kind"] == "kv" and pool["dtype"] == "float32"
    # Write a recognisable value through step's path and find it at the documented address.
    toks = prompt(BS * 2)
    r.step([Chunk(toks, 0, [5, 2])])
    blk, layer, tok, head = 2, 3, 5, 1
    kv = r.kv_cache[blk, layer, 1, tok, head]  # V of position BS+5, head 1
    addr = (pool["base_ptr"] + blk * pool["block_stride"] + layer * pool["layer_stride"] + pool["kv_stride"]
            + tok * cfg.num_key_value_heads * cfg.head_dim * elt + head * cfg.head_dim * elt)
    raw = (ctypes.c_float * cfg.head_dim).from_address(addr)
    assert list(raw) == kv.tolist()
    assert pool["buffer_entries"][:2] == [(0, 0, pool["kv_stride"]), (0, pool["kv_stride"], pool["kv_stride"])]


def test_read_write_blocks_moves_a_sequence_between_runners(tiny):
    """What the transfer layer does: copy a prompt's blocks to another runner, then decode there."""
    toks = prompt(26, 7)
    src = make_runner(tiny)
    src.step([Chunk(toks[:25], 0, [4, 9, 1, 7])])
    dst = make_runner(tiny)
    dst.write_blocks([30, 31, 32, 33], src.read_blocks([4, 9, 1, 7]))
    out = dst.step([Chunk(toks[25:], 25, [30, 31, 32, 33])])
    close(out, make_runner(tiny).step([Chunk(toks, 0, table(0, 26))]))
    with pytest.raises(RunnerInputError, match="shape"):
        dst.write_blocks([0], src.read_blocks([0, 1]))


@pytest.mark.parametrize("chunks, match", [
    ([], "at least one chunk"),
    ([Chunk([], 0, [0])], "no tokens"),
    ([Chunk([1] * 9, 0, [0])], "hold only 8"),
    ([Chunk([1, 2], -1, [0])], "non-negative"),
    ([Chunk([1, 2], 0, [96])], r"block ids must be in \[0, 96\)"),
    ([Chunk([1, 261], 0, [0])], r"token ids must be in \[0, 261\)"),
    ([Chunk([1, 2], 0, [3]), Chunk([5], 1, [3])], "same KV slot"),
])
def test_bad_chunks_raise_typed_errors(tiny, chunks, match):
    with pytest.raises(RunnerInputError, match=match):
        make_runner(tiny).step(chunks)


def test_config_validation():
    with pytest.raises(ModelConfigError, match="multiple of"):
        dataclasses.replace(preset_config("tiny"), num_key_value_heads=3)
    with pytest.raises(ModelConfigError, match="not supported"):
        ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 1, "hidden_size": 1})
    with pytest.raises(ModelConfigError, match="rope scaling type 'longrope'"):
        ModelConfig.from_hf({**preset_config("tiny").to_hf(), "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(ModelConfigError, match="requires 'low_freq_factor'"):
        ModelConfig.from_hf({**preset_config("tiny").to_hf(), "rope_scaling": {"rope_type": "llama3", "factor": 8}})
    assert ModelConfig.from_hf(preset_config("tiny").to_hf(), name="tiny") == preset_config("tiny")


_CHECKSUM = ("import torch; from worker.presets import build_preset; m = build_preset('tiny');"
             "print(sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(m.parameters())))")


def test_preset_weights_identical_across_processes(tiny):
    here = sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(tiny.parameters()))
    out = subprocess.run([sys.executable, "-c", _CHECKSUM], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert float(out.stdout) == here
    again = build_preset("tiny")
    for a, b in zip(tiny.parameters(), again.parameters()):
        assert torch.equal(a, b)
    other_seed = build_preset("tiny", seed=1)
    assert not torch.equal(next(other_seed.parameters()), next(tiny.parameters()))


def test_bf16_runs_and_tracks_fp32(tiny):
    toks = prompt(20)
    ref = make_runner(tiny).step([Chunk(toks, 0, table(0, 20))])
    m16 = build_preset("tiny", dtype=torch.bfloat16)
    r = ModelRunner(m16, num_blocks=8, block_size=BS)
    assert r.kv_cache.dtype == torch.bfloat16
    out = r.step([Chunk(toks, 0, table(0, 20))])
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    assert out.argmax() == ref.argmax()


def test_which_steps_replay_a_graph_and_which_graphs_a_new_token_buffer_drops(tiny):
    # worker/graphs.py CudaGraphs: its rules run on any device (capture itself needs CUDA: test_gpu.py)
    r = ModelRunner(tiny, num_blocks=8, block_size=BS, cuda_graphs=False)
    g = r.graphs
    assert g.max_len == 8 * BS  # the cache, smaller than the model's context, bounds a graphed decode
    assert g.replays_decode(g.max_graph_batch, g.max_len)
    assert not g.replays_decode(g.max_graph_batch + 1, 1) and not g.replays_decode(1, g.max_len + 1)
    assert g.replays_prefill(0, 2) and g.replays_prefill(0, g.max_prefill_graph_tokens)
    assert not g.replays_prefill(0, 1) and not g.replays_prefill(3, 10)
    assert not g.replays_prefill(0, g.max_prefill_graph_tokens + 1)
    plain, fused, prefill = ("decode", ((1, 1),)), ("decode", ((1, 1),), "fused"), ("prefill", 128)
    g.captured = {plain: "plain graph", fused: "fused graph", prefill: "prefill graph"}
    buf = r.token_buffer(1)
    assert buf.numel() >= 2 * g.max_graph_batch and len(g.captured) == 3  # a first buffer drops nothing
    buf[:3] = torch.tensor([7, 8, 9])
    grown = r.token_buffer(buf.numel() + 1)
    assert grown.tolist()[:3] == [7, 8, 9] and r.step_tokens is grown
    assert set(g.captured) == {plain, prefill}  # only graphs that captured the old buffer go
