"""KV-cache events: one canonical model and the codecs around it (docs/kv-events.md "Decoding into
one model").

Decoders accept every producer we route for:
- vLLM: ZMQ frames ``[topic, seq_be8, msgpack([ts, events, dp_rank])]``, events as maps tagged
  ``"type"`` (vLLM >= 0.24) or legacy tagged arrays (positional, length-guarded);
- SGLang: the same framing; signed int64 hashes, a partial last page, bigram token pairs,
  ``cache_salt`` at top level, legacy arrays with a metadata slot;
- TensorRT-LLM: the V2 streaming ZMQ publisher (vLLM's map format) and the HTTP
  ``POST /kv_cache_events`` JSON (``created/stored/removed/updated``).

Invariants of the canonical events:
- engine hashes are opaque ids: ints are bit-cast to u64 (so signed int64 hashes and their
  unsigned twins are one id), raw bytes stay bytes, hex strings become bytes;
- ``BlocksStored.token_ids`` splits into ``len(engine_hashes)`` consecutive chunks of
  ``engine_block_size`` tokens, the last chunk possibly shorter (SGLang partial page) and never
  empty; every token id is in ``[0, 2**32)``;
- anything else is a :class:`EventDecodeError` with a ``reason``: a malformed payload never
  reaches the index half-decoded (a batch decodes completely or raises), and no other exception
  type leaves a decoder, whatever the bytes (a property test feeds arbitrary msgpack);
- decoding is bounded: payloads above ``MAX_PAYLOAD_BYTES`` are refused before parsing, nesting
  deeper than the interpreter's recursion limit fails inside msgspec, and the only free-form field
  kept (``extra_keys``) may nest at most ``MAX_EXTRA_KEYS_DEPTH`` levels.

``encode_vllm_batch`` is the one encoder: our workers publish exactly vLLM 0.33's bytes (checked
against vLLM's own bytes in tests/router/test_events.py), so any vLLM-compatible consumer can read them.
"""

from __future__ import annotations

import array
import enum
import reprlib
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from protocol import kv_replay

__all__ = [
    "Tier", "BlocksStored", "BlocksRemoved", "BlocksMoved", "AllCleared", "EventBatch",
    "KvEvent", "EventDecodeError", "decode_zmq", "decode_payload", "decode_trtllm_http",
    "encode_vllm_batch", "END_SEQ_BYTES", "norm_hash", "tier_of",
]

_M64 = (1 << 64) - 1
EngineHash = Union[int, bytes]
END_SEQ_BYTES = kv_replay.END_SEQ    # the replay end marker (framing: protocol.kv_replay)
# A vLLM batch of a 128k-token prefill is ~1 MB; anything near this bound is not an event batch.
MAX_PAYLOAD_BYTES = 32 * 1024 * 1024
MAX_EXTRA_KEYS_DEPTH = 4   # list per block -> tuple of keys -> (mm id, offset) -> scalar
_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 2, 40, 40


class EventDecodeError(ValueError):
    """A payload that cannot be decoded; ``reason`` says what was expected and what was found."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Tier(str, enum.Enum):
    GPU = "gpu"
    HOST = "host"
    DISK = "disk"
    EXTERNAL = "external"


_MEDIUM_TIERS = {
    None: Tier.GPU, "GPU": Tier.GPU, "DEVICE": Tier.GPU, "CUDA": Tier.GPU,
    "CPU": Tier.HOST, "CPU_PINNED": Tier.HOST, "CPU_TIER1": Tier.HOST, "HOST": Tier.HOST,
    "HOST_PINNED": Tier.HOST, "DISK": Tier.DISK, "NVME": Tier.DISK, "STORAGE": Tier.DISK,
}
_TIER_MEDIUM = {Tier.GPU: "GPU", Tier.HOST: "CPU", Tier.DISK: "DISK", Tier.EXTERNAL: "EXTERNAL"}


def tier_of(medium: Any) -> Tier:
    """Map an engine's ``medium`` string to a tier (unknown names are an external tier)."""
    if medium is None:
        return Tier.GPU
    if not isinstance(medium, str):
        raise EventDecodeError(f"medium: expected a string or null, found {type(medium).__name__}")
    return _MEDIUM_TIERS.get(medium.upper(), Tier.EXTERNAL)


