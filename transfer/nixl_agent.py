"""`NixlAgent`: the transfer agent on NIXL's UCX backend (DRAM on CPU, VRAM on GPU).

Facts this wrapper is built around (nixl 1.5.1 with its bundled UCX 1.23.0, read from the wheel and measured):
- The progress thread is OFF by default (`progress_thread=False`): on few cores NIXL's thread spins
  a core per agent. Then whoever waits drives progress — the initiator through `poll`, the target
  through `progress()`/`get_notifications()` *even when idle*, or UCX wire-up never completes.
- NIXL's descriptor lists are built locally from our Nx3 arrays (`get_serialized_descs` is pickle:
  never used). The agent descriptor on the wire is our msgpack envelope around NIXL's opaque
  metadata bytes, carrying the kind so a mismatch is caught at load time.
- `initialize_xfer` never merges adjacent descriptors; callers merge runs first (mappers do).
  `prep_descs`/`submit_prepped` use `prep_xfer_dlist`/`make_prepped_xfer`, which merge runs that
  are adjacent on both sides and avoid rebuilding lists per transfer: worth it for block-granular
  transfers between pools prepared once per peer.
- NIXL's exceptions share no base class; all twelve are caught and mapped to ours. `transfer()`
  can raise (peer disconnect) as well as return "ERR".
- Names must be unique per incarnation; a restarted peer under an old name is refused
  (`NameConflict`) until invalidated.
- On GPU, torch must be imported (CUDA initialised) before the agent is created so UCX's CUDA
  modules find libcudart.
- UCX's TCP transport listens on every interface unless told otherwise; the UCX backend is created
  with `engine_config` settings that pin it to the configured host (transfer/ucx_bind.py).
- UCX's cuda_ipc posts one copy per descriptor (~8 µs each), so scattered KV blocks crawled at a
  few % of a device copy. VRAM writes to a peer on the same host therefore go through
  `DirectCopies` (transfer/direct.py): the peer's allocations are mapped by CUDA IPC when its
  descriptor is loaded and one batched-copy kernel writes every block; NIXL still carries the
  notification, and everything else (other hosts, DRAM, READs).
"""
from __future__ import annotations

import importlib
import logging
import sys
import threading
import time

import msgpack
import numpy as np

from .agent import (AGENT_DESC_VERSION, DONE, ERR, PROC, PrepHandle, RegHandle, TransferAgent,
                    XferHandle, regions_array)
from .descs import Coverage, Descs, check_pair, merge_runs, strided
from . import ucx_bind
from .errors import (AgentMismatch, AgentUnavailable, FailureCause, InvalidDescriptors,
                     NameConflict, OutOfRange, PeerLost, RemoteNotLoaded, TransferError)

log = logging.getLogger("splitserve.transfer.nixl")

_NIXL = None
PROGRESS_IDLE_S = 0.001


def _host_wait(after) -> None:
    """A write NIXL posts itself cannot wait on the device: wait for `after` here (held lock and
    all: only writes that do not go direct — another host, no CUDA IPC — take this path)."""
    if after is not None:
        after.synchronize()


class _Direct:
    """The backend of a direct write: the event after its kernel, and the notification to send."""

    __slots__ = ("event", "notif")

    def __init__(self, event, notif: bytes) -> None:
        self.event, self.notif = event, notif


def import_nixl():
    """The NIXL `_api` module: the meta package first, then the CUDA-specific wheels."""
    global _NIXL
    if _NIXL is not None:
        return _NIXL
    if "torch" in sys.modules:
        try:  # make libcudart visible to UCX's optional CUDA modules
            import torch

            if torch.cuda.is_available():
                torch.cuda.init()
        except Exception:  # a CPU-only torch is fine
            pass
    errors = []
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            _NIXL = importlib.import_module(mod)
            return _NIXL
        except Exception as e:  # ImportError, or a broken shared library (OSError)
            errors.append(f"{mod}: {type(e).__name__}: {e}")
    raise AgentUnavailable("no NIXL binding imports (" + "; ".join(errors) + ")")


