"""The torch engine over a multi-rank (TP × PP) worker.

``ParallelTorchEngine`` is a :class:`worker.engine.TorchEngine` — same scheduler, same sampling
on rank 0 — whose runner is a :class:`worker.parallel.rank_group.ParallelRunner`. Additions:

* ``rank_group``: the :class:`~worker.parallel.rank_group.RankGroup` (``call_all`` for the transfer layer,
  ``pids()``, ``rank_page_tables()``);
* ``rank_page_tables()``: every rank's page table, rank order (docs/worker.md, "Multi-rank internals");
* health: ``alive`` is False once any rank died; the engine then fails every request still
  running, refuses new ones (503), and calls ``on_fatal`` (the CLI uses it to drain and exit
  with ``exit_code`` = 1);
* ``stop()`` also stops the followers.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from worker.engine import TorchEngine
from worker.requests import EngineStopped

log = logging.getLogger("splitserve.worker.parallel")

__all__ = ["ParallelTorchEngine", "build_parallel_engine", "RANK_FAILURE_EXIT_CODE"]

#: Process exit status of a worker whose rank died (a clean drain exits 0).
RANK_FAILURE_EXIT_CODE = 1


class ParallelTorchEngine(TorchEngine):
    engine_name = "torch"

    def __init__(self, group, tokenizer, **kw) -> None:
        self.rank_group = group   # before the KV connector binds: it builds a transceiver per rank
        super().__init__(group.runner, tokenizer, **kw)
        self.failure: str | None = None
        self.exit_code = 0
        #: Called once, on the event loop, when a rank died (after requests were failed).
        self.on_fatal: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        group.on_failure.append(self._rank_failed)

    @property
    def tp_size(self) -> int:
        return self.rank_group.layout.tp_size

    @property
    def pp_size(self) -> int:
        return self.rank_group.layout.pp_size

    def rank_page_tables(self) -> list[dict]:
        """Every rank's page table (``runner.page_table()`` of that rank plus ``rank``,
        ``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``, ``layer_start``, ``layer_end``,
        ``head_start``, ``kv_heads``, ``total_layers``, ``total_kv_heads``,
        ``duplicate_head_factor``, ``pid``), in rank order."""
        return self.rank_group.rank_page_tables()

    @property
    def alive(self) -> bool:
        return super().alive and self.failure is None and self.rank_group.healthy

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await super().start()

    async def submit(self, req):
        if self.failure is not None:
            raise EngineStopped(f"this worker lost a rank and is shutting down: {self.failure}")
        return await super().submit(req)

    def _rank_failed(self, reason: str) -> None:
        """Watchdog thread → event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self.failure = reason
            self.exit_code = RANK_FAILURE_EXIT_CODE
            return
        try:
            loop.call_soon_threadsafe(self._fatal, reason)
        except RuntimeError:  # the loop closed in between
            self.failure = reason

    def _fatal(self, reason: str) -> None:
        if self.failure is not None and self.exit_code:
            return
        self.failure = reason
        self.exit_code = RANK_FAILURE_EXIT_CODE
        log.error("failing every request: %s", reason)
        self.scheduler.fail_requests(f"a rank of this worker died: {reason}")
        cb = self.on_fatal
        if cb is not None:
            cb()

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.rank_group.shutdown)


def build_parallel_engine(model: str, *, tp_size: int, pp_size: int, device=None, dtype=None,
                          num_blocks: int | None = None, block_size: int = 16,
                          max_batch_size: int = 64, max_num_tokens: int = 2048,
                          pin_timeout_s: float = 60.0, memory_fraction: float = 0.85,
                          cpu_kv_budget_bytes: int = 1 << 30, log_level: str = "WARNING",
                          startup_timeout_s: float = 600.0, cache_dir: str | None = None,
                          **engine_kw) -> ParallelTorchEngine:
    """Launch the ranks of ``model`` (preset, HF directory, or a GGUF source converted into
    ``cache_dir`` first) and wrap them in an engine.

    Without ``num_blocks`` the pool is sized from rank 0's free memory (CUDA) or a 1 GiB budget
    (CPU) over *rank 0's* bytes per block — every rank holds the same number of blocks, and rank 0
    stores at least as many layers as any other stage."""
    import json
    from pathlib import Path

    import torch

    from protocol.named_models import is_gguf_source
    from protocol.tokenizer import ByteTokenizer
    from worker.loader import load_tokenizer, resolve_device, resolve_dtype
    from worker.model_config import ModelConfig
    from worker.parallel.comm import RankLayout
    from worker.presets import is_preset, preset_config
    from worker.parallel.rank_group import RankGroup
    from worker.runner import kv_bytes_per_block
    from worker.parallel.tp_model import shard_config

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if is_gguf_source(model) and not Path(model).is_dir():
        from worker.gguf_loader import gguf_directory

        model = str(gguf_directory(model, cache_dir))  # the ranks load the converted directory
    if is_preset(model) and not Path(model).is_dir():
        cfg = preset_config(model)
        tok = ByteTokenizer(vocab_size=cfg.vocab_size)
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model {model!r} is neither a preset (tiny, 1b, 8b) nor a directory "
                             f"with a config.json")
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()), name=path.name)
        tok = load_tokenizer(path, cfg)
    layout0 = RankLayout(tp_size=tp_size, pp_size=pp_size, rank=0)
    shard0 = shard_config(cfg, layout0)
    if not num_blocks:
        per_block = kv_bytes_per_block(shard0, block_size, dt)
        if dev.type == "cuda":
            # Weights of rank 0 are not loaded yet: leave room for them (its share of the model).
            free, _ = torch.cuda.mem_get_info(dev)
            params = sum(p for p in _param_counts(cfg)) / max(1, tp_size * pp_size)
            budget = int((free - params * torch.empty(0, dtype=dt).element_size()) * memory_fraction)
        else:
            budget = cpu_kv_budget_bytes
        max_blocks = -(-cfg.max_position_embeddings // block_size) * max_batch_size
        num_blocks = max(16, min(budget // per_block, max_blocks))
    group = RankGroup.launch(model, cfg, tp_size=tp_size, pp_size=pp_size, device=dev, dtype=dt,
                             num_blocks=num_blocks, block_size=block_size, log_level=log_level,
                             startup_timeout_s=startup_timeout_s)
    try:
        eng = ParallelTorchEngine(group, tok, max_batch_size=max_batch_size,
                                  max_num_tokens=max_num_tokens, pin_timeout_s=pin_timeout_s,
                                  **engine_kw)
    except BaseException:
        group.shutdown()
        raise
    log.info("multi-rank torch engine: %s tp=%d pp=%d on %s/%s, %d KV blocks of %d tokens per rank",
             model, tp_size, pp_size, dev, str(dt).removeprefix("torch."), num_blocks, block_size)
    return eng


def _param_counts(cfg):
    """Parameter counts of the full model by part (embedding, layers, output)."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim \
        + cfg.num_attention_heads * cfg.head_dim * h
    yield cfg.vocab_size * h
    yield L * (attn + 3 * h * i + 2 * h)
    if not cfg.tie_word_embeddings:
        yield cfg.vocab_size * h
