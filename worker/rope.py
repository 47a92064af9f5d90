"""Rotary position embeddings of the Llama family (worker/model.py): the cos/sin tables of plain
RoPE and the linear / dynamic-NTK / llama3 / YaRN scalings, identical in value to transformers', and
the "rotate half" application to q and k."""

from __future__ import annotations

import math

import torch

from worker.model_config import ModelConfig, ModelConfigError

__all__ = ["RotaryEmbedding", "apply_rope"]


class RotaryEmbedding:
    """cos/sin tables for rotary embeddings, identical in value to transformers' implementation.

    Static types cache ``cos``/``sin`` in fp32 for positions ``[0, cached_len)`` and grow the table by
    doubling; the entries are computed exactly as transformers does (``float(position) * inv_freq``), so
    caching changes no bit. ``dynamic`` (NTK) recomputes ``inv_freq`` from the sequence's length once it
    exceeds ``max_position_embeddings``: like transformers generating one sequence, keys cached earlier
    keep the rotation they were written with.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dim = cfg.head_dim
        scaling = cfg.rope_scaling or {"rope_type": "default"}
        self.rope_type = scaling["rope_type"]
        self.scaling = scaling
        self.inv_freq, self.attention_factor = self._inv_freq(None)
        self._cos = torch.empty(0, self.dim, device=self.device)
        self._sin = torch.empty(0, self.dim, device=self.device)
        #: ``dtype -> [cached_len, 2, head_dim]``: cos and sign-folded sin (see :meth:`cos_sin_signed`)
        #: cast from the current fp32 tables; rebuilt when those grow.
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._typed_src: torch.Tensor | None = None

    def _base_inv_freq(self, base: float) -> torch.Tensor:
        exps = torch.arange(0, self.dim, 2, dtype=torch.int64).to(dtype=torch.float) / self.dim
        return 1.0 / (base ** exps)

    def _inv_freq(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        cfg, s, base = self.cfg, self.scaling, self.cfg.rope_theta
        t = self.rope_type
        if t == "default":
            inv, factor = self._base_inv_freq(base), 1.0
        elif t == "linear":
            inv, factor = self._base_inv_freq(base) / s["factor"], 1.0
        elif t == "dynamic":
            max_pos = cfg.max_position_embeddings
            seq_len = max(seq_len or max_pos, max_pos)
            f = s["factor"]
            base = base * ((f * seq_len / max_pos) - (f - 1)) ** (self.dim / (self.dim - 2))
            inv, factor = self._base_inv_freq(base), 1.0
        elif t == "llama3":
            inv = self._base_inv_freq(base)
            f, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old = s["original_max_position_embeddings"]
            low_wl, high_wl = old / lo, old / hi
            wavelen = 2 * math.pi / inv
            inv_l = torch.where(wavelen > low_wl, inv / f, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * inv_l / f + smooth * inv_l
            medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
            inv, factor = torch.where(medium, smoothed, inv_l), 1.0
        elif t == "yarn":
            inv, factor = self._yarn(base)
        else:  # guarded by ModelConfig validation
            raise ModelConfigError(f"unsupported rope type {t!r}")
        return inv.to(self.device), float(factor)

    def _yarn(self, base: float) -> tuple[torch.Tensor, float]:
        s, dim = self.scaling, self.dim
        orig = s["original_max_position_embeddings"]
        f = s.get("factor")
        if f is None:
            f = self.cfg.max_position_embeddings / orig

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention = s.get("attention_factor")
        if attention is None:
            ms, ms_all = s.get("mscale"), s.get("mscale_all_dim")
            attention = get_mscale(f, ms) / get_mscale(f, ms_all) if ms and ms_all else get_mscale(f)
        beta_fast = s.get("beta_fast") or 32
        beta_slow = s.get("beta_slow") or 1

        def correction_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extra = 1.0 / pos_freqs
        inter = 1.0 / (f * pos_freqs)
        extra_factor = 1 - ramp
        return inter * (1 - extra_factor) + extra * extra_factor, float(attention)

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                max_position: int | None = None, max_seq_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[n, head_dim]`` cos and sin for ``positions`` (int64 on this device).

        ``seq_lens`` (the owning sequence's length after this step, per token) only matters for
        ``dynamic`` scaling. ``max_position``/``max_seq_len`` are host-side maxima of the two tensors;
        passing them avoids a device sync (and is required inside CUDA-graph capture)."""
        if self.rope_type == "dynamic":
            max_pos = self.cfg.max_position_embeddings
            if seq_lens is not None and max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            if seq_lens is None or max_seq_len <= max_pos:
                return self._table(self.inv_freq, positions)
            cos = torch.empty(positions.shape[0], self.dim, device=self.device)
            sin = torch.empty_like(cos)
            for length in torch.unique(seq_lens).tolist():
                sel = seq_lens == length
                inv = self.inv_freq if length <= max_pos else self._inv_freq(int(length))[0]
                cos[sel], sin[sel] = self._table(inv, positions[sel])
            return cos, sin
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else -1
        self._grow(max_position + 1)
        return self._cos[positions], self._sin[positions]

    def _grow(self, need: int) -> None:
        """Static types: make the fp32 tables cover positions ``[0, need)`` (doubling)."""
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 256)
            self._cos, self._sin = self._table(self.inv_freq, torch.arange(size, device=self.device))

    def cos_sin_signed(self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None,
                       max_position: int | None = None, max_seq_len: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and :func:`_signed_sin` ``sin`` ``[n, head_dim]`` in ``dtype``, the inputs of
        :func:`apply_rope` and the triton RoPE kernel; arguments as :meth:`cos_sin`.

        Static types gather both from one cached ``[len, 2, head_dim]`` table already cast and
        sign-folded: one kernel per step instead of six (two gathers, two casts, a negation and a
        concatenation: at batch 1 a CUDA-graph decode step is bound by its launches). Casting, negating and
        gathering commute exactly, so the values are bit for bit those of the unfused sequence. The two
        results are strided views of the gathered ``[n, 2, head_dim]`` tensor, with equal strides."""
        if self.rope_type == "dynamic":
            cos, sin = self.cos_sin(positions, seq_lens, max_position, max_seq_len)
            return cos.to(dtype), _signed_sin(sin.to(dtype))
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else -1
        self._grow(max_position + 1)
        both = self.typed_table(dtype)[positions]
        return both[..., 0, :], both[..., 1, :]

    def typed_table(self, dtype: torch.dtype) -> torch.Tensor:
        """The cached ``[cached_len, 2, head_dim]`` table of :meth:`cos_sin_signed` (static types)."""
        if self._typed_src is not self._cos:
            self._typed, self._typed_src = {}, self._cos
        tab = self._typed.get(dtype)
        if tab is None:
            tab = torch.stack((self._cos.to(dtype), _signed_sin(self._sin.to(dtype))), dim=1)
            self._typed[dtype] = tab
        return tab

    def graph_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every cached table a captured CUDA graph may read (kept alive with the graph)."""
        return (self._cos, self._sin, *self._typed.values())

    def ensure(self, length: int) -> None:
        """Pre-build the static table up to ``length`` positions (keeps CUDA-graph replays allocation-free)."""
        if self.rope_type != "dynamic" and length > self._cos.shape[0]:
            self._cos, self._sin = self._table(self.inv_freq, torch.arange(length, device=self.device))


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: folds rotate-half's negation into the table, once per step."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF "rotate half" RoPE, ``x*cos + rotate_half(x)*sin``, in three kernels for q and k together.

    x: [n, heads, head_dim] (may be a strided view); cos/sin_signed: [n, head_dim] in x.dtype.
    rotate_half(x)*sin == swap_halves(x)*sin_signed exactly (a sign flip is exact)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos[:, None, :], swapped, sin_signed[:, None, :])
