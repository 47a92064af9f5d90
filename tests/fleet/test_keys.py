"""fleet/keys.py's routing key bytes are router/block_keys.py's canonical keys, u64 little-endian,
on both of block_keys_list's paths (per-block library calls below 160 blocks, numpy above)."""
from __future__ import annotations

import numpy as np
import orjson
import pytest

from fleet.keys import KeyBuilder
from fleet.validate import parse_request
from protocol.prompt import load_tokenizer
from router.block_keys import block_keys


@pytest.mark.parametrize("chars", [40, 400, 4000, 80000])
@pytest.mark.parametrize("block_size", [7, 16, 32])
def test_key_bytes_are_the_canonical_keys(chars, block_size):
    kb = KeyBuilder(load_tokenizer("tiny"))
    creq = parse_request(orjson.dumps({"model": "m", "prompt": "ab c" * (chars // 4)}), "completion")
    got, n = kb._keys(creq, block_size, 123)
    ids = kb.token_ids(creq)
    assert n == len(ids) and len(got) == 8 * (n // block_size)
    assert got == np.asarray(block_keys(ids, block_size, 123), dtype="<u8").tobytes()
