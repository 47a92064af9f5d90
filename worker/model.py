"""Llama-architecture decoder over a paged KV cache.

Covers the Llama family as Hugging Face `transformers` defines it (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM`` without per-layer windows): RMSNorm, rotary position
embeddings with ``rope_theta`` and the linear / dynamic-NTK / llama3 / YaRN scalings, grouped-query
attention, SwiGLU MLP, an optional sliding window, tied or untied embeddings, fp32 or bf16, CPU or
CUDA.

The model never owns KV memory: :class:`worker.runner.ModelRunner` allocates the cache and passes it in
with an :class:`AttentionMetadata` that says where each new token's K/V goes and what each sequence
attends to. Tokens of all sequences in a step are flattened into one ``[num_tokens, hidden]`` matrix
so every linear layer runs once per step; only attention looks at sequence boundaries.

Numerics follow transformers so logits agree to ~1e-6 relative in fp32: RMSNorm normalises in fp32 and
casts back before the weight, cos/sin are computed in fp32 as ``position * inv_freq`` and cast to the
activation dtype, rotation is the "rotate half" convention of HF-format checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention.plan import PagedDecode

__all__ = [
    "ModelConfig",
    "ModelConfigError",
    "AttentionMetadata",
    "PrefillSeq",
    "DecodeBatch",
    "DecodeGroup",
    "RotaryEmbedding",
    "LlamaForCausalLM",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A config.json (or preset) describes something this decoder cannot run faithfully."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    ``rope_scaling`` is normalised to ``None`` (plain RoPE) or a dict with a ``rope_type`` from
    :data:`SUPPORTED_ROPE_TYPES` plus that type's parameters. ``sliding_window`` applies to every
    layer (Mistral semantics: a query at position p sees keys at positions ``p-W+1 .. p``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    model_type: str = "llama"
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def positive(key: str) -> None:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{key} must be a positive integer, found {value!r}")

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            positive(key)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, found {self.head_dim}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ModelConfigError(f"sliding_window must be a positive integer or null, found {self.sliding_window!r}")
        if self.rope_theta <= 0:
            raise ModelConfigError(f"rope_theta must be positive, found {self.rope_theta!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any], name: str = "") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters``). Raises :class:`ModelConfigError` for architectures or options that would
        silently compute something else."""
        if not isinstance(d, dict):
            raise ModelConfigError(f"config.json must hold a JSON object, found {type(d).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"config.json model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ModelConfigError(f"config.json is missing required key {key!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads

        rope_params = d.get("rope_parameters")
        rope_theta = d.get("rope_theta")
        scaling = d.get("rope_scaling")
        if isinstance(rope_params, dict):
            if any(isinstance(v, dict) for v in rope_params.values()):
                raise ModelConfigError("per-layer-type rope_parameters are not supported")
            rope_theta = rope_params.get("rope_theta", rope_theta)
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_theta is None:
            rope_theta = 10000.0
        scaling = _normalize_rope_scaling(scaling, d)
        partial = (rope_params or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ModelConfigError(f"partial_rotary_factor {partial!r} is not supported; only 1.0")

        window = d.get("sliding_window")
        qkv_bias = bool(d.get("attention_bias", False))
        o_bias = qkv_bias
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
            if d.get("use_sliding_window", False):
                raise ModelConfigError("qwen2 use_sliding_window (per-layer windows) is not supported")
            window = None
        if model_type == "llama" and not d.get("use_sliding_window", True):
            window = None
        if d.get("layer_types") and len(set(d["layer_types"])) > 1:
            raise ModelConfigError(f"mixed layer_types {sorted(set(d['layer_types']))} are not supported")

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=window,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids,
            model_type=model_type,
            name=name,
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf(self) -> dict[str, Any]:
        """The equivalent transformers ``config.json`` dict (legacy ``rope_scaling`` spelling, which
        both transformers 4.x and 5.x read)."""
        d: dict[str, Any] = {
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM"}[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "sliding_window": self.sliding_window,
            "attention_bias": self.qkv_bias if self.model_type != "qwen2" else False,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        }
        if self.model_type == "llama" and self.sliding_window is None:
            d.pop("sliding_window")
        return d

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _normalize_rope_scaling(scaling: Any, d: dict[str, Any]) -> dict[str, Any] | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ModelConfigError(f"rope_scaling must be an object or null, found {scaling!r}")
    s = dict(scaling)
    rope_type = s.pop("rope_type", None) or s.pop("type", None) or "default"
    s.pop("type", None)
    if rope_type == "default":
        return None
    s["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        s.setdefault("original_max_position_embeddings",
                     d.get("original_max_position_embeddings", d.get("max_position_embeddings", 4096)))
    _validate_rope_scaling(s)
    return s


def _validate_rope_scaling(s: dict[str, Any]) -> None:
    rope_type = s.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"rope scaling type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}")
    required = {"linear": ("factor",), "dynamic": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("original_max_position_embeddings",), "default": ()}[rope_type]
    for key in required:
        if s.get(key) is None:
            raise ModelConfigError(f"rope scaling {rope_type!r} requires {key!r}; found keys {sorted(s)}")


# ----------------------------------------------------------------------------- rotary embeddings


class RotaryEmbedding:
    """cos/sin tables for rotary embeddings, identical in value to transformers' implementation.

    Static types cache ``cos``/``sin`` in fp32 for positions ``[0, cached_len)`` and grow the table by
    doubling; the entries are computed exactly as transformers does (``float(position) * inv_freq``), so
    caching changes no bit. ``dynamic`` (NTK) recomputes ``inv_freq`` from the sequence's length once it
    exceeds ``max_position_embeddings``: like transformers generating one sequence, keys cached earlier
    keep the rotation they were written with.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dim = cfg.head_dim
        scaling = cfg.rope_scaling or {"rope_type": "default"}
        self.rope_type = scaling["rope_type"]
        self.scaling = scaling
        self.inv_freq, self.attention_factor = self._inv_freq(None)
        self._cos = torch.empty(0, self.dim, device=self.device)
        self._sin = torch.empty(0, self.dim, device=self.device)

    def _base_inv_freq(self, base: float) -> torch.Tensor:
        exps = torch.arange(0, self.dim, 2, dtype=torch.int64).to(dtype=torch.float) / self.dim
        return 1.0 / (base ** exps)

    def _inv_freq(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        cfg, s, base = self.cfg, self.scaling, self.cfg.rope_theta
        t = self.rope_type
        if t == "default":
            inv, factor = self._base_inv_freq(base), 1.0
        elif t == "linear":
            inv, factor = self._base_inv_freq(base) / s["factor"], 1.0
        elif t == "dynamic":
            max_pos = cfg.max_position_embeddings
            seq_len = max(seq_len or max_pos, max_pos)
            f = s["factor"]
            base = base * ((f * seq_len / max_pos) - (f - 1)) ** (self.dim / (self.dim - 2))
            inv, factor = self._base_inv_freq(base), 1.0
        elif t == "llama3":
            inv = self._base_inv_freq(base)
            f, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old = s["original_max_position_embeddings"]
            low_wl, high_wl = old / lo, old / hi
            wavelen = 2 * math.pi / inv
            inv_l = torch.where(wavelen > low_wl, inv / f, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * inv_l / f + smooth * inv_l
            medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
            inv, factor = torch.where(medium, smoothed, inv_l), 1.0
        elif t == "yarn":
            inv, factor = self._yarn(base)
        else:  # guarded by ModelConfig validation
            raise ModelConfigError(f"unsupported rope type {t!r}")
        return inv.to(self.device), float(factor)

    def _yarn(self, base: float) -> tuple[torch.Tensor, float]:
        s, dim = self.scaling, self.dim
        orig = s["original_max_position_embeddings"]
        f = s.get("factor")
        if f is None:
            f = self.cfg.max_position_embeddings / orig

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention = s.get("attention_factor")
        if attention is None:
            ms, ms_all = s.get("mscale"), s.get("mscale_all_dim")
            attention = get_mscale(f, ms) / get_mscale(f, ms_all) if ms and ms_all else get_mscale(f)
        beta_fast = s.get("beta_fast") or 32
        beta_slow = s.get("beta_slow") or 1

        def correction_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extra = 1.0 / pos_freqs
        inter = 1.0 / (f * pos_freqs)
        extra_factor = 1 - ramp
        return inter * (1 - extra_factor) + extra * extra_factor, float(attention)

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                max_position: int | None = None, max_seq_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[n, head_dim]`` cos and sin for ``positions`` (int64 on this device).

        ``seq_lens`` (the owning sequence's length after this step, per token) only matters for
        ``dynamic`` scaling. ``max_position``/``max_seq_len`` are host-side maxima of the two tensors;
        passing them avoids a device sync (and is required inside CUDA-graph capture)."""
        if self.rope_type == "dynamic":
            max_pos = self.cfg.max_position_embeddings
            if seq_lens is not None and max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            if seq_lens is None or max_seq_len <= max_pos:
                return self._table(self.inv_freq, positions)
            cos = torch.empty(positions.shape[0], self.dim, device=self.device)
            sin = torch.empty_like(cos)
            for length in torch.unique(seq_lens).tolist():
                sel = seq_lens == length
                inv = self.inv_freq if length <= max_pos else self._inv_freq(int(length))[0]
                cos[sel], sin[sel] = self._table(inv, positions[sel])
            return cos, sin
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else -1
        need = max_position + 1
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 256)
            self._cos, self._sin = self._table(self.inv_freq, torch.arange(size, device=self.device))
        return self._cos[positions], self._sin[positions]

    def ensure(self, length: int) -> None:
        """Pre-build the static table up to ``length`` positions (keeps CUDA-graph replays allocation-free)."""
        if self.rope_type != "dynamic" and length > self._cos.shape[0]:
            self._cos, self._sin = self._table(self.inv_freq, torch.arange(length, device=self.device))


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: folds rotate-half's negation into the table, once per step."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF "rotate half" RoPE, ``x*cos + rotate_half(x)*sin``, in three kernels for q and k together.

    x: [n, heads, head_dim] (may be a strided view); cos/sin_signed: [n, head_dim] in x.dtype.
    rotate_half(x)*sin == swap_halves(x)*sin_signed exactly (a sign flip is exact)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos[:, None, :], swapped, sin_signed[:, None, :])


