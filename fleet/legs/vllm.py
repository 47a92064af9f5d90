"""vLLM's prefill/decode legs over its KV connector (`kv_transfer_params`), as vLLM's own proxy sends
them: tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (`send_request_to_service`,
`_handle_completions`, vllm-project/vllm main) and vllm-router 0.1.17 in `--vllm-pd-disaggregation`
mode (captured in tests/fleet/peers/fixtures/vllm-router-0.1.17.json).

- prefill: the client's body with `kv_transfer_params = {do_remote_decode: true, do_remote_prefill:
  false, remote_engine_id/remote_block_ids/remote_host/remote_port: null}`, `stream: false`,
  `max_tokens: 1` (and `max_completion_tokens: 1` when given), no `stream_options`, no
  `min_tokens`/`min_completion_tokens` (not supported on P);
- decode: the client's body plus the top-level `kv_transfer_params` of the prefill answer, verbatim:
  NIXL's scheduler fills it in `request_finished` (vllm 0.33.0,
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py: do_remote_prefill,
  remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port, tp_size, ...) and
  the decode's scheduler reads them back (nixl/base_scheduler.py: remote_engine_id,
  remote_request_id, remote_host, remote_port, tp_size must all be set);
- both legs carry the same `X-Request-Id`.

Cancellation: vLLM's OpenAI server has no abort endpoint outside `--tokens-only` mode
(vllm/entrypoints/scale_out/token_in_token_out/api_router.py registers `/abort_requests` only
there); a closed connection aborts the request (the serving layer's disconnect check). A finished
prefill's blocks wait for the decode's read and are freed at `kv_lease_duration` (30 s by default,
nixl/base_scheduler.py) when no decode comes.
"""
from __future__ import annotations

from . import plan

NAME = "vllm"
SEQUENTIAL = True
ALLOWS_LOCAL_PREFILL = True       # a decode request without kv_transfer_params is served locally
ABORT_PATH = None          # connection close only

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
# What the decode side requires of the prefill answer's params (nixl/base_scheduler.py).
REQUIRED_DECODE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                        "remote_block_ids")


def abort_body(request_id: int) -> dict | None:
    return None


def prefill_body(body: dict) -> dict:
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    return out


class BadPrefillAnswer(ValueError):
    """The prefill answer cannot start a decode leg (`str(e)` says what was expected)."""


def decode_params(answer: dict) -> dict | None:
    """The `kv_transfer_params` the decode leg must carry, from the prefill's JSON answer.

    None when the prefill server returned none (no KV connector on it): the decode leg then runs
    the whole request itself, as vLLM's proxy does. A params object that announces a remote prefill
    but lacks what the decode side needs is an error, not a silent local prefill."""
    if not isinstance(answer, dict):
        raise BadPrefillAnswer(f"expected a JSON object, found {type(answer).__name__}")
    kv = answer.get("kv_transfer_params")
    if kv is None:
        return None
    if not isinstance(kv, dict):
        raise BadPrefillAnswer(f"expected kv_transfer_params to be an object, found {type(kv).__name__}")
    if kv.get("do_remote_prefill"):
        missing = [k for k in REQUIRED_DECODE_KEYS if kv.get(k) is None]
        if missing:
            raise BadPrefillAnswer(f"kv_transfer_params announces a remote prefill but lacks {missing}")
    return kv


def decode_body(body: dict, kv: dict | None) -> dict:
    out = dict(body)
    if kv is not None:
        out["kv_transfer_params"] = kv
    return out


def mode_of(kv: dict | None) -> str:
    """The request's mode once the prefill answered: disaggregated when its params announce a remote
    prefill (the decode reads the KV), else no_kv_transfer (no KV connector on that prefill server:
    the decode server computes the prompt itself)."""
    return plan.DISAGGREGATED if kv is not None and kv.get("do_remote_prefill") else plan.NO_KV_TRANSFER
