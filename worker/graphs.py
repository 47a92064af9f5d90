"""CUDA-graph capture and replay of ``ModelRunner`` steps: ``CudaGraphs`` (an object the
``worker.runner.ModelRunner`` owns and calls), the ``_StepGraph`` it captures into, and ``fed_ids``
(device token feeding, shared with the eager step).

A decode-only step replays a graph captured per grouping shape (per group: batch bucket, blocks-per-row
bucket); a lone fresh prompt replays one captured per padded length. Graphs are captured lazily and
share one memory pool. ``ModelRunner.step`` decides when a step replays a graph.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from worker.attention.plan import PagedDecode, choose_split, fill_units, max_units, num_sms, row_ranges
from worker.decode_groups import decode_stats, plan_decode_groups
from worker.model import AttentionMetadata, DecodeBatch, DecodeGroup, PrefillSeq

__all__ = ["CudaGraphs", "fed_ids"]


class CudaGraphs:
    """The captured steps of one ``ModelRunner``: which shapes replay a graph, the graphs captured so
    far (``captured``, keyed by shape) and the memory pool they share.

    Invariants: a graph reads and writes only tensors that outlive it (the runner's KV cache, the
    token buffer it was captured with, what ``_StepGraph.keep`` holds); padding rows write only
    ``scratch_block``; a fused graph is dropped (``drop_fused``) when the token buffer it captured is
    replaced. The geometry is the runner's, given here once; the model and the KV cache are passed to
    each step (a graph captures the cache it was given); ``token_buffer(rows)`` is the runner's device
    token buffer (``ModelRunner.token_buffer``)."""

    def __init__(self, *, device: torch.device, dtype: torch.dtype, block_size: int, window: int | None,
                 scratch_block: int, attention_backend: str, max_len: int,
                 token_buffer: Callable[[int], torch.Tensor]) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self._window = window
        self.scratch_block = scratch_block
        self.attention_backend = attention_backend
        self.token_buffer = token_buffer
        self.max_graph_batch = 256
        self.max_prefill_graph_tokens = 2048
        self.prefill_graph_granularity = 128
        #: Decode steps replay graphs only up to this context length (the cache's or the model's).
        self.max_len = max_len
        self._rope_len = max(max_len, self.max_prefill_graph_tokens)
        self.captured: dict[tuple, _StepGraph] = {}
        self._pool = None

    def replays_decode(self, rows: int, max_end: int) -> bool:
        return rows <= self.max_graph_batch and max_end <= self.max_len

    def replays_prefill(self, start: int, end: int) -> bool:
        return start == 0 and 1 < end <= self.max_prefill_graph_tokens

    def drop_fused(self) -> None:
        """Forget the graphs that captured the old token buffer (captured again when next used)."""
        self.captured = {k: g for k, g in self.captured.items() if not (len(k) > 2 and k[2] == "fused")}

    def decode_step(self, model, kv_cache: torch.Tensor, checked, feed: np.ndarray | None, fused: bool,
                    max_decode_groups: int, decode_group_overhead_keys: int) -> tuple[torch.Tensor, dict[str, int]]:
        """Decode rows through the graph captured for their grouping: per group, a (batch bucket,
        blocks-per-row bucket) pair. Graph rows are laid out group after group, each group padded to
        its batch bucket; the graph's ``order`` input maps them back to chunk order. Returns the
        logits and the step's ``decode_stats``."""
        bs, n = self.block_size, len(checked)
        starts = np.fromiter((c[1] for c in checked), dtype=np.int64, count=n)
        window = self._window
        firsts = (np.maximum(0, starts - window + 1) // bs) if window else np.zeros(n, dtype=np.int64)
        sizes = np.fromiter((c[3].size for c in checked), dtype=np.int64, count=n)
        need = sizes - firsts
        plan = plan_decode_groups(need, max_decode_groups, decode_group_overhead_keys / bs)
        cap = (self.max_len + bs - 1) // bs
        shape = tuple((_bucket(len(grp), self.max_graph_batch),
                       _bucket(int(need[grp[0]]), max(int(need[grp[0]]), cap))) for grp in plan)
        key = ("decode", shape, "fused") if fused else ("decode", shape)
        g = self.captured.get(key) or self._capture_decode(model, kv_cache, shape, fused)
        g.ready.synchronize()  # the previous upload from this pinned buffer has finished
        host = g.host
        paged = self.attention_backend == "triton"
        self._decode_padding(host, len(shape), whole_tables=not paged)
        # Per-row scalars in a few array writes (chunk ci goes to graph row rows[k], ci = order[k]).
        order = np.concatenate(plan) if len(plan) > 1 else plan[0]
        rows = np.concatenate([row0 + np.arange(len(grp)) for grp, row0 in
                               zip(plan, np.cumsum([0] + [b for b, _ in shape[:-1]]))]) if len(plan) > 1 \
            else np.arange(n)
        tokens = np.fromiter((c[0][0] for c in checked), dtype=np.int64, count=n)
        slot_block = np.fromiter((c[3][-1] for c in checked), dtype=np.int64, count=n)  # block of `start`
        host["ids"][rows] = tokens[order]
        host["pos"][rows] = starts[order]
        host["slot_block"][rows] = slot_block[order]
        host["slot_off"][rows] = starts[order] % bs
        host["first_key"][rows] = firsts[order] * bs
        host["order"][order] = rows
        if feed is not None:
            host["feed"][rows] = feed[order]
        row0 = 0
        for gi, grp in enumerate(plan):
            tables = host["tables"][row0:] if paged else host[f"tables{gi}"]
            for j, ci in enumerate(grp.tolist()):
                used = checked[ci][3]
                f = int(firsts[ci])
                tables[j, : used.size - f] = used[f:] if f else used
            row0 += shape[gi][0]
        need = int(need.sum())
        if paged:
            lo, hi = row_ranges(host["pos"], host["first_key"], self._window)
            fill_units(lo, hi, g.split, host["u_row"], host["u_lo"], host["u_hi"], host["row_start"])
            stats = decode_stats(n, 1, int((hi - lo)[host["order"][:n]].sum()), need * bs)
        else:
            stats = decode_stats(n, len(plan), sum(b * nb for b, nb in shape) * bs, need * bs)
        # The graph returns logits in the model dtype: the fp32 cast is this copy out of its static
        # output, which is made anyway (one kernel per step fewer than casting inside the graph).
        out = g.run()[:n]
        return (out.float() if out.dtype != torch.float32 else out.clone()), stats

    def prefill_step(self, model, kv_cache: torch.Tensor, chunk) -> torch.Tensor:
        """A fresh prompt (start 0) padded to a multiple of ``prefill_graph_granularity`` tokens.
        Padding tokens sit causally after the prompt, so no prompt token attends to them; their K/V
        go to the scratch block."""
        tokens, _, end, used = chunk
        tb = -(-end // self.prefill_graph_granularity) * self.prefill_graph_granularity
        g = self.captured.get(("prefill", tb)) or self._capture_prefill(model, kv_cache, tb)
        g.ready.synchronize()
        host = g.host
        host["ids"][:end] = tokens
        host["ids"][end:] = 0
        host["slot_block"][:end] = used[np.arange(end) // self.block_size]
        host["slot_block"][end:] = self.scratch_block
        host["last"][0] = end - 1
        return g.run().clone()

    def _decode_padding(self, host: dict[str, np.ndarray], num_groups: int, whole_tables: bool = True) -> None:
        """Padding rows: token 0 at position 0 writing into (and reading only) the scratch block.

        ``whole_tables=False`` (paged decode steps): only each table's first entry is reset — the
        paged kernel reads a row's table only inside its ``[lo, hi)`` range, which a padding row's
        position 0 makes its first slot; stale entries past a real row's blocks are never read (and
        are block ids of earlier steps anyway). Saves rewriting ~1 MB per step for a 32k row."""
        host["ids"][:] = 0
        host["pos"][:] = 0
        host["slot_block"][:] = self.scratch_block
        host["slot_off"][:] = 0
        host["first_key"][:] = 0
        host["order"][:] = np.arange(host["order"].size)
        host["feed"][:] = -1
        if "tables" in host:
            if whole_tables:
                host["tables"][:] = self.scratch_block
            else:
                host["tables"][:, 0] = self.scratch_block
            return
        for gi in range(num_groups):
            host[f"tables{gi}"][:] = self.scratch_block

    def _capture_decode(self, model, kv_cache: torch.Tensor, shape: tuple[tuple[int, int], ...],
                        fused: bool = False) -> "_StepGraph":
        """Capture a decode step whose rows form ``len(shape)`` groups of ``(rows, blocks per row)``.
        Distinct captures stay few: each group's pair comes from power-of-two buckets, groups are
        split only where the blocks bucket changes, and there are at most ``max_decode_groups``.

        ``fused``: the graph also takes fed tokens from ``step_tokens`` (its ``feed`` input) and
        writes each row's argmax there (``ModelRunner.step``); plain steps keep the graph without them."""
        bs, dev, window = self.block_size, self.device, self._window
        rows = sum(b for b, _ in shape)
        fields = {"ids": (rows,), "pos": (rows,), "slot_block": (rows,), "slot_off": (rows,),
                  "first_key": (rows,), "order": (rows,), "feed": (rows,)}
        paged = self.attention_backend == "triton"
        if paged:
            # One table for all rows (the kernel reads each row's own range); work units sized from the
            # key's buckets so every step of this shape fits (worker/attention/plan.py).
            split = choose_split(sum(b * nb for b, nb in shape) * bs, kv_cache.shape[4], num_sms(dev))
            units = max_units([(b, nb * bs) for b, nb in shape], split)
            row_units = max(-(-nb * bs // split) for _, nb in shape)
            fields.update({"tables": (rows, max(nb for _, nb in shape)), "u_row": (units,), "u_lo": (units,),
                           "u_hi": (units,), "row_start": (rows + 1,)})
        else:
            fields.update({f"tables{gi}": grp for gi, grp in enumerate(shape)})
        g = _StepGraph(fields, dev)
        if paged:
            g.split = split
            direct = all(nb * bs <= split for _, nb in shape)
        self._decode_padding(g.host, len(shape))
        token_idx = torch.arange(rows, device=dev)
        key_offs = [torch.arange(nb * bs, device=dev) for _, nb in shape]
        v = g.dev
        key = ("decode", shape, "fused") if fused else ("decode", shape)
        tokens = self.token_buffer(rows) if fused else None

        def ids_in() -> torch.Tensor:
            return fed_ids(v["ids"], v["feed"], tokens) if fused else v["ids"]

        def tokens_out(logits: torch.Tensor) -> torch.Tensor:
            if fused:  # rows past the step's chunks hold padding rows' argmax: never read
                torch.argmax(logits, dim=-1, out=tokens[:rows])
            return logits

        def last_rows(h: torch.Tensor) -> torch.Tensor:
            # A one-row graph's ``order`` is [0]: the reorder would be a copy kernel per step for nothing.
            return h if rows == 1 else h.index_select(0, v["order"])
        if paged:
            lo, hi = row_ranges(g.host["pos"], g.host["first_key"], window)
            fill_units(lo, hi, split, g.host["u_row"], g.host["u_lo"], g.host["u_hi"], g.host["row_start"])

            def body() -> torch.Tensor:
                pd = PagedDecode(v["tables"], v["pos"], v["first_key"], v["u_row"], v["u_lo"], v["u_hi"],
                                 v["row_start"], direct, max_row_units=row_units)
                meta = AttentionMetadata(v["slot_block"], v["slot_off"], [], None, bs, "triton", pd)
                h = model(ids_in(), v["pos"], meta, kv_cache, None, max_position=self._rope_len - 1)
                return tokens_out(model.compute_logits(last_rows(h)))

            return self._capture(model, key, g, body, keep=(tokens,) if fused else (), tokens=tokens)

        def body() -> torch.Tensor:
            groups, row0 = [], 0
            for gi, (b, _) in enumerate(shape):
                kp = v["first_key"][row0:row0 + b, None] + key_offs[gi][None, :]
                pos = v["pos"][row0:row0 + b, None]
                mask = kp <= pos
                if window:
                    mask = mask & (kp > pos - window)
                bias = torch.zeros(mask.shape, dtype=self.dtype, device=dev).masked_fill_(~mask, float("-inf"))
                groups.append(DecodeGroup(row0, row0 + b, v[f"tables{gi}"], bias[:, None, None, :]))
                row0 += b
            meta = AttentionMetadata(v["slot_block"], v["slot_off"], [], DecodeBatch(token_idx, groups), bs)
            h = model(ids_in(), v["pos"], meta, kv_cache, None, max_position=self._rope_len - 1)
            return tokens_out(model.compute_logits(last_rows(h)))

        return self._capture(model, key, g, body, keep=(token_idx, *key_offs) + ((tokens,) if fused else ()),
                             tokens=tokens)

    def _capture_prefill(self, model, kv_cache: torch.Tensor, tb: int) -> "_StepGraph":
        bs, dev, window = self.block_size, self.device, self._window
        g = _StepGraph({"ids": (tb,), "slot_block": (tb,), "last": (1,)}, dev)
        g.host["ids"][:] = 0
        g.host["slot_block"][:] = self.scratch_block
        g.host["last"][:] = 0
        pos = torch.arange(tb, device=dev)
        slot_off = pos % bs
        mask = None
        if window and tb > window:
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        v = g.dev

        def body() -> torch.Tensor:
            meta = AttentionMetadata(v["slot_block"], slot_off, [PrefillSeq(0, tb, 0, None, 0, mask)], None, bs)
            h = model(v["ids"], pos, meta, kv_cache, None, max_position=self._rope_len - 1)
            return model.compute_logits(h.index_select(0, v["last"])).float()

        return self._capture(model, ("prefill", tb), g, body, keep=(pos, slot_off, mask))

    def _capture(self, model, key: tuple, g: "_StepGraph", body, keep: tuple,
                 tokens: torch.Tensor | None = None) -> "_StepGraph":
        dev = self.device
        model.rotary.ensure(self._rope_len)
        model.rotary.typed_table(model.dtype)  # the table the step gathers cos/sin from, built on this stream
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g.upload(blocking=True)
        # A fused graph's warm-up writes argmax tokens of padding rows into step_tokens, which may hold
        # the previous step's tokens that this step is about to feed from: keep them.
        saved = tokens.clone() if tokens is not None else None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up kernels / workspaces outside the capture
                body()
        torch.cuda.current_stream(dev).wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.output = body()
        if saved is not None:
            tokens.copy_(saved)
        # The graph replays raw addresses: every tensor it reads that was allocated outside the capture
        # must outlive it (a freed index tensor would be reused and read back as garbage indices).
        g.keep = keep + model.rotary.graph_tensors()
        self.captured[key] = g
        return g


def fed_ids(ids: torch.Tensor, feed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``ids`` with entry ``i`` replaced by ``tokens[feed[i]]`` where ``feed[i] >= 0`` (device only)."""
    return torch.where(feed >= 0, tokens.reshape(-1).index_select(0, feed.clamp(min=0)).to(ids.dtype), ids)


def _bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, but at most ``cap`` (callers ensure cap >= n)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


class _StepGraph:
    """One captured step and its static inputs: every integer input lives in one pinned host buffer
    mirrored by one device buffer, so a replay costs one host→device copy and the graph launch."""

    def __init__(self, fields: dict[str, tuple[int, ...]], dev: torch.device) -> None:
        sizes = {k: int(np.prod(shape)) for k, shape in fields.items()}
        total = sum(sizes.values())
        self._host = torch.empty(total, dtype=torch.int64, pin_memory=True)
        self._dev = torch.empty(total, dtype=torch.int64, device=dev)
        host_np = self._host.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        off = 0
        for k, shape in fields.items():
            self.host[k] = host_np[off:off + sizes[k]].reshape(shape)
            self.dev[k] = self._dev[off:off + sizes[k]].view(shape)
            off += sizes[k]
        self.ready = torch.cuda.Event()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        self.keep: tuple = ()
        self.split = 0  # paged decode graphs: the work-unit size their buffers were sized for

    def upload(self, blocking: bool = False) -> None:
        self._dev.copy_(self._host, non_blocking=not blocking)

    def run(self) -> torch.Tensor:
        self.upload()
        self.ready.record()
        self.graph.replay()
        return self.output
