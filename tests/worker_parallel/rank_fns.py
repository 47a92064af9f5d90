"""Functions the tests run on every rank through ``RankGroup.call_all`` (allowed by
``SPLITSERVE_RANK_CALLABLE_PACKAGES=tests.worker_parallel.``, which the fixtures set)."""
from __future__ import annotations

import os


def whoami(ctx):
    ls, le = ctx.layout.layer_range(ctx.model_config.num_hidden_layers)
    return {"rank": ctx.rank, "pid": os.getpid(), "layers": [ls, le]}


def echo(ctx, value):
    return value


def fail_on(ctx, rank):
    from transfer.errors import SessionError

    if ctx.rank == rank:
        raise SessionError(f"only on rank {rank}")
    return ctx.rank


def boom(ctx):
    return 1 // 0
