"""Leg adapters: what each engine family expects on the two legs of a disaggregated request.

One module per protocol, each a set of pure functions (bodies in, bodies out; fleet/flow.py and
fleet/pd_flow.py are the imperative shells that send them), and `plan` for what every protocol shares
(the answering leg's body, the modes, the fallback rule, the route header):

- `trtllm` — TensorRT-LLM's `disaggregated_params` (and our own worker's): context leg first, the
  generation leg carries the context answer's params (sent by fleet/flow.py);
- `vllm` — vLLM's `kv_transfer_params` (NIXL connector): prefill first with `max_tokens: 1`, the
  decode leg carries the `kv_transfer_params` the prefill answer returned;
- `sglang` — SGLang's bootstrap rendezvous: both legs at once with `bootstrap_host`,
  `bootstrap_port`, `bootstrap_room`; the decode answer is relayed.

The common interface: every module has `ABORT_PATH` and `abort_body(request_id)` (None when the engine has no abort endpoint and
closing the connection is the only cancellation), `SEQUENTIAL` (the decode leg waits for the prefill
answer) and `ALLOWS_LOCAL_PREFILL` (whether a decode server can serve a request with no prefill leg, which
conditional disaggregation needs). `engine_protocol_of` picks the engine protocol of one server.
"""
from __future__ import annotations

from types import ModuleType

from . import sglang, trtllm, vllm

ENGINE_PROTOCOLS = ("trtllm", "vllm", "sglang")
# Leg fields only the fleet sets: a client body carrying one is refused (validate.py), so no client
# can forge a KV handle, join another request's bootstrap room or name an engine request id.
INTERNAL_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")
DEFAULT = "trtllm"
_MODULES: dict[str, ModuleType] = {"trtllm": trtllm, "vllm": vllm, "sglang": sglang}


def module(engine_protocol: str) -> ModuleType:
    try:
        return _MODULES[engine_protocol]
    except KeyError:
        raise ValueError(f"protocol must be one of {list(ENGINE_PROTOCOLS)}, found {engine_protocol!r}") from None


def infer(info: dict | None) -> str | None:
    """The protocol a server's `/server_info` says it speaks, or None when it does not say.

    - our worker states `disagg_protocol` (worker/server.py);
    - SGLang's `/server_info` is its resolved server args, which always hold `disaggregation_mode`
      and `disaggregation_bootstrap_port` (sglang 0.5.23, sglang/srt/arg_groups/fields/disagg.py and
      sglang/srt/utils/common.py `build_server_info`);
    - vLLM serves `/server_info` only in dev mode (`VLLM_SERVER_DEV_MODE=1`), as `{"vllm_config": ...}`;
    - an `engine` key naming one of the protocols (e.g. a TensorRT-LLM-compatible server).
    """
    if not isinstance(info, dict) or not info:
        return None
    p = info.get("disagg_protocol")
    if p in _MODULES:
        return p
    if "disaggregation_mode" in info or "disaggregation_bootstrap_port" in info:
        return "sglang"
    if "vllm_config" in info:
        return "vllm"
    e = info.get("engine")
    if isinstance(e, str) and e.lower() in _MODULES:
        return e.lower()
    return None


def engine_protocol_of(configured: str | None, info: dict | None) -> str:
    """A server's protocol: its group's `protocol` when configured, else what its `/server_info`
    says, else TensorRT-LLM's."""
    if configured is not None:
        return configured
    return infer(info) or DEFAULT
