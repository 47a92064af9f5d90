"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and later).

A batch-1 decode step of ``1b`` is ~150 kernels of 1–20 µs in one CUDA graph; between two of them the
GPU drains the first, then ramps the second up, which left ~70 µs of gaps per step and kept the narrow
weight matrices (qkv, o_proj: ≤ 0.8 MB a layer) at ~2 TB/s (bench/RESULTS.md, "decode kernels
(issue 17, third pass)"). With PDL a kernel is launched while its predecessor still runs
(``launch_pdl=True`` sets CUDA's programmatic-stream-serialization attribute; a captured graph keeps it
as a programmatic edge):

- every kernel here starts with ``gdc_wait`` (``griddepcontrol.wait``: returns once the previous grid
  has completed and its writes are visible) before it reads or writes any activation, then calls
  ``gdc_launch_dependents`` so the *next* kernel may be scheduled beside it. Triggering only after the
  wait keeps at most two kernels resident, and since every kernel waits for its predecessor, a kernel
  that has started its work knows that all earlier kernels have finished (what the caching
  allocator's buffer reuse needs);
- what does not depend on the previous kernel — the weight matrices of the small-M linears
  (worker/attention/triton_linear.py) — is prefetched into L2 *before* the wait, so a matrix streams
  from HBM while the norm or attention kernel before it still runs.

``SPLITSERVE_PDL=0`` turns it off (benchmarks compare both). Off on the CPU interpreter (no inline
PTX there) and below compute capability 9.0, where the instructions do not exist.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["enabled", "launch_kwargs", "gdc_enter", "prefetch_l2"]

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


#: Experiment switches (bench only): prefetch weights before the wait; trigger the next launch right
#: after the wait (else at exit); the kernels (by launcher name) that use PDL, ``None`` = all.
PREFETCH = True
TRIGGER = True
KERNELS: set[str] | None = None


def launch_kwargs(device: torch.device, kernel: str = "") -> dict:
    """``PDL`` constexprs and launch option for one kernel launch on ``device``."""
    if enabled(device) and (KERNELS is None or kernel in KERNELS):
        return {"PDL": True, "TRIGGER": TRIGGER, "launch_pdl": True}
    return {"PDL": False, "TRIGGER": False}


@triton.jit
def gdc_enter(PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch (module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """``prefetch.global.L2`` of every address in ``ptrs`` (a hint: no data comes back)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