@dataclass(slots=True)
class BlocksStored:
    """Blocks became resident. ``parent_engine_hash`` None = the chain starts at the root."""

    engine_hashes: list
    parent_engine_hash: EngineHash | None
    token_ids: list[int] | None  # None: a tier-only update of already known blocks
    engine_block_size: int
    tier: Tier = Tier.GPU
    lora_name: str | None = None
    cache_salt: str | None = None
    group: int | None = None
    group_kind: str | None = None
    extra_keys: list | None = None

    def __post_init__(self):
        if self.token_ids is not None:
            _check_token_split(self.engine_hashes, self.token_ids, self.engine_block_size)


@dataclass(slots=True)
class BlocksRemoved:
    engine_hashes: list
    tier: Tier = Tier.GPU
    group: int | None = None


@dataclass(slots=True)
class BlocksMoved:
    """Blocks changed tier (TensorRT-LLM ``updated`` with a ``cache_level`` diff)."""

    engine_hashes: list
    from_tier: Tier
    to_tier: Tier
    group: int | None = None


@dataclass(slots=True)
class AllCleared:
    """Every block of the worker is gone (all tiers when ``tier`` is None)."""

    tier: Tier | None = None


KvEvent = Union[BlocksStored, BlocksRemoved, BlocksMoved, AllCleared]


@dataclass(slots=True)
class EventBatch:
    """One published batch. ``seq`` is the transport sequence (or TRT ``event_id``)."""

    seq: int
    ts: float
    dp_rank: int | None
    events: list = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # event types we do not model
    # The publisher's incarnation (its start id), when it sends one: a 4th element of the batch
    # array, after dp_rank (docs/kv-events.md "What our worker publishes"). vLLM's own decoder
    # skips it (msgspec array_like structs ignore trailing elements unless forbid_unknown_fields).
    epoch: str | None = None

    @property
    def is_replay_end(self) -> bool:
        return self.seq == -1


# ---------------------------------------------------------------------------------------------
# field validation helpers


def norm_hash(h: Any, what: str = "block hash") -> EngineHash:
    if isinstance(h, bool):
        raise EventDecodeError(f"{what}: expected int or bytes, found bool")
    if isinstance(h, int):
        return h & _M64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, str):
        try:
            return bytes.fromhex(h)
        except ValueError:
            raise EventDecodeError(f"{what}: expected int, bytes or hex string, "
                                   f"found non-hex string {h[:40]!r}") from None
    raise EventDecodeError(f"{what}: expected int, bytes or hex string, "
                           f"found {type(h).__name__}")


def _hash_list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise EventDecodeError(f"{what}: expected a list, found {type(v).__name__}")
    out = []
    for h in v:
        # ints dominate; keep the common path branch-light
        if type(h) is int:
            out.append(h & _M64)
        else:
            out.append(norm_hash(h, what))
    return out


def _tokens(v: Any, what: str) -> list[int]:
    """Token ids; bigram pairs collapse to their first elements."""
    if not isinstance(v, list):
        raise EventDecodeError(f"{what}: expected a list, found {type(v).__name__}")
    if v and isinstance(v[0], (list, tuple)):
        # SGLang/EAGLE bigram keys: position i carries (token_i, next token); the block's own
        # tokens are the first elements, so block alignment is unchanged
        try:
            firsts = [p[0] for p in v]
            if any(len(p) != 2 for p in v):
                raise TypeError
        except (TypeError, IndexError, KeyError):
            raise EventDecodeError(f"{what}: bigram entries must be [a, b] pairs") from None
        v = firsts
    try:
        # range and type check in C (a Python loop here cost ~1 us per 16-token block)
        array.array("I", v)
    except (OverflowError, TypeError):
        bad = next((t for t in v if type(t) is not int or not 0 <= t <= 0xFFFFFFFF), None)
        raise EventDecodeError(
            f"{what}: expected token ids in [0, 2**32), found {_short.repr(bad)}") from None
    return v


def _check_depth(v: Any, limit: int, what: str) -> None:
    """Reject containers nested deeper than ``limit`` (iterative: no recursion on hostile data)."""
    stack = [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (list, tuple, dict)):
            if d > limit:
                raise EventDecodeError(f"{what}: nested deeper than {limit} levels")
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))


