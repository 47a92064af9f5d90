"""Plugs a `KvTransceiver` into a worker engine through the engine's documented hooks.

Duck-typed (this package imports nothing of the worker). The engine provides (worker/engine.py):

- `opaque_state_hook(pinned) -> dict`: a `context_only` request finished prefill and its prompt
  blocks are pinned; the returned fields go into the response's `encoded_opaque_state`.
- `prefill_hook(req, tokens_done, block_ids)`: a `context_only` request computed another prefill
  chunk (pipelined transfer: the finished blocks can leave now).
- `context_end_hook(req)`: a `context_only` request left the scheduler (finished, aborted, failed).
- `receive_expected_hook(req)`: a `generation_only` request was accepted (it may wait for blocks
  before its receive begins): the context instance is told it is claimed.
- `receive_abandoned_hook(req)`: a `generation_only` request ended before its receive began
  (aborted while queued, client gone): the context instance is told, so it frees the KV it
  pinned for it now rather than at its pin timeout.
- `receiver`: an object with `async receive(spec)` filling a `generation_only` request's blocks.
- `pinned_transfer(cid)`, `release(cid, reason)`, and `pool.pin/unpin(block_ids)` (refcounts).

Context side: a send session per context request. The link holds its *own* pin on every block a
session may read, so whoever else frees the request (abort, pin-timeout sweep, preemption) cannot
hand a block to someone else while a write reads it; the link drops its pin only once
`cancel_send` said True or the session is over. When the session ends, the engine's pin is
released too, with the session's typed cause (`transfer.session.SendEnd`: `transferred`,
`receiver_cancelled`, `write_failed`, `send_timeout`, `context_cancelled`). A send that could not
even start releases the engine's pin at once (`transfer_failed`): no receiver could ever fetch it.

Generation side: `receive(spec)` posts one whole-prompt receive and waits. If it is cancelled it
keeps waiting — shielded — until `cancel_receive` says no context rank can write any more, because
the engine reuses the blocks the moment `receive` returns.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field

from protocol.disagg import OpaqueStateError, RequestType, decode_opaque_state

from .errors import SessionError, TransferError
from .session import KvTransceiver, SendEnd

log = logging.getLogger("splitserve.transfer.link")

CONTEXT_ONLY = RequestType.CONTEXT_ONLY


class KvTransferFailed(TransferError):
    """The KV of a generation_only request could not be received."""


@dataclass
class _Send:
    cid: int
    num_tokens: int
    pinned: list[int] = field(default_factory=list)   # blocks this link holds a pin on
    finished: bool = False                            # final slice appended
    ended: bool = False                               # the engine is done with the request


class EngineTransferLink:
    def __init__(self, engine, transceiver: KvTransceiver, *, poll_s: float = 0.002):
        self.engine = engine
        self.tx = transceiver
        self.poll_s = poll_s
        self._sends: dict[int, _Send] = {}
        # Sends that ended (failed/cancelled) while their request was still prefilling.
        self._ended_early: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._watch_task: asyncio.Task | None = None
        self._closed = False
        engine.opaque_state_hook = self._context_finished
        engine.receiver = self
        if hasattr(engine, "prefill_hook"):
            engine.prefill_hook = self._prefill_progress
        if hasattr(engine, "context_end_hook"):
            engine.context_end_hook = self._context_ended
        if hasattr(engine, "receive_abandoned_hook"):
            engine.receive_abandoned_hook = self._receive_abandoned
        if hasattr(engine, "receive_expected_hook"):
            engine.receive_expected_hook = self._receive_expected

    # ------------------------------------------------------------------ info
    def server_info(self) -> dict:
        return self.tx.server_info()

    @property
    def endpoint(self) -> str:
        return self.tx.endpoint

    # ------------------------------------------------------------------ context side (loop thread)
    def _blocks_of(self, ids, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.tx.tokens_per_block)
        return [int(b) for b in list(ids)[:need]]

    def _pin_more(self, st: _Send, blocks: list[int]) -> None:
        new = [b for b in blocks if b not in set(st.pinned)]
        if new:
            self.engine.pool.pin(new)
            st.pinned.extend(new)

    def _ensure_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch(),
                                                                      name="kv-transfer-watch")

    def _prefill_progress(self, req, tokens_done: int, block_ids) -> None:
        if self._closed or req.ctx_request_id is None:
            return
        cid = int(req.ctx_request_id)
        if cid in self._ended_early:
            return  # its receiver cancelled or failed: nothing more to send for this request
        n = len(req.prompt_token_ids)
        blocks = self._blocks_of(block_ids, min(tokens_done, n))
        st = self._sends.get(cid)
        try:
            if st is None:
                self.tx.begin_send(cid, n, blocks)
                st = self._sends[cid] = _Send(cid=cid, num_tokens=n)
                self._ensure_watch()
            if st.finished:
                return
            # Blocks computed so far are pinned before the transfer thread may read them.
            self._pin_more(st, blocks)
            self.tx.progress_send(cid, tokens_done, blocks)
        except Exception:  # a transfer problem must never stop the engine loop
            log.exception("pipelined send of context request %s", cid)

    def _context_finished(self, pinned) -> dict:
        """Prefill done, blocks pinned by the engine: append the final slice. On failure the
        response carries no transfer fields and the generation leg fails cleanly."""
        try:
            return self._context_finished_inner(pinned)
        except Exception:  # never let a transfer problem stop the engine loop
            log.exception("send of context request %s not started", pinned.ctx_request_id)
            # The answer carries no transfer fields, so nobody will fetch these blocks: end the
            # send (if one began) and drop the engine's new pin right after this hook returns.
            cid = int(pinned.ctx_request_id)
            if cid in self._sends:
                self._sends[cid].ended = True
                try:
                    self.tx.cancel_send(cid)   # the watch finishes it once no write is in flight
                except Exception:
                    log.exception("cancel of send %s", cid)
            asyncio.get_running_loop().call_soon(self.engine.release, cid, "transfer_failed")
            return {}

    def _context_finished_inner(self, pinned) -> dict:
        cid = int(pinned.ctx_request_id)
        if cid in self._ended_early:
            # The pipelined send already failed (its receiver is gone): nothing will fetch these
            # blocks, so the engine's new pin is released right after this hook returns.
            reason = self._ended_early.pop(cid)
            asyncio.get_running_loop().call_soon(self.engine.release, cid, "transfer_failed")
            log.info("context request %s finished prefill after its transfer ended (%s)", cid,
                     reason)
            return {}
        n = len(pinned.prompt_token_ids)
        blocks = self._blocks_of(pinned.block_ids, n)
        st = self._sends.get(cid)
        if st is None:
            self.tx.begin_send(cid, n, blocks)
            st = self._sends[cid] = _Send(cid=cid, num_tokens=n)
            self._ensure_watch()
        self._pin_more(st, blocks)
        if not st.finished:
            self.tx.finish_send(cid, None, blocks)
            st.finished = True
        return {"tx_ep": self.tx.endpoint, "tx_inst": self.tx.instance_id, "tx_req": cid,
                "tx_agent": self.tx.agent.kind}

    def _context_ended(self, req) -> None:
        if req.ctx_request_id is None:
            return
        st = self._sends.get(int(req.ctx_request_id))
        if st is not None:
            st.ended = True

    async def _watch(self) -> None:
        """Release what finished transfers no longer need; cancel what the engine dropped."""
        while self._sends:
            for cid, st in list(self._sends.items()):
                status = self.tx.send_status(cid)
                engine_pin = self.engine.pinned_transfer(cid) is not None
                if not status.quiescent:
                    dropped = (st.ended and not engine_pin) or self._closed
                    # not dropped: still wanted; cancel refused: a write is in flight — keep
                    # every page and ask again next round
                    if not dropped or not self.tx.cancel_send(cid):
                        continue
                    status = self.tx.send_status(cid)
                self._finish_send(cid, st, status.state, status.cause)
            await asyncio.sleep(self.poll_s)

    def _finish_send(self, cid: int, st: _Send, state: str, cause: str | None = None) -> None:
        if self.engine.pinned_transfer(cid) is not None:
            if cause is None:
                cause = SendEnd.TRANSFERRED if state == "done" else SendEnd.CANCELLED
            self.engine.release(cid, cause)
        elif not st.finished and not st.ended:
            self._ended_early[cid] = state
            while len(self._ended_early) > 4096:
                self._ended_early.popitem(last=False)
        if st.pinned:
            self.engine.pool.unpin(st.pinned)
            st.pinned = []
        try:
            self.tx.release_send(cid)
        except SessionError as e:  # cancel said True just above; this is a bug if it fires
            log.error("release of send %s refused: %s", cid, e)
        self._sends.pop(cid, None)

    # ------------------------------------------------------------------ generation side
    def _receive_expected(self, req) -> None:
        """A generation_only request was accepted: claim its KV at the context instance."""
        if self._closed:
            return
        try:
            ep, key = self._source(req)
        except KvTransferFailed:
            return  # its receive will fail with this error; nothing to claim
        try:
            self.tx.claim_receive(key, ep)
        except Exception:  # never let a transfer problem stop the engine loop
            log.exception("claim of receive %s", key)

    def _receive_abandoned(self, req) -> None:
        """A generation_only request ended before `receive` was called for it."""
        if self._closed:
            return
        try:
            ep, key = self._source(req)
        except KvTransferFailed:
            return  # it names no context instance: nothing was pinned for it that we could free
        log.debug("generation_only request for %s ended before its receive began; telling %s",
                  key, ep)
        try:
            self.tx.abandon_receive(key, ep)
        except Exception:  # never let a transfer problem stop the engine loop
            log.exception("abandon of receive %s", key)

    @staticmethod
    def _source(spec) -> tuple[str, int]:
        dp = spec.disaggregated_params or {}
        blob = dp.get("encoded_opaque_state")
        if isinstance(blob, str) and blob:
            try:
                st = decode_opaque_state(blob)
            except OpaqueStateError as e:
                raise KvTransferFailed(f"encoded_opaque_state unreadable: {e}") from None
            if st.tx_ep is not None and st.tx_req is not None:
                return st.tx_ep, st.tx_req
        ep, cid = dp.get("ctx_info_endpoint"), dp.get("ctx_request_id")
        if isinstance(ep, str) and ep.startswith("tcp://") and isinstance(cid, int):
            return ep, cid  # generation_first: the context leg may not have started yet
        raise KvTransferFailed("disaggregated_params carry no KV transfer endpoint (neither an "
                               "encoded_opaque_state from a transfer-enabled context worker nor "
                               "ctx_info_endpoint + ctx_request_id)")

    async def receive(self, spec) -> None:
        if self._closed:
            raise KvTransferFailed("the worker is shutting down")
        ep, key = self._source(spec)
        log.debug("receive of %s from %s", key, ep)
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        try:
            self.tx.begin_receive(key, ep, len(spec.prompt_token_ids), list(spec.block_ids),
                                  on_done=lambda: loop.call_soon_threadsafe(done.set))
        except SessionError as e:
            raise KvTransferFailed(str(e)) from None
        try:
            while True:
                st = self.tx.recv_status(key)
                if st.quiescent:
                    break
                try:  # woken by the completion callback; the timeout is only a safety net
                    await asyncio.wait_for(done.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            await self._cancel_receive(key)
            raise
        self.tx.release_receive(key)
        if st.state != "done":
            raise KvTransferFailed(st.error or st.state)

    async def _cancel_receive(self, key: int) -> None:
        """Do not return before no context rank can write into the blocks (bounded by the
        transceiver: acknowledgement, result, or the peer's loss)."""
        while True:
            try:
                if self.tx.cancel_receive(key):
                    break
                await asyncio.sleep(self.poll_s)
            except asyncio.CancelledError:
                continue  # cancelled again: still not safe to hand the blocks back
        self.tx.release_receive(key)

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Cancel every send (waiting for in-flight writes), drop the link's pins, stop the
        transceiver. Call after the engine stopped."""
        self._closed = True
        while self._sends:
            for cid, st in list(self._sends.items()):
                if self.tx.cancel_send(cid):
                    status = self.tx.send_status(cid)
                    self._finish_send(cid, st, status.state, status.cause)
            if self._sends:
                await asyncio.sleep(self.poll_s)
        if self._watch_task is not None:
            self._watch_task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.tx.shutdown)