# ----------------------------------------------------------------------------- attention metadata


@dataclass
class PrefillSeq:
    """One multi-token chunk: new tokens ``token_start:token_end`` of the flat batch at absolute
    positions ``start_pos ..``; ``gather_blocks`` are the cache blocks holding keys from absolute
    position ``key_start`` (block-aligned) up to the chunk's last position, or ``None`` when the chunk
    starts the sequence and attends only to its own fresh K/V."""

    token_start: int
    token_end: int
    start_pos: int
    gather_blocks: torch.Tensor | None
    key_start: int
    attn_mask: torch.Tensor | None  # bool [q, k]; None means plain causal over fresh K/V


@dataclass
class DecodeGroup:
    """Decode rows ``start:end`` (of the decode batch) that read block tables of similar length:
    ``tables`` [end-start, nblk] lists the blocks each row reads (padded to the group's longest row),
    ``bias`` [end-start, 1, 1, nblk*block_size] (model dtype) is 0 where a key is visible and -inf
    elsewhere (causal/window range and padding)."""

    start: int
    end: int
    tables: torch.Tensor
    bias: torch.Tensor


@dataclass
class DecodeBatch:
    """Single-token chunks attended to together: ``token_idx`` selects their rows of the flat batch;
    ``groups`` partition those rows into consecutive runs, each gathering only as many keys as its
    own longest row needs, so one long context does not make every short row gather its length.

    Invariant: the groups are ordered and contiguous, ``groups[0].start == 0`` and
    ``groups[-1].end == len(token_idx)``."""

    token_idx: torch.Tensor
    groups: list[DecodeGroup]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the runner, shared by all layers.

    ``slot_block``/``slot_offset`` give, per new token, the cache block and the offset inside it where
    that token's K/V are written before any attention reads the cache.

    ``backend`` ``"triton"`` (worker/attention): decode rows are described by ``paged`` (the kernel
    reads their blocks in place; ``decode`` is then ``None``), and a prefill chunk with
    ``gather_blocks`` is attended by the paged prefill kernel through that table from position
    ``key_start`` (``attn_mask`` unused)."""

    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    prefills: list[PrefillSeq]
    decode: DecodeBatch | None
    block_size: int
    backend: str = "torch"
    paged: PagedDecode | None = None


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel; it accumulates in fp32 like transformers' LlamaRMSNorm (which additionally
        # rounds to the activation dtype before the weight multiply: a last-bit difference in bf16).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention. q/k/v projections are fused into one matrix (rows: q, then k, then v)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = cfg.sliding_window
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias,
                                  device=device, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if meta.backend == "triton":
            return self._forward_triton(x, cos, sin, meta, kv_cache)
        qkv = self.qkv_proj(x)
        qk = _apply_rope(qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads,
                                                                   self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)

        # kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        layer = kv_cache[:, self.layer_idx]
        layer[meta.slot_block, 0, meta.slot_offset] = k
        layer[meta.slot_block, 1, meta.slot_offset] = v

        d = meta.decode
        if not meta.prefills and d is not None:
            # Decode-only step: the batch rows are the decode rows in order; no scatter needed.
            return self.o_proj(self._decode(q, layer, d, meta.block_size).reshape(n, self.q_size))
        if d is None and len(meta.prefills) == 1:
            return self.o_proj(self._prefill(q, k, v, layer, meta.prefills[0], meta.block_size)
                               .reshape(n, self.q_size))
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for p in meta.prefills:
            out[p.token_start:p.token_end] = self._prefill(q, k, v, layer, p, meta.block_size)
        if d is not None:
            out[d.token_idx] = self._decode(q[d.token_idx], layer, d, meta.block_size)
        return self.o_proj(out.view(n, self.q_size))

    def _forward_triton(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """The triton backend: K/V stay in the pool and are read there through block tables.

        A decode-only step of at most ``MAX_M`` rows runs qkv and o_proj as split-K partial products
        (worker/attention/triton_linear.py): the fp32 ``[S, n, ·]`` result is summed by its consumer
        (RoPE + store here, the residual-add + RMSNorm after o_proj), so the return value is then
        those partials, not the product."""
        ops = _triton_ops()
        n = x.shape[0]
        if not meta.prefills:
            # Decode-only step: RoPE and both cache stores in one launch, then the paged kernel.
            small = ops.use_small_m(x)
            a, o = self.qkv_proj, self.o_proj
            qkv = ops.linear_partials(x, a.weight, a.bias) if small else a(x)
            q = ops.rope_store(qkv, cos, sin, kv_cache, self.layer_idx, meta.slot_block, meta.slot_offset,
                               self.num_heads, self.num_kv_heads, self.head_dim)
            out = torch.empty_like(q)
            ops.paged_decode(q, kv_cache, self.layer_idx, meta.paged, self.scale, out)
            out = out.view(n, self.q_size)
            return ops.linear_partials(out, o.weight, o.bias) if small else o(out)
        qkv = self.qkv_proj(x)
        qk = _apply_rope(qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads,
                                                                   self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        layer = kv_cache[:, self.layer_idx]
        layer[meta.slot_block, 0, meta.slot_offset] = k
        layer[meta.slot_block, 1, meta.slot_offset] = v
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for p in meta.prefills:
            if p.gather_blocks is None:  # fresh prompt: its own K/V are at hand, SDPA as the torch path
                out[p.token_start:p.token_end] = self._prefill(q, k, v, layer, p, meta.block_size)
            else:
                ops.paged_prefill(q[p.token_start:p.token_end], kv_cache, self.layer_idx, p.gather_blocks,
                                  p.start_pos, p.key_start, self.scale, self.window, out[p.token_start:p.token_end])
        if meta.paged is not None:
            s = meta.paged.token_start
            ops.paged_decode(q[s:], kv_cache, self.layer_idx, meta.paged, self.scale, out[s:])
        return self.o_proj(out.view(n, self.q_size))

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor,
                 p: "PrefillSeq", block_size: int) -> torch.Tensor:
        """Attention output ``[Lq, H, D]`` of one multi-token chunk."""
        qs = q[p.token_start:p.token_end].transpose(0, 1)  # [H, Lq, D]
        if p.gather_blocks is None:
            ks = k[p.token_start:p.token_end].transpose(0, 1)
            vs = v[p.token_start:p.token_end].transpose(0, 1)
        else:
            nb, keys = p.gather_blocks.shape[0], p.attn_mask.shape[1]
            ks = layer[p.gather_blocks, 0].view(nb * block_size, self.num_kv_heads, self.head_dim)
            vs = layer[p.gather_blocks, 1].view(nb * block_size, self.num_kv_heads, self.head_dim)
            ks, vs = ks[:keys].transpose(0, 1), vs[:keys].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
            attn_mask=p.attn_mask, is_causal=p.attn_mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, layer: torch.Tensor, d: "DecodeBatch", block_size: int) -> torch.Tensor:
        """Attention output ``[B, H, D]`` of single-token rows ``q`` ``[B, H, D]``, one gather and one
        attention per :class:`DecodeGroup` (outputs concatenated in row order)."""
        if len(d.groups) == 1:
            return self._decode_group(q, layer, d.groups[0], block_size)
        return torch.cat([self._decode_group(q[g.start:g.end], layer, g, block_size) for g in d.groups])

    def _decode_group(self, q: torch.Tensor, layer: torch.Tensor, g: "DecodeGroup",
                      block_size: int) -> torch.Tensor:
        """The query heads sharing one KV head become that KV head's "query rows", so GQA decode is
        plain attention over ``[b, kv_heads, groups, D]`` with no repeated K/V; ``g.bias`` (additive,
        shared by all layers) masks keys outside each row's causal/window range and the padding."""
        b, nblk = g.tables.shape
        groups = self.num_heads // self.num_kv_heads
        qd = q.reshape(b, self.num_kv_heads, groups, self.head_dim)
        kd = layer[g.tables, 0].view(b, nblk * block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vd = layer[g.tables, 1].view(b, nblk * block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.bias, scale=self.scale)
        return o.reshape(b, self.num_heads, self.head_dim)


_TRITON_OPS = None


def _triton_ops():
    """worker.attention.triton_ops, imported on first use (CPU installs need no Triton)."""
    global _TRITON_OPS
    if _TRITON_OPS is None:
        from worker.attention import interpreting
        interpreting()  # SPLITSERVE_TRITON_INTERPRET=1 must reach triton before the kernels are defined
        from worker.attention import triton_ops
        _TRITON_OPS = triton_ops
    return _TRITON_OPS


class MLP(nn.Module):
    """SwiGLU; gate and up projections fused into one matrix (rows: gate, then up)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias,
                                      device=device, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                   device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = Attention(cfg, layer_idx, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if meta.backend == "triton":
            h, m = self.triton_parts(h, self.input_layernorm(h), cos, sin, meta, kv_cache)
            return h + m
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


    def triton_parts(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the triton backend from ``x = input_layernorm(h)``: the residual after
        attention and the MLP output, not yet added (the caller folds that add into the next norm).
        At most ``MAX_M`` rows: gate·up with SiLU in one kernel, and the MLP output is down_proj's
        split-K partials (worker/attention/triton_linear.py), summed by that next norm."""
        ops = _triton_ops()
        a = self.self_attn(x, cos, sin, meta, kv_cache)
        # a + h, not h + a: the kernel's first input may be split-K partials (fp32 addition commutes).
        h, x = ops.add_rms_norm(a, h, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        mlp = self.mlp
        if ops.use_small_m(x):
            gu, down = mlp.gate_up_proj, mlp.down_proj
            return h, ops.linear_partials(ops.gate_up_silu(x, gu.weight, gu.bias), down.weight, down.bias)
        return h, mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(x)))


