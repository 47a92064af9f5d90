"""Load a Llama-family GGUF file (llama.cpp's format) into the worker's model, with its tokenizer.

``load_gguf("smollm2-135m")`` or ``load_gguf("path/to/model.gguf")``. The file is read with the
``gguf`` library; every tensor is dequantized (``gguf.quants.dequantize``: F32, F16, BF16, Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants) to float32 and renamed to transformers' Llama names; the
result is written once as a Hugging Face directory (``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` with the chat template, ``generation_config.json``, float32 safetensors)
under the cache directory, keyed by the xxh3-128 of the file's bytes. Every load — the first one
right after converting — then goes through :mod:`worker.loader`'s directory path, so a GGUF model
and a Hugging Face checkpoint share one strict weight loader, and a restart skips the conversion.

What llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.modify_tensors``) changes, undone
here: Q and K projection rows are permuted from the rotate-half layout of Hugging Face checkpoints
to the interleaved (GPT-J) pairs llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` rotates — the inverse is
transformers 5.24.0 ``modeling_gguf_pytorch_utils.py`` ``LlamaTensorProcessor._reverse_permute_weights``;
llama-3 RoPE scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors rather than as
parameters — they are recovered by matching the tensor against the llama3 formula
(``_llama3_rope``); a tied output layer is simply absent (``output.weight``).

Cache directory: ``cache_dir`` argument, else ``$SPLITSERVE_CACHE_DIR``, else
``$XDG_CACHE_HOME/splitserve``, else ``~/.cache/splitserve``. Two workers converting the same file
at once serialize on a lock file; the directory appears by an atomic rename, so a crash leaves no
half-written cache behind. An unwritable cache directory is not fatal: the conversion then goes
to a temporary directory that is removed after loading.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from protocol.gguf_tokenizer import gguf_tokenizer_files
from protocol.named_models import gguf_source_path, is_named_model
from protocol.tokenizer import TokenizerError
from worker.loader import LoaderError, load_directory

__all__ = ["GGUFError", "GGUFLoadInfo", "load_gguf", "convert_gguf", "read_gguf", "hf_config_from_gguf",
           "gguf_directory", "cache_root", "file_digest", "CACHE_FORMAT"]

log = logging.getLogger(__name__)

#: Bumped whenever the converted directory's content would change for the same file.
CACHE_FORMAT = 1
_MARKER = "splitserve_gguf.json"
_SHARD_BYTES = 2 << 30
_ARCHS = {"llama": ("llama", "LlamaForCausalLM")}


class GGUFError(LoaderError):
    """A GGUF file this worker cannot load faithfully (the key or tensor at fault is named)."""


@dataclass(frozen=True)
class GGUFLoadInfo:
    source: Path          # the .gguf file
    cache: Path           # the converted directory (removed after loading when not cached)
    digest: str           # xxh3-128 of the file's bytes
    converted: bool       # this call converted the file (False: loaded from the cache)
    convert_s: float      # seconds spent converting (0 when cached)
    load_s: float         # seconds for the whole load (hash, convert if needed, read weights)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "splitserve"


def file_digest(path: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def read_gguf(path: Path):
    """``(metadata as {key: plain value}, gguf.GGUFReader)``."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
    meta = {k: f.contents() for k, f in reader.fields.items()}
    return meta, reader


