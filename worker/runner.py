"""Runs ragged batches of prefill chunks and decode tokens through a model over a paged KV cache.

KV storage layout (one pool, all layers, block-major)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (contiguous)

so one block holds every layer's K and V for ``block_size`` consecutive positions of one sequence in
one contiguous run of bytes. Byte address of element (block b, layer l, kv c ∈ {0: K, 1: V}, token t,
head h, dim d)::

    base_ptr + b·block_stride + l·layer_stride + c·kv_stride + t·token_stride + h·head_stride + d·elt
    elt          = dtype size
    head_stride  = head_dim·elt
    token_stride = num_kv_heads·head_stride                   (NHD: token-major inside a block)
    kv_stride    = block_size·token_stride
    layer_stride = 2·kv_stride          (= block_bytes: one layer's K+V of one block)
    block_stride = num_layers·layer_stride

This is the affine ``PhysicalPool`` of DESIGN.md §9 with ``slot = block``: the (layer, block) region
``base + l·layer_stride + b·block_stride`` is ``block_bytes`` long, and all layers of a block are
adjacent, so moving a block between two workers with equal geometry is one copy of ``block_stride``
bytes and runs of consecutive block ids merge into one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from worker.model import AttentionMetadata, DecodeBatch, LlamaForCausalLM, ModelConfig, PrefillSeq

__all__ = ["Chunk", "ModelRunner", "RunnerInputError", "kv_bytes_per_block"]


class RunnerInputError(ValueError):
    """A chunk list that cannot be run (empty chunk, missing blocks, id out of range, overlap)."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """``token_ids`` at absolute positions ``start_pos .. start_pos+len-1`` of one sequence.

    ``block_ids`` is the sequence's block table from position 0: entry ``i`` holds positions
    ``i·block_size .. (i+1)·block_size-1``. It must cover at least ``start_pos+len`` positions; blocks
    before ``start_pos`` must already hold that sequence's K/V (earlier chunks, a prefix-cache hit or a
    transfer). A single-token chunk is a decode step."""

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (size the pool from a memory budget with this)."""
    elt = torch.empty(0, dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elt


class ModelRunner:
    """Owns the KV cache of one model and runs steps on it.

    Invariants: the cache is one contiguous tensor allocated once (its base pointer never changes, so
    memory registered for transfer stays valid); ``step`` writes K/V only into the slots of the chunks'
    new positions; block ids are plain indices into dimension 0 and carry no ownership (the
    scheduler's ``BlockPool`` decides who may write where)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int = 16,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, found {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, found {block_size!r}")
        device = torch.device(device) if device is not None else model.device
        dtype = dtype or model.dtype
        if model.device != device or model.dtype != dtype:
            model.move(device, dtype)
        self.model = model
        self.cfg: ModelConfig = model.config
        self.device = model.device
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        cfg = self.cfg
        # Zero-filled, not empty: padded decode rows read unwritten slots whose attention weight is 0,
        # and 0·NaN from uninitialised memory would poison the output.
        self.kv_cache = torch.zeros(num_blocks, cfg.num_hidden_layers, 2, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=self.device)
        self.vocab_size = cfg.vocab_size
        self._window = cfg.sliding_window

    # ------------------------------------------------------------------ geometry

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer's K+V in one block (the page table's per-(layer, block) region)."""
        return self.kv_cache.stride(1) * self.kv_cache.element_size()

    @property
    def block_stride(self) -> int:
        """Bytes between consecutive blocks (= all layers of one block)."""
        return self.kv_cache.stride(0) * self.kv_cache.element_size()

    def page_table(self) -> dict[str, Any]:
        """Plain description of the KV pool for the transfer layer (see the module docstring for the
        address formula). ``buffer_entries`` lists, per layer, the K and V buffers inside one
        (layer, block) region as ``(local_layer, byte_offset, byte_size)``."""
        c, t = self.cfg, self.kv_cache
        elt = t.element_size()
        kv_bytes = t.stride(2) * elt
        layers = list(range(c.num_hidden_layers))
        pool = {
            "base_ptr": t.data_ptr(),
            "total_bytes": t.numel() * elt,
            "num_blocks": self.num_blocks,
            "layers": layers,
            "layer_stride": t.stride(1) * elt,
            "block_stride": self.block_stride,
            "slot_stride": self.block_stride,
            "block_bytes": self.block_bytes,
            "slot_bytes": self.block_bytes,
            "kind": "kv",
            "kv_factor": 2,
            "kv_stride": kv_bytes,
            "layout": "NHD",
            "num_kv_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "element_bytes": elt,
            "sliding_window": self._window,
            "buffer_entries": [(i, role * kv_bytes, kv_bytes) for i in range(len(layers)) for role in (0, 1)],
        }
        dev = self.device
        return {
            "version": 1,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "num_layers": c.num_hidden_layers,
            "device": str(dev),
            "device_id": dev.index if dev.type == "cuda" and dev.index is not None else (
                torch.cuda.current_device() if dev.type == "cuda" else -1),
            "mem_type": "VRAM" if dev.type == "cuda" else "DRAM",
            "pools": [pool],
        }

    # ------------------------------------------------------------------ test helpers

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy of blocks ``[n, num_layers, 2, block_size, kv_heads, head_dim]``."""
        return self.kv_cache[self._block_index(block_ids)].clone()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite whole blocks with ``data`` shaped like :meth:`read_blocks`' result."""
        idx = self._block_index(block_ids)
        want = (len(idx),) + tuple(self.kv_cache.shape[1:])
        if tuple(data.shape) != want:
            raise RunnerInputError(f"write_blocks expects data of shape {want}, found {tuple(data.shape)}")
        self.kv_cache[idx] = data.to(device=self.device, dtype=self.dtype)

    def _block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise RunnerInputError(f"block ids must be in [0, {self.num_blocks}), found {ids.tolist()}")
        return torch.from_numpy(ids).to(self.device)

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def step(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Run one step; returns fp32 logits ``[len(chunks), vocab]`` of each chunk's last token."""
        if not chunks:
            raise RunnerInputError("step needs at least one chunk, found none")
        batch = self._prepare(chunks)
        hidden = self.model(batch["input_ids"], batch["positions"], batch["meta"], self.kv_cache,
                            batch["seq_lens"])
        return self.model.compute_logits(hidden[batch["last_idx"]]).float()

    def _prepare(self, chunks: Sequence[Chunk]) -> dict[str, Any]:
        bs, window, dev = self.block_size, self._window, self.device
        tok_parts, pos_parts, blk_parts, len_parts = [], [], [], []
        prefills: list[PrefillSeq] = []
        dec_idx: list[int] = []
        dec_rows: list[np.ndarray] = []
        dec_first: list[int] = []
        dec_pos: list[int] = []
        last_idx: list[int] = []
        offset = 0
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            start = c.start_pos
            if n == 0:
                raise RunnerInputError(f"chunk {i} has no tokens")
            if not isinstance(start, (int, np.integer)) or start < 0:
                raise RunnerInputError(f"chunk {i} start_pos must be a non-negative int, found {start!r}")
            end = start + n
            blocks = np.asarray(c.block_ids, dtype=np.int64).reshape(-1)
            if blocks.size * bs < end:
                raise RunnerInputError(
                    f"chunk {i} covers positions up to {end - 1} but its {blocks.size} blocks of {bs} hold "
                    f"only {blocks.size * bs} positions")
            used = blocks[: (end - 1) // bs + 1]
            if used.min() < 0 or used.max() >= self.num_blocks:
                raise RunnerInputError(f"chunk {i} block ids must be in [0, {self.num_blocks}), found {used.tolist()}")
            pos = np.arange(start, end, dtype=np.int64)
            tok_parts.append(np.asarray(c.token_ids, dtype=np.int64).reshape(-1))
            pos_parts.append(pos)
            blk_parts.append(used[pos // bs])
            len_parts.append(np.full(n, end, dtype=np.int64))
            first_key = max(0, start - window + 1) if window else 0
            first_blk = first_key // bs
            if n == 1:
                dec_idx.append(offset)
                dec_rows.append(used[first_blk:])
                dec_first.append(first_blk * bs)
                dec_pos.append(start)
            elif start == 0:
                mask = None
                if window and n > window:
                    q = np.arange(n)
                    mask = torch.from_numpy((q[None, :] <= q[:, None]) & (q[None, :] > q[:, None] - window)).to(dev)
                prefills.append(PrefillSeq(offset, offset + n, 0, None, 0, mask))
            else:
                key_start = first_blk * bs
                kp = np.arange(key_start, end)
                mask = kp[None, :] <= pos[:, None]
                if window:
                    mask &= kp[None, :] > pos[:, None] - window
                prefills.append(PrefillSeq(offset, offset + n, start,
                                           torch.from_numpy(used[first_blk:]).to(dev), key_start,
                                           torch.from_numpy(mask).to(dev)))
            offset += n
            last_idx.append(offset - 1)

        tokens = np.concatenate(tok_parts)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)][:8].tolist()
            raise RunnerInputError(f"token ids must be in [0, {self.vocab_size}), found {bad}")
        positions = np.concatenate(pos_parts)
        slot_block = np.concatenate(blk_parts)
        slot_offset = positions % bs
        slots = slot_block * bs + slot_offset
        if np.unique(slots).size != slots.size:
            raise RunnerInputError("two chunks of one step write the same KV slot (block, offset); "
                                   "each sequence must write into blocks of its own")

        decode = None
        if dec_idx:
            nblk = max(r.size for r in dec_rows)
            tables = np.zeros((len(dec_rows), nblk), dtype=np.int64)
            for j, r in enumerate(dec_rows):
                tables[j, : r.size] = r
            kp = np.asarray(dec_first)[:, None] + np.arange(nblk * bs)[None, :]
            p = np.asarray(dec_pos)[:, None]
            mask = kp <= p
            if window:
                mask &= kp > p - window
            decode = DecodeBatch(torch.tensor(dec_idx, device=dev), torch.from_numpy(tables).to(dev),
                                 torch.from_numpy(mask[:, None, None, :]).to(dev))

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        meta = AttentionMetadata(t(slot_block), t(slot_offset), prefills, decode, bs)
        return {
            "input_ids": t(tokens),
            "positions": t(positions),
            "seq_lens": t(np.concatenate(len_parts)),
            "meta": meta,
            "last_idx": torch.tensor(last_idx, device=dev),
        }
