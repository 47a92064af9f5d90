"""The worker side of the vLLM and SGLang engine protocols (fleet/legs/), for the sim engine.

A worker started with ``--disagg-protocol vllm|sglang`` reads that engine's leg fields and maps them
onto the engine's own context_only / generation_only requests, so the fleet's two-leg flows for those
protocols run end to end on real processes (placement, cancellation, leak checks). What each engine
does is taken from its source:

vLLM (vllm 0.33.0, NIXL connector, vllm/distributed/kv_transfer/kv_connector/v1/nixl/):
- a request with ``kv_transfer_params.do_remote_decode`` is a prefill: it runs the prompt, keeps its
  blocks for the decode's read (pull_scheduler.py ``request_finished``: delay_free_blocks) and answers
  with top-level ``kv_transfer_params`` = {do_remote_prefill: true, do_remote_decode: false,
  remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port, tp_size, ...};
- a request with ``kv_transfer_params.do_remote_prefill`` is a decode: it loads the prompt's KV from
  (remote_host, remote_port) and samples every output token itself (the prefill's token is not
  reused); here the "load" is the sim receiver's wait plus a release call to the prefill worker;
- blocks never read are freed after the lease (``kv_lease_duration``; here ``--pin-timeout``);
  there is no abort endpoint: a closed connection aborts the request.

SGLang (sglang 0.5.23, sglang/srt/disaggregation/):
- prefill and decode both get ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``; the prefill
  server runs a bootstrap server on ``--disaggregation-bootstrap-port`` where the decode side meets it
  by room; here the prefill worker listens on ``--bootstrap-port`` for ``/kv_wait`` (the decode waits
  until the room's prefill is done) and ``/kv_release`` (transfer done, free the blocks);
- ``POST /abort_request {"rid": ...}`` aborts by the request's ``rid`` (http_server.py).

The sim receiver moves no bytes (worker/sim.py); the rest — scheduler, pins, aborts, KV events — is
the engine's real code.
"""
from __future__ import annotations

from typing import Any

from protocol.disagg import OpaqueState, encode_opaque_state
from worker.requests import CONTEXT_ONLY, GENERATION_ONLY, InvalidRequest

ENGINE_PROTOCOLS = ("trtllm", "vllm", "sglang")
SGLANG_MODES = {"context": "prefill", "generation": "decode", "both": "null"}


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def incoming(engine_protocol: str, role: str, body: dict, local_id: int) -> tuple[dict, dict | None]:
    """(body with ``disaggregated_params`` set, leg state or None) for one request.

    ``local_id`` is the worker-minted id a prefill's pin is kept under (vLLM's engine request id)."""
    if engine_protocol == "vllm":
        return _vllm_in(body, local_id)
    if engine_protocol == "sglang":
        return _sglang_in(role, body)
    return body, None


def _vllm_in(body: dict, local_id: int) -> tuple[dict, dict | None]:
    kv = body.get("kv_transfer_params")
    if kv is None:
        return body, None
    if not isinstance(kv, dict):
        raise InvalidRequest(f"'kv_transfer_params' must be an object, got {_tname(kv)}",
                             param="kv_transfer_params")
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv.get("do_remote_decode"):
        out["disaggregated_params"] = {"request_type": CONTEXT_ONLY, "disagg_request_id": local_id}
        return out, {"kind": "vllm_prefill"}
    if kv.get("do_remote_prefill"):
        # vLLM's decode side needs all of these (nixl/base_scheduler.py).
        for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids"):
            if kv.get(k) is None:
                raise InvalidRequest(f"'kv_transfer_params.{k}' is required with do_remote_prefill",
                                     param=f"kv_transfer_params.{k}")
        try:
            cid = int(kv["remote_request_id"])
        except (TypeError, ValueError):
            raise InvalidRequest("'kv_transfer_params.remote_request_id' must name a request of a "
                                 f"splitserve sim prefill worker, got {kv['remote_request_id']!r}",
                                 param="kv_transfer_params.remote_request_id") from None
        port = kv["remote_port"]
        if type(port) is not int or not 0 < port < 65536:
            raise InvalidRequest(f"'kv_transfer_params.remote_port' must be a port number, got {port!r}",
                                 param="kv_transfer_params.remote_port")
        url = f"http://{_host(kv['remote_host'])}:{port}"
        out["disaggregated_params"] = {"request_type": GENERATION_ONLY, "ctx_request_id": cid,
                                       "encoded_opaque_state": encode_opaque_state(OpaqueState(worker_url=url))}
        return out, {"kind": "vllm_decode"}
    return out, None


def _host(h: Any) -> str:
    if not isinstance(h, str) or not h or "/" in h or "@" in h:
        raise InvalidRequest(f"expected a host name or address, got {h!r}", param="kv_transfer_params.remote_host")
    return f"[{h}]" if ":" in h else h


def _sglang_in(role: str, body: dict) -> tuple[dict, dict | None]:
    room = body.get("bootstrap_room")
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) and rid):
        raise InvalidRequest(f"'rid' must be a non-empty string, got {_tname(rid)}", param="rid")
    out = {k: v for k, v in body.items() if k not in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")}
    if room is None:
        return out, ({"kind": "sglang", "rid": rid} if rid else None)
    if type(room) is not int or not 0 <= room < 1 << 63:
        raise InvalidRequest(f"'bootstrap_room' must be an integer in [0, 2**63), got {room!r}",
                             param="bootstrap_room")
    if role == "context":
        out["disaggregated_params"] = {"request_type": CONTEXT_ONLY, "disagg_request_id": room}
        return out, {"kind": "sglang_prefill", "rid": rid, "room": room}
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if not isinstance(host, str) or not host:
        raise InvalidRequest(f"'bootstrap_host' must be the prefill server's host, got {host!r}",
                             param="bootstrap_host")
    if type(port) is not int or not 0 < port < 65536:
        raise InvalidRequest(f"'bootstrap_port' must be a port number, got {port!r}", param="bootstrap_port")
    if "/" in host or "@" in host:
        raise InvalidRequest(f"'bootstrap_host' must be a host name or address, got {host!r}",
                             param="bootstrap_host")
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    out["disaggregated_params"] = {"request_type": GENERATION_ONLY, "ctx_request_id": room,
                                   "encoded_opaque_state": encode_opaque_state(
                                       OpaqueState(worker_url=url, wait=True))}
    return out, {"kind": "sglang_decode", "rid": rid, "room": room}


def vllm_prefill_params(ctx, *, engine_id: str, host: str, port: int) -> dict:
    """The prefill answer's ``kv_transfer_params``, the field set of NIXL's ``request_finished``."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(ctx.block_ids)],
            "remote_engine_id": engine_id, "remote_request_id": str(ctx.ctx_request_id),
            "remote_host": host, "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": len(ctx.prompt_token_ids), "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0, "transfer_mode": "pull"}


def outgoing(body: dict, state: dict | None, ctx, *, engine_id: str, host: str, port: int) -> dict:
    """A JSON answer in the engine's shape: our disaggregated_params out, the engine's fields in."""
    if state is None:
        return body
    body.pop("prompt_token_ids", None)
    for c in body.get("choices") or ():
        c.pop("disaggregated_params", None)
    if state["kind"] == "vllm_prefill" and ctx is not None and ctx.pinned:
        body["kv_transfer_params"] = vllm_prefill_params(ctx, engine_id=engine_id, host=host, port=port)
    elif state["kind"] == "vllm_prefill":
        body["kv_transfer_params"] = None
    return body
