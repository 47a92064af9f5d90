"""KV-transfer sessions: the per-rank transceiver that moves one request's KV from a context rank
to generation ranks.

Threads per rank: the caller (the worker's engine loop) calls the API; a *listener* thread
(`Messenger`) handles control messages and only changes state; a *transfer* thread loads peer
agents, builds descriptors, submits one-sided writes, polls them, and enforces timeouts. All
session state is under one lock; nothing blocks while holding it.

Split by object: `sender.py` (context side: send sessions, registered generation ranks),
`receiver.py` (generation side: receive sessions, known context instances), `pump.py` (the transfer
thread), `control.py` (the typed control messages and who sends which), `states.py` (state enums,
`Status`, `SendEnd`, `TransferConfig`, `RankTopology`); this module is the facade that builds them
over one `RankCore` (`session_core.py`: configuration, agent, messenger, the lock) and routes
control messages. `transfer.transceiver.Transceiver` is the surface it offers (the worker's multi-rank
facade offers it too).

Context side (sender): `begin_send` creates a send session; `progress_send` appends block-aligned
slices as prefill chunks finish (pipelining), `finish_send` appends the final slice (always, even
when empty: it carries completion and `meta`, e.g. first_gen_tokens).

Generation side (receiver): `begin_receive` posts one whole-prompt receive per context rank that
shares layers and heads with this one; it completes when every one of them sent a final `ok`.

Completion: `begin_send(..., on_end=)` and `begin_receive(..., on_done=)` take a callback that is
called once, from a transceiver thread, when that session is quiescent (nothing can write into or
out of its pages any more); the caller then reads the status. Nobody needs to poll.

Lifecycle rules:
- `cancel_*` returns True when the pages may be freed now, False while a write may be in flight
  ("not yet" is not an error; call again next iteration). Submitted writes are never aborted.
- A timeout is non-terminal while a peer may still write: a timed-out receive cancels its writers
  and becomes terminal only when each acknowledged, finished, or was lost (connection closed /
  heartbeat timeout: a dead process cannot write).
- `release_*` retires a request; a retired request cannot be re-created, and a late `recv` for it
  gets an error result.
- A generation rank that gives up on a request before its `recv` was posted (cancelled while it
  was still fetching the context instance, or — `abandon_receive` — a request that ended before
  its receive began) still sends `cancel` to the context instance: only then does the context rank
  learn that nobody will fetch the pinned KV, instead of holding it until its send timeout.
- A context rank learns that a generation rank holds a request when its `recv` arrives, or — so
  that a request queued on the generation side for long is not mistaken for a lost one — from a
  `claim` sent as soon as the generation worker accepted it (`claim_receive`). A finished send
  session that nobody claimed within `claim_timeout_s` is ended (`SendEnd.UNCLAIMED`): whoever
  carried the context answer to a generation worker is gone (a fleet process killed between the
  two legs), and only the pin timeout would free the KV otherwise. Flat rank 0 decides (the
  endpoint peers are given); a multi-rank worker then cancels its other ranks.
- A send session ends with a typed `Status.cause` (`SendEnd`): what the engine's pin is released
  with.
- Multi-rank workers must agree before acting: each rank reports `Status.code` (0 in flight,
  1 failed, 2 done); `combine_codes` (min over ranks = global AND) gives the instance's outcome.
"""
from __future__ import annotations

import logging
import uuid
from typing import Callable, Sequence

from . import control as C
from .agent import TransferAgent
from .agents import make_agent
from .errors import ProtocolError
from .messenger import Messenger
from .page_table import PageTable
from .peers import head_range, layer_range, standard_layout
from .pump import Pump
from .rank_info import RankInfo
from .receiver import Receiver
from .sender import Sender
from .session_core import RankCore
from .transceiver import Transceiver
from .states import (DONE, FAILED, IN_FLIGHT, RankTopology, SendEnd, Status,  # noqa: F401
                     TransferConfig, combine_codes)

log = logging.getLogger("splitserve.transfer.session")

#: The facade's public surface (the value types live in `transfer/states.py`).
__all__ = ["KvTransceiver", "TransferConfig", "RankTopology", "Status", "SendEnd", "combine_codes",
           "IN_FLIGHT", "FAILED", "DONE"]


