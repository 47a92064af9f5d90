"""The KV-connector seam: how KV crosses workers, as the engine sees it.

Modelled on vLLM's ``KVConnectorBase_V1``: one object, given to the engine at construction, whose
hooks the scheduler calls at fixed points of a request's life; the engine never learns what moves
the bytes. The engine calls ``bind(engine)`` once from its constructor, handing over the narrow
surface below (``KvEngine``) — the pins it keeps for finished context legs and the block pool — so
a connector that needs the engine's own KV memory (the transfer connector registers it) can be
built before the engine exists.

Who calls what, all on the engine's event loop thread:

* context side (``context_only`` requests):
  ``prefill_launched(req, tokens_done, block_ids, after)`` when a prefill chunk is queued on the
  device (async scheduling on CUDA: ``after`` is the CUDA event that follows its K/V writes);
  ``prefill_progress(req, tokens_done, block_ids)`` after every prefill chunk is written;
  ``context_finished(pinned) -> dict`` once prefill is done and the prompt blocks are pinned — the
  fields returned go into the response's ``encoded_opaque_state``;
  ``context_ended(req)`` when the request leaves the scheduler (finished, aborted, failed);
  ``pin_released(ctx_request_id, reason)`` whenever the engine dropped a finished request's pin
  (the connector's own ``release``, an abort, the pin-timeout sweep, shutdown).
* generation side (``generation_only`` requests):
  ``receive_expected(req)`` when one is accepted (it may wait for blocks long before its receive);
  ``await receive(spec)`` fills its freshly allocated blocks; ``receive_abandoned(req)`` when it
  ended before its receive began.
* ``close()``: by whoever built the connector, after the engine stopped.

Implementations: ``worker.kv_connector_transfer.TransferKvConnector`` (KV moves through
``transfer/``) and the sim engine's ``worker.sim.SimReceiver`` (no bytes; a callback over HTTP).
"""
from __future__ import annotations

import abc
from typing import Protocol

from worker.kv_cache import BlockPool
from worker.requests import EngineRequest, PinnedTransfer, ReceiveSpec

__all__ = ["KvConnector", "KvEngine", "KvTransferFailed"]


class KvTransferFailed(Exception):
    """The KV of a generation_only request could not be received (the request fails with it)."""


class KvEngine(Protocol):
    """What a connector may use of the engine it is bound to."""

    pool: BlockPool       # pin/unpin: a connector's own references on blocks it may still read

    def pinned_transfer(self, ctx_request_id) -> PinnedTransfer | None: ...

    def release(self, ctx_request_id, reason: str = "transferred") -> bool: ...


class KvConnector(abc.ABC):
    """Hooks default to doing nothing; ``receive`` is the one a connector must provide (an engine
    without a connector refuses ``generation_only`` requests with HTTP 501)."""

    engine: KvEngine | None = None

    def bind(self, engine: KvEngine) -> None:
        """Called once, by the constructor of the engine this connector was given to."""
        if self.engine is not None and self.engine is not engine:
            raise RuntimeError(f"{type(self).__name__} is already bound to another engine")
        self.engine = engine

    # ------------------------------------------------------------------ context side
    def prefill_launched(self, req: EngineRequest, tokens_done: int, block_ids: list[int],
                         after) -> None:
        """A ``context_only`` request's prompt tokens [0, tokens_done) are queued on the device;
        they are written once the CUDA event ``after`` completed (None: written already).
        ``prefill_progress`` follows for the same tokens once the step is applied."""

    def prefill_progress(self, req: EngineRequest, tokens_done: int, block_ids: list[int]) -> None:
        """A ``context_only`` request computed prompt tokens [0, tokens_done)."""

    def context_finished(self, pinned: PinnedTransfer) -> dict:
        """Prefill is done and ``pinned`` holds the prompt blocks: extra opaque-state fields."""
        return {}

    def context_ended(self, req: EngineRequest) -> None:
        """A ``context_only`` request left the scheduler (any reason)."""

    def pin_released(self, ctx_request_id: int, reason: str) -> None:
        """The engine released the pin of a finished context request."""

    # ------------------------------------------------------------------ generation side
    def receive_expected(self, req: EngineRequest) -> None:
        """A ``generation_only`` request was accepted; its receive may begin much later."""

    def receive_abandoned(self, req: EngineRequest) -> None:
        """A ``generation_only`` request ended before its receive began."""

    @abc.abstractmethod
    async def receive(self, spec: ReceiveSpec) -> None:
        """Fill every block of ``spec`` with the prompt's K/V; raise (``KvTransferFailed``) on
        failure. When cancelled, return only once no remote write into ``spec.block_ids`` can
        still land: the engine reuses the blocks right after."""

    # ------------------------------------------------------------------ lifecycle and info
    async def close(self) -> None:
        """Release what the connector holds; idempotent."""

    def server_info(self) -> dict | None:
        """The ``transfer`` field of ``/server_info`` (None: nothing to advertise)."""
        return None

    @property
    def endpoint(self) -> str | None:
        """The ``disaggregated_params.ctx_info_endpoint`` peers are given, if any."""
        return None
