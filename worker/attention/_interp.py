"""Fix-up of Triton's CPU interpreter, applied once on import by every kernel module (triton_ops,
triton_linear) when ``TRITON_INTERPRET=1``; does nothing otherwise."""
from __future__ import annotations

import os

import numpy as np


def _interpreter_compat() -> None:
    """Triton 3.6's CPU interpreter turns loop bounds into ints with ``int(array)``, which numpy ≥ 2.4
    refuses for the shape-(1,) arrays it uses for scalars; ``.item()`` reads the same value."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_compat()
