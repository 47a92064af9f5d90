"""The routing tokenizer and the prompt→token-ids recipe, shared by the fleet and the coordinator.

The fleet computes a request's block keys from these token ids (fleet/keys.py); the coordinator
runs the same recipe over fixed probe prompts to check that a worker tokenizes them identically
(coordinator/kv_parity.py). One module, so the two can never disagree with each other — only with a
worker, which is exactly what the parity probe catches.

Recipe (worker/protocol.py does the same): completions encode the prompt with special tokens;
chats render the model's chat template over the text of each message (list parts joined by
newlines) and encode the result without adding special tokens; `prompt_token_ids` (or a token-id
`prompt`) is used as is.

The chat template follows Hugging Face's precedence (worker/loader.py): `chat_template.jinja`,
else `chat_template.json`, else `tokenizer_config.json`'s `chat_template`. Newer checkpoints ship
only the separate file; ignoring it tokenizes every chat differently from the worker.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from router.gguf_tokenizer import gguf_tokenizer
from router.named_models import gguf_source_path, is_gguf_source
from router.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["TokenizerUnavailable", "PRESETS", "load_tokenizer", "chat_template_of",
           "routing_tokenizer_name", "message_text", "request_token_ids"]

# Names the workers resolve to a built-in model with the byte-level tokenizer (worker/presets.py).
PRESETS = frozenset({"tiny", "1b", "8b"})


class TokenizerUnavailable(RuntimeError):
    pass


def chat_template_of(d: Path) -> str | None:
    """The chat template shipped beside the tokenizer (None: use tokenizer_config.json's)."""
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cj = d / "chat_template.json"
    if cj.is_file():
        t = json.loads(cj.read_text(encoding="utf-8")).get("chat_template")
        return t if isinstance(t, str) else None
    return None


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer the workers use for `model`: a preset name, a Hugging Face model directory, or
    a GGUF source (a named model such as `smollm2-135m`, or a `.gguf` file)."""
    if model is None or model in PRESETS:
        return ByteTokenizer()
    if is_gguf_source(model) and not Path(model).is_dir():
        return _gguf_tokenizer(model)
    d = Path(model)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise TokenizerUnavailable(
            f"cannot build the routing tokenizer for model {model!r}: expected a preset "
            f"({', '.join(sorted(PRESETS))}) or a directory with tokenizer.json, found neither")
    cfg = {}
    tc = d / "tokenizer_config.json"
    if tc.is_file():
        cfg = json.loads(tc.read_text(encoding="utf-8"))
    return HFTokenizer.from_json(tj.read_text(encoding="utf-8"), cfg, chat_template=chat_template_of(d))


def _gguf_tokenizer(model: str) -> Tokenizer:
    """The GGUF file's own tokenizer, built by the recipe the workers use (router/gguf_tokenizer.py)."""
    import gguf

    try:
        fields = gguf.GGUFReader(gguf_source_path(model)).fields
    except (OSError, ValueError, KeyError) as e:
        raise TokenizerUnavailable(f"cannot build the routing tokenizer for model {model!r}: {e}") from None
    return gguf_tokenizer({k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")})


def routing_tokenizer_name(config, reported_models=()) -> str | None:
    """Which tokenizer routes: the config's `tokenizer` (upstream's engine key, per server
    section), else its `model`, else the first model a server reports in `/server_info`."""
    tok = (config.generation_servers.engine_args.get("tokenizer")
           or config.context_servers.engine_args.get("tokenizer"))
    return tok or config.served_model or next(iter(reported_models), None)


def message_text(m: Mapping[str, Any]) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return "\n".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")


def request_token_ids(tok: Tokenizer, body: Mapping[str, Any], chat: bool) -> list[int]:
    """The prompt token ids a worker computes for this (already validated) request body."""
    ids = body.get("prompt_token_ids")
    if ids is not None:
        return ids
    if chat:
        msgs = [{"role": m["role"], "content": message_text(m)} for m in body["messages"]]
        agp = body.get("add_generation_prompt", True)
        text = tok.apply_chat_template(msgs, add_generation_prompt=agp is not False)
        return tok.encode(text, add_special_tokens=False)
    p = body["prompt"]
    if isinstance(p, list):
        return p
    return tok.encode(p)
