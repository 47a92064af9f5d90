"""The prompt→token-ids recipe: tokenizer loading, chat-template resolution, message text, ids.

One module for every side: the fleet computes a request's block keys from these token ids
(fleet/keys.py), the worker tokenizes the requests it serves with the same functions
(worker/openai_api.py, its tokenizer loaded by worker/loader.py and worker/cli.py through
`chat_template_of`), and the coordinator runs the recipe over fixed probe prompts to check that a
worker tokenizes them identically (coordinator/kv_parity.py). So fleet, worker and coordinator can
never disagree with each other — only with a foreign worker, which the parity probe catches.

Recipe: completions encode the prompt with special tokens; chats render the model's chat template
over the text of each message (`message_text`: a string as is, text parts joined by newlines — what
vLLM does for string-content templates) and encode the result without adding special tokens (the
template holds any BOS); `prompt_token_ids` (or a token-id `prompt`) is used as is.

The chat template follows Hugging Face's precedence: `chat_template.jinja`, else
`chat_template.json`, else `tokenizer_config.json`'s `chat_template`. Newer checkpoints ship only
the separate file; ignoring it tokenizes every chat differently from the worker.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from protocol.named_models import gguf_source_path, is_gguf_source

if TYPE_CHECKING:
    from protocol.tokenizer import Tokenizer

__all__ = ["TokenizerUnavailable", "PRESETS", "load_tokenizer", "chat_template_of",
           "routing_tokenizer_name", "message_text", "chat_messages", "prompt_ids", "chat_ids",
           "request_token_ids"]

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
    # imported here: protocol.tokenizer normalises messages with this module's message_text
    from protocol.tokenizer import ByteTokenizer, HFTokenizer
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
    """The GGUF file's own tokenizer, built by the recipe the workers use (protocol/gguf_tokenizer.py)."""
    from protocol.gguf_metadata import gguf_metadata
    from protocol.gguf_tokenizer import gguf_tokenizer
    try:
        meta = gguf_metadata(gguf_source_path(model))
    except (OSError, ValueError, KeyError) as e:
        raise TokenizerUnavailable(f"cannot build the routing tokenizer for model {model!r}: {e}") from None
    return gguf_tokenizer({k: v for k, v in meta.items() if k.startswith("tokenizer.")})


def routing_tokenizer_name(config, reported_models=()) -> str | None:
    """Which tokenizer routes: the config's `tokenizer` (upstream's engine key, per server
    section), else its `model`, else the first model a server reports in `/server_info`."""
    tok = (config.generation_servers.engine_args.get("tokenizer")
           or config.context_servers.engine_args.get("tokenizer"))
    return tok or config.served_model or next(iter(reported_models), None)


def message_text(m: Mapping[str, Any]) -> str:
    """A chat message's text for the template: a string as is, null as "", text parts joined by
    newlines (other part types carry no text)."""
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return "\n".join(p.get("text", "") for p in c if isinstance(p, Mapping) and p.get("type") == "text")


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The template's input: each message's role and `message_text`."""
    return [{"role": m["role"], "content": message_text(m)} for m in messages]


def prompt_ids(tok: "Tokenizer", prompt: str | list[int]) -> list[int]:
    """A completion prompt's ids: token ids as given, text encoded with special tokens."""
    if isinstance(prompt, list):
        return prompt
    return tok.encode(prompt)


def chat_ids(tok: "Tokenizer", messages: Sequence[Mapping[str, Any]],
             add_generation_prompt: bool = True) -> list[int]:
    """A chat's ids: the chat template over `chat_messages`, encoded without special tokens (the
    rendered prompt already holds any BOS the template adds)."""
    text = tok.apply_chat_template(chat_messages(messages), add_generation_prompt=add_generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def request_token_ids(tok: "Tokenizer", body: Mapping[str, Any], chat: bool) -> list[int]:
    """The prompt token ids a worker computes for this (already validated) request body."""
    ids = body.get("prompt_token_ids")
    if ids is not None:
        return ids
    if chat:
        return chat_ids(tok, body["messages"], body.get("add_generation_prompt", True) is not False)
    return prompt_ids(tok, body["prompt"])
