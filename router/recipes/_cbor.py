"""Minimal canonical CBOR (RFC 8949 §4.2.1) for the value shapes vLLM hashes.

vLLM's ``sha256_cbor``/``xxhash_cbor`` hash ``cbor2.dumps(obj, canonical=True)`` of
``(parent: bytes, tokens: tuple[int, ...], extra_keys: tuple | None)``. Supported here: None,
bool, int (any sign, up to 64-bit magnitude), bytes, str, list/tuple. Anything else raises
TypeError, so an unsupported extra key can never hash silently to a wrong value.
"""

from __future__ import annotations

import struct


def _head(major: int, n: int) -> bytes:
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + struct.pack(">H", n)
    if n < 0x100000000:
        return bytes((m | 26,)) + struct.pack(">I", n)
    if n < 0x10000000000000000:
        return bytes((m | 27,)) + struct.pack(">Q", n)
    raise TypeError(f"integer {n} does not fit CBOR's 64-bit argument")


def dumps(obj) -> bytes:
    out = bytearray()
    _enc(obj, out)
    return bytes(out)


def _enc(obj, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        out += _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        out += _head(2, len(b))
        out += b
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        out += _head(3, len(b))
        out += b
    elif isinstance(obj, (list, tuple)):
        out += _head(4, len(obj))
        for x in obj:
            _enc(x, out)
    else:
        raise TypeError(f"canonical CBOR: unsupported type {type(obj).__name__}")
