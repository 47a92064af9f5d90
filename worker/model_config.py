"""Shape and numerics of a Llama-family decoder: ``ModelConfig``, read from and written back to a
Hugging Face ``config.json``, with the RoPE scaling normalised and checked. No torch imported here
(the presets, the loaders and the multi-rank launcher read configs before building anything)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ModelConfig", "ModelConfigError", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES"]

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
