"""Attention backends of the torch worker.

``torch``: today's path (worker/model.py): decode rows gather their blocks into a dense tensor per
:class:`~worker.model.DecodeGroup` and run SDPA; a chunk with a cached prefix gathers its blocks.

``triton``: kernels in :mod:`worker.attention.triton_ops` read K/V in place from the block pool
through each row's block table (flash-decoding with split-K for decode, a paged flash-attention
for chunks after a prefix), plus one fused RoPE + KV-store kernel per layer on decode steps. Every
launch's metadata has a fixed size per CUDA-graph key (:mod:`worker.attention.plan`), so captured
decode graphs keep working.

``auto`` picks ``triton`` on CUDA when Triton imports, ``torch`` otherwise. Triton is imported only
when the triton backend is used: CPU installs never need it. On the CPU the triton backend runs only
under Triton's interpreter (``TRITON_INTERPRET=1``, or ``SPLITSERVE_TRITON_INTERPRET=1`` which sets
it), which is how the kernels are tested without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

__all__ = ["BACKENDS", "AttentionBackendError", "resolve_backend", "triton_available", "interpreting"]

BACKENDS = ("auto", "triton", "torch")


class AttentionBackendError(ValueError):
    """An attention backend that cannot run here (unknown name, no Triton, no CUDA device)."""


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter in this process.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, and Triton's own library
    functions are defined when triton is imported (torch imports it early, e.g. with torch._dynamo):
    ``SPLITSERVE_TRITON_INTERPRET=1`` can only stand in for it before that import."""
    if os.environ.get("SPLITSERVE_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise AttentionBackendError(
                "SPLITSERVE_TRITON_INTERPRET=1 took effect after triton was imported; set TRITON_INTERPRET=1 "
                "when the process starts")
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str | None, device: torch.device | str) -> str:
    """``auto``/``triton``/``torch`` → the backend that runs on ``device`` (``triton`` or ``torch``)."""
    name = name or "auto"
    if name not in BACKENDS:
        raise AttentionBackendError(f"attention backend must be one of {BACKENDS}, found {name!r}")
    dev = torch.device(device)
    if name == "torch":
        return "torch"
    usable = triton_available() and (dev.type == "cuda" or (dev.type == "cpu" and interpreting()))
    if name == "auto":
        return "triton" if usable and dev.type == "cuda" else "torch"
    if not triton_available():
        raise AttentionBackendError("attention backend 'triton' needs the triton package, which is not installed")
    if not usable:
        raise AttentionBackendError(
            f"attention backend 'triton' needs a CUDA device (found {dev.type}); on the CPU it runs only "
            f"under Triton's interpreter (SPLITSERVE_TRITON_INTERPRET=1)")
    return "triton"
