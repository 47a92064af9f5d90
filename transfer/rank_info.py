"""RankInfo: everything a peer needs to write into (or be written by) one rank.

Exchanged once per peer endpoint and cached: topology (TP/PP/CP/DP ranks and sizes, the layers and
KV heads this rank holds), the page table, the transfer agent's kind, name and descriptor, and the
control endpoint. Encoded with msgpack through msgspec (typed decode, never pickle).

`check_compatible(a, b)` is called on both ends at exchange time: a different wire version, agent
kind, block size, page-table layout version, dtype or model geometry is a `ConfigMismatch` with a
message naming both values — not a failed write later.
"""
from __future__ import annotations

import msgspec

from .errors import ConfigMismatch, ProtocolError
from .page_table import LAYOUT_VERSION, PageTable

RANK_INFO_VERSION = 1


class RankInfo(msgspec.Struct, frozen=True):
    instance_id: str          # unique per worker incarnation
    role: str                 # "context" | "generation" | "both"
    endpoint: str             # this rank's control (ZMQ ROUTER) endpoint
    agent_kind: str
    agent_name: str
    agent_desc: bytes
    page_table: PageTable
    num_layers: int           # model total
    total_kv_heads: int       # model total
    layer_start: int          # global layers [layer_start, layer_end) held here
    layer_end: int
    head_start: int           # global KV heads [head_start, head_start + kv_heads) held here
    kv_heads: int
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    model: str = ""
    # Every rank of this instance by flat rank: (layer_start, layer_end, head_start, kv_heads).
    # Lets a peer count this instance's ranks it will hear from without fetching each RankInfo.
    instance_layout: tuple[tuple[int, int, int, int], ...] = ()
    v: int = RANK_INFO_VERSION

    @property
    def tokens_per_block(self) -> int:
        return self.page_table.tokens_per_block

    @property
    def flat_rank(self) -> int:
        """CP-minor flattening: pp·(TP·CP) + tp·CP + cp."""
        return flatten_rank(self.pp_rank, self.tp_rank, self.cp_rank, self.tp_size, self.cp_size)

    @property
    def key(self) -> str:
        """Unique name of this rank across the cluster."""
        return f"{self.instance_id}/{self.flat_rank}"

    @property
    def tp_per_dp(self) -> int:
        return max(1, self.tp_size // max(1, self.dp_size))

    def encode(self) -> bytes:
        return _ENC.encode(self)


def flatten_rank(pp: int, tp: int, cp: int, tp_size: int, cp_size: int) -> int:
    """CP-minor rank flattening. A TP-minor formula mis-routes exactly when tp>1 and cp>1."""
    return pp * (tp_size * cp_size) + tp * cp_size + cp


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(RankInfo)


def decode_rank_info(data: bytes) -> RankInfo:
    """Decode and sanity-check; a different wire version is a ConfigMismatch, garbage a ProtocolError."""
    try:
        head = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"RankInfo is not msgpack: {e}") from None
    if isinstance(head, dict) and head.get("v") not in (None, RANK_INFO_VERSION):
        raise ConfigMismatch(f"RankInfo wire version {head.get('v')}; this build speaks "
                             f"{RANK_INFO_VERSION}")
    try:
        info = _DEC.decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"RankInfo does not validate: {e}") from None
    info.page_table.validate()
    if not (0 <= info.layer_start < info.layer_end <= info.num_layers):
        raise ProtocolError(f"RankInfo layers [{info.layer_start}, {info.layer_end}) outside "
                            f"0..{info.num_layers}")
    return info


def check_compatible(a: RankInfo, b: RankInfo) -> None:
    """Raise ConfigMismatch unless two ranks can exchange KV."""
    checks = [
        ("RankInfo wire version", a.v, b.v),
        ("transfer agent kind", a.agent_kind, b.agent_kind),
        ("KV block size (tokens per block)", a.tokens_per_block, b.tokens_per_block),
        ("page-table layout version", a.page_table.layout_version, b.page_table.layout_version),
        ("KV dtype", a.page_table.dtype, b.page_table.dtype),
        ("model layer count", a.num_layers, b.num_layers),
        ("model KV head count", a.total_kv_heads, b.total_kv_heads),
    ]
    if a.model and b.model:
        checks.append(("model", a.model, b.model))
    for what, x, y in checks:
        if x != y:
            raise ConfigMismatch(f"{what} differs between {a.key} ({x!r}) and {b.key} ({y!r})")
    if a.page_table.layout_version != LAYOUT_VERSION:
        raise ConfigMismatch(f"page-table layout version {a.page_table.layout_version}; this build "
                             f"speaks {LAYOUT_VERSION}")
