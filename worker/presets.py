"""Named random-weight models: the same name gives the same weights in every process, on every device.

Weights come from a counter-based hash (index → 32-bit integer mix → uniform float), evaluated with
exact integer tensor ops: no RNG state, no dependence on device, thread count or initialisation order.
A context worker on one machine and a generation worker on another therefore build bit-identical
models from the preset name alone, which is what lets them hand KV caches to each other.

Scales are chosen so logits of a random model have a spread of a few units: greedy decoding is then
far from ties and does not flip under batching-order rounding differences.
"""

from __future__ import annotations

import math

import torch
import xxhash

from worker.model import LlamaForCausalLM
from worker.model_config import ModelConfig

__all__ = ["PRESETS", "preset_config", "build_preset", "init_random_weights", "is_preset",
           "BYTE_VOCAB", "TINY_VOCAB"]

#: Byte-level tokenizer ids (protocol/tokenizer.py ``ByteTokenizer``): 0..255 bytes, then specials.
BYTE_VOCAB = 256
TINY_VOCAB = 261  # exactly the byte tokenizer: every id the model can emit means something

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    # A few hundred thousand parameters: CPU tests and `make serve` stay fast.
    "tiny": ModelConfig(
        vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=(257, 260), name="tiny"),
    # Llama-3.2-1B shapes.
    "1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE), max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=256, eos_token_id=(257, 260), name="1b"),
    # Llama-3-8B shapes.
    "8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=(257, 260), name="8b"),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}") from None


def build_preset(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> LlamaForCausalLM:
    """The preset's model with deterministic weights (same ``name``/``seed`` → same bits anywhere,
    for a given dtype)."""
    cfg = preset_config(name)
    model = LlamaForCausalLM(cfg, device=device, dtype=dtype)
    init_random_weights(model, seed=seed, namespace=name)
    return model.eval().requires_grad_(False)


_M32 = 0xFFFFFFFF
_CHUNK = 1 << 24


def _tensor_seed(namespace: str, seed: int, param: str) -> int:
    return xxhash.xxh32_intdigest(f"{namespace}/{seed}/{param}".encode())


@torch.no_grad()
def _fill_uniform_(t: torch.Tensor, seed: int, bound: float) -> None:
    """Fill ``t`` with hash-derived values uniform on [-bound, bound).

    All intermediate products stay below 2**63 (32-bit value × 31-bit constant), so int64 tensor math
    is exact and identical on CPU and CUDA; the float conversion of a 24-bit integer and the scaling
    by a power of two are exact, leaving one IEEE multiply by ``bound`` (correctly rounded everywhere).
    """
    flat = t.view(-1)
    n = flat.numel()
    if n >= 1 << 32:
        raise ValueError(f"tensor of {n} elements is too large for the 32-bit hash counter")
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        x = torch.arange(lo, hi, dtype=torch.int64, device=t.device)
        x = (x * 0x2545F491) & _M32
        x = x ^ seed
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & _M32
        x = x ^ (x >> 15)
        x = (x * 0x5BD1E995) & _M32
        x = x ^ (x >> 16)
        u = (x >> 8).to(torch.float32) * (2.0 ** -23) - 1.0  # exact: [-1, 1) in steps of 2**-23
        flat[lo:hi] = (u * bound).to(t.dtype)


def init_random_weights(model: LlamaForCausalLM, seed: int = 0, namespace: str | None = None) -> None:
    """Deterministic init: projections ~ U(±sqrt(3/fan_in)) (unit variance gain), norms = 1,
    embeddings unit-variance when untied or ``2/sqrt(hidden)`` std when tied (the same matrix then
    also produces logits)."""
    cfg = model.config
    ns = namespace or cfg.name or "model"
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            p.data.fill_(1.0)
            continue
        if name.endswith(".bias"):
            bound = 0.1
        elif name == "embed_tokens.weight":
            std = 2.0 / math.sqrt(cfg.hidden_size) if cfg.tie_word_embeddings else 1.0
            bound = std * math.sqrt(3.0)
        elif name == "lm_head.weight":
            bound = 2.0 / math.sqrt(cfg.hidden_size) * math.sqrt(3.0)
        else:
            bound = math.sqrt(3.0 / p.shape[-1])
        _fill_uniform_(p.data, _tensor_seed(ns, seed, name), bound)
