"""TensorRT-LLM's `disaggregated_params` legs (docs/reference/trtllm_disagg.md; our worker
speaks the same). The bodies are built in fleet/flow.py (`_ctx_body`, `_gen_body`,
`_generation_first`), the flow's original protocol; this module holds what the other protocols'
modules hold for it: the abort and the scheduling facts."""
from __future__ import annotations

NAME = "trtllm"
SEQUENTIAL = True          # the generation leg needs the context answer's disaggregated_params
LOCAL_PREFILL = True       # a generation server serves a plain request aggregated
ABORT_PATH = "/v1/abort"   # worker/server.py `abort`: by X-Request-Id or disagg_request_id


def abort_body(rid: int) -> dict | None:
    return {"request_id": rid}