def _check_token_split(hashes: list, tokens: list, block_size: Any) -> None:
    if type(block_size) is not int or block_size <= 0:
        raise EventDecodeError(f"block_size: expected a positive int, found {block_size!r}")
    n = len(hashes)
    if n == 0:
        if tokens:
            raise EventDecodeError(f"BlockStored: {len(tokens)} token ids but no block hashes")
        return
    lo, hi = (n - 1) * block_size + 1, n * block_size
    if not lo <= len(tokens) <= hi:
        raise EventDecodeError(
            f"BlockStored: {n} blocks of {block_size} tokens need {lo}..{hi} token ids, "
            f"found {len(tokens)}")


def _opt_int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if type(v) is not int:
        raise EventDecodeError(f"{what}: expected int or null, found {type(v).__name__}")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise EventDecodeError(f"{what}: expected string or null, found {type(v).__name__}")
    return v


# ---------------------------------------------------------------------------------------------
# ZMQ / msgpack (vLLM, SGLang, TensorRT-LLM V2 streaming)

_VLLM_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                "kv_cache_spec_sliding_window")
_SGL_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium")
_REMOVED = ("block_hashes", "medium", "group_idx")
_ENGINES = ("vllm", "sglang", "trtllm")
_INDEXED_KINDS = (None, "full_attention", "mla")


def _as_map(ev: Any, engine: str) -> dict:
    if isinstance(ev, dict):
        if "type" not in ev:
            raise EventDecodeError("event map without a \"type\" tag")
        return ev
    if isinstance(ev, list) and ev and isinstance(ev[0], str):
        tag, vals = ev[0], ev[1:]
        if tag == "BlockStored":
            names = _SGL_STORED if engine == "sglang" else _VLLM_STORED
            d = {"type": tag, **dict(zip(names, vals))}
            if engine == "sglang" and len(vals) > len(_SGL_STORED):
                # legacy SGLang trailing slots varied: a metadata map, or lora_name + extra_keys
                tail = vals[len(_SGL_STORED):]
                if isinstance(tail[0], dict):
                    d["cache_salt"] = tail[0].get("cache_salt")
                else:
                    d["lora_name"] = tail[0]
                    if len(tail) > 1:
                        d["extra_keys"] = tail[1]
            return d
        if tag == "BlockRemoved":
            return {"type": tag, **dict(zip(_REMOVED, vals))}
        return {"type": tag}
    raise EventDecodeError(f"event: expected a map or a tagged array, found {type(ev).__name__}")


def _salt_from_extra_keys(extra_keys: Any, lora_name: str | None) -> str | None:
    """vLLM puts the cache salt, untagged, among block 0's extra keys (``vllm/v1/core/kv_cache_utils.py``)."""
    if not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    for k in first:
        # MM identifiers come as (id, offset) pairs, embeds as 64-hex digests
        if isinstance(k, str) and k != lora_name and not (
                len(k) == 64 and all(c in "0123456789abcdef" for c in k)):
            return k
    return None


