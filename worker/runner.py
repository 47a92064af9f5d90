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

This is the affine ``PhysicalPool`` of docs/design.md §9 with ``slot = block``: the (layer, block) region
``base + l·layer_stride + b·block_stride`` is ``block_bytes`` long, and all layers of a block are
adjacent, so moving a block between two workers with equal geometry is one copy of ``block_stride``
bytes and runs of consecutive block ids merge into one copy.

This file holds ``ModelRunner`` (the cache, input checks, the eager step) and ``Chunk``; CUDA-graph
capture and replay are in worker/graphs.py (``CudaGraphs``, an object ``ModelRunner`` owns), decode-row grouping
(``plan_decode_groups``, re-exported here) in worker/decode_groups.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from worker.attention import resolve_backend
from worker.attention.plan import PagedDecode, build_paged_decode
from worker.decode_groups import decode_stats, plan_decode_groups
from worker.graphs import CudaGraphs, fed_ids
from worker.model import AttentionMetadata, DecodeBatch, DecodeGroup, LlamaForCausalLM, PrefillSeq
from worker.model_config import ModelConfig

__all__ = ["Chunk", "ModelRunner", "RunnerInputError", "kv_bytes_per_block", "plan_decode_groups"]


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


_SMALL_MODEL_PARAMS = 100_000_000


def _limit_cpu_threads(model: LlamaForCausalLM, threads: int | None) -> None:
    """Pick torch's intra-op thread count for CPU inference (process-wide).

    Small models get one thread: their matmuls are too small to split, and OpenMP workers spinning on
    a machine shared with other processes (several workers on a laptop, CI) made a tiny decode step
    ~40x slower in measurements here. ``threads`` or ``SPLITSERVE_CPU_THREADS`` overrides."""
    if threads is None:
        env = os.environ.get("SPLITSERVE_CPU_THREADS")
        if env:
            try:
                threads = int(env)
            except ValueError:
                raise ValueError(f"SPLITSERVE_CPU_THREADS must be an integer, found {env!r}") from None
        elif sum(p.numel() for p in model.parameters()) < _SMALL_MODEL_PARAMS:
            threads = 1
    if threads is not None and threads > 0 and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


