"""`Transceiver`: the one surface a worker drives KV transfer through.

Implemented by `transfer.session.KvTransceiver` (one rank: its own agent, control endpoint and
pool) and by the worker's multi-rank facade `worker.parallel.rank_transfer.MultiRankTransceiver`
(every rank's `KvTransceiver` driven as one; only rank 0's endpoint is advertised). The worker's
KV connector (`worker/kv_connector_transfer.py`) takes either.

Every method is safe to call from the worker's event loop: none blocks on a transfer. The
callbacks (`on_end`, `on_done`) are called once, from a transceiver thread, when the session is
quiescent; the caller then reads the status (and must hop to its own loop itself).
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from .agent import TransferAgent
from .states import Status


@runtime_checkable
class Transceiver(Protocol):
    endpoint: str            # the control endpoint peers are given (`ctx_info_endpoint`)
    instance_id: str
    agent: TransferAgent     # rank 0's, for a multi-rank worker
    tokens_per_block: int

    def server_info(self) -> dict:
        """The `transfer` field of the worker's /server_info."""

    # -- context side
    def begin_send(self, request_id: int, num_tokens: int, block_ids,
                   on_end: Callable[[], None] | None = None) -> None: ...

    def progress_send(self, request_id: int, tokens_done: int, block_ids=None,
                      after=None) -> None:
        """`after`: a CUDA event the write of these tokens waits for (see KvTransceiver)."""

    def finish_send(self, request_id: int, meta: dict | None = None, block_ids=None,
                    after=None) -> None: ...

    def send_status(self, request_id: int) -> Status: ...

    def cancel_send(self, request_id: int) -> bool:
        """True: the pages may be freed now; False: a write is in flight (`on_end` follows)."""

    def release_send(self, request_id: int) -> None: ...

    # -- generation side
    def begin_receive(self, request_id: int, ctx_endpoint: str, num_tokens: int, block_ids,
                      on_done: Callable[[], None] | None = None) -> None: ...

    def recv_status(self, request_id: int) -> Status: ...

    def cancel_receive(self, request_id: int) -> bool:
        """True: no peer can write any more; False: a write may still land (`on_done` follows)."""

    def claim_receive(self, request_id: int, ctx_endpoint: str) -> None: ...

    def abandon_receive(self, request_id: int, ctx_endpoint: str) -> None: ...

    def release_receive(self, request_id: int) -> None: ...

    # -- shared
    def pending(self) -> dict: ...

    def shutdown(self) -> None: ...