def _stored_from_map(d: dict, engine: str) -> BlocksStored | None:
    kind = d.get("kv_cache_spec_kind")
    if kind not in _INDEXED_KINDS:
        return None  # sliding-window / mamba groups evict independently: never indexed
    hashes = _hash_list(d.get("block_hashes"), "BlockStored.block_hashes")
    parent = d.get("parent_block_hash")
    parent = None if parent is None else norm_hash(parent, "BlockStored.parent_block_hash")
    raw_tokens = d.get("token_ids")
    tokens = None if raw_tokens is None else _tokens(raw_tokens, "BlockStored.token_ids")
    block_size = d.get("block_size")
    if block_size is None and tokens is not None and hashes:
        block_size = -(-len(tokens) // len(hashes))
    if tokens is None and block_size is None:
        block_size = 1
    lora_name = _opt_str(d.get("lora_name"), "BlockStored.lora_name")
    extra_keys = d.get("extra_keys")
    if extra_keys is not None:
        _check_depth(extra_keys, MAX_EXTRA_KEYS_DEPTH, "BlockStored.extra_keys")
    salt = _opt_str(d.get("cache_salt"), "BlockStored.cache_salt")
    if salt is None and engine == "vllm" and parent is None:
        salt = _salt_from_extra_keys(extra_keys, lora_name)
    return BlocksStored(
        engine_hashes=hashes, parent_engine_hash=parent, token_ids=tokens,
        engine_block_size=block_size, tier=tier_of(d.get("medium")), lora_name=lora_name,
        cache_salt=salt, group=_opt_int(d.get("group_idx"), "BlockStored.group_idx"),
        group_kind=kind, extra_keys=extra_keys if isinstance(extra_keys, list) else None)


def _event_from_map(d: dict, engine: str) -> KvEvent | None | str:
    t = d["type"]
    if t == "BlockStored":
        return _stored_from_map(d, engine)
    if t == "BlockRemoved":
        return BlocksRemoved(_hash_list(d.get("block_hashes"), "BlockRemoved.block_hashes"),
                             tier_of(d.get("medium")),
                             _opt_int(d.get("group_idx"), "BlockRemoved.group_idx"))
    if t == "AllBlocksCleared":
        return AllCleared(None)
    if not isinstance(t, str):
        raise EventDecodeError(f"event type: expected a string, found {type(t).__name__}")
    return t  # a type we do not model: reported in EventBatch.skipped


_decoder = msgspec.msgpack.Decoder()


def decode_payload(payload: bytes, seq: int = 0, engine: str = "vllm") -> EventBatch:
    """Decode one msgpack batch ``[ts, events, dp_rank?]``."""
    if engine not in _ENGINES:
        raise ValueError(f"engine must be one of {_ENGINES}, found {engine!r}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventDecodeError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        obj = _decoder.decode(payload)
    except RecursionError:
        raise EventDecodeError("payload nests deeper than the decoder's recursion limit") from None
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise EventDecodeError(f"payload is not valid msgpack: {e}") from None
    try:
        return _batch_from_obj(obj, seq, engine)
    except EventDecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - contain every decoder bug to this one payload
        raise EventDecodeError(f"malformed batch ({type(e).__name__}: {_short.repr(e)})") from None


def _batch_from_obj(obj: Any, seq: int, engine: str) -> EventBatch:
    if not isinstance(obj, list) or len(obj) < 2:
        raise EventDecodeError(
            f"batch: expected an array [ts, events, dp_rank], found {type(obj).__name__}"
            + (f" of length {len(obj)}" if isinstance(obj, list) else ""))
    ts, evs = obj[0], obj[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventDecodeError(f"batch.ts: expected a number, found {type(ts).__name__}")
    if not isinstance(evs, list):
        raise EventDecodeError(f"batch.events: expected an array, found {type(evs).__name__}")
    dp_rank = _opt_int(obj[2] if len(obj) > 2 else None, "batch.dp_rank")
    epoch = obj[3] if len(obj) > 3 and isinstance(obj[3], str) and obj[3] else None
    batch = EventBatch(seq=seq, ts=float(ts), dp_rank=dp_rank, epoch=epoch)
    for ev in evs:
        out = _event_from_map(_as_map(ev, engine), engine)
        if out is None:
            continue
        if isinstance(out, str):
            batch.skipped.append(out)
        else:
            batch.events.append(out)
    return batch


def decode_zmq(frames: list[bytes], engine: str = "vllm") -> EventBatch:
    """Decode a live ``[topic, seq, payload]`` message or a replay reply.

    Replies may be ``[topic, seq, payload]`` (vLLM 0.33, SGLang) or ``[seq, payload]`` (older),
    with a DEALER's empty delimiter in front; in every shape the last two frames are seq and
    payload. The end marker (seq -1, empty payload) gives a batch with ``is_replay_end``.
    """
    if not isinstance(frames, (list, tuple)) or len(frames) < 2:
        raise EventDecodeError(f"expected [topic, seq, payload] frames, found "
                               f"{len(frames) if isinstance(frames, (list, tuple)) else frames!r}")
    seq_b, payload = bytes(frames[-2]), frames[-1]
    if len(seq_b) != 8:
        raise EventDecodeError(f"seq frame: expected 8 bytes, found {len(seq_b)}")
    if seq_b == END_SEQ_BYTES:
        if payload:
            raise EventDecodeError("replay end marker (seq -1) with a non-empty payload")
        return EventBatch(seq=-1, ts=0.0, dp_rank=None)
    if not payload:
        raise EventDecodeError(f"empty payload for seq {int.from_bytes(seq_b, 'big')}")
    return decode_payload(bytes(payload), int.from_bytes(seq_b, "big"), engine)


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM HTTP (POST /kv_cache_events)


def _trt_level(v: Any) -> Tier:
    if v is None or v == 0:
        return Tier.GPU
    if type(v) is not int:
        raise EventDecodeError(f"cache_level: expected int, found {type(v).__name__}")
    return Tier.HOST if v == 1 else Tier.DISK


def _trt_stored(data: dict, group: int | None) -> list[BlocksStored]:
    """A ``stored`` event as one BlocksStored per run of blocks sharing a cache salt.

    Per block, beside ``block_hash``/``tokens``/``cache_level`` (``KVCacheEventSerializer``):
    ``cache_salt`` (a block-level salt overrides the event-level one), ``mm_keys`` and ``lora_id``
    (``KVCacheStoredBlockData`` of KV cache manager V2, ``kv_cache_manager_v2/_events.py``). A
    block whose content the tokens alone do not name (``token_extra_id``, multimodal keys, a LoRA
    task) ends the indexed run: it and its descendants in the event are not indexed, so they can
    only miss, never match a plain prompt."""
    blocks = data.get("blocks")
    if not isinstance(blocks, list):
        raise EventDecodeError(f"stored.blocks: expected a list, found {type(blocks).__name__}")
    event_salt = _opt_str(data.get("cache_salt"), "stored.cache_salt")
    parent = data.get("parent_hash")
    parent = None if parent is None else norm_hash(parent, "stored.parent_hash")
    out: list[BlocksStored] = []
    run_hashes: list = []
    run_tokens: list[int] = []
    run_salt = run_size = run_level = None

    def flush():
        nonlocal run_hashes, run_tokens, parent
        if run_hashes:
            out.append(BlocksStored(
                engine_hashes=run_hashes, parent_engine_hash=parent,
                token_ids=_tokens(run_tokens, "stored.blocks[].tokens"),
                engine_block_size=run_size, tier=run_level or Tier.GPU, cache_salt=run_salt,
                group=group))
            parent = run_hashes[-1]
        run_hashes, run_tokens = [], []

    for b in blocks:
        if not isinstance(b, dict) or not isinstance(b.get("tokens"), list):
            raise EventDecodeError("stored.blocks[]: expected {block_hash, tokens: [...]}")
        ids = []
        extra = bool(b.get("mm_keys")) or b.get("lora_id") is not None
        for t in b["tokens"]:
            if not isinstance(t, dict) or type(t.get("token_id")) is not int:
                raise EventDecodeError("stored.blocks[].tokens[]: expected {token_id: int}")
            if t.get("token_extra_id", 0):
                extra = True
            ids.append(t["token_id"])
        if extra:
            break
        h = norm_hash(b.get("block_hash"), "stored.blocks[].block_hash")
        salt = _opt_str(b.get("cache_salt"), "stored.blocks[].cache_salt") or event_salt
        level = _trt_level(b.get("cache_level"))
        if run_hashes and (salt != run_salt or level != run_level or len(ids) != run_size):
            flush()
        if not run_hashes:
            run_salt, run_level, run_size = salt, level, len(ids)
        if not ids:
            raise EventDecodeError("stored.blocks[].tokens: a stored block has no tokens")
        run_hashes.append(h)
        run_tokens.extend(ids)
    flush()
    return out


def decode_trtllm_http(obj: Any) -> list[EventBatch]:
    """Decode the JSON list ``POST /kv_cache_events`` returns: one batch per TRT event, with
    ``seq = event_id`` (gaps mean lost events) and ``dp_rank = attention_dp_rank``."""
    try:
        return _trtllm_batches(obj)
    except EventDecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - contain every decoder bug to this one response
        raise EventDecodeError(
            f"malformed kv_cache_events ({type(e).__name__}: {_short.repr(e)})") from None


def _trtllm_batches(obj: Any) -> list[EventBatch]:
    if not isinstance(obj, list):
        raise EventDecodeError(f"kv_cache_events: expected a JSON list, found {type(obj).__name__}")
    out = []
    for ev in obj:
        if not isinstance(ev, dict) or not isinstance(ev.get("data"), dict):
            raise EventDecodeError("kv_cache_events[]: expected {event_id, data: {type, ...}}")
        event_id = ev.get("event_id")
        if type(event_id) is not int:
            raise EventDecodeError(f"event_id: expected int, found {type(event_id).__name__}")
        group = _opt_int(ev.get("layer_group_id", ev.get("window_size")), "window_size")
        batch = EventBatch(seq=event_id, ts=0.0,
                           dp_rank=_opt_int(ev.get("attention_dp_rank"), "attention_dp_rank"))
        data = ev["data"]
        t = data.get("type")
        if t == "created":
            batch.events.append(AllCleared(None))  # engine (re)start
        elif t == "stored":
            batch.events.extend(_trt_stored(data, group))
        elif t == "removed":
            batch.events.append(BlocksRemoved(
                _hash_list(data.get("block_hashes"), "removed.block_hashes"), Tier.GPU, group))
        elif t == "updated":
            diff = data.get("cache_level")
            if diff is not None:
                if not isinstance(diff, dict):
                    raise EventDecodeError("updated.cache_level: expected an event_diff map")
                old, new = _trt_level(diff.get("old_value")), _trt_level(diff.get("new_value"))
                if old != new:
                    batch.events.append(BlocksMoved(
                        [norm_hash(data.get("block_hash"), "updated.block_hash")], old, new, group))
            # a priority-only update changes nothing the router sees
        elif isinstance(t, str):
            batch.skipped.append(t)
        else:
            raise EventDecodeError(f"data.type: expected a string, found {type(t).__name__}")
        out.append(batch)
    return out


# ---------------------------------------------------------------------------------------------
# the encoder: vLLM 0.33 structs, field for field, so msgspec emits vLLM's exact bytes


class _VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _VBlockStored(_VEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Any
    token_ids: list
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None


class _VBlockRemoved(_VEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Any
    group_idx: Any = None
    locality: Any = None
    ownership: Any = None


class _VAllBlocksCleared(_VEvent, tag="AllBlocksCleared"):
    pass


class _VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Any = None


class _VBatchEpoch(msgspec.Struct, array_like=True, gc=False):
    """`_VBatch` plus the publisher's epoch as a trailing element (dp_rank always written)."""
    ts: float
    events: list
    data_parallel_rank: Any
    publisher_epoch: str


_encoder = msgspec.msgpack.Encoder()


def _wire_hash(h: Any) -> Any:
    return h & _M64 if isinstance(h, int) else bytes(h)


def encode_vllm_batch(ts: float, events: list, dp_rank: int | None = None,
                      epoch: str | None = None) -> bytes:
    """Encode canonical events as a vLLM 0.33 ``KVEventBatch`` payload (map-form events);
    ``epoch``: the publisher's start id as a trailing element (vLLM's decoder skips it)."""
    out = []
    for ev in events:
        if isinstance(ev, BlocksStored):
            if ev.token_ids is None:
                raise ValueError("BlocksStored without token ids cannot be published")
            out.append(_VBlockStored(
                block_hashes=[_wire_hash(h) for h in ev.engine_hashes],
                parent_block_hash=None if ev.parent_engine_hash is None
                else _wire_hash(ev.parent_engine_hash),
                token_ids=list(ev.token_ids), block_size=ev.engine_block_size, lora_id=None,
                medium=_TIER_MEDIUM[ev.tier], lora_name=ev.lora_name, extra_keys=ev.extra_keys,
                group_idx=ev.group, kv_cache_spec_kind=ev.group_kind))
        elif isinstance(ev, BlocksRemoved):
            out.append(_VBlockRemoved(block_hashes=[_wire_hash(h) for h in ev.engine_hashes],
                                      medium=_TIER_MEDIUM[ev.tier], group_idx=ev.group))
        elif isinstance(ev, AllCleared):
            out.append(_VAllBlocksCleared())
        else:
            raise TypeError(f"cannot encode {type(ev).__name__} in vLLM's format")
    if epoch is not None:
        return _encoder.encode(_VBatchEpoch(float(ts), out, dp_rank, epoch))
    return _encoder.encode(_VBatch(float(ts), out, dp_rank))
