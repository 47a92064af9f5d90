"""Suite-wide switches. Area fixtures live in tests/<area>/conftest.py.

- `slow`: long cases, run only with SPLITSERVE_SLOW=1 (CI has 2 cores and a 20-minute budget).
- `gpu`: needs CUDA; skipped when torch sees no device.
- `nixl`: needs the nixl package; skipped when it cannot be imported.
- SPLITSERVE_TRITON_INTERPRET=1 runs Triton kernels under Triton's CPU interpreter.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

if os.environ.get("SPLITSERVE_TRITON_INTERPRET") == "1":
    # Triton's interpreter must be on before anything imports triton (torch does, early): the
    # paged-attention kernels then run on the CPU (tests/worker_model/test_paged_attention.py).
    os.environ["TRITON_INTERPRET"] = "1"


def _has_cuda() -> bool:
    try:
        import torch
    except Exception:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("SPLITSERVE_SLOW") == "1"
    have_nixl = importlib.util.find_spec("nixl") is not None
    cuda = None
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow case; set SPLITSERVE_SLOW=1 to run it"))
        if "nixl" in item.keywords and not have_nixl:
            item.add_marker(pytest.mark.skip(reason="nixl is not installed on this machine"))
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = _has_cuda()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="no CUDA device on this machine"))
