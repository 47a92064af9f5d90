"""Routing keys: tokenize a request once, exactly as the workers do, and compute its block keys.

The coordinator's KV index is keyed by canonical block keys (`router.block_keys`), which the workers
publish from the token ids they actually cached. The fleet must therefore produce the *same* token
ids as the worker for the same request: completions encode the prompt with special tokens, chats
render the model's chat template over the text of each message and encode the result without
adding special tokens: the recipe and the tokenizer loader live in protocol/prompt.py,
which the coordinator's key parity probe runs too.

Long prompts are tokenized in a worker thread (the `tokenizers` library releases the GIL), short
ones inline: a thread hop costs more than tokenizing a few hundred characters.
"""
from __future__ import annotations

import asyncio

from protocol.prompt import (TokenizerUnavailable, load_tokenizer, request_token_ids,
                                      routing_tokenizer_name)
from router.block_keys import block_keys_bytes
from router.pairing import PolicyKind
from protocol.tokenizer import Tokenizer

from .validate import CHAT, ClientRequest

__all__ = ["KeyBuilder", "TokenizerUnavailable", "load_tokenizer", "make_key_builder"]

_INLINE_CHARS = 8192


class KeyBuilder:
    """Block keys of a request's prompt, computed with the workers' tokenizer."""

    def __init__(self, tokenizer: Tokenizer, ns_seed: int = 0):
        self.tok = tokenizer
        self.ns_seed = ns_seed      # until the coordinator's routing config says otherwise

    def token_ids(self, creq: ClientRequest) -> list[int]:
        return request_token_ids(self.tok, creq.body, creq.kind == CHAT)

    def _size(self, creq: ClientRequest) -> int:
        b = creq.body
        if creq.kind == CHAT:
            return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 256
                       for m in b["messages"])
        p = b.get("prompt")
        return len(p) if isinstance(p, str) else 0

    def _keys(self, creq: ClientRequest, block_size: int, ns_seed: int) -> tuple[bytes, int]:
        ids = self.token_ids(creq)
        return block_keys_bytes(ids, block_size, ns_seed), len(ids)

    def _params(self, routing: dict) -> tuple[int, int]:
        bs = int(routing.get("block_size") or 16)
        # the coordinator's published seed wins: its index keys events under it
        ns = int(routing["ns_seed"] if routing.get("ns_seed") is not None else self.ns_seed)
        return bs, ns

    def keys_now(self, creq: ClientRequest, routing: dict) -> tuple[bytes, int] | None:
        """`keys_for`'s answer computed inline, or None when the prompt is long enough to go to a
        worker thread (then await `keys_for`)."""
        if self._size(creq) > _INLINE_CHARS:
            return None
        return self._keys(creq, *self._params(routing))

    async def keys_for(self, creq: ClientRequest, routing: dict) -> tuple[bytes, int]:
        """→ (block keys as little-endian u64 bytes, number of prompt tokens)."""
        got = self.keys_now(creq, routing)
        if got is not None:
            return got
        return await asyncio.to_thread(self._keys, creq, *self._params(routing))


def make_key_builder(config, reported_models: list[str] = ()) -> KeyBuilder | None:
    """A builder when some role's policy needs block keys, else None (round robin never tokenizes).

    The tokenizer comes from the config's `tokenizer` (upstream's engine key, top level or per server
    section), else its `model`, else the model the servers report in `/server_info`. It must be the workers' own: with another tokenizer the block keys never match the
    index and KV-aware routing silently degrades to load balancing — so failing to build it is an error.
    """
    if not any(PolicyKind(g.router.type).keyed for g in (config.context_servers, config.generation_servers)):
        return None
    model = routing_tokenizer_name(config, reported_models)
    if model is None:
        raise TokenizerUnavailable("KV-aware routing needs the workers' tokenizer, but neither the config's "
                                   "`model` nor any server's /server_info names a model")
    return KeyBuilder(load_tokenizer(model), config.routing.ns_seed)
