"""One rank's shard of the Llama decoder (tensor and pipeline parallel), and its weights.

The shard is an ordinary :mod:`worker.model` decoder over a *shard config*: the stage's layers
(re-indexed from 0, so the rank's KV cache holds exactly its layers), ``heads/tp`` query heads, the
rank's KV heads (``transfer.peers.head_range``), and ``intermediate/tp`` MLP columns. It therefore
runs under an unmodified :class:`worker.runner.ModelRunner`, whose KV pool and ``page_table()``
then describe precisely this rank's storage.

Megatron-style TP: qkv and gate/up are column-parallel (each rank computes its heads / MLP
columns), o_proj and down_proj are row-parallel followed by an all-reduce over the stage's TP
ranks; their biases live on TP rank 0 only so the sum adds them once. Embedding, norms and the
output projection are replicated. With more TP ranks than KV heads, query heads ``[t·H/tp, …)``
all read KV head ``t // (tp/H_kv)`` — the head that rank stores — so GQA grouping is unchanged.

PP: stage 0 embeds, every other stage receives the previous stage's hidden states; the last stage's
TP rank 0 computes logits and, unless it is rank 0, sends them to rank 0 (the leader samples).

Weights come from the same source as the single-rank model, one full parameter at a time, then
sliced: presets through ``worker.presets.init_random_weights`` (bit-identical to ``build_preset``),
Hugging Face directories through ``worker.loader.load_model`` on the CPU.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from worker.model import DecoderLayer, RMSNorm
from worker.model_config import ModelConfig
from worker.parallel.comm import RankComm, RankLayout
from worker.rope import RotaryEmbedding

__all__ = ["RankModel", "shard_config", "build_rank_model", "full_parameters"]


def shard_config(cfg: ModelConfig, layout: RankLayout) -> ModelConfig:
    """The config of this rank's shard (local layer count, local heads, local MLP width)."""
    layout.check_model(cfg)
    ls, le = layout.layer_range(cfg.num_hidden_layers)
    _, kv = layout.head_range(cfg.num_key_value_heads)
    return dataclasses.replace(
        cfg, num_hidden_layers=le - ls, num_attention_heads=cfg.num_attention_heads // layout.tp_size,
        num_key_value_heads=kv, intermediate_size=cfg.intermediate_size // layout.tp_size)


class _RowParallelLinear(nn.Linear):
    """A linear layer over this rank's input slice; the all-reduce sums the slices' outputs."""

    comm: RankComm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


class RankModel(nn.Module):
    """The interface :class:`worker.runner.ModelRunner` expects of a model (``config``, ``device``,
    ``dtype``, ``rotary``, ``move``, ``forward``, ``compute_logits``) over one rank's shard.

    ``config`` is the shard config; ``full_config`` the whole model's. Invariant: every rank of the
    worker calls ``forward`` then ``compute_logits`` once per step with the same chunks, in the same
    order — the collectives inside pair up only then."""

    def __init__(self, full_cfg: ModelConfig, layout: RankLayout, comm: RankComm | None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        cfg = shard_config(full_cfg, layout)
        self.full_config = full_cfg
        self.config = cfg
        self.layout = layout
        self.comm = comm
        self.layer_start, self.layer_end = layout.layer_range(full_cfg.num_hidden_layers)
        first, last = layout.is_first_stage, layout.is_last_stage
        self._computes_logits = layout.rank == layout.logits_rank
        device = torch.device(device)
        with torch.device("meta"):
            need_embed = first or (last and cfg.tie_word_embeddings and self._computes_logits)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if need_embed else None
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype) if self._computes_logits else None
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype) if (
                self._computes_logits and not cfg.tie_word_embeddings) else None
            if layout.tp_size > 1:
                for layer in self.layers:
                    a, m = layer.self_attn, layer.mlp
                    a.o_proj = self._row_parallel(a.o_proj, dtype)
                    m.down_proj = self._row_parallel(m.down_proj, dtype)
        self.to_empty(device=device)
        self.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg, device)
        self._dtype = dtype

    def _row_parallel(self, lin: nn.Linear, dtype: torch.dtype) -> _RowParallelLinear:
        out = _RowParallelLinear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=dtype)
        out.comm = self.comm
        return out

    # ------------------------------------------------------------------ runner interface
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def move(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "RankModel":
        self.to(device=device, dtype=dtype or self.dtype)
        self._dtype = dtype or self._dtype
        self.rotary = RotaryEmbedding(self.config, device)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_cache: torch.Tensor,
                seq_lens: torch.Tensor | None = None, max_position: int | None = None,
                max_seq_len: int | None = None) -> torch.Tensor:
        """This stage's output hidden states ``[num_tokens, hidden]`` (sent on to the next stage)."""
        lay = self.layout
        cos, sin = self.rotary.cos_sin_signed(positions, self.dtype, seq_lens, max_position, max_seq_len)
        if lay.is_first_stage:
            h = self.embed_tokens(input_ids)
        else:
            h = torch.empty(input_ids.shape[0], self.config.hidden_size, dtype=self.dtype,
                            device=input_ids.device)
            self.comm.recv(h, lay.prev_rank)
        for layer in self.layers:
            h = layer(h, cos, sin, meta, kv_cache)
        if not lay.is_last_stage:
            self.comm.send(h, lay.next_rank)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` on rank 0 (and on the last stage's TP rank 0); an unspecified
        placeholder of that shape on every other rank, whose caller ignores it."""
        lay = self.layout
        rows = hidden.shape[0]
        if self._computes_logits:
            logits = F.linear(self.norm(hidden), self.output_weight)
            if lay.rank != 0:
                self.comm.send(logits, 0, tag=1)
            return logits
        out = torch.empty(rows, self.config.vocab_size, dtype=self.dtype, device=hidden.device)
        if lay.rank == 0:
            self.comm.recv(out, lay.logits_rank, tag=1)
        return out


# ---------------------------------------------------------------------------------- weights
class _OneParameter:
    """Duck-typed stand-in for a model holding one parameter, so the preset initialiser (which
    derives every value from the parameter's *name* and full shape) fills exactly that tensor."""

    def __init__(self, cfg: ModelConfig, name: str, tensor: torch.Tensor) -> None:
        self.config = cfg
        self._item = (name, tensor)

    def named_parameters(self):
        return iter([self._item])


def full_parameters(model: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
                    ) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """A function ``(global parameter name, full shape) -> full tensor`` for a preset or a
    Hugging Face directory. Presets materialise one parameter at a time on ``device``."""
    from worker.presets import init_random_weights, is_preset

    if is_preset(model) and not Path(model).is_dir():
        def preset_param(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = torch.empty(shape, dtype=dtype, device=device)
            init_random_weights(_OneParameter(cfg, name, t), seed=0, namespace=model)
            return t
        return preset_param

    from worker.loader import load_model

    # The whole checkpoint on the CPU once; each rank keeps only its slices.
    full, _tok, _cfg = load_model(model, device="cpu", dtype=dtype)
    params = dict(full.named_parameters())

    def hf_param(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = params[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"parameter {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t
    return hf_param


def _full_shape(cfg: ModelConfig, local: str) -> tuple[int, ...]:
    H, kv, d, hid, inter = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            cfg.hidden_size, cfg.intermediate_size)
    leaf = local.rsplit(".", 2)[-2:]
    mod, kind = leaf[0], leaf[1]
    if local in ("embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, hid)
    if mod in ("norm", "input_layernorm", "post_attention_layernorm"):
        return (hid,)
    rows = {"qkv_proj": (H + 2 * kv) * d, "o_proj": hid, "gate_up_proj": 2 * inter, "down_proj": hid}[mod]
    cols = {"qkv_proj": hid, "o_proj": H * d, "gate_up_proj": hid, "down_proj": inter}[mod]
    return (rows,) if kind == "bias" else (rows, cols)


def _slice(cfg: ModelConfig, layout: RankLayout, local: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full parameter behind local parameter name ``local``."""
    tp, t = layout.tp_size, layout.tp_rank
    mod, kind = local.rsplit(".", 2)[-2:]
    H, d, inter = cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size
    if mod == "qkv_proj":
        kv = cfg.num_key_value_heads
        hq = H // tp
        hs, nh = layout.head_range(kv)
        q = full[t * hq * d:(t + 1) * hq * d]
        k = full[(H + hs) * d:(H + hs + nh) * d]
        v = full[(H + kv + hs) * d:(H + kv + hs + nh) * d]
        return torch.cat([q, k, v], dim=0)
    if mod == "gate_up_proj":
        w = inter // tp
        return torch.cat([full[t * w:(t + 1) * w], full[inter + t * w:inter + (t + 1) * w]], dim=0)
    if mod in ("o_proj", "down_proj"):
        if kind == "bias":  # added once after the all-reduce: TP rank 0 holds it
            return full if t == 0 else torch.zeros_like(full)
        w = full.shape[1] // tp
        return full[:, t * w:(t + 1) * w]
    return full


@torch.no_grad()
def build_rank_model(model: str, full_cfg: ModelConfig, layout: RankLayout, comm: RankComm | None,
                     device: torch.device, dtype: torch.dtype) -> RankModel:
    """This rank's shard with its weights loaded (``model`` is a preset name or an HF directory)."""
    m = RankModel(full_cfg, layout, comm, device=device, dtype=dtype)
    source = full_parameters(model, full_cfg, device, dtype)
    for local, p in m.named_parameters():
        glob = local
        if local.startswith("layers."):
            _, idx, rest = local.split(".", 2)
            glob = f"layers.{m.layer_start + int(idx)}.{rest}"
        full = source(glob, _full_shape(full_cfg, local))
        part = _slice(full_cfg, layout, local, full)
        if tuple(part.shape) != tuple(p.shape):
            raise ValueError(f"rank {layout.rank}: shard of {glob} has shape {tuple(part.shape)}, "
                             f"the rank model expects {tuple(p.shape)}")
        p.copy_(part.to(device=p.device, dtype=p.dtype))
        del full, part
    return m.eval()


def iter_rank_parameters(m: RankModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, tensor) of the shard's parameters (diagnostics and tests)."""
    for local, p in m.named_parameters():
        if local.startswith("layers."):
            _, idx, rest = local.split(".", 2)
            yield f"layers.{m.layer_start + int(idx)}.{rest}", p
        else:
            yield local, p