def _key(meta: dict[str, Any], arch: str, key: str, default: Any = ...) -> Any:
    full = f"{arch}.{key}"
    if full not in meta:
        if default is ...:
            raise GGUFError(f"GGUF metadata has no {full!r}")
        return default
    value = meta[full]
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"GGUF {full!r} varies per layer ({sorted(set(value))}); not supported")
        value = value[0]
    return value


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                        rope_freqs: np.ndarray | None = None, embed_rows: int | None = None) -> dict[str, Any]:
    """The transformers ``config.json`` dict the GGUF metadata describes (``embed_rows``: the
    embedding table's row count, which is the vocabulary size the weights have)."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(f"GGUF general.architecture is {arch!r}; supported: {sorted(_ARCHS)}")
    if _key(meta, arch, "expert_count", 0):
        raise GGUFError(f"GGUF {arch}.expert_count is {meta[f'{arch}.expert_count']}: mixture-of-experts "
                        f"models are not supported")
    hidden = int(_key(meta, arch, "embedding_length"))
    heads = int(_key(meta, arch, "attention.head_count"))
    kv_heads = int(_key(meta, arch, "attention.head_count_kv", heads))
    head_dim = int(_key(meta, arch, "attention.key_length", hidden // heads))
    if int(_key(meta, arch, "attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"GGUF {arch}.attention.value_length differs from key_length ({head_dim})")
    rot = int(_key(meta, arch, "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(f"GGUF {arch}.rope.dimension_count is {rot} but heads have {head_dim} dimensions: "
                        f"partial rotary embeddings are not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    model_type, cls = _ARCHS[arch]
    cfg: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "hidden_act": "silu",
        "vocab_size": int(embed_rows or _key(meta, arch, "vocab_size", len(tokens))),
        "hidden_size": hidden, "intermediate_size": int(_key(meta, arch, "feed_forward_length")),
        "num_hidden_layers": int(_key(meta, arch, "block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(_key(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_key(meta, arch, "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_key(meta, arch, "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names, "mlp_bias": False,
    }
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        if isinstance(meta.get(f"tokenizer.ggml.{theirs}"), int):
            cfg[ours] = meta[f"tokenizer.ggml.{theirs}"]
    scaling = _key(meta, arch, "rope.scaling.type", "none")
    factor = _key(meta, arch, "rope.scaling.factor", None)
    orig = _key(meta, arch, "rope.scaling.original_context_length", None)
    if rope_freqs is not None:
        if scaling not in ("none", "llama3"):
            raise GGUFError(f"GGUF has both rope_freqs and {arch}.rope.scaling.type {scaling!r}")
        cfg["rope_scaling"] = _llama3_rope(rope_freqs, head_dim, cfg["rope_theta"])
    elif scaling == "linear" and factor:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif scaling == "yarn" and factor:
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor),
                               "original_max_position_embeddings": int(orig or cfg["max_position_embeddings"])}
    elif scaling not in ("none", "linear", "yarn") or (scaling != "none" and not factor):
        raise GGUFError(f"GGUF {arch}.rope.scaling.type {scaling!r} (factor {factor!r}) is not supported; "
                        f"expected none, linear or yarn")
    return cfg


def _llama3_rope(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover llama3 RoPE parameters from llama.cpp's ``rope_freqs`` divisors.

    convert_hf_to_gguf writes ``1 / ((1 - s) / factor + s)`` per frequency (1 above the high-frequency
    wavelength, ``factor`` below the low one); every Llama 3.x release uses low_freq_factor 1,
    high_freq_factor 4 and an original context of 8192, so those are checked, not guessed: the
    divisors they imply must match the tensor."""
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if freqs.shape[0] != head_dim // 2:
        raise GGUFError(f"GGUF rope_freqs has {freqs.shape[0]} entries, expected head_dim / 2 = {head_dim // 2}")
    factor = float(freqs.max())
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    for low, high, orig in ((1.0, 4.0, 8192),):
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        expect = np.where(wavelen < orig / high, 1.0,
                          np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        if np.allclose(expect, freqs, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise GGUFError("GGUF rope_freqs does not match llama3 RoPE scaling with low_freq_factor 1, "
                    "high_freq_factor 4 and original context 8192; other per-frequency factors are not supported")


_LEAF = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def _hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LEAF:
        return f"model.layers.{parts[1]}.{_LEAF[parts[2]]}.{parts[3]}"
    raise GGUFError(f"GGUF tensor {name!r} has no counterpart in a Llama model")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's ``LlamaModel.permute``: rows ``(head, pair, half)`` of
    interleaved rotary pairs back to ``(head, half, pair)``, the rotate-half layout."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t) -> np.ndarray:
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dimensions innermost first
    try:
        arr = quants.dequantize(t.data, GGMLQuantizationType(t.tensor_type))
    except NotImplementedError as e:
        raise GGUFError(f"GGUF tensor {t.name} has type {t.tensor_type.name}, which gguf cannot "
                        f"dequantize: {e}") from e
    arr = np.asarray(arr, dtype=np.float32)
    if arr.size != math.prod(shape):
        raise GGUFError(f"GGUF tensor {t.name}: {arr.size} values for shape {shape}")
    return arr.reshape(shape)


def _hf_tensors(reader, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    permute = cfg["model_type"] == "llama"
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into rope_scaling by hf_config_from_gguf
        name = _hf_name(t.name)
        arr = _dequantize(t)
        if permute and ".self_attn.q_proj." in name:
            arr = _unpermute(arr, cfg["num_attention_heads"])
        elif permute and ".self_attn.k_proj." in name:
            arr = _unpermute(arr, cfg["num_key_value_heads"])
        arr = np.ascontiguousarray(arr)
        yield name, torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 data is a read-only map


def convert_gguf(path: Path, out: Path) -> dict[str, Any]:
    """Write the GGUF file at ``path`` as a Hugging Face directory ``out``; returns its config dict."""
    from safetensors.torch import save_file

    meta, reader = read_gguf(path)
    names = {t.name for t in reader.tensors}
    freqs = next((_dequantize(t) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(f"{path} has no token_embd.weight tensor")
    cfg = hf_config_from_gguf(meta, names, freqs, embed_rows=int(embed.shape[-1]))
    try:
        tok_json, tok_cfg, extra_eos = gguf_tokenizer_files(meta)
    except TokenizerError as e:
        raise GGUFError(f"{path}: {e}") from e
    eos = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
    eos += [e for e in extra_eos if e not in eos]
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    shards = 0

    def flush() -> None:
        nonlocal shard, shards
        if shard:
            shards += 1
            fname = f"model-{shards:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            shard = {}

    size = 0
    for name, tensor in _hf_tensors(reader, cfg):
        if size + tensor.nbytes > _SHARD_BYTES:
            flush()
            size = 0
        shard[name] = tensor
        size += tensor.nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": eos}, indent=2))
    (out / "tokenizer.json").write_text(tok_json)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return cfg


def _convert_into_cache(path: Path, digest: str, root: Path) -> tuple[Path, float, bool]:
    """``(directory, seconds converting, converted)``: the cached conversion, made now if missing."""
    base = root / "gguf"
    final = base / f"{digest}-v{CACHE_FORMAT}"
    if (final / _MARKER).is_file():
        return final, 0.0, False
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{digest}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here, then finds the cache
        if (final / _MARKER).is_file():
            return final, 0.0, False
        tmp = Path(tempfile.mkdtemp(prefix=f"{digest}.tmp-", dir=base))
        try:
            t0 = time.perf_counter()
            convert_gguf(path, tmp)
            took = time.perf_counter() - t0
            (tmp / _MARKER).write_text(json.dumps({"format": CACHE_FORMAT, "xxh3_128": digest,
                                                   "source": str(path), "convert_s": round(took, 3)}))
            if final.exists():
                shutil.rmtree(final)  # a stale directory without its marker
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, took, True


def gguf_directory(source: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached Hugging Face directory of a named model or ``.gguf`` path, converted now if
    missing (for callers that hand a directory on, like the tensor-parallel ranks)."""
    path = _source_path(source)
    return _convert_into_cache(path, file_digest(path), cache_root(cache_dir))[0]


def _source_path(source: str | os.PathLike) -> Path:
    try:
        return gguf_source_path(source)
    except (FileNotFoundError, KeyError) as e:
        raise LoaderError(str(e)) from None


def load_gguf(source: str | os.PathLike, device: str | torch.device | None = "cpu",
              dtype: str | torch.dtype | None = None, cache_dir: str | os.PathLike | None = None):
    """``(model, tokenizer, config, GGUFLoadInfo)`` for a named model or a ``.gguf`` path."""
    path = _source_path(source)
    name = os.fspath(source) if is_named_model(os.fspath(source)) else path.name
    t0 = time.perf_counter()
    digest = file_digest(path)
    root = cache_root(cache_dir)
    tmp_root = None
    try:
        cdir, took, converted = _convert_into_cache(path, digest, root)
    except OSError as e:
        log.warning("cache directory %s is not usable (%s); converting %s into a temporary directory",
                    root, e, path.name)
        tmp_root = Path(tempfile.mkdtemp(prefix="splitserve-gguf-"))
        cdir, took, converted = _convert_into_cache(path, digest, tmp_root)
    try:
        model, tok, cfg = load_directory(cdir, device=device, dtype=dtype, name=name)
    finally:
        if tmp_root is not None:
            shutil.rmtree(tmp_root, ignore_errors=True)
    total = time.perf_counter() - t0
    log.info("loaded %s from %s in %.2fs (%s)", name, path, total,
             f"converted in {took:.2f}s, cached at {cdir}" if converted else f"cached at {cdir}")
    return model, tok, cfg, GGUFLoadInfo(path, cdir, digest, converted, took, total)
