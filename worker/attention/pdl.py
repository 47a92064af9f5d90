"""Programmatic dependent launch (PDL) for the triton backend's kernels (Hopper and later).

A batch-1 decode step of ``1b`` is ~130 kernels of 1–20 µs in one CUDA graph. Launched with
``launch_pdl=True`` (CUDA's programmatic-stream-serialization attribute; a captured graph keeps it as a
programmatic edge), a kernel may start as soon as every program of the previous one has *exited*,
before that grid's completion is flushed, which hides part of each launch. Every kernel here therefore
starts with ``gdc_wait`` (``griddepcontrol.wait``: returns once the previous grid has completed and
its writes are visible) before it reads or writes anything; since every kernel waits for its
predecessor, a kernel that passed its wait knows all earlier kernels have finished, which the caching
allocator's buffer reuse needs.

Measured on the H200 (bench/RESULTS.md, "decode kernels (issue 17, fourth pass)", ``1b`` batch 1 / 32
at 1k context, one process): without PDL 1.092 / 1.543 ms per step; with this 1.070 / 1.529 ms. Two
further uses of PDL were slower and are not used: triggering the next launch right after the wait
(``gdc_launch_dependents``, so the next kernel's programs sit resident beside the running one) 1.205 /
1.689 ms, and in addition prefetching the next linear layer's weights into L2 before its wait
(``prefetch.global.L2``) 1.392 / 1.827 ms.

``SPLITSERVE_PDL=0`` turns it off. Off on the CPU interpreter (no inline PTX there) and below compute
capability 9.0, where the instruction does not exist.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["enabled", "launch_kwargs", "gdc_wait"]

_CACHE: dict[str, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL (read per launch: tests toggle the variable)."""
    if os.environ.get("SPLITSERVE_PDL", "1") == "0" or device.type != "cuda":
        return False
    key = str(device)
    if key not in _CACHE:
        from worker.attention import interpreting
        _CACHE[key] = (not interpreting() and torch.cuda.get_device_capability(device) >= (9, 0)
                       and hasattr(tl.extra.cuda, "gdc_wait"))
    return _CACHE[key]


def launch_kwargs(device: torch.device) -> dict:
    """``PDL`` constexpr and launch option for one kernel launch on ``device``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def gdc_wait(PDL: tl.constexpr):
    """Wait for the previous kernel's completion (module docstring); nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
