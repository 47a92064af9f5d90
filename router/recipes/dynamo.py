"""NVIDIA Dynamo block hashes (ai-dynamo-runtime 1.6.1; what routing does with engine
recipes: docs/routing.md "Block keys"; vectors: tests/router/test_recipes.py).

Dynamo's local hash is ``xxh3_64(u32le(block), seed=compute_salt_hash(ns, lora))`` and its
sequence hash chains them with seed 1337. Our canonical scheme *is* this pair, so these are thin
named views over ``router.block_keys``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..block_keys import CHAIN_SEED, chain_keys, local_hashes, salt_seed

_M64 = (1 << 64) - 1


def compute_salt_hash(cache_namespace: str | None = None, lora_name: str | None = None) -> int:
    """Dynamo's local-hash seed (1337 plus the namespace salt)."""
    return (CHAIN_SEED + salt_seed(cache_namespace, lora_name)) & _M64


def compute_block_hash_for_seq(tokens: Sequence[int], kv_block_size: int,
                               lora_name: str | None = None,
                               cache_namespace: str | None = None) -> list[int]:
    """Local (unchained) block hashes of the full blocks, as Dynamo's frontend computes them."""
    return local_hashes(tokens, kv_block_size, salt_seed(cache_namespace, lora_name)).tolist()


def sequence_hashes(local: Sequence[int], parent: int | None = None) -> list[int]:
    """Dynamo's ``SequenceHash`` chain over local hashes."""
    return chain_keys(list(local), parent)
