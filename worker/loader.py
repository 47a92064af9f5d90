"""Build a model and its tokenizer from a preset name or a Hugging Face-format directory (GGUF files
and named GGUF models are converted to such a directory first: worker/gguf_loader.py).

A directory holds ``config.json``, weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, and normally ``tokenizer.json`` + ``tokenizer_config.json`` (chat
template there or in ``chat_template.jinja``) and ``generation_config.json`` (extra stop ids). Only
safetensors are read — never pickled ``*.bin`` files. Weight names follow transformers'
``LlamaForCausalLM`` (``model.layers.N.self_attn.q_proj.weight`` …); q/k/v and gate/up are fused on load.
Loading is strict: a missing, unexpected or mis-shaped tensor is an error naming it
(:class:`LoaderError`); an unsupported architecture in config.json raises
:class:`worker.model_config.ModelConfigError`. Both are ``ValueError``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from protocol.named_models import NAMED_MODELS, is_gguf_source
from protocol.prompt import chat_template_of
from protocol.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from worker.model import LlamaForCausalLM
from worker.model_config import ModelConfig
from worker.presets import build_preset, is_preset, preset_config

__all__ = ["LoaderError", "load_model", "load_directory", "load_tokenizer", "save_hf_checkpoint", "resolve_dtype",
           "resolve_device"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class LoaderError(ValueError):
    """A model directory or name that cannot be loaded, with the file or tensor at fault."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LoaderError("device 'cuda' requested but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise LoaderError(f"device must be 'cpu' or 'cuda', found {str(device)!r}")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` → float32 on CPU, bfloat16 on CUDA."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise LoaderError(f"dtype must be float32, bfloat16 or float16, found {dtype}")
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise LoaderError(f"dtype must be one of {sorted(_DTYPES)}, found {dtype!r}") from None


def load_model(name_or_dir: str | os.PathLike, device: str | torch.device | None = "cpu",
               dtype: str | torch.dtype | None = None, cache_dir: str | os.PathLike | None = None,
               ) -> tuple[LlamaForCausalLM, Tokenizer, ModelConfig]:
    """``(model, tokenizer, config)`` for a preset name (``tiny``, ``1b``, ``8b``), a directory, a
    named GGUF model (``smollm2-135m``) or a ``.gguf`` file (worker/gguf_loader.py; ``cache_dir``
    holds the converted weights)."""
    name = os.fspath(name_or_dir)
    if is_preset(name) and not Path(name).is_dir():
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        cfg = preset_config(name)
        model = build_preset(name, device=dev, dtype=dt)
        return model, ByteTokenizer(vocab_size=cfg.vocab_size), cfg
    if is_gguf_source(name) and not Path(name).is_dir():
        from worker.gguf_loader import load_gguf

        model, tok, cfg, _info = load_gguf(name, device=device, dtype=dtype, cache_dir=cache_dir)
        return model, tok, cfg
    path = Path(name)
    if not path.is_dir():
        raise LoaderError(f"model {name!r} is neither a preset (tiny, 1b, 8b), a named model "
                          f"({', '.join(sorted(NAMED_MODELS))}), a .gguf file nor a directory")
    return load_directory(path, device, dtype)


def load_directory(path: str | os.PathLike, device: str | torch.device | None = "cpu",
                   dtype: str | torch.dtype | None = None, name: str | None = None,
                   ) -> tuple[LlamaForCausalLM, Tokenizer, ModelConfig]:
    """``(model, tokenizer, config)`` of a Hugging Face-format directory; ``name`` (default: the
    directory's name) is the config's model name."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = Path(path)
    cfg = ModelConfig.from_hf(_read_json(path / "config.json"), name=name or path.name)
    model = LlamaForCausalLM(cfg, device=dev, dtype=dt)
    _load_weights(model, path)
    return model.eval(), load_tokenizer(path, cfg), cfg


def _read_json(p: Path, required: bool = True) -> Any:
    if not p.is_file():
        if required:
            raise LoaderError(f"{p} does not exist")
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoaderError(f"{p} is not valid JSON: {e}") from e


def load_tokenizer(path: str | os.PathLike, cfg: ModelConfig | None = None) -> Tokenizer:
    """The directory's tokenizer. Without a ``tokenizer.json`` a byte-level tokenizer stands in
    (test checkpoints written without one), provided the vocabulary is large enough."""
    path = Path(path)
    gen = _read_json(path / "generation_config.json", required=False) or {}
    extra_eos: list[int] = []
    for src in (gen.get("eos_token_id"), list(cfg.eos_token_id) if cfg else None):
        if isinstance(src, int):
            extra_eos.append(src)
        elif isinstance(src, list):
            extra_eos.extend(int(x) for x in src)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        vocab = cfg.vocab_size if cfg else 0
        if vocab < 256 + len(ByteTokenizer.SPECIALS):
            raise LoaderError(f"{path} has no tokenizer.json and its vocabulary ({vocab}) is too small "
                              f"for the byte-level fallback tokenizer")
        log.warning("%s has no tokenizer.json; using the byte-level tokenizer", path)
        return ByteTokenizer(vocab_size=vocab)
    tcfg = _read_json(path / "tokenizer_config.json", required=False) or {}
    return HFTokenizer.from_json(tj.read_text(encoding="utf-8"), tcfg, chat_template=chat_template_of(path),
                                 extra_eos_token_ids=extra_eos)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {  # HF name within a layer → (our parameter, part index, parts)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_PLAIN = ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def _shard_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (_read_json(index) or {}).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoaderError(f"{index} has no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif single.is_file():
        files = [single]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {bins}: pickled weights are not loaded; convert them to safetensors)" if bins else ""
        raise LoaderError(f"{path} has no *.safetensors weights{hint}")
    for f in files:
        if not f.is_file():
            raise LoaderError(f"weight shard {f} listed in the index does not exist")
    return files


def _split_sizes(model: LlamaForCausalLM, target: str) -> list[int]:
    c = model.config
    if "qkv_proj" in target:
        return [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                c.num_key_value_heads * c.head_dim]
    return [c.intermediate_size, c.intermediate_size]


@torch.no_grad()
def _load_weights(model: LlamaForCausalLM, path: Path) -> None:
    from safetensors import safe_open
    from safetensors import SafetensorError

    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {}  # parameter → parts written
    unexpected: list[str] = []
    cfg = model.config
    for f in _shard_files(path):
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise LoaderError(f"{f} is not a readable safetensors file: {e}") from e
        with handle:
            for key in handle.keys():
                target, part = _map_name(key, cfg)
                if target is None:
                    if part == -2:
                        continue  # buffers transformers used to save (rotary inv_freq), or tied lm_head
                    unexpected.append(key)
                    continue
                if target not in params:
                    unexpected.append(key)
                    continue
                tensor = handle.get_tensor(key)
                dest = params[target]
                if part >= 0:
                    sizes = _split_sizes(model, target)
                    lo = sum(sizes[:part])
                    dest = dest[lo:lo + sizes[part]]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise LoaderError(f"{f.name}: tensor {key} has shape {tuple(tensor.shape)}, "
                                      f"config.json implies {tuple(dest.shape)}")
                done = filled.setdefault(target, set())
                if part in done:
                    raise LoaderError(f"tensor {key} appears more than once across shards")
                dest.copy_(tensor)
                done.add(part)
    if unexpected:
        raise LoaderError(f"{path}: unexpected tensors {unexpected[:8]}"
                          + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
    missing = []
    for name in params:
        parts = {0, 1, 2} if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias") else (
            {0, 1} if "gate_up_proj" in name else {-1})
        if filled.get(name, set()) != parts:
            missing.append(name)
    if missing:
        raise LoaderError(f"{path}: missing weights for {missing[:8]}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _map_name(key: str, cfg: ModelConfig) -> tuple[str | None, int]:
    """HF tensor name → (our parameter name, fused part or -1); (None, -2) means skip silently,
    (None, -1) means unexpected."""
    if key == "model.embed_tokens.weight":
        return "embed_tokens.weight", -1
    if key == "model.norm.weight":
        return "norm.weight", -1
    if key == "lm_head.weight":
        return (None, -2) if cfg.tie_word_embeddings else ("lm_head.weight", -1)
    m = _LAYER_RE.match(key)
    if not m:
        return None, -1
    layer, rest = m.group(1), m.group(2)
    if rest.endswith("rotary_emb.inv_freq"):
        return None, -2
    module, _, leaf = rest.rpartition(".")
    if module in _FUSED:
        target, part = _FUSED[module]
        return f"layers.{layer}.{target}.{leaf}", part
    if module in _PLAIN:
        return f"layers.{layer}.{module}.{leaf}", -1
    return None, -1


@torch.no_grad()
def save_hf_checkpoint(model: LlamaForCausalLM, path: str | os.PathLike, tokenizer_json: str | None = None,
                       tokenizer_config: dict[str, Any] | None = None) -> Path:
    """Write ``model`` as a Hugging Face directory (config.json + model.safetensors, HF tensor names),
    loadable by :func:`load_model` and by transformers."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        if name == "embed_tokens.weight":
            tensors["model.embed_tokens.weight"] = t
        elif name == "norm.weight":
            tensors["model.norm.weight"] = t
        elif name == "lm_head.weight":
            tensors["lm_head.weight"] = t
        else:
            _, layer, rest = name.split(".", 2)
            module, _, leaf = rest.rpartition(".")
            if module in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
                names = (["q_proj", "k_proj", "v_proj"] if module.startswith("self_attn")
                         else ["gate_proj", "up_proj"])
                prefix = module.split(".")[0]
                for sub, piece in zip(names, t.split(_split_sizes(model, module), dim=0)):
                    tensors[f"model.layers.{layer}.{prefix}.{sub}.{leaf}"] = piece.contiguous()
            else:
                tensors[f"model.layers.{layer}.{rest}"] = t
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(tokenizer_json)
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path

