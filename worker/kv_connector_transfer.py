"""``TransferKvConnector``: the worker's KV connector over ``transfer/`` (a ``Transceiver``).

Built unbound with a factory; the engine's constructor binds it, and ``bind`` builds the
transceiver over the engine's own KV memory (``transceiver_for``: one ``KvTransceiver``, or
``MultiRankTransceiver`` for a multi-rank engine). This module is where request fields become
transfer calls: ``disaggregated_params`` (OpenAI level) are read here, never in ``transfer/``.

Context side: a send session per context request. The connector holds its *own* pin on every
block a session may read, so whoever else frees the request (abort, pin-timeout sweep,
preemption) cannot hand a block to someone else while a write reads it; it drops its pin only
once ``cancel_send`` said True or the session is over. When the session ends, the engine's pin is
released too, with the session's typed cause (``transfer.states.SendEnd``: ``transferred``,
``receiver_cancelled``, ``write_failed``, ``send_timeout``, ``unclaimed``,
``context_cancelled``). A send that could not even start releases the engine's pin at once
(``transfer_failed``): no receiver could ever fetch it.

Nothing polls: a send is looked at again only when something that decides its fate happened —
the transceiver's ``on_end`` callback (the session went quiescent), ``context_ended``, or
``pin_released`` — each marking it for the loop-side watch task. A slow sweep (``SAFETY_S``) looks
at every send in case a wake-up was lost; it is not how sends finish.

Generation side: ``receive(spec)`` posts one whole-prompt receive and waits for its ``on_done``
callback. If it is cancelled it keeps waiting — shielded — until ``cancel_receive`` says no
context rank can write any more, because the engine reuses the blocks the moment ``receive``
returns.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Callable

from protocol.disagg import OpaqueStateError, decode_opaque_state
from transfer.errors import SessionError, TransferError
from transfer.states import SendEnd, TransferConfig
from transfer.transceiver import Transceiver
from worker.kv_connector import KvConnector, KvEngine, KvTransferFailed

log = logging.getLogger("splitserve.worker.kv_connector")

__all__ = ["TransferKvConnector", "transceiver_for", "kv_source", "OPAQUE_FIELDS"]

#: What a context response's opaque state carries for the transfer (``context_finished``).
OPAQUE_FIELDS = ("tx_ep", "tx_inst", "tx_req", "tx_agent")
#: Safety-net period of the send watch (nothing waits on it in the normal course).
SAFETY_S = 1.0


def kv_source(disaggregated_params: dict | None) -> tuple[str, int]:
    """Where a generation_only request's KV is: (context control endpoint, transfer request id),
    from the opaque state a transfer-enabled context worker answered with, or (generation_first,
    the context leg may not have started yet) ``ctx_info_endpoint`` + ``ctx_request_id``."""
    dp = disaggregated_params or {}
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
        return ep, cid
    raise KvTransferFailed("disaggregated_params carry no KV transfer endpoint (neither an "
                           "encoded_opaque_state from a transfer-enabled context worker nor "
                           "ctx_info_endpoint + ctx_request_id)")


def transceiver_for(engine, cfg: TransferConfig, *, role: str, model_name: str) -> Transceiver:
    """The transceiver over ``engine``'s KV pool(s); ``TransferError`` becomes a ValueError that
    names the setup (the CLI prints it and exits 2)."""
    from transfer.page_table import PageTable
    from transfer.session import KvTransceiver, RankTopology

    if getattr(engine, "rank_group", None) is not None:  # multi-rank: one transceiver per rank
        from worker.parallel.rank_transfer import build_rank_transfer

        return build_rank_transfer(engine, cfg, role=role, model_name=model_name)
    runner = engine.runner
    if cfg.agent == "shm":
        if runner.device.type != "cpu":
            raise ValueError("--transfer-agent shm moves host memory only; use nixl or tcp on cuda")
        from transfer.memory import alloc_shared_host

        # The shm agent's peers write straight into these pages: move the (still empty) K/V pool
        # into a shared-memory file before anything registers or captures its address.
        t = runner.kv_cache
        shared = alloc_shared_host(t.numel() * t.element_size())
        runner.kv_cache = shared.view(t.dtype).view(t.shape)
    mc = runner.cfg
    topo = RankTopology(role=role, num_layers=mc.num_hidden_layers,
                        total_kv_heads=mc.num_key_value_heads, model=model_name)
    try:
        return KvTransceiver(PageTable.from_runner_dict(engine.page_table()), topo, cfg)
    except TransferError as e:
        raise ValueError(f"KV transfer setup failed: {e}") from None


@dataclass
class _Send:
    cid: int
    num_tokens: int
    pinned: list[int] = field(default_factory=list)   # blocks this connector holds a pin on
    handed: int = 0                                   # prompt tokens handed to the transfer
    final: bool = False                               # final slice appended
    finished: bool = False                            # context_finished: prefill done, answered
    ended: bool = False                               # the engine is done with the request


class TransferKvConnector(KvConnector):
    def __init__(self, make_transceiver: Callable[[KvEngine], Transceiver]):
        """``make_transceiver(engine)`` runs once, in ``bind``: e.g. ``lambda e:
        transceiver_for(e, cfg, role=..., model_name=...)``."""
        self._make = make_transceiver
        self.tx: Transceiver | None = None
        self._sends: dict[int, _Send] = {}
        # Sends that ended (failed/cancelled) while their request was still prefilling.
        self._ended_early: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._dirty: set[int] = set()
        self._wake = asyncio.Event()
        self._watch_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def bind(self, engine: KvEngine) -> None:
        super().bind(engine)
        if self.tx is None:
            self.tx = self._make(engine)

    # ------------------------------------------------------------------ info
    def server_info(self) -> dict:
        return self.tx.server_info()

    @property
    def endpoint(self) -> str:
        return self.tx.endpoint

    # ------------------------------------------------------------------ context side
    def _blocks_of(self, ids, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.tx.tokens_per_block)
        return [int(b) for b in list(ids)[:need]]

    def _pin_more(self, st: _Send, blocks: list[int]) -> None:
        # One set per call: `b not in set(st.pinned)` inside the comprehension rebuilt it for every
        # block, quadratic in the prompt — ~40 ms on the engine's loop for a 16k prompt (1,024
        # blocks), hundreds at 32k, measured on an H100 as a late context answer and handover.
        have = set(st.pinned)
        new = [b for b in blocks if b not in have]
        if new:
            self.engine.pool.pin(new)
            st.pinned.extend(new)

    def _begin(self, cid: int, n: int, blocks: list[int]) -> _Send:
        loop = self._loop = asyncio.get_running_loop()
        # on_end comes from a transceiver thread: hop to the loop, mark, wake the watch.
        self.tx.begin_send(cid, n, blocks,
                           on_end=lambda: loop.call_soon_threadsafe(self._mark, cid))
        st = self._sends[cid] = _Send(cid=cid, num_tokens=n)
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = loop.create_task(self._watch(), name="kv-transfer-watch")
        return st

    def _mark(self, cid: int) -> None:
        if cid in self._sends:
            self._dirty.add(cid)
            self._wake.set()

    def _pipelined(self) -> bool:
        cfg = getattr(self.tx, "cfg", None)
        return bool(getattr(cfg, "pipeline", False))

    def prefill_launched(self, req, tokens_done: int, block_ids, after) -> None:
        """Pipelining on the GPU: the chunk's blocks are handed to the transfer as soon as its
        compute is queued, with the CUDA event after it; the write waits for the event on the
        device. The prompt's last chunk appends the final slice here too, so its write (and the
        completion it carries) starts the moment the compute ends, not once the engine has seen the
        step finish, sampled and answered. Monolithic sends (``pipeline`` off) wait for
        ``context_finished`` as before."""
        if not self._pipelined():
            return
        self._progress(req, tokens_done, block_ids, after, queued=True)

    def prefill_progress(self, req, tokens_done: int, block_ids) -> None:
        self._progress(req, tokens_done, block_ids, None, queued=False)

    def _progress(self, req, tokens_done: int, block_ids, after, queued: bool) -> None:
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
                st = self._begin(cid, n, blocks)
            # Handed over already when the chunk was queued (prefill_launched): the block list it
            # gave then is longer, and a shorter one now would cut the session's source ids
            # under the slices still in flight.
            if st.final or tokens_done <= st.handed:
                return
            st.handed = tokens_done
            # Blocks computed so far are pinned before the transfer thread may read them.
            self._pin_more(st, blocks)
            if queued and tokens_done >= n:
                self.tx.finish_send(cid, None, blocks, after=after)
                st.final = True
            else:
                self.tx.progress_send(cid, tokens_done, blocks, after=after)
        except Exception:  # a transfer problem must never stop the engine loop
            log.exception("pipelined send of context request %s", cid)

    def context_finished(self, pinned) -> dict:
        """Prefill done, blocks pinned by the engine: append the final slice. On failure the
        response carries no transfer fields and the generation leg fails cleanly."""
        try:
            return self._context_finished(pinned)
        except Exception:  # never let a transfer problem stop the engine loop
            log.exception("send of context request %s not started", pinned.ctx_request_id)
            # The answer carries no transfer fields, so nobody will fetch these blocks: end the
            # send (if one began) and drop the engine's new pin right after this hook returns.
            cid = int(pinned.ctx_request_id)
            if cid in self._sends:
                self._sends[cid].ended = True
                try:
                    self.tx.cancel_send(cid)   # its on_end fires once no write is in flight
                except Exception:
                    log.exception("cancel of send %s", cid)
                self._mark(cid)
            asyncio.get_running_loop().call_soon(self.engine.release, cid, "transfer_failed")
            return {}

    def _context_finished(self, pinned) -> dict:
        cid = int(pinned.ctx_request_id)
        if cid in self._ended_early:
            # The pipelined send already ended: the engine's new pin is released right after this
            # hook returns. Ended as "done", every byte landed before the engine saw its last step
            # finish (the final slice left right behind the compute: ``prefill_launched``).
            reason = self._ended_early.pop(cid)
            done = reason == "done"
            asyncio.get_running_loop().call_soon(
                self.engine.release, cid, SendEnd.TRANSFERRED if done else "transfer_failed")
            if done:
                return self._opaque(cid)
            log.info("context request %s finished prefill after its transfer ended (%s)", cid,
                     reason)
            return {}
        n = len(pinned.prompt_token_ids)
        blocks = self._blocks_of(pinned.block_ids, n)
        st = self._sends.get(cid)
        if st is None:
            st = self._begin(cid, n, blocks)
        self._pin_more(st, blocks)
        if not st.final:
            self.tx.finish_send(cid, None, blocks)
            st.final = True
        st.finished = True
        return self._opaque(cid)

    def _opaque(self, cid: int) -> dict:
        return dict(zip(OPAQUE_FIELDS, (self.tx.endpoint, self.tx.instance_id, cid,
                                        self.tx.agent.kind)))

    def context_ended(self, req) -> None:
        if req.ctx_request_id is None:
            return
        cid = int(req.ctx_request_id)
        st = self._sends.get(cid)
        if st is not None:
            st.ended = True
            self._mark(cid)

    def pin_released(self, ctx_request_id: int, reason: str) -> None:
        self._mark(int(ctx_request_id))

    async def _watch(self) -> None:
        """Finish the sends something happened to; exits when none is left."""
        while self._sends:
            try:
                await asyncio.wait_for(self._wake.wait(), SAFETY_S)
                dirty, self._dirty = self._dirty, set()
            except asyncio.TimeoutError:
                dirty = set(self._sends)   # the safety net: look at every send
            self._wake.clear()
            for cid in dirty:
                st = self._sends.get(cid)
                if st is not None:
                    self._check(cid, st)

    def _check(self, cid: int, st: _Send) -> None:
        """Release what a finished transfer no longer needs; cancel what the engine dropped."""
        status = self.tx.send_status(cid)
        if not status.quiescent:
            dropped = (st.ended and self.engine.pinned_transfer(cid) is None) or self._closed
            # not dropped: still wanted; cancel refused: a write is in flight — keep every page,
            # the session's on_end marks it again once the write landed
            if not dropped or not self.tx.cancel_send(cid):
                return
            status = self.tx.send_status(cid)
        self._finish_send(cid, st, status.state, status.cause)

    def _finish_send(self, cid: int, st: _Send, state: str, cause: str | None = None) -> None:
        self._sends.pop(cid, None)   # first: the release below reports back via pin_released
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

    # ------------------------------------------------------------------ generation side
    def receive_expected(self, req) -> None:
        """A generation_only request was accepted: claim its KV at the context instance."""
        if self._closed:
            return
        try:
            ep, key = kv_source(req.disaggregated_params)
        except KvTransferFailed:
            return  # its receive will fail with this error; nothing to claim
        try:
            self.tx.claim_receive(key, ep)
        except Exception:  # never let a transfer problem stop the engine loop
            log.exception("claim of receive %s", key)

    def receive_abandoned(self, req) -> None:
        """A generation_only request ended before ``receive`` was called for it."""
        if self._closed:
            return
        try:
            ep, key = kv_source(req.disaggregated_params)
        except KvTransferFailed:
            return  # it names no context instance: nothing was pinned for it that we could free
        log.debug("generation_only request for %s ended before its receive began; telling %s",
                  key, ep)
        try:
            self.tx.abandon_receive(key, ep)
        except Exception:  # never let a transfer problem stop the engine loop
            log.exception("abandon of receive %s", key)

    async def receive(self, spec) -> None:
        if self._closed:
            raise KvTransferFailed("the worker is shutting down")
        ep, key = kv_source(spec.disaggregated_params)
        log.debug("receive of %s from %s", key, ep)
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        try:
            self.tx.begin_receive(key, ep, len(spec.prompt_token_ids), list(spec.block_ids),
                                  on_done=lambda: loop.call_soon_threadsafe(done.set))
        except SessionError as e:
            raise KvTransferFailed(str(e)) from None
        try:
            while not (st := self.tx.recv_status(key)).quiescent:
                await self._woken(done)
        except asyncio.CancelledError:
            await self._cancel_receive(key, done)
            raise
        self.tx.release_receive(key)
        if st.state != "done":
            raise KvTransferFailed(st.error or st.state)

    @staticmethod
    async def _woken(done: asyncio.Event) -> None:
        """Until the receive's on_done fired (the timeout is only a safety net)."""
        try:
            await asyncio.wait_for(done.wait(), SAFETY_S)
        except asyncio.TimeoutError:
            pass

    async def _cancel_receive(self, key: int, done: asyncio.Event) -> None:
        """Do not return before no context rank can write into the blocks (bounded by the
        transceiver: acknowledgement, result, or the peer's loss — each fires on_done)."""
        while True:
            try:
                if self.tx.cancel_receive(key):
                    break
                await self._woken(done)
            except asyncio.CancelledError:
                continue  # cancelled again: still not safe to hand the blocks back
        self.tx.release_receive(key)

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Cancel every send (waiting for in-flight writes), drop the connector's pins, stop the
        transceiver. Call after the engine stopped; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.tx is None:
            return
        if self._watch_task is not None:   # from here on this coroutine drives the sends
            self._watch_task.cancel()
            try:
                await self._watch_task
            except asyncio.CancelledError:
                pass
        while self._sends:
            for cid, st in list(self._sends.items()):
                self._check(cid, st)   # closed: every send is dropped, cancelled when it can be
            if self._sends:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), SAFETY_S)
                except asyncio.TimeoutError:
                    pass
        await asyncio.get_running_loop().run_in_executor(None, self.tx.shutdown)