class KvTransceiver(Transceiver):
    """One rank's end of KV transfer (see the module docstring)."""

    def __init__(self, page_table: PageTable, topology: RankTopology,
                 config: TransferConfig | None = None, agent: TransferAgent | None = None):
        self.cfg = cfg = config or TransferConfig()
        page_table.validate()
        self.page_table = page_table
        self.topology = topo = topology
        inst = topo.instance_id or uuid.uuid4().hex[:16]
        self.instance_id = inst
        flat = topo.pp_rank * topo.tp_size + topo.tp_rank
        self.agent = agent or make_agent(cfg.agent, name=f"{topo.role}-{inst}-{flat}",
                                         host=cfg.host, advertise_host=cfg.advertise_host,
                                         progress_thread=cfg.progress_thread)
        self._regs = []
        try:
            for base, extent, dev, mem in page_table.regions():
                self._regs.append(self.agent.register_memory([(base, extent, dev)], mem))
        except Exception:
            if agent is None:
                self.agent.shutdown()
            raise
        ls, le = topo.layers or layer_range(topo.pp_rank, topo.pp_size, topo.num_layers)
        hs, nh = topo.heads or head_range(topo.tp_rank, topo.tp_size, topo.total_kv_heads)
        self._core = core = RankCore(cfg, topo, page_table, self.agent)
        self.stats = core.stats
        self._ready = False
        self.messenger = core.messenger = Messenger(
            f"{inst}/{flat}", self._on_message, self._on_peer_lost, host=cfg.host, port=cfg.port,
            advertise_host=cfg.advertise_host, connect_timeout_s=cfg.connect_timeout_s,
            heartbeat_ivl_s=cfg.heartbeat_ivl_s, heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            decode=C.decode, on_decoded=self._route)
        self.info = core.info = RankInfo(
            instance_id=inst, role=topo.role, endpoint=self.messenger.endpoint,
            agent_kind=self.agent.kind, agent_name=self.agent.name,
            agent_desc=self.agent.get_local_agent_desc(), page_table=page_table,
            num_layers=topo.num_layers, total_kv_heads=topo.total_kv_heads, layer_start=ls,
            layer_end=le, head_start=hs, kv_heads=nh, tp_size=topo.tp_size, tp_rank=topo.tp_rank,
            pp_size=topo.pp_size, pp_rank=topo.pp_rank, dp_size=topo.dp_size, dp_rank=topo.dp_rank,
            model=topo.model,
            instance_layout=standard_layout(topo.num_layers, topo.total_kv_heads, topo.tp_size,
                                            topo.pp_size) if topo.layers is None and topo.heads is None
            else ())
        self._sender = Sender(core)
        self._receiver = Receiver(core)
        self._pump = core.pump = Pump(core, self._sender, self._receiver)
        self._routes: dict[type, Callable] = {
            C.GetInstance: self._sender.on_get_instance, C.Register: self._sender.on_register,
            C.Recv: self._sender.on_recv, C.Cancel: self._sender.on_cancel,
            C.Claim: self._sender.on_claim,
            C.Instance: self._receiver.on_instance, C.Registered: self._receiver.on_registered,
            C.RegisterFailed: self._receiver.on_register_failed,
            C.Result: self._receiver.on_result, C.Error: self._receiver.on_error}
        self._by_kind = {"router": {c: self._routes[c] for c in C.REQUESTS},
                         "dealer": {c: self._routes[c] for c in C.REPLIES}}
        self._ready = True
        core.results_by_notif = self.agent.deliver_notifications(self._on_notification)
        core.ready_waiter = self.agent.ready_waiter()
        self._pump.start()

    # ------------------------------------------------------------------ identity
    @property
    def endpoint(self) -> str:
        return self.messenger.endpoint

    @property
    def tokens_per_block(self) -> int:
        return self.page_table.tokens_per_block

    def set_instance(self, infos: Sequence[bytes]) -> None:
        """Rank 0 of a multi-rank worker: every rank's encoded RankInfo, in flat-rank order (what
        `get_instance` answers). Each is validated."""
        self._sender.set_instance(infos)

    def server_info(self) -> dict:
        """The `transfer` field of the worker's /server_info."""
        return {"endpoint": self.endpoint, "instance_id": self.instance_id,
                "agent": self.agent.describe(), "tokens_per_block": self.tokens_per_block,
                "layout_version": self.page_table.layout_version,
                "tp_size": self.topology.tp_size, "pp_size": self.topology.pp_size,
                **self.cfg.describe()}

    # ================================================================== context side API
    def begin_send(self, request_id: int, num_tokens: int, block_ids,
                   on_end: Callable[[], None] | None = None) -> None:
        """Open a send session for `num_tokens` prompt tokens stored in `block_ids` (per group, or
        one list for a single-group table). Receivers that posted early (generation_first) are
        adopted. `on_end()` is called once, from a transceiver thread, when the session is
        quiescent (done, failed or cancelled, no write in flight)."""
        self._sender.begin(request_id, num_tokens, block_ids, on_end)

    def progress_send(self, request_id: int, tokens_done: int, block_ids=None,
                      after=None) -> None:
        """Prefill has computed tokens [0, tokens_done): send the full blocks not sent yet. With
        `after` (a CUDA event recorded after the compute of those tokens was queued), the tokens
        may still be computing: their write is ordered after the event (on the device where the
        agent can, `TransferAgent.orders_after`; else the transfer thread waits for it)."""
        self._sender.progress(request_id, tokens_done, block_ids, after)

    def finish_send(self, request_id: int, meta: dict | None = None, block_ids=None,
                    after=None) -> None:
        """Prefill is done (or, with `after`, queued up to that CUDA event: see `progress_send`):
        append the final slice (always sent; carries `meta`) and start the send timeout."""
        self._sender.finish(request_id, meta, block_ids, after)

    def send_status(self, request_id: int) -> Status:
        return self._sender.status(request_id)

    def cancel_send(self, request_id: int) -> bool:
        """True: no write from these pages can happen any more (free them). False: a write is in
        flight; nothing may be freed yet — call again later (or wait for `on_end`)."""
        return self._sender.cancel(request_id)

    def release_send(self, request_id: int) -> None:
        """The worker freed the request's pages: retire the session (never re-created)."""
        self._sender.release(request_id)

    # ================================================================== generation side API
    def begin_receive(self, request_id: int, ctx_endpoint: str, num_tokens: int, block_ids,
                      on_done: Callable[[], None] | None = None) -> None:
        """Register a whole-prompt receive of `num_tokens` tokens into `block_ids` (per group or one
        list) from the context instance at `ctx_endpoint`. Returns at once; poll `recv_status`, or
        pass `on_done()`: called once, from a transceiver thread, when the receive is quiescent."""
        self._receiver.begin(request_id, ctx_endpoint, num_tokens, block_ids, on_done)

    def recv_status(self, request_id: int) -> Status:
        return self._receiver.status(request_id)

    def cancel_receive(self, request_id: int) -> bool:
        """True: no peer can write into these pages any more (free them). False: a context rank may
        still be writing; its cancel acknowledgement is awaited — call again later (or wait for
        `on_done`)."""
        return self._receiver.cancel(request_id)

    def claim_receive(self, request_id: int, ctx_endpoint: str) -> None:
        """This worker accepted a request whose KV the context instance at `ctx_endpoint` holds
        (its receive may begin much later, once blocks are free): claim it, so the context rank
        does not end the send as unclaimed."""
        self._receiver.claim(request_id, ctx_endpoint)

    def abandon_receive(self, request_id: int, ctx_endpoint: str) -> None:
        """A request that will never call `begin_receive` here (it ended first: aborted, client
        gone, shutdown) but whose context leg may have pinned KV for it: tell the context
        instance, which ends its send session (`SendEnd.RECEIVER_CANCELLED`). No-op for a request
        that has a receive session (`cancel_receive` covers it)."""
        self._receiver.abandon(request_id, ctx_endpoint)

    def release_receive(self, request_id: int) -> None:
        self._receiver.release(request_id)

    # ================================================================== shared
    def pending(self) -> dict:
        with self._core.lock:
            return {"send": len(self._sender.sessions), "recv": len(self._receiver.sessions),
                    "parked": sum(len(v) for v in self._sender.parked.values()),
                    "inflight_tasks": len(self._pump.tasks),
                    "receivers": len(self._sender.receivers),
                    "peer_instances": len(self._receiver.peers)}

    def shutdown(self) -> None:
        if not self._pump.shutdown():
            return
        self.messenger.close()
        self._receiver.shutdown()
        for rx in self._sender.receivers.values():
            self._pump.release_preps(rx)
        self.agent.shutdown()

    # ------------------------------------------------------------------ control messages
    def _on_message(self, source: tuple, msg: dict) -> None:
        """(listener) Route a control message to the side that handles it. A request arrives on
        our ROUTER (`who` is the peer's identity), a reply on a DEALER (`who` is its endpoint)."""
        kind, who = source
        t = msg["t"]
        try:
            m = C.parse(msg)
        except ProtocolError as e:
            if t not in C.TAGS:
                log.warning("unknown control message %r from %r", t, who)
                return
            self._bad(kind, who, t, e)
            return
        self._route(source, m)

    def _route(self, source: tuple, m: C.ControlMessage) -> None:
        """(listener) A typed control message to the side that handles it: requests from the
        ROUTER (or a lane a peer connected), replies from a DEALER (or our lane). One dict
        lookup (an isinstance against a tuple of five classes took ~1.5 µs warm)."""
        kind, who = source
        fn = self._by_kind[kind].get(type(m)) if self._ready else None
        if fn is None:
            log.warning("unknown control message %r from %r", type(m).__struct_config__.tag, who)
            return
        try:
            fn(who, m)
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            self._bad(kind, who, type(m).__struct_config__.tag, e)

    def _bad(self, kind: str, who, t: str, e: Exception) -> None:
        log.warning("bad %r message from %r: %s", t, who, e)
        if kind == "router":
            self._core.reply(who, C.Error(error=f"bad {t!r}: {e}"))

    def _on_notification(self, sender: str, data: bytes) -> None:
        """(agent thread) A notification: the `ok` result of a write into our pages, delivered
        after its last byte landed (`control.Recv.notif`)."""
        try:
            res = C.parse_result_notif(data)
        except ProtocolError as e:
            log.warning("bad result notification from agent %r: %s", sender, e)
            return
        if res is None:
            log.warning("unexpected notification from agent %r (%d bytes)", sender, len(data))
            return
        self._receiver.on_result(None, res, agent=sender)

    def _on_peer_lost(self, endpoint: str, reason: str) -> None:
        self._receiver.on_peer_lost(endpoint, reason)
