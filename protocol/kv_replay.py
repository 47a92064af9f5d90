"""KV-event replay framing and the `/kv_snapshot` body: the one copy publisher and subscriber share.

Replay is vLLM 0.33's `ZmqEventPublisher._service_replay` (vllm/distributed/kv_events.py of the
vllm-0.33.0 wheel; docs/kv-events.md "Engines × versions × transports"): a DEALER sends
`[b"", seq_be8]`; the ROUTER answers one `[b"", topic, seq_be8, payload]` message per buffered
batch with `seq >= start` (oldest first), then the end marker `[b"", b"", END_SEQ, b""]`. vLLM ignores a request without
the delimiter; our publisher also answers the bare `[seq_be8]` form, with the same frames minus the
delimiter. Every reply shape ends in `[seq_be8, payload]`, which is all a subscriber reads. A first
replayed seq above the requested one means the ring buffer already dropped the gap: resync from
`/kv_snapshot`.

`/kv_snapshot` (msgpack, `KvSnapshot`): the worker's resident block keys after batch `seq` (-1:
nothing published yet), keyed at `block_size` / `key_scheme`.
"""
from __future__ import annotations

from typing import Sequence

import msgspec

__all__ = ["END_SEQ", "seq_bytes", "request_frames", "parse_request", "reply_frames",
           "end_frames", "reply_tail", "KvSnapshot", "encode_snapshot", "decode_snapshot",
           "SnapshotError"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)     # the replay end marker's seq frame


def seq_bytes(seq: int) -> bytes:
    return int(seq).to_bytes(8, "big")


def request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a ROUTER replay socket for the batches from `start_seq`."""
    return [b"", seq_bytes(start_seq)]


def parse_request(rest: Sequence[bytes]) -> tuple[list[bytes], int | None]:
    """A ROUTER's view of a request, `rest` being the frames after the peer identity →
    (the delimiter to echo in front of every reply, the start seq or None when malformed)."""
    head: list[bytes] = []
    if rest and rest[0] == b"":
        head, rest = [b""], rest[1:]
    if len(rest) != 1 or len(rest[0]) != 8:
        return head, None
    return head, int.from_bytes(rest[0], "big")


def reply_frames(topic: bytes, seq: int, payload) -> list:
    """One replayed batch (after the identity and delimiter): `[topic, seq_be8, payload]`."""
    return [topic, seq_bytes(seq), payload]


def end_frames() -> list[bytes]:
    """The end marker (after the identity and delimiter)."""
    return [b"", END_SEQ, b""]


def reply_tail(frames: Sequence[bytes]) -> tuple[bytes, bytes] | None:
    """`(seq_be8, payload)` of a reply in any of its shapes; None when it has fewer than two frames.
    The end marker is `(END_SEQ, b"")`."""
    if len(frames) < 2:
        return None
    return bytes(frames[-2]), bytes(frames[-1])


class KvSnapshot(msgspec.Struct):
    block_size: int
    key_scheme: str
    seq: int | None = None        # the last batch published before the snapshot (-1: none)
    # resident block keys (engine hash == canonical key), u64: an array, or one bin of
    # little-endian u64 (8 bytes per key)
    block_keys: list[int] | bytes | None = None
    # the publisher's incarnation (start id) the snapshot belongs to: its resume point is `seq + 1`
    # of that publisher only (the recovery contract of vLLM PR #57789: epoch + snapshot + resume seq)
    epoch: str | None = None


class SnapshotError(ValueError):
    """A `/kv_snapshot` body that does not fit `KvSnapshot`; says what was found."""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(KvSnapshot)


def encode_snapshot(seq: int, block_size: int, key_scheme: str, block_keys,
                    epoch: str | None = None) -> bytes:
    return _enc.encode(KvSnapshot(seq=int(seq), block_size=int(block_size), key_scheme=key_scheme,
                                  block_keys=[int(k) for k in block_keys], epoch=epoch))


def decode_snapshot(body: bytes) -> KvSnapshot:
    try:
        snap = _dec.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise SnapshotError(f"not a KV snapshot (msgpack {{seq, block_size, key_scheme, "
                            f"block_keys}}): {e}") from None
    if snap.seq is not None and snap.seq < -1:
        raise SnapshotError(f"snapshot seq must be >= -1, got {snap.seq}")
    return snap
