"""Routing keys: tokenize a request once, exactly as the workers do, and compute its block keys.

The coordinator's KV index is keyed by canonical block keys (`router.block_keys`), which the workers
publish from the token ids they actually cached. The fleet must therefore produce the *same* token
ids as the worker for the same request: completions encode the prompt with special tokens, chats
render the model's chat template over the text of each message (list parts joined by newlines) and
encode the result without adding special tokens (worker/protocol.py does the same). Requests that
already carry `prompt_token_ids` (or a token-id `prompt`) are not tokenized at all.

Long prompts are tokenized in a worker thread (the `tokenizers` library releases the GIL), short
ones inline: a thread hop costs more than tokenizing a few hundred characters.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np

from router.block_keys import block_keys, salt_seed
from router.gguf_tokenizer import gguf_tokenizer
from router.named_models import gguf_source_path, is_gguf_source
from router.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

from .validate import CHAT, ClientRequest

_INLINE_CHARS = 8192
# Names the workers resolve to a built-in model with the byte-level tokenizer (worker/presets.py).
_PRESETS = frozenset({"tiny", "1b", "8b"})


class TokenizerUnavailable(RuntimeError):
    pass


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer the workers use for `model`: a preset name, a Hugging Face model directory, or
    a GGUF source (a named model such as `smollm2-135m`, or a `.gguf` file)."""
    if model is None or model in _PRESETS:
        return ByteTokenizer()
    if is_gguf_source(model) and not Path(model).is_dir():
        return _gguf_tokenizer(model)
    d = Path(model)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise TokenizerUnavailable(
            f"cannot build the routing tokenizer for model {model!r}: expected a preset "
            f"({', '.join(sorted(_PRESETS))}) or a directory with tokenizer.json, found neither")
    cfg = {}
    tc = d / "tokenizer_config.json"
    if tc.is_file():
        cfg = json.loads(tc.read_text(encoding="utf-8"))
    return HFTokenizer.from_json(tj.read_text(encoding="utf-8"), cfg)


def _gguf_tokenizer(model: str) -> Tokenizer:
    """The GGUF file's own tokenizer, built by the recipe the workers use (router/gguf_tokenizer.py)."""
    import gguf

    try:
        fields = gguf.GGUFReader(gguf_source_path(model)).fields
    except (OSError, ValueError, KeyError) as e:
        raise TokenizerUnavailable(f"cannot build the routing tokenizer for model {model!r}: {e}") from None
    return gguf_tokenizer({k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")})


def _message_text(m: dict) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return "\n".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")


class KeyBuilder:
    """Block keys of a request's prompt, computed with the workers' tokenizer."""

    def __init__(self, tokenizer: Tokenizer, namespace: str | None = None):
        self.tok = tokenizer
        self.ns_seed = salt_seed(namespace) if namespace else 0

    def token_ids(self, creq: ClientRequest) -> list[int]:
        b = creq.body
        ids = b.get("prompt_token_ids")
        if ids is not None:
            return ids
        if creq.kind == CHAT:
            msgs = [{"role": m["role"], "content": _message_text(m)} for m in b["messages"]]
            agp = b.get("add_generation_prompt", True)
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=agp is not False)
            return self.tok.encode(text, add_special_tokens=False)
        p = b["prompt"]
        if isinstance(p, list):
            return p
        return self.tok.encode(p)

    def _size(self, creq: ClientRequest) -> int:
        b = creq.body
        if creq.kind == CHAT:
            return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 256
                       for m in b["messages"])
        p = b.get("prompt")
        return len(p) if isinstance(p, str) else 0

    def _keys(self, creq: ClientRequest, block_size: int, ns_seed: int) -> tuple[bytes, int]:
        ids = self.token_ids(creq)
        keys = block_keys(ids, block_size, ns_seed)
        return np.asarray(keys, dtype="<u8").tobytes(), len(ids)

    async def keys_for(self, creq: ClientRequest, routing: dict) -> tuple[bytes, int]:
        """→ (block keys as little-endian u64 bytes, number of prompt tokens)."""
        bs = int(routing.get("block_size") or 16)
        ns = int(routing.get("ns_seed") or self.ns_seed)
        if self._size(creq) <= _INLINE_CHARS:
            return self._keys(creq, bs, ns)
        return await asyncio.to_thread(self._keys, creq, bs, ns)


def make_key_builder(config, reported_models: list[str] = ()) -> KeyBuilder | None:
    """A builder when some role's policy needs block keys, else None (round robin never tokenizes).

    The tokenizer comes from the config's `tokenizer` (upstream's engine key, top level or per server
    section), else its `model`, else the model the servers report in `/server_info`. It must be the workers' own: with another tokenizer the block keys never match the
    index and KV-aware routing silently degrades to load balancing — so failing to build it is an error.
    """
    types = {config.context_servers.router.type, config.generation_servers.router.type}
    if not types & {"kv_cache_aware", "conversation"}:
        return None
    tok = config.generation_servers.engine_args.get("tokenizer") or config.context_servers.engine_args.get("tokenizer")
    model = tok or config.served_model or next(iter(reported_models), None)
    if model is None:
        raise TokenizerUnavailable("KV-aware routing needs the workers' tokenizer, but neither the config's "
                                   "`model` nor any server's /server_info names a model")
    return KeyBuilder(load_tokenizer(model), config.routing.namespace)
