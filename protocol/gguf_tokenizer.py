"""A ``tokenizers`` tokenizer from a GGUF file's tokenizer metadata, pure: a metadata dict in.

A GGUF file carries no ``tokenizer.json``; llama.cpp stores the vocabulary as metadata instead
(``tokenizer.ggml.tokens`` / ``token_type`` / ``merges`` / ``*_token_id``, ``tokenizer.ggml.pre`` naming
the pre-tokenizer regex, ``tokenizer.chat_template``). This module rebuilds the byte-level BPE
tokenizer that metadata describes (``tokenizer.ggml.model == "gpt2"``, the GPT-2 / Llama-3 /
SmolLM / Qwen2 family), as :class:`protocol.tokenizer.HFTokenizer`, so the worker and the fleet's
routing tokenizer derive their token ids from one recipe.

The construction follows transformers 5.24.0 ``integrations/gguf/gguf_tokenizer_mapping.py``
(``byte_level_tokenizer``: tokens outside the byte alphabet respelled through ``bytes_to_unicode``;
``add_gguf_special_tokens``: token type 3 = CONTROL → special added token, 4 = USER_DEFINED → plain
added token; BOS on ``encode`` only when ``tokenizer.ggml.add_bos_token`` says so). The
pre-tokenizer comes from llama.cpp's ``tokenizer.ggml.pre`` table (``src/llama-vocab.cpp``): for
``smollm``/``starcoder``-style vocabularies llama.cpp splits every digit (``\\p{N}``) before the
GPT-2 regex — the ``Digits(individual_digits)`` + ``ByteLevel`` pair of those models' own
``tokenizer.json``; transformers' GGUF path drops the digit split, which only matters for a
vocabulary that has multi-digit tokens (SmolLM2's has none, see tests/worker_model/test_gguf.py).
An unknown pre-tokenizer name is an error rather than a guess: a tokenizer that splits differently
from the one the model was trained with gives other ids, and KV-aware routing then never matches.

The worker loader reads the metadata with the ``gguf`` library (worker/gguf_loader.py), the fleet
(fleet/keys.py) and the sim engine with protocol/gguf_metadata.py (the metadata alone, without the
library's per-string arrays); all pass the plain-value dict to :func:`gguf_tokenizer`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

from protocol.tokenizer import HFTokenizer, TokenizerError

__all__ = ["gguf_tokenizer", "gguf_tokenizer_files", "GGUF_PRE_TOKENIZERS"]

# llama.cpp src/llama-vocab.cpp (LLAMA_VOCAB_PRE_TYPE_* regex_exprs), by tokenizer.ggml.pre value.
_GPT2_REGEX = None  # ByteLevel's own regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: pre-tokenizer name → (split every digit first, regex or None for the GPT-2 one)
GGUF_PRE_TOKENIZERS: dict[str, tuple[bool, str | None]] = {
    "default": (False, _GPT2_REGEX), "gpt-2": (False, _GPT2_REGEX), "gpt2": (False, _GPT2_REGEX),
    "smollm": (True, _GPT2_REGEX), "starcoder": (True, _GPT2_REGEX), "refact": (True, _GPT2_REGEX),
    "command-r": (True, _GPT2_REGEX), "codeshell": (True, _GPT2_REGEX),
    "llama-bpe": (False, _LLAMA3_REGEX), "llama3": (False, _LLAMA3_REGEX), "smaug-bpe": (False, _LLAMA3_REGEX),
    "qwen2": (False, _QWEN2_REGEX), "deepseek-r1-qwen": (False, _QWEN2_REGEX),
}

_CONTROL, _USER_DEFINED = 3, 4


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
    # GPT-2's bytes_to_unicode (transformers convert_slow_tokenizer.bytes_to_unicode).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    spelling = {b: chr(c) for b, c in zip(bs, cs)}
    return spelling, frozenset(spelling.values())


def _get(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    if key not in meta:
        if required:
            raise TokenizerError(f"GGUF metadata has no {key!r}: the file does not describe a tokenizer")
        return None
    value = meta[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise TokenizerError(f"GGUF metadata {key!r} must be {getattr(kind, '__name__', kind)}, "
                             f"found {type(value).__name__}")
    return value


def gguf_tokenizer_files(meta: Mapping[str, Any]) -> tuple[str, dict[str, Any], list[int]]:
    """``(tokenizer.json text, tokenizer_config dict, extra eos ids)`` for GGUF tokenizer metadata:
    what :meth:`HFTokenizer.from_json` takes, and what a Hugging Face directory holds."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _get(meta, "tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise TokenizerError(f"GGUF tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') "
                             f"vocabularies are supported")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerError(f"GGUF tokenizer.ggml.pre {pre!r} is not a known pre-tokenizer; expected one "
                             f"of {sorted(GGUF_PRE_TOKENIZERS)}")
    tokens = list(_get(meta, "tokenizer.ggml.tokens", (list, tuple)))
    types = list(_get(meta, "tokenizer.ggml.token_type", (list, tuple), required=False) or [])
    merges = list(_get(meta, "tokenizer.ggml.merges", (list, tuple), required=False) or [])
    if types and len(types) != len(tokens):
        raise TokenizerError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    spelling, alphabet = _byte_alphabet()
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if not isinstance(tok, str):
            raise TokenizerError(f"GGUF tokenizer.ggml.tokens[{i}] must be a string, found {type(tok).__name__}")
        spelled = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    pairs = []
    for i, m in enumerate(merges):
        a, sep, b = m.partition(" ") if isinstance(m, str) else ("", "", "")
        if not sep:
            raise TokenizerError(f"GGUF tokenizer.ggml.merges[{i}] must be 'left right', found {m!r}")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    split_digits, regex = GGUF_PRE_TOKENIZERS[pre]
    if regex is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        steps = [pre_tokenizers.Digits(individual_digits=True), byte_level] if split_digits else [byte_level]
    else:
        steps = [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    tok.decoder = decoders.ByteLevel()
    # Control tokens written in the byte alphabet only: one with other characters is a llama.cpp
    # mislabel (transformers skips it too; adding it would grow the vocabulary past the model's).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

    def token_of(key: str) -> str | None:
        idx = _get(meta, f"tokenizer.ggml.{key}", int, required=False)
        if idx is None:
            return None
        if not 0 <= idx < len(tokens):
            raise TokenizerError(f"GGUF tokenizer.ggml.{key} is {idx}, outside the {len(tokens)}-token vocabulary")
        return tokens[idx]

    bos, eos, pad, unk = (token_of(k) for k in ("bos_token_id", "eos_token_id", "padding_token_id",
                                                "unknown_token_id"))
    add_bos = meta.get("tokenizer.ggml.add_bos_token") is True and bos is not None
    add_eos = meta.get("tokenizer.ggml.add_eos_token") is True and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    specials = [(t, vocab.get(t, tokens.index(t))) for t in dict.fromkeys(
        ([bos] if add_bos else []) + ([eos] if add_eos else []))]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    config: dict[str, Any] = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
                              "add_bos_token": add_bos, "add_eos_token": add_eos,
                              "clean_up_tokenization_spaces": False}
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    # llama.cpp stops on end-of-turn / end-of-message too (Llama-3's <|eot_id|>, <|eom_id|>).
    extra = [int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
             if isinstance(meta.get(k), int) and 0 <= meta[k] < len(tokens)]
    return tok.to_str(), {k: v for k, v in config.items() if v is not None}, extra


def gguf_tokenizer(meta: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer GGUF metadata (``{key: plain value}``, e.g. from ``gguf.GGUFReader`` fields'
    ``contents()``) describes, with its chat template and stop ids."""
    text, config, extra = gguf_tokenizer_files(meta)
    return HFTokenizer.from_json(text, config, extra_eos_token_ids=extra)

