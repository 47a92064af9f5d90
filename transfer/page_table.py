"""A rank's KV storage described independently of the cache manager that made it.

`PhysicalPool` is one registered memory region with an affine layout::

    address(layer, slot) = base + layer·layer_stride + slot·slot_stride

where `layer` is the pool-local layer index (0 ≤ layer < layers) and `slot` the block id
(0 ≤ slot < num_slots). Each (layer, slot) region is `slot_bytes` long. Block-major storage
(`[blocks, layers, …]`) has `layer_stride = slot_bytes` and `slot_stride = layers·slot_bytes`;
layer-major storage (`[layers, blocks, …]`) has `slot_stride = slot_bytes` and
`layer_stride = num_slots·slot_bytes`. Both are the same formula.

`PoolView` is one layer group's view of a pool: which global layers the pool-local layers are
(`layer_ids`), and `buffer_entries` rows `(local_layer, offset, size)` — the K and V buffers (or any
other per-layer buffers) inside each (layer, slot) region. Offsets are 64-bit (layer-major pools
exceed 4 GiB). Invariants, checked by `validate()`: every layer has the same number of entries, in
the same role order (a `1 + 3` split over two layers is refused, not mis-sliced); every entry lies
inside its region; `role` is only an equality label for matching (the transfer layer never
enumerates role names).

`LayerGroup` holds layers sharing a block table and, when windowed, their `sliding_window`.
`PageTable` is the whole rank: pools, groups, tokens per block, and `layout_version` (bumped whenever
the meaning of any field changes; two ends with different versions refuse to talk).

Heads: a kv view holds `kv_heads` consecutive global KV heads starting at `head_start`, laid out per
entry as `layout` — "NHD" (`[token, head, dim]`) or "HND" (`[head, token, dim]`). A "replicated"
view holds bytes identical on every TP rank. Byte geometry (bytes per head, per token) is always
derived from the registered entry sizes, never from element sizes.
"""
from __future__ import annotations

from typing import Any, Sequence

import msgspec
import numpy as np

from .errors import UnsupportedTopology

LAYOUT_VERSION = 1
LAYOUTS = ("NHD", "HND")
VIEW_KINDS = ("kv", "replicated")


class PhysicalPool(msgspec.Struct, frozen=True):
    """One registered region: address(layer, slot) = base + layer·layer_stride + slot·slot_stride."""

    base: int
    layer_stride: int
    slot_stride: int
    slot_bytes: int
    num_slots: int
    layers: int
    mem_type: str = "DRAM"
    device_id: int = 0
    total_bytes: int = 0  # registered extent from `base`; 0 = computed from the strides

    def address(self, layer: int, slot: int) -> int:
        return self.base + layer * self.layer_stride + slot * self.slot_stride

    @property
    def extent(self) -> int:
        """Bytes from `base` that the pool spans (what gets registered)."""
        if self.total_bytes:
            return self.total_bytes
        last = (self.layers - 1) * self.layer_stride + (self.num_slots - 1) * self.slot_stride
        return last + self.slot_bytes

    def slot_ptrs(self, ids) -> np.ndarray:
        """`base + slot_stride·ids` for ids ≥ 0 (`-1` = no block here: filtered out)."""
        a = np.asarray(ids, dtype=np.int64)
        a = a[a >= 0]
        return np.uint64(self.base) + np.uint64(self.slot_stride) * a.astype(np.uint64)

    def validate(self) -> None:
        for f in ("layer_stride", "slot_stride", "slot_bytes", "num_slots", "layers"):
            if getattr(self, f) <= 0 and not (f == "layer_stride" and self.layers == 1):
                raise UnsupportedTopology(f"pool {f} must be positive; found {getattr(self, f)}")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise UnsupportedTopology(f"pool mem_type must be DRAM or VRAM; found {self.mem_type!r}")
        if self.total_bytes and self.total_bytes < self.extent_from_strides():
            raise UnsupportedTopology(
                f"pool total_bytes {self.total_bytes} < extent implied by strides "
                f"{self.extent_from_strides()}")

    def extent_from_strides(self) -> int:
        last = (self.layers - 1) * self.layer_stride + (self.num_slots - 1) * self.slot_stride
        return last + self.slot_bytes


