"""Llama-architecture decoder over a paged KV cache.

Covers the Llama family as Hugging Face `transformers` defines it (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM`` without per-layer windows): RMSNorm, rotary position
embeddings with ``rope_theta`` and the linear / dynamic-NTK / llama3 / YaRN scalings, grouped-query
attention, SwiGLU MLP, an optional sliding window, tied or untied embeddings, fp32 or bf16, CPU or
CUDA.

The config (``ModelConfig``) lives in worker/model_config.py and the rotary embeddings in
worker/rope.py; this module holds the attention metadata, the layers and the model.

The model never owns KV memory: :class:`worker.runner.ModelRunner` allocates the cache and passes it in
with an :class:`AttentionMetadata` that says where each new token's K/V goes and what each sequence
attends to. Tokens of all sequences in a step are flattened into one ``[num_tokens, hidden]`` matrix
so every linear layer runs once per step; only attention looks at sequence boundaries.

Numerics follow transformers so logits agree to ~1e-6 relative in fp32: RMSNorm normalises in fp32 and
casts back before the weight, cos/sin are computed in fp32 as ``position * inv_freq`` and cast to the
activation dtype, rotation is the "rotate half" convention of HF-format checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention.plan import PagedDecode
from worker.model_config import ModelConfig
from worker.rope import RotaryEmbedding, apply_rope

__all__ = [
    "AttentionMetadata",
    "PrefillSeq",
    "DecodeBatch",
    "DecodeGroup",
    "RMSNorm",
    "DecoderLayer",
    "LlamaForCausalLM",
]


# ----------------------------------------------------------------------------- attention metadata


@dataclass
class PrefillSeq:
    """One multi-token chunk: new tokens ``token_start:token_end`` of the flat batch at absolute
    positions ``start_pos ..``; ``gather_blocks`` are the cache blocks holding keys from absolute
    position ``key_start`` (block-aligned) up to the chunk's last position, or ``None`` when the chunk
    starts the sequence and attends only to its own fresh K/V."""

    token_start: int
    token_end: int
    start_pos: int
    gather_blocks: torch.Tensor | None
    key_start: int
    attn_mask: torch.Tensor | None  # bool [q, k]; None means plain causal over fresh K/V


@dataclass
class DecodeGroup:
    """Decode rows ``start:end`` (of the decode batch) that read block tables of similar length:
    ``tables`` [end-start, nblk] lists the blocks each row reads (padded to the group's longest row),
    ``bias`` [end-start, 1, 1, nblk*block_size] (model dtype) is 0 where a key is visible and -inf
    elsewhere (causal/window range and padding)."""

    start: int
    end: int
    tables: torch.Tensor
    bias: torch.Tensor


@dataclass
class DecodeBatch:
    """Single-token chunks attended to together: ``token_idx`` selects their rows of the flat batch;
    ``groups`` partition those rows into consecutive runs, each gathering only as many keys as its
    own longest row needs, so one long context does not make every short row gather its length.

    Invariant: the groups are ordered and contiguous, ``groups[0].start == 0`` and
    ``groups[-1].end == len(token_idx)``."""

    token_idx: torch.Tensor
    groups: list[DecodeGroup]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the runner, shared by all layers.

    ``slot_block``/``slot_offset`` give, per new token, the cache block and the offset inside it where
    that token's K/V are written before any attention reads the cache.

    ``backend`` ``"triton"`` (worker/attention): decode rows are described by ``paged`` (the kernel
    reads their blocks in place; ``decode`` is then ``None``), and a prefill chunk with
    ``gather_blocks`` is attended by the paged prefill kernel through that table from position
    ``key_start`` (``attn_mask`` unused)."""

    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    prefills: list[PrefillSeq]
    decode: DecodeBatch | None
    block_size: int
    backend: str = "torch"
    paged: PagedDecode | None = None


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel; it accumulates in fp32 like transformers' LlamaRMSNorm (which additionally
        # rounds to the activation dtype before the weight multiply: a last-bit difference in bf16).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention. q/k/v projections are fused into one matrix (rows: q, then k, then v)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = cfg.sliding_window
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias,
                                  device=device, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if meta.backend == "triton":
            return self._forward_triton(x, cos, sin, meta, kv_cache)
        q, k, v, layer = self._qkv_store(x, cos, sin, meta, kv_cache)

        d = meta.decode
        if not meta.prefills and d is not None:
            # Decode-only step: the batch rows are the decode rows in order; no scatter needed.
            return self.o_proj(self._decode(q, layer, d, meta.block_size).reshape(n, self.q_size))
        if d is None and len(meta.prefills) == 1:
            return self.o_proj(self._prefill(q, k, v, layer, meta.prefills[0], meta.block_size)
                               .reshape(n, self.q_size))
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for p in meta.prefills:
            out[p.token_start:p.token_end] = self._prefill(q, k, v, layer, p, meta.block_size)
        if d is not None:
            out[d.token_idx] = self._decode(q[d.token_idx], layer, d, meta.block_size)
        return self.o_proj(out.view(n, self.q_size))

    def _qkv_store(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   kv_cache: torch.Tensor):
        """q, k, v of the step's tokens (RoPE applied) and this layer's cache view, after storing the
        new K/V into their slots. kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads,
                                                                   self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        layer = kv_cache[:, self.layer_idx]
        layer[meta.slot_block, 0, meta.slot_offset] = k
        layer[meta.slot_block, 1, meta.slot_offset] = v
        return q, k, v, layer

    def _forward_triton(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """The triton backend: K/V stay in the pool and are read there through block tables.

        A decode-only step of at most ``MAX_M`` rows runs qkv and o_proj as split-K partial products
        (worker/attention/triton_linear.py): the fp32 ``[S, n, ·]`` result is summed by its consumer
        (RoPE + store here, the residual-add + RMSNorm after o_proj), so the return value is then
        those partials, not the product.

        Launches per layer of such a step (this method + :meth:`DecoderLayer.triton_parts`): qkv, RoPE +
        store, decode, [merge], o_proj, add + RMSNorm, gate·up + SiLU, down, and the next layer's add +
        RMSNorm: 8, or 9 with the merge (rows over several work units). At one row of at most
        ``MERGE_MAX_UNITS`` units o_proj merges them itself: 9 → 8 (``1b`` at 1k context)."""
        ops = _triton_ops()
        n = x.shape[0]
        if not meta.prefills:
            # Decode-only step: RoPE and both cache stores in one launch, then the paged kernel.
            small = ops.use_small_m(x)
            a, o = self.qkv_proj, self.o_proj
            qkv = ops.linear_partials(x, a.weight, a.bias, role="qkv") if small else a(x)
            q = ops.rope_store(qkv, cos, sin, kv_cache, self.layer_idx, meta.slot_block, meta.slot_offset,
                               self.num_heads, self.num_kv_heads, self.head_dim)
            pd = meta.paged
            if small and ops.merges_units(n, pd.max_row_units, pd.direct):
                # One short row: o_proj merges the attention's units itself (no merge kernel).
                mid_o, mid_l = ops.paged_decode_units(q, kv_cache, self.layer_idx, pd, self.scale)
                return ops.merged_linear_partials(mid_o, mid_l, pd.row_start, pd.max_row_units, o.weight, o.bias)
            out = torch.empty_like(q)
            ops.paged_decode(q, kv_cache, self.layer_idx, pd, self.scale, out)
            out = out.view(n, self.q_size)
            return ops.linear_partials(out, o.weight, o.bias, role="o") if small else o(out)
        q, k, v, layer = self._qkv_store(x, cos, sin, meta, kv_cache)
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for p in meta.prefills:
            if p.gather_blocks is None:  # fresh prompt: its own K/V are at hand, SDPA as the torch path
                out[p.token_start:p.token_end] = self._prefill(q, k, v, layer, p, meta.block_size)
            else:
                ops.paged_prefill(q[p.token_start:p.token_end], kv_cache, self.layer_idx, p.gather_blocks,
                                  p.start_pos, p.key_start, self.scale, self.window, out[p.token_start:p.token_end])
        if meta.paged is not None:
            s = meta.paged.token_start
            ops.paged_decode(q[s:], kv_cache, self.layer_idx, meta.paged, self.scale, out[s:])
        return self.o_proj(out.view(n, self.q_size))

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor,
                 p: "PrefillSeq", block_size: int) -> torch.Tensor:
        """Attention output ``[Lq, H, D]`` of one multi-token chunk."""
        qs = q[p.token_start:p.token_end].transpose(0, 1)  # [H, Lq, D]
        if p.gather_blocks is None:
            ks = k[p.token_start:p.token_end].transpose(0, 1)
            vs = v[p.token_start:p.token_end].transpose(0, 1)
        else:
            nb, keys = p.gather_blocks.shape[0], p.attn_mask.shape[1]
            ks = layer[p.gather_blocks, 0].view(nb * block_size, self.num_kv_heads, self.head_dim)
            vs = layer[p.gather_blocks, 1].view(nb * block_size, self.num_kv_heads, self.head_dim)
            ks, vs = ks[:keys].transpose(0, 1), vs[:keys].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
            attn_mask=p.attn_mask, is_causal=p.attn_mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, layer: torch.Tensor, d: "DecodeBatch", block_size: int) -> torch.Tensor:
        """Attention output ``[B, H, D]`` of single-token rows ``q`` ``[B, H, D]``, one gather and one
        attention per :class:`DecodeGroup` (outputs concatenated in row order)."""
        if len(d.groups) == 1:
            return self._decode_group(q, layer, d.groups[0], block_size)
        return torch.cat([self._decode_group(q[g.start:g.end], layer, g, block_size) for g in d.groups])

    def _decode_group(self, q: torch.Tensor, layer: torch.Tensor, g: "DecodeGroup",
                      block_size: int) -> torch.Tensor:
        """The query heads sharing one KV head become that KV head's "query rows", so GQA decode is
        plain attention over ``[b, kv_heads, groups, D]`` with no repeated K/V; ``g.bias`` (additive,
        shared by all layers) masks keys outside each row's causal/window range and the padding."""
        b, nblk = g.tables.shape
        groups = self.num_heads // self.num_kv_heads
        qd = q.reshape(b, self.num_kv_heads, groups, self.head_dim)
        kd = layer[g.tables, 0].view(b, nblk * block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vd = layer[g.tables, 1].view(b, nblk * block_size, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.bias, scale=self.scale)
        return o.reshape(b, self.num_heads, self.head_dim)


_TRITON_OPS = None


def _triton_ops():
    """worker.attention.triton_ops, imported on first use (CPU installs need no Triton)."""
    global _TRITON_OPS
    if _TRITON_OPS is None:
        from worker.attention import interpreting
        interpreting()  # SPLITSERVE_TRITON_INTERPRET=1 must reach triton before the kernels are defined
        from worker.attention import triton_ops
        _TRITON_OPS = triton_ops
    return _TRITON_OPS


class MLP(nn.Module):
    """SwiGLU; gate and up projections fused into one matrix (rows: gate, then up)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias,
                                      device=device, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                   device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = Attention(cfg, layer_idx, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = MLP(cfg, device, dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if meta.backend == "triton":
            h, m = self.triton_parts(h, self.input_layernorm(h), cos, sin, meta, kv_cache)
            return h + m
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


    def triton_parts(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the triton backend from ``x = input_layernorm(h)``: the residual after
        attention and the MLP output, not yet added (the caller folds that add into the next norm).
        At most ``MAX_M`` rows: gate·up with SiLU in one kernel, and the MLP output is down_proj's
        split-K partials (worker/attention/triton_linear.py), summed by that next norm."""
        ops = _triton_ops()
        a = self.self_attn(x, cos, sin, meta, kv_cache)
        # a + h, not h + a: the kernel's first input may be split-K partials (fp32 addition commutes).
        h, x = ops.add_rms_norm(a, h, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        mlp = self.mlp
        if ops.use_small_m(x):
            gu, down = mlp.gate_up_proj, mlp.down_proj
            return h, ops.linear_partials(ops.gate_up_silu(x, gu.weight, gu.bias), down.weight, down.bias, role="down")
        return h, mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(x)))


class LlamaForCausalLM(nn.Module):
    """The decoder. Parameters are created uninitialised (``torch.empty``); the loader or a preset fills
    them. With ``tie_word_embeddings`` the output projection *is* ``embed_tokens.weight``."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        device = torch.device(device)
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=device)
        self.requires_grad_(False)  # inference only: no autograd bookkeeping on weights
        self.rotary = RotaryEmbedding(cfg, device)
        # (hidden, norm(hidden)) of the last one-row triton decode forward: the final add + RMSNorm
        # kernel computes both, so compute_logits given that very hidden skips its own norm launch.
        self._normed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def move(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "LlamaForCausalLM":
        """``.to(device, dtype)`` that also moves the rotary tables (plain tensors, not buffers)."""
        self.to(device=device, dtype=dtype or self.dtype)
        self.rotary = RotaryEmbedding(self.config, device)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, seq_lens: torch.Tensor | None = None,
                max_position: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the last layer, before the final norm.
        ``max_position``/``max_seq_len``: host-side maxima (see :meth:`RotaryEmbedding.cos_sin`)."""
        cos, sin = self.rotary.cos_sin_signed(positions, self.dtype, seq_lens, max_position, max_seq_len)
        if meta.backend == "triton":
            # Each layer's closing residual add is folded into the next layer's input RMSNorm; on a
            # one-row decode step the embedding lookup and the first input norm are one launch too.
            # Launches of a one-row decode graph of 1b (16 layers): 157 before these fusions (cos/sin 6,
            # embedding + norm 2, 16 × 9 layer launches, final add + norm, reorder, norm, LM head, fp32
            # cast) → 133 at contexts up to ~2k (cos/sin 1, embedding + norm 1, 16 × 8, final add + norm,
            # norm, LM head) and 149 beyond (16 × 9: the merge kernel stays; Attention._forward_triton);
            # 148 at every context since the seventh pass: o_proj's own merge is off (triton_linear.py
            # MERGE_MAX_UNITS: slower than the merge kernel) and the final add + norm's output feeds the
            # LM head (compute_logits).
            ops, layers = _triton_ops(), self.layers
            norm0 = layers[0].input_layernorm
            self._normed = None
            one_row = not meta.prefills and input_ids.dim() == 1 and input_ids.shape[0] == 1
            if one_row:
                h, x = ops.embed_rms_norm(input_ids, self.embed_tokens.weight, norm0.weight, norm0.eps)
            else:
                h = self.embed_tokens(input_ids)
                x = norm0(h)
            for i, layer in enumerate(layers):
                h, m = layer.triton_parts(h, x, cos, sin, meta, kv_cache)
                if i + 1 == len(layers):
                    if m.dim() != 3:
                        return h + m
                    # m is split-K partials: the add kernel sums them; its normalised output is the LM
                    # head's input, kept for compute_logits at one row (one launch fewer per step).
                    h, y = ops.add_rms_norm(m, h, self.norm.weight, self.norm.eps)
                    if one_row:
                        self._normed = (h, y)
                    return h
                norm = layers[i + 1].input_layernorm
                h, x = ops.add_rms_norm(m, h, norm.weight, norm.eps)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, meta, kv_cache)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (model dtype) for the given rows of :meth:`forward`'s output."""
        normed = self._normed
        if normed is not None and hidden is normed[0]:  # the final norm already ran (forward)
            logits = _triton_ops().linear_m1(normed[1], self.output_weight)
            return F.linear(normed[1], self.output_weight) if logits is None else logits
        return F.linear(self.norm(hidden), self.output_weight)