class LlamaForCausalLM(nn.Module):
    """The decoder. Parameters are created uninitialised (``torch.empty``); the loader or a preset fills
    them. With ``tie_word_embeddings`` the output projection *is* ``embed_tokens.weight``."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        device = torch.device(device)
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=device)
        self.requires_grad_(False)  # inference only: no autograd bookkeeping on weights
        self.rotary = RotaryEmbedding(cfg, device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def move(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "LlamaForCausalLM":
        """``.to(device, dtype)`` that also moves the rotary tables (plain tensors, not buffers)."""
        self.to(device=device, dtype=dtype or self.dtype)
        self.rotary = RotaryEmbedding(self.config, device)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, seq_lens: torch.Tensor | None = None,
                max_position: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the last layer, before the final norm.
        ``max_position``/``max_seq_len``: host-side maxima (see :meth:`RotaryEmbedding.cos_sin`)."""
        cos, sin = self.rotary.cos_sin(positions, seq_lens, max_position, max_seq_len)
        cos, sin = cos.to(self.dtype), _signed_sin(sin.to(self.dtype))
        h = self.embed_tokens(input_ids)
        if meta.backend == "triton":
            # Each layer's closing residual add is folded into the next layer's input RMSNorm.
            ops, layers = _triton_ops(), self.layers
            x = layers[0].input_layernorm(h)
            for i, layer in enumerate(layers):
                h, m = layer.triton_parts(h, x, cos, sin, meta, kv_cache)
                if i + 1 == len(layers):
                    # m may be split-K partials: the add kernel sums them (its normalised output unused)
                    return ops.add_rms_norm(m, h, self.norm.weight, self.norm.eps)[0] if m.dim() == 3 else h + m
                norm = layers[i + 1].input_layernorm
                h, x = ops.add_rms_norm(m, h, norm.weight, norm.eps)
        for layer in self.layers:
            h = layer(h, cos, sin, meta, kv_cache)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (model dtype) for the given rows of :meth:`forward`'s output."""
        return F.linear(self.norm(hidden), self.output_weight)