class ModelRunner:
    """Owns the KV cache of one model and runs steps on it.

    Invariants: the cache is one contiguous tensor allocated once (its base pointer never changes, so
    memory registered for transfer stays valid); ``step`` writes K/V only into the slots of the chunks'
    new positions; block ids are plain indices into dimension 0 and carry no ownership (the
    scheduler's ``BlockPool`` decides who may write where)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int = 16,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 cpu_threads: int | None = None, cuda_graphs: bool | None = None,
                 attention_backend: str | None = "auto") -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, found {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, found {block_size!r}")
        device = torch.device(device) if device is not None else model.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
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
        # and 0·NaN from uninitialised memory would poison the output. One extra block past the end
        # (``scratch_block``) takes the K/V writes of padding rows in CUDA-graph batches; it is not part
        # of the page table and no scheduler ever sees its id.
        self.kv_cache = torch.zeros(num_blocks + 1, cfg.num_hidden_layers, 2, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=self.device)
        self.scratch_block = num_blocks
        self.vocab_size = cfg.vocab_size
        self._window = cfg.sliding_window
        #: ``triton`` (paged kernels, worker/attention) or ``torch`` (gather + SDPA); see
        #: :func:`worker.attention.resolve_backend` for what ``auto`` picks.
        self.attention_backend = resolve_backend(attention_backend, self.device)
        if self.device.type == "cpu":
            _limit_cpu_threads(model, cpu_threads)
        if cuda_graphs is None:
            cuda_graphs = os.environ.get("SPLITSERVE_CUDA_GRAPHS", "1") != "0"
        #: Replay captured CUDA graphs (``graphs``, worker/graphs.py) for decode-only steps (up to
        #: ``max_graph_batch`` rows) and for a lone fresh prompt of up to ``max_prefill_graph_tokens``
        #: (where launch overhead, not the GPU, bounds eager prefill). CUDA only; not with dynamic RoPE,
        #: whose frequencies depend on lengths.
        #: Graphs are captured lazily per size bucket and share one memory pool.
        self.use_cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda" and (
            model.rotary.rope_type != "dynamic")
        self.graphs = CudaGraphs(
            device=self.device, dtype=dtype, block_size=block_size, window=self._window,
            scratch_block=self.scratch_block, attention_backend=self.attention_backend,
            max_len=min(num_blocks * block_size, max(cfg.max_position_embeddings, block_size)),
            token_buffer=self.token_buffer)
        #: Device tokens of the last step (see :meth:`step`), allocated on first use.
        self.step_tokens: torch.Tensor | None = None
        #: Decode rows are split into at most this many groups by table length (see
        #: :func:`plan_decode_groups`); 1 restores one batch padded to the longest table.
        self.max_decode_groups = 3
        #: What one more decode group costs, in gathered key slots: a gather and an attention kernel
        #: per layer cost about as much as moving this many extra keys on a GPU.
        self.decode_group_overhead_keys = 4096
        #: Shape of the last step's decode attention: ``decode_rows``, ``decode_groups``,
        #: ``decode_key_slots`` (key slots gathered per layer, padding included — what the step
        #: pays for) and ``decode_context_slots`` (the block-rounded keys the rows actually need).
        self.last_step_stats: dict[str, int] = {}

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
            "total_bytes": self.num_blocks * self.block_stride,
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
    def step(self, chunks: Sequence[Chunk], feed_index: Sequence[int] | None = None,
             greedy_tokens: bool = False) -> torch.Tensor:
        """Run one step; returns fp32 logits ``[len(chunks), vocab]`` of each chunk's last token.

        Device-side tokens (async scheduling, worker/engine.py): ``step_tokens`` is a device int64
        buffer the runner owns. ``feed_index[i] >= 0`` makes chunk ``i`` (a single-token chunk) take its
        token from ``step_tokens[feed_index[i]]`` instead of ``token_ids`` (a placeholder), and with
        ``feed_index`` or ``greedy_tokens`` the step leaves ``argmax(logits[i])`` in ``step_tokens[i]``
        for every chunk — inside the CUDA graph of a decode step, so the previous step's greedy tokens
        feed this one with no host round trip and no extra launch. A caller sampling a row otherwise
        overwrites that row of ``step_tokens`` after the call, before the next one.

        Nothing here waits for the device: inputs go up from pinned memory without blocking, so a call
        returns once the step is queued (the logits are a device tensor still being computed)."""
        if not chunks:
            raise RunnerInputError("step needs at least one chunk, found none")
        checked = self._check_decode(chunks) if all(len(c.token_ids) == 1 for c in chunks) else None
        decode_only = checked is not None
        if checked is None:
            checked = [self._check(i, c) for i, c in enumerate(chunks)]
            self._check_slots(checked)
        n = len(checked)
        feed = None
        if feed_index is not None:
            feed = np.asarray(feed_index, dtype=np.int64).reshape(-1)
            if feed.size != n:
                raise RunnerInputError(f"feed_index has {feed.size} entries for {n} chunks")
            top = int(feed.max())
            if top < 0:
                feed = None
            else:
                self.token_buffer(top + 1)
                bad = [] if decode_only else [
                    i for i in np.flatnonzero(feed >= 0).tolist() if checked[i][2] - checked[i][1] != 1]
                if bad:
                    raise RunnerInputError(f"fed chunks must have one token; chunks {bad} have more")
        fused = feed is not None or greedy_tokens
        if fused:
            self.token_buffer(n)
        logits = None
        if self.use_cuda_graphs:
            graphs = self.graphs
            if decode_only and graphs.replays_decode(n, max(end for _, _, end, _ in checked)):
                logits, self.last_step_stats = graphs.decode_step(
                    self.model, self.kv_cache, checked, feed, fused, self.max_decode_groups,
                    self.decode_group_overhead_keys)
                return logits
            if feed is None and n == 1 and graphs.replays_prefill(checked[0][1], checked[0][2]):
                logits = graphs.prefill_step(self.model, self.kv_cache, checked[0])
        if logits is None:
            batch = self._prepare(checked, feed)
            input_ids = batch["input_ids"]
            if feed is not None:
                input_ids = fed_ids(input_ids, batch["feed"], self.step_tokens)
            hidden = self.model(input_ids, batch["positions"], batch["meta"], self.kv_cache,
                                batch["seq_lens"], batch["max_position"], batch["max_seq_len"])
            logits = self.model.compute_logits(hidden[batch["last_idx"]]).float()
        if fused:
            self.step_tokens[:n].copy_(torch.argmax(logits, dim=-1))
        return logits

    def token_buffer(self, rows: int) -> torch.Tensor:
        """``step_tokens`` with room for ``rows`` rows (at least ``graphs.max_graph_batch``). Growing it
        drops the graphs that captured the old buffer's address (they are captured again when next used);
        its contents are kept."""
        buf = self.step_tokens
        if buf is None or buf.numel() < rows:
            with torch.inference_mode(False):  # a normal tensor: callers write sampled rows into it
                new = torch.zeros(max(2 * rows, 2 * self.graphs.max_graph_batch), dtype=torch.int64, device=self.device)
            if buf is not None:
                new[:buf.numel()].copy_(buf)
                self.graphs.drop_fused()
            self.step_tokens = buf = new
        return buf

    def _h2d(self, a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``a`` on the model's device without waiting for the device: a blocking copy from pageable
        memory synchronises the stream (waits for every queued step), which would serialise the host's
        preparation of a step with the step before it."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cuda":
            return t if dtype is None else t.to(dtype)
        t = t.pin_memory().to(self.device, non_blocking=True)
        return t if dtype is None else t.to(dtype)

    def _check(self, i: int, c: Chunk) -> tuple[np.ndarray, int, int, np.ndarray]:
        """Validate one chunk → (token ids, start, end, the block-table prefix it touches)."""
        bs = self.block_size
        n = len(c.token_ids)
        start = c.start_pos
        if n == 0:
            raise RunnerInputError(f"chunk {i} has no tokens")
        if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or start < 0:
            raise RunnerInputError(f"chunk {i} start_pos must be a non-negative int, found {start!r}")
        end = int(start) + n
        need = (end - 1) // bs + 1
        ids = c.block_ids
        if len(ids) < need:
            raise RunnerInputError(
                f"chunk {i} covers positions up to {end - 1} but its {len(ids)} blocks of {bs} hold "
                f"only {len(ids) * bs} positions")
        # Only the blocks this chunk touches are converted: converting a long table every decode step
        # cost ~60 µs per 2k-entry list, most of a batch-32 step's host time (bench/results/history/worker.md, "decode kernels
        # (issue 17, third pass)").
        used = np.asarray(ids[:need], dtype=np.int64).reshape(-1)
        if used.min() < 0 or used.max() >= self.num_blocks:
            raise RunnerInputError(f"chunk {i} block ids must be in [0, {self.num_blocks}), found {used.tolist()}")
        tokens = np.asarray(c.token_ids, dtype=np.int64).reshape(-1)
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)][:8].tolist()
            raise RunnerInputError(f"chunk {i} token ids must be in [0, {self.vocab_size}), found {bad}")
        return tokens, int(start), end, used

    def _check_decode(self, chunks: Sequence[Chunk]) -> list | None:
        """:meth:`_check` + :meth:`_check_slots` for single-token chunks, in a few array operations
        (31 rows of per-chunk checks cost ~0.25 ms of a mixed decode step's host time). ``None`` when
        anything is off: the per-chunk path then raises the error naming it."""
        bs, n = self.block_size, len(chunks)
        starts = [c.start_pos for c in chunks]
        if not all(type(st) is int and st >= 0 for st in starts):
            return None
        used = []
        for c, st in zip(chunks, starts):
            ids = c.block_ids
            need = st // bs + 1
            if len(ids) < need:
                return None
            if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
                used.append(ids[:need])  # the torch engine's tables (worker/engine.py ``_table``)
            else:
                used.append(np.asarray(ids[:need], dtype=np.int64).reshape(-1))
        tokens = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=n)
        flat = np.concatenate(used) if n > 1 else used[0]
        if (flat.min() < 0 or flat.max() >= self.num_blocks or tokens.min() < 0
                or tokens.max() >= self.vocab_size):
            return None
        if n > 1:
            pos = np.asarray(starts, dtype=np.int64)
            slots = np.fromiter((u[-1] for u in used), dtype=np.int64, count=n) * bs + pos % bs
            if np.unique(slots).size != n:
                return None
        return [(tokens[i:i + 1], st, st + 1, u) for i, (st, u) in enumerate(zip(starts, used))]

    def _check_slots(self, checked) -> None:
        bs = self.block_size
        if len(checked) == 1:
            return
        slots = np.concatenate([used[np.arange(s, e) // bs] * bs + np.arange(s, e) % bs
                                for _, s, e, used in checked])
        if np.unique(slots).size != slots.size:
            raise RunnerInputError("two chunks of one step write the same KV slot (block, offset); "
                                   "each sequence must write into blocks of its own")

    def _first_key_block(self, start: int) -> int:
        """First block any query from ``start`` on can see (sliding window), else 0."""
        window = self._window
        return (max(0, start - window + 1) // self.block_size) if window else 0

    def _plan(self, checked, dec_chunks: list[int]) -> list[np.ndarray]:
        """Group the decode chunks ``dec_chunks`` (indices into ``checked``) by blocks read; returns
        positions into ``dec_chunks`` per group."""
        if not dec_chunks:
            return []
        need = [checked[i][3].size - self._first_key_block(checked[i][1]) for i in dec_chunks]
        return plan_decode_groups(need, self.max_decode_groups,
                                  self.decode_group_overhead_keys / self.block_size)

    def _prepare(self, checked, feed: np.ndarray | None = None) -> dict[str, Any]:
        bs, window = self.block_size, self._window
        tok_parts, pos_parts, blk_parts, len_parts, feed_parts = [], [], [], [], []
        prefills: list[PrefillSeq] = []
        dec_idx: list[int] = []
        dec_rows: list[np.ndarray] = []
        dec_first: list[int] = []
        dec_pos: list[int] = []
        # Decode rows go last, in group order, so each group is one contiguous run of the flat batch
        # (and a decode-only step needs no scatter); ``last_idx`` maps results back to chunk order.
        dec_chunks = [i for i, (_, s, e, _) in enumerate(checked) if e - s == 1]
        paged = self.attention_backend == "triton"
        # The paged kernel reads each row's own range whatever its neighbours: no grouping needed.
        plan = ([np.arange(len(dec_chunks))] if dec_chunks else []) if paged else self._plan(checked, dec_chunks)
        run_order = [i for i, (_, s, e, _) in enumerate(checked) if e - s != 1]
        run_order += [dec_chunks[j] for grp in plan for j in grp]
        last_idx = [0] * len(checked)
        offset = 0
        for ci in run_order:
            tokens, start, end, used = checked[ci]
            n = end - start
            pos = np.arange(start, end, dtype=np.int64)
            tok_parts.append(tokens)
            pos_parts.append(pos)
            blk_parts.append(used[pos // bs])
            len_parts.append(np.full(n, end, dtype=np.int64))
            if feed is not None:
                feed_parts.append(np.full(n, feed[ci] if n == 1 else -1, dtype=np.int64))
            first_blk = self._first_key_block(start)
            if n == 1:
                dec_idx.append(offset)
                dec_rows.append(used[first_blk:])
                dec_first.append(first_blk * bs)
                dec_pos.append(start)
            elif start == 0 and paged and window and n > window:
                # A windowed prompt longer than its window: the kernel masks by position, no [n, n] mask.
                prefills.append(PrefillSeq(offset, offset + n, 0, self._h2d(used), 0, None))
            elif start == 0:
                mask = None
                if window and n > window:
                    q = np.arange(n)
                    mask = self._h2d((q[None, :] <= q[:, None]) & (q[None, :] > q[:, None] - window))
                prefills.append(PrefillSeq(offset, offset + n, 0, None, 0, mask))
            elif paged:
                prefills.append(PrefillSeq(offset, offset + n, start, self._h2d(used[first_blk:]),
                                           first_blk * bs, None))
            else:
                key_start = first_blk * bs
                kp = np.arange(key_start, end)
                mask = kp[None, :] <= pos[:, None]
                if window:
                    mask &= kp[None, :] > pos[:, None] - window
                prefills.append(PrefillSeq(offset, offset + n, start,
                                           self._h2d(used[first_blk:]), key_start, self._h2d(mask)))
            offset += n
            last_idx[ci] = offset - 1

        positions = np.concatenate(pos_parts)
        slot_block = np.concatenate(blk_parts)
        decode = paged_meta = None
        self.last_step_stats = decode_stats(0, 0, 0, 0)
        if dec_idx and paged:
            paged_meta = self._paged_decode_meta(dec_rows, dec_first, dec_pos, dec_idx[0])
        elif dec_idx:
            groups, start, gathered = [], 0, 0
            for grp in plan:
                end_row = start + len(grp)
                rows = dec_rows[start:end_row]
                nblk = max(r.size for r in rows)
                tables = np.zeros((len(rows), nblk), dtype=np.int64)
                for j, r in enumerate(rows):
                    tables[j, : r.size] = r
                kp = np.asarray(dec_first[start:end_row])[:, None] + np.arange(nblk * bs)[None, :]
                p = np.asarray(dec_pos[start:end_row])[:, None]
                mask = kp <= p
                if window:
                    mask &= kp > p - window
                bias = np.where(mask, np.float32(0), np.float32(-np.inf))[:, None, None, :]
                groups.append(DecodeGroup(start, end_row, self._h2d(tables), self._h2d(bias, self.dtype)))
                gathered += tables.size * bs
                start = end_row
            decode = DecodeBatch(self._h2d(np.asarray(dec_idx, dtype=np.int64)), groups)
            self.last_step_stats = decode_stats(len(dec_idx), len(groups), gathered,
                                                 sum(r.size for r in dec_rows) * bs)

        # One host→device copy for all per-token integer inputs (each copy from pageable memory syncs).
        n = positions.size
        dynamic = self.model.rotary.rope_type == "dynamic"
        parts = [np.concatenate(tok_parts), positions, slot_block, positions % bs,
                 np.asarray(last_idx, dtype=np.int64)]
        if dynamic:
            parts.append(np.concatenate(len_parts))
        if feed is not None:
            parts.append(np.concatenate(feed_parts))
        packed = self._h2d(np.concatenate(parts))
        input_ids, pos_t, blk_t, off_t = packed[:n], packed[n:2 * n], packed[2 * n:3 * n], packed[3 * n:4 * n]
        o = 4 * n + len(last_idx)
        last_t = packed[4 * n:o]
        seq_lens = packed[o:o + n] if dynamic else None
        feed_t = packed[packed.numel() - n:] if feed is not None else None
        return {
            "feed": feed_t,
            "input_ids": input_ids,
            "positions": pos_t,
            "seq_lens": seq_lens,
            "max_position": int(positions.max()),
            "max_seq_len": max(end for _, _, end, _ in checked),
            "meta": AttentionMetadata(blk_t, off_t, prefills, decode, bs, self.attention_backend, paged_meta),
            "last_idx": last_t,
        }

    def _paged_decode_meta(self, rows: list[np.ndarray], first: list[int], pos: list[int],
                           token_start: int) -> PagedDecode:
        """Eager-step metadata of the paged decode kernel (worker/attention/plan.py)."""
        meta, read = build_paged_decode(rows, pos, first, self._window, self.kv_cache.shape[4], self.device,
                                        token_start=token_start)
        self.last_step_stats = decode_stats(len(rows), 1, read, sum(t.size for t in rows) * self.block_size)
        return meta