def _nixl_errors(api) -> tuple[type, ...]:
    b = importlib.import_module(api.__name__.rsplit(".", 1)[0] + "._bindings")
    return tuple(getattr(b, n) for n in dir(b) if n.endswith("Error") and isinstance(
        getattr(b, n), type))


def _map_error(e: Exception, what: str) -> TransferError:
    n = type(e).__name__
    msg = f"{what}: {n}: {e}"
    if n == "nixlRemoteDisconnectError":
        return PeerLost(msg)
    if n == "nixlNotFoundError":
        return OutOfRange(msg + " (descriptor not covered by registrations, or peer unknown)")
    if n == "nixlNotAllowedError":
        return NameConflict(msg)
    if n in ("nixlInvalidParamError", "nixlMismatchError"):
        return InvalidDescriptors(msg)
    return TransferError(msg)


def _direct_copies():
    """Direct same-host GPU writes, when this process uses CUDA (never imports torch itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    from .direct import DirectCopies

    return DirectCopies()


class NixlAgent(TransferAgent):
    kind = "nixl"
    mem_types = ("DRAM", "VRAM")
    orders_after = True
    posts_async = True   # UCX posts, or a kernel queued on the transfer stream
    OPTIONS = ("progress_thread", "telemetry", "backends", "host", "direct")

    def __init__(self, name: str, *, host: str = "127.0.0.1", progress_thread: bool = False,
                 telemetry: bool = False, backends: tuple[str, ...] = ("UCX",),
                 direct: bool = True):
        api = import_nixl()
        self._api = api
        self._errors = _nixl_errors(api)
        self.name = name
        self._lock = threading.RLock()
        self._telemetry = telemetry
        self.progress_thread = progress_thread
        # An operator's UCX_NET_DEVICES decides the interfaces alone (NIXL skips our key then).
        overrides = ucx_bind.operator_overrides()
        self.ucx = {} if "NET_DEVICES" in overrides else ucx_bind.ucx_settings(host)
        self.ucx_overrides = overrides
        try:
            cfg = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[],
                                        capture_telemetry=telemetry)
            self._agent = api.nixl_agent(name, cfg)
            for b in backends:
                params = {"engine_config": ucx_bind.engine_config(self.ucx)} if (
                    b == "UCX" and self.ucx) else {}
                self._agent.create_backend(b, params)
        except Exception as e:
            raise AgentUnavailable(f"NIXL agent with backends {list(backends)} failed: "
                                   f"{type(e).__name__}: {e}") from None
        if not getattr(self._agent, "backends", {"UCX": 1}):
            raise AgentUnavailable(f"NIXL created no backend of {list(backends)}")
        if overrides:
            log.info("nixl: UCX settings from the environment take precedence: %s", overrides)
        self._regs: dict[int, RegHandle] = {}
        self._local = Coverage()
        self._remotes: set[str] = set()
        self._notifs: dict[str, list[bytes]] = {}
        self._preps: dict[int, PrepHandle] = {}
        self._closed = False
        self._direct = _direct_copies() if direct else None
        self._nixl_inflight: set[int] = set()   # ids of NIXL (not direct) writes still PROC
        self._last_progress = 0.0

    # ------------------------------------------------------------------ memory
    def register_memory(self, regions, mem_type: str = "DRAM") -> RegHandle:
        if mem_type not in self.mem_types:
            raise InvalidDescriptors(f"NIXL memory type must be DRAM or VRAM; found {mem_type!r}")
        arr = regions_array(regions)
        rows = [(int(a), int(n), int(d), "") for a, n, d in arr.tolist()]
        with self._lock:
            try:
                reg = self._agent.get_reg_descs(rows, mem_type)
                self._agent.register_memory(reg)
            except self._errors as e:
                raise _map_error(e, "register_memory") from None
            h = RegHandle(regions=arr, mem_type=mem_type, backend=reg)
            self._regs[h.id] = h
            if mem_type == "VRAM" and self._direct is not None:
                self._direct.register(arr)
            self._local.add((a, n, d, mem_type) for a, n, d, _ in rows)
        return h

    def deregister_memory(self, handle: RegHandle) -> None:
        with self._lock:
            if self._regs.pop(handle.id, None) is None:
                raise InvalidDescriptors("deregister_memory: handle is not registered here")
            try:
                self._agent.deregister_memory(handle.backend)
            except self._errors as e:
                raise _map_error(e, "deregister_memory") from None
            self._local.remove([(a, n, d, handle.mem_type) for a, n, d in handle.regions.tolist()])
            if handle.mem_type == "VRAM" and self._direct is not None:
                self._direct.deregister(handle.regions)

    # ------------------------------------------------------------------ peers
    def get_local_agent_desc(self) -> bytes:
        with self._lock:
            md = self._agent.get_agent_metadata()
            direct = self._direct.describe() if self._direct is not None else None
        env = {"v": AGENT_DESC_VERSION, "kind": self.kind, "name": self.name, "md": bytes(md)}
        if direct:
            env["direct"] = direct
        return msgpack.packb(env)

    def load_remote_agent(self, desc: bytes) -> str:
        try:
            env = msgpack.unpackb(desc, raw=False)
        except Exception as e:
            raise AgentMismatch(f"agent descriptor is not our msgpack envelope: {e}") from None
        if not isinstance(env, dict) or env.get("kind") != self.kind:
            found = env.get("kind") if isinstance(env, dict) else type(env).__name__
            raise AgentMismatch(f"remote agent is kind {found!r}; this agent is 'nixl'")
        if env.get("v") != AGENT_DESC_VERSION:
            raise AgentMismatch(
                f"remote agent descriptor version {env.get('v')}; expected {AGENT_DESC_VERSION}")
        with self._lock:
            try:
                name = self._agent.add_remote_agent(env["md"])
            except self._errors as e:
                raise _map_error(e, f"load_remote_agent({env.get('name')!r})") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            if self._direct is not None:
                self._direct.load(name, env.get("direct"))
        return name

    def invalidate_remote_agent(self, name: str) -> None:
        with self._lock:
            if name not in self._remotes:
                return
            self._remotes.discard(name)
            if self._direct is not None:
                self._direct.drop(name)
            for p in [p for p in self._preps.values() if p.remote == name]:
                self._release_prep_locked(p)
            try:
                self._agent.remove_remote_agent(name)
            except self._errors as e:
                log.warning("nixl: remove_remote_agent(%s): %s", name, e)

    def check_remote_descs(self, name: str, descs: Descs) -> bool:
        with self._lock:
            if name not in self._remotes:
                return False
            try:
                return bool(self._agent.check_remote_metadata(
                    name, self._agent.get_xfer_descs(descs.arr, descs.mem_type)))
            except self._errors:
                return False

    # ------------------------------------------------------------------ transfers
    def _precheck(self, remote: str, local: Descs) -> None:
        if remote not in self._remotes:
            raise RemoteNotLoaded(f"remote agent {remote!r} is not loaded")
        bad = self._local.uncovered(local)
        if bad >= 0:
            a, n, d = local.arr[bad].tolist()
            raise OutOfRange(f"local descriptor {bad} ({local.mem_type} addr=0x{a:x} len={n} "
                             f"dev={d}) is not inside any registered region")

    def _start(self, x: XferHandle, h, what: str) -> XferHandle:
        x.backend = h
        try:
            st = self._agent.transfer(h)
        except self._errors as e:
            self._release_backend(x)
            raise _map_error(e, what) from None
        x.state = {"DONE": DONE, "ERR": ERR}.get(st, PROC)
        if x.state == PROC:
            self._nixl_inflight.add(x.id)
        if x.state == ERR:
            x.error, x.cause = f"{what}: NIXL returned ERR at post", FailureCause.FAILED
        return x

    def submit_transfer(self, remote: str, local: Descs, remote_descs: Descs, notif: bytes = b"",
                        op: str = "WRITE", after=None) -> XferHandle:
        if op not in ("WRITE", "READ"):
            raise InvalidDescriptors(f"op must be WRITE or READ; found {op!r}")
        check_pair(local, remote_descs)
        with self._lock:
            self._precheck(remote, local)
            x = XferHandle(remote=remote, op=op, nbytes=local.total_bytes, ndescs=len(local))
            if not len(local):  # NIXL rejects empty lists; an empty transfer is just its notif
                if notif:
                    self.notify(remote, notif)
                x.state = DONE
                return x
            if self._write_direct(x, local, remote_descs, notif, after):
                return x
            _host_wait(after)
            try:
                h = self._agent.initialize_xfer(
                    op, self._agent.get_xfer_descs(local.arr, local.mem_type),
                    self._agent.get_xfer_descs(remote_descs.arr, remote_descs.mem_type),
                    remote, bytes(notif))
            except self._errors as e:
                raise _map_error(e, f"{op} to {remote!r}") from None
            return self._start(x, h, f"{op} to {remote!r}")

    def prep_descs(self, remote: str | None, descs: Descs) -> PrepHandle:
        with self._lock:
            if remote is not None and remote not in self._remotes:
                raise RemoteNotLoaded(f"remote agent {remote!r} is not loaded")
            if remote is None:
                bad = self._local.uncovered(descs)
                if bad >= 0:
                    raise OutOfRange(f"prepared local descriptor {bad} is not registered")
            try:
                h = self._agent.prep_xfer_dlist(remote if remote is not None else "NIXL_INIT_AGENT",
                                                descs.arr, descs.mem_type)
            except self._errors as e:
                raise _map_error(e, f"prep_descs({remote!r})") from None
            p = PrepHandle(descs=descs, remote=remote, backend=h)
            if self._direct is not None and descs.mem_type == "VRAM":
                # The direct write's plan, once per list instead of per transfer (issue 37: the
                # route, coverage, translation, merge and row table were ~60 numpy calls per
                # submit): a local list as is, a peer's with this process's mapped addresses.
                st = strided(descs)
                p.direct = st if remote is None else self._direct.map_strided(remote, st, descs)
            self._preps[p.id] = p
            return p

    def submit_prepped(self, remote: str, local: PrepHandle, local_idx, remote_side: PrepHandle,
                       remote_idx, notif: bytes = b"", op: str = "WRITE", after=None) -> XferHandle:
        li = np.asarray(local_idx, dtype=np.int64)
        ri = np.asarray(remote_idx, dtype=np.int64)
        if li.shape != ri.shape or li.ndim != 1:
            raise InvalidDescriptors(f"index lists must be 1-D and equal; found {li.shape} {ri.shape}")
        # Each numpy call here is on the critical path of every transfer, and runs cold there
        # (~10-30 µs): a negative index reads as a huge unsigned one, so one reduction checks
        # both bounds, and the rows are gathered once for the length check and the post.
        for idx, p, side in ((li, local, "local"), (ri, remote_side, "remote")):
            if idx.size and idx.view(np.uint64).max() >= len(p.descs):
                raise InvalidDescriptors(f"{side} index out of range 0..{len(p.descs) - 1}")
        src, dst = local.direct, remote_side.direct
        fast = (src is not None and dst is not None and src.length == dst.length
                and op == "WRITE" and remote_side.remote == remote)
        if not fast:
            la, ra = local.descs.arr[li], remote_side.descs.arr[ri]
            if li.size and not np.array_equal(la[:, 1], ra[:, 1]):
                raise InvalidDescriptors("prepared rows differ in length between local and remote")
        with self._lock:
            if remote not in self._remotes:
                raise RemoteNotLoaded(f"remote agent {remote!r} is not loaded")
            if local.backend is None or remote_side.backend is None:
                raise InvalidDescriptors("prepared list was released")
            if fast and li.size:
                # Both lists strided and this peer mapped (plans made at prep, dropped with
                # the peer): one index upload and one launch, no per-row work on the host.
                # `ndescs` counts the kernel's rows (it merges nothing; neither need it).
                x = XferHandle(remote=remote, op=op, nbytes=int(li.size) * src.length,
                               ndescs=int(li.size))
                event, x.ready = self._direct.write_strided(src, li, dst, ri, after)
                x.backend = _Direct(event, bytes(notif))
                return x
            if fast:
                la, ra = local.descs.arr[li], remote_side.descs.arr[ri]
            # NIXL merges rows adjacent on both sides; count what it will actually post.
            ndescs = int(merge_runs(la[:, 0], ra[:, 0], la[:, 1])[2].size) if li.size else 0
            x = XferHandle(remote=remote, op=op, nbytes=int(la[:, 1].sum()), ndescs=ndescs)
            if not li.size:
                if notif:
                    self.notify(remote, notif)
                x.state = DONE
                return x
            if self._write_direct(x, Descs(la, local.descs.mem_type),
                                  Descs(ra, remote_side.descs.mem_type), notif, after):
                return x
            _host_wait(after)
            try:
                h = self._agent.make_prepped_xfer(op, local.backend, li, remote_side.backend, ri,
                                                  bytes(notif))
            except self._errors as e:
                raise _map_error(e, f"prepped {op} to {remote!r}") from None
            return self._start(x, h, f"prepped {op} to {remote!r}")

    def _write_direct(self, x: XferHandle, local: Descs, remote_descs: Descs,
                      notif: bytes, after=None) -> bool:
        """(locked) Queue `x` as one kernel into the peer's mapped memory, when it can go so
        (ordered on the device after the CUDA event `after`, if given)."""
        if self._direct is None or x.op != "WRITE":
            return False
        mapped = self._direct.route(x.remote, local, remote_descs)
        if mapped is None:
            return False
        event, x.ready = self._direct.write(local, mapped, after)
        x.backend = _Direct(event, bytes(notif))
        return True

    def _release_prep_locked(self, p: PrepHandle) -> None:
        self._preps.pop(p.id, None)
        if p.backend is not None:
            try:
                self._agent.release_dlist_handle(p.backend)
            except self._errors as e:
                log.warning("nixl: release_dlist_handle: %s", e)
            p.backend = None

    def release_prepped(self, prep: PrepHandle) -> None:
        with self._lock:
            self._release_prep_locked(prep)

    def poll(self, handle: XferHandle) -> str:
        if handle.state != PROC:
            return handle.state
        if isinstance(handle.backend, _Direct):
            return self._poll_direct(handle)
        with self._lock:
            try:
                st = self._agent.check_xfer_state(handle.backend)
            except self._errors as e:
                err = _map_error(e, f"{handle.op} to {handle.remote!r}")
                handle.state, handle.error = ERR, str(err)
                handle.cause = FailureCause.PEER_LOST if isinstance(err, PeerLost) \
                    else FailureCause.FAILED
                return ERR
        if st != "PROC":
            self._nixl_inflight.discard(handle.id)
        if st == "DONE":
            handle.state = DONE
        elif st == "ERR":
            handle.state, handle.cause = ERR, FailureCause.FAILED
            handle.error = f"{handle.op} to {handle.remote!r}: NIXL reported ERR"
        return handle.state

    def orders_on_device(self, remote: str) -> bool:
        return self._direct is not None and remote in self._direct.peers

    def expect_writes_from(self, desc: bytes) -> None:
        if self._direct is None:
            return
        try:
            env = msgpack.unpackb(desc, raw=False)
        except Exception:
            return   # load_remote_agent, on the writer's side, says what is wrong with it
        if isinstance(env, dict):
            self._direct.expect(env.get("direct"))

    def ready_waiter(self):
        """Direct writes from a peer on this host end with an interprocess event: a receiver
        with CUDA here can wait on it (`DirectCopies.landed`)."""
        return self._direct

    def wait_any(self, handles) -> bool:
        """A direct write's kernel runs on this agent's one stream, so the oldest one in flight
        finishes first: wait for its event (torch releases the GIL while it waits), instead of
        spinning in Python against the threads that launch the model's kernels."""
        for h in handles:
            if h.state == PROC and isinstance(h.backend, _Direct):
                h.backend.event.synchronize()
                return True
        return False

    def _poll_direct(self, handle: XferHandle) -> str:
        d = handle.backend
        if not d.event.query():
            return PROC
        if d.notif:   # every byte is in the peer's memory: now the notification may go
            try:
                self.notify(handle.remote, d.notif)
            except TransferError as e:
                handle.state, handle.error = ERR, str(e)
                handle.cause = FailureCause.PEER_LOST if isinstance(e, (PeerLost, RemoteNotLoaded)) \
                    else FailureCause.FAILED
                return ERR
        handle.state = DONE
        return DONE

    def stats(self, handle: XferHandle) -> dict | None:
        if not self._telemetry or handle.backend is None:
            return None
        with self._lock:
            try:
                t = self._agent.get_xfer_telemetry(handle.backend)
            except self._errors:
                return None
        return {k: getattr(t, k) for k in ("descCount", "totalBytes", "postDuration",
                                            "xferDuration") if hasattr(t, k)}

    def _release_backend(self, handle: XferHandle) -> None:
        if isinstance(handle.backend, _Direct):
            handle.backend = None   # a finished kernel holds nothing; a running one its event
            return
        if handle.backend is not None:
            try:
                self._agent.release_xfer_handle(handle.backend)
            except self._errors as e:
                log.warning("nixl: release_xfer_handle: %s", e)
            handle.backend = None

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            self._nixl_inflight.discard(handle.id)
            self._release_backend(handle)

    # ------------------------------------------------------------------ notifications
    def notify(self, remote: str, msg: bytes) -> None:
        with self._lock:
            if remote not in self._remotes:
                raise RemoteNotLoaded(f"remote agent {remote!r} is not loaded")
            try:
                self._agent.send_notif(remote, bytes(msg))
            except self._errors as e:
                raise _map_error(e, f"notify {remote!r}") from None

    def progress(self) -> None:
        """Drive NIXL: at most every `PROGRESS_IDLE_S` while no NIXL write of ours is in flight
        (each call is a UCX worker progress holding the GIL; a transfer thread spinning on a
        direct write's event would otherwise call it thousands of times per transfer)."""
        now = time.monotonic()
        if not self._nixl_inflight and now - self._last_progress < PROGRESS_IDLE_S:
            return
        self._last_progress = now
        self._progress()

    def _progress(self) -> None:
        with self._lock:
            try:
                new = self._agent.get_new_notifs()
            except self._errors as e:
                log.warning("nixl: get_new_notifs: %s", e)
                return
            for k, v in new.items():
                k = k.decode() if isinstance(k, bytes) else str(k)
                self._notifs.setdefault(k, []).extend(bytes(m) for m in v)

    def get_notifications(self) -> dict[str, list[bytes]]:
        self._progress()
        with self._lock:
            out, self._notifs = self._notifs, {}
        return out

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in list(self._preps.values()):
                self._release_prep_locked(p)
            for name in list(self._remotes):
                try:
                    self._agent.remove_remote_agent(name)
                except self._errors:
                    pass
            self._remotes.clear()
            if self._direct is not None:
                self._direct.close()
            for h in list(self._regs.values()):
                try:
                    self._agent.deregister_memory(h.backend)
                except self._errors:
                    pass
            self._regs.clear()
            self._agent = None

    def describe(self) -> dict:
        d = super().describe()
        d.update(backend="UCX", progress_thread=self.progress_thread, ucx=dict(self.ucx))
        if self._direct is not None:
            d["direct"] = {"peers": sorted(self._direct.peers), "exported": len(self._direct.exports),
                           "not_direct": dict(self._direct.refused)}
        if self.ucx_overrides:
            d["ucx_env"] = dict(self.ucx_overrides)
        return d
