"""RotaryEmbedding.cos_sin_signed (worker/rope.py): the one-gather cos/sin of every step must equal,
bit for bit, the six-kernel sequence it replaced (fp32 gather, cast, sign fold of sin's first half)."""
from __future__ import annotations

import pytest
import torch

from worker.model_config import ModelConfig
from worker.rope import RotaryEmbedding, _signed_sin

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


def _cfg(scaling) -> ModelConfig:
    return ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       rope_scaling=scaling)


def _unfused(rot: RotaryEmbedding, positions, dtype, seq_lens=None):
    cos, sin = rot.cos_sin(positions, seq_lens)
    return cos.to(dtype), _signed_sin(sin.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_cos_sin_signed_is_the_unfused_sequence_bit_for_bit(kind, dtype):
    rot, ref = RotaryEmbedding(_cfg(SCALINGS[kind])), RotaryEmbedding(_cfg(SCALINGS[kind]))
    # Positions out of order and repeated; a second call past the cached length grows the tables
    # (the typed table must follow, not serve stale rows).
    for positions in (torch.tensor([5, 0, 17, 17, 3]), torch.tensor([1000, 2, 999, 300])):
        seq_lens = positions + 1 if kind == "dynamic" else None
        cos, sin = rot.cos_sin_signed(positions, dtype, seq_lens)
        rc, rs = _unfused(ref, positions, dtype, seq_lens)
        assert cos.dtype == sin.dtype == dtype and cos.shape == rc.shape == (positions.numel(), 16)
        assert torch.equal(cos, rc) and torch.equal(sin, rs)
        assert cos.stride() == sin.stride() and cos.stride(1) == 1  # what the triton RoPE kernel requires


def test_typed_table_follows_growth_and_graphs_keep_it():
    rot = RotaryEmbedding(_cfg(None))
    rot.ensure(128)
    tab = rot.typed_table(torch.bfloat16)
    assert rot.typed_table(torch.bfloat16) is tab  # cached: one gather per step, nothing rebuilt
    assert any(t is tab for t in rot.graph_tensors())
    cos, _ = rot.cos_sin_signed(torch.tensor([300]), torch.bfloat16)  # past 128: tables grow
    assert rot.typed_table(torch.bfloat16) is not tab and rot.typed_table(torch.bfloat16).shape[0] > 300
    assert torch.equal(cos, _unfused(RotaryEmbedding(_cfg(None)), torch.tensor([300]), torch.bfloat16)[0])