class PoolView(msgspec.Struct, frozen=True):
    """A layer group's view of pool `pool`; see the module docstring for the invariants."""

    pool: int
    role: frozenset[str]
    layer_ids: tuple[int, ...]
    buffer_entries: tuple[tuple[int, int, int], ...]
    layout: str = "NHD"
    kind: str = "kv"
    head_start: int = 0
    kv_heads: int = 1

    def entries_per_layer(self) -> int:
        return len(self.buffer_entries) // max(1, len(self.layer_ids))

    def entries_of(self, local_layer: int) -> list[tuple[int, int]]:
        """(offset, size) of the layer's entries, in role order."""
        return [(o, s) for lay, o, s in self.buffer_entries if lay == local_layer]

    def local_index(self) -> dict[int, int]:
        """global layer id → pool-local layer index."""
        return {g: i for i, g in enumerate(self.layer_ids)}


class LayerGroup(msgspec.Struct, frozen=True):
    layer_ids: tuple[int, ...]
    views: tuple[PoolView, ...]
    sliding_window: int | None = None


class PageTable(msgspec.Struct, frozen=True):
    tokens_per_block: int
    pools: tuple[PhysicalPool, ...]
    groups: tuple[LayerGroup, ...]
    dtype: str = ""
    layout_version: int = LAYOUT_VERSION

    # ------------------------------------------------------------------ checks
    def validate(self) -> "PageTable":
        if self.tokens_per_block <= 0:
            raise UnsupportedTopology(f"tokens_per_block must be positive; found {self.tokens_per_block}")
        if not self.pools or not self.groups:
            raise UnsupportedTopology("a page table needs at least one pool and one layer group")
        for p in self.pools:
            p.validate()
        seen: set[int] = set()
        for gi, g in enumerate(self.groups):
            if set(g.layer_ids) & seen:
                raise UnsupportedTopology(f"group {gi}: layers {sorted(set(g.layer_ids) & seen)} "
                                          f"belong to two groups")
            seen |= set(g.layer_ids)
            if g.sliding_window is not None and g.sliding_window <= 0:
                raise UnsupportedTopology(f"group {gi}: sliding_window must be positive or None")
            for v in g.views:
                self._validate_view(gi, g, v)
        return self

    def _validate_view(self, gi: int, g: LayerGroup, v: PoolView) -> None:
        where = f"group {gi} view of pool {v.pool}"
        if not 0 <= v.pool < len(self.pools):
            raise UnsupportedTopology(f"{where}: pool index out of range 0..{len(self.pools) - 1}")
        pool = self.pools[v.pool]
        if v.layout not in LAYOUTS:
            raise UnsupportedTopology(f"{where}: layout must be one of {LAYOUTS}; found {v.layout!r}")
        if v.kind not in VIEW_KINDS:
            raise UnsupportedTopology(f"{where}: kind must be one of {VIEW_KINDS}; found {v.kind!r}")
        if not set(v.layer_ids) <= set(g.layer_ids):
            raise UnsupportedTopology(f"{where}: layers {sorted(set(v.layer_ids) - set(g.layer_ids))} "
                                      f"are not in the group")
        if len(v.layer_ids) > pool.layers:
            raise UnsupportedTopology(f"{where}: {len(v.layer_ids)} layers > pool's {pool.layers}")
        if v.kv_heads <= 0 or v.head_start < 0:
            raise UnsupportedTopology(f"{where}: kv_heads must be positive, head_start ≥ 0")
        counts = [0] * len(v.layer_ids)
        for lay, off, size in v.buffer_entries:
            if not 0 <= lay < len(v.layer_ids):
                raise UnsupportedTopology(f"{where}: entry layer {lay} outside 0..{len(v.layer_ids) - 1}")
            if off < 0 or size <= 0 or off + size > pool.slot_bytes:
                raise UnsupportedTopology(
                    f"{where}: entry (layer {lay}, offset {off}, size {size}) is outside the "
                    f"{pool.slot_bytes}-byte (layer, slot) region")
            counts[lay] += 1
        if not counts or min(counts) != max(counts) or counts[0] == 0:
            raise UnsupportedTopology(
                f"{where}: every layer must have the same number of buffer entries; found {counts}")
        shapes = {tuple(s for _o, s in v.entries_of(i)) for i in range(len(v.layer_ids))}
        if len(shapes) != 1:
            raise UnsupportedTopology(f"{where}: entry sizes differ between layers: {sorted(shapes)}")

    # ------------------------------------------------------------------ helpers
    def regions(self) -> list[tuple[int, int, int, str]]:
        """(addr, len, dev, mem_type) of every pool, for registration."""
        return [(p.base, p.extent, p.device_id, p.mem_type) for p in self.pools]

    def group_of_layer(self, layer: int) -> int:
        for i, g in enumerate(self.groups):
            if layer in g.layer_ids:
                return i
        raise KeyError(layer)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(x for g in self.groups for x in g.layer_ids))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_runner_dict(cls, d: dict[str, Any], *, layer_offset: int = 0, head_start: int = 0,
                         role: Sequence[str] = ("kv",)) -> "PageTable":
        """Wrap the plain dict `worker.runner.ModelRunner.page_table()` returns.

        Expected keys: top level `block_size`, `pools` (and optionally `mem_type`, `device_id`);
        per pool `base_ptr`, `layer_stride`, `slot_stride` (or `block_stride`), `slot_bytes` (or
        `block_bytes`), `num_blocks`, `layers` (list of pool-local layer indices or a count),
        `buffer_entries`, `layout`, `num_kv_heads`, `dtype`, optional `sliding_window`, `kind`,
        `total_bytes`. `layer_offset` maps pool-local layer i to global layer `layer_offset + i`
        (a PP stage), `head_start` is the first global KV head this rank holds (a TP rank).
        """
        try:
            tpb = int(d["block_size"])
            pools, groups = [], {}
            for i, p in enumerate(d["pools"]):
                layers = p["layers"]
                n_layers = len(layers) if isinstance(layers, (list, tuple)) else int(layers)
                mem = p.get("mem_type", d.get("mem_type", "DRAM"))
                dev = p.get("device_id", d.get("device_id", 0))
                pools.append(PhysicalPool(
                    base=int(p["base_ptr"]), layer_stride=int(p["layer_stride"]),
                    slot_stride=int(p.get("slot_stride", p.get("block_stride"))),
                    slot_bytes=int(p.get("slot_bytes", p.get("block_bytes"))),
                    num_slots=int(p.get("num_blocks", d.get("num_blocks"))), layers=n_layers,
                    mem_type=str(mem), device_id=max(0, int(dev if dev is not None else 0)),
                    total_bytes=int(p.get("total_bytes", 0))))
                kind = p.get("kind", "kv")
                kind = "replicated" if kind == "replicated" else "kv"
                window = p.get("sliding_window") or None
                gids = tuple(layer_offset + j for j in range(n_layers))
                view = PoolView(
                    pool=i, role=frozenset(p.get("role", role)), layer_ids=gids,
                    buffer_entries=tuple((int(a), int(b), int(c)) for a, b, c in p["buffer_entries"]),
                    layout=str(p.get("layout", "NHD")), kind=kind, head_start=int(head_start),
                    kv_heads=int(p.get("num_kv_heads", 1)))
                key = (gids, window)
                groups.setdefault(key, []).append(view)
            dtype = str(d["pools"][0].get("dtype", "")) if d["pools"] else ""
        except (KeyError, TypeError, ValueError) as e:
            raise UnsupportedTopology(f"runner page table is missing or has a bad field: {e!r}") from None
        gl = tuple(LayerGroup(layer_ids=k[0], views=tuple(v), sliding_window=k[1])
                   for k, v in groups.items())
        return cls(tokens_per_block=tpb, pools=tuple(pools), groups=gl, dtype=dtype).validate()
