"""The leader's side of a multi-rank worker: spawn the followers, run rank 0, broadcast steps,
call functions on every rank, watch the followers.

``RankGroup.launch(...)`` spawns ranks 1..N-1 (``python -m worker.parallel.rank_worker``), builds rank 0's
shard in this process, and returns once every rank is ready. ``group.runner`` is a
:class:`ParallelRunner`, a drop-in for :class:`worker.runner.ModelRunner` that sends each step's
chunks to the followers before running rank 0's part of it; block ids are global (one scheduler),
so every rank's pool mirrors the same block table.

Failure model: a follower that exits — crash, kill, OOM — is noticed by the watchdog thread
within ``WATCH_INTERVAL_S``; the group then records ``failure``, kills the other followers, aborts
rank 0's process groups (a step in flight fails at once instead of waiting out the collective
timeout) and calls every ``on_failure`` callback. Nothing restarts: the worker is expected to exit
non-zero and be restarted whole. Followers die with the leader (``PR_SET_PDEATHSIG`` plus the
step channel's EOF), so a killed leader leaves no orphans.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from worker.parallel.comm import (ParallelConfigError, RankComm, RankLayout, WireClosed, encode_chunks,
                             rank_timeout_s, recv_msg, send_msg)

log = logging.getLogger("splitserve.worker.ranks")

__all__ = ["RankGroup", "ParallelRunner", "RankGroupFailed", "RankStartupError", "RankCallError"]

WATCH_INTERVAL_S = 0.1
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: spawn
# from one thread that lives as long as the process, whichever (maybe short-lived) thread launches.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rank-spawner")


class RankGroupFailed(RuntimeError):
    """A rank of this worker died or the group was shut down; the worker cannot step any more."""


class RankStartupError(RankGroupFailed, OSError):
    """A follower failed to start (bad model, no memory, died while loading)."""


class RankCallError(RuntimeError):
    """A function run on a follower rank raised; ``rank``, ``type_name`` name where and what."""

    def __init__(self, rank: int, type_name: str, message: str) -> None:
        super().__init__(f"rank {rank}: {type_name}: {message}")
        self.rank, self.type_name, self.message = rank, type_name, message


def _rethrow(rank: int, reply: dict) -> BaseException:
    """A follower's error as the same exception class when it is one of ours (so callers catch
    e.g. ``transfer.errors.SessionError`` whichever rank raised it), else :class:`RankCallError`."""
    mod, name, msg = reply.get("module", ""), reply.get("type", "Exception"), reply.get("error", "")
    if mod.startswith(("transfer.", "worker.")):
        try:
            import importlib

            cls = getattr(importlib.import_module(mod), name)
            if isinstance(cls, type) and issubclass(cls, Exception):
                return cls(f"rank {rank}: {msg}")
        except Exception:  # an exception class with another constructor: report it generically
            pass
    return RankCallError(rank, name, msg)


class _Follower:
    def __init__(self, rank: int, proc: subprocess.Popen, step: socket.socket, rpc: socket.socket):
        self.rank, self.proc, self.step, self.rpc = rank, proc, step, rpc
        self.rpc_lock = threading.Lock()
        self.next_id = 0
        self.page_table: dict | None = None


class RankGroup:
    """All ranks of one worker, seen from rank 0. Thread-safe: ``call*`` may run on any thread
    (the event loop for transfer hooks, the step thread for steps)."""

    def __init__(self, layout: RankLayout, model_name: str, model_config, runner, comm: RankComm,
                 followers: list[_Follower], tmpdir: str) -> None:
        from worker.parallel.rank_worker import RankContext

        self.layout = layout
        self.model_name = model_name
        self.model_config = model_config
        self.comm = comm
        self.followers = followers
        self.context = RankContext(layout, runner, model_config, model_name)
        self.runner = ParallelRunner(self, runner)
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self._tmpdir = tmpdir
        self._closing = False
        self._state_lock = threading.Lock()
        self._watch = threading.Thread(target=self._watchdog, name="rank-watchdog", daemon=True)
        self._watch.start()

    # ------------------------------------------------------------------ launch
    @classmethod
    def launch(cls, model: str, model_config, *, tp_size: int, pp_size: int, device, dtype,
               num_blocks: int, block_size: int, startup_timeout_s: float = 600.0,
               log_level: str = "WARNING", cpu_threads: int | None = None) -> "RankGroup":
        """Spawn followers, build rank 0, wait for every rank. Raises :class:`ParallelConfigError`
        for layouts the model or machine cannot run, :class:`RankGroupFailed` when a follower fails
        to start (its error is in the message and on stderr)."""
        import torch

        from worker.runner import ModelRunner
        from worker.parallel.tp_model import build_rank_model

        layout = RankLayout(tp_size=tp_size, pp_size=pp_size, rank=0)
        layout.check_model(model_config)
        world = layout.world_size
        device = torch.device(device)
        if device.type == "cuda":
            n = torch.cuda.device_count()
            base = device.index or 0
            if base + world > n:
                raise ParallelConfigError(f"tp_size×pp_size = {world} ranks need one GPU each "
                                          f"from cuda:{base}; torch sees {n} GPU(s)")
            device = torch.device("cuda", base)
        timeout_s = rank_timeout_s()
        tmpdir = tempfile.mkdtemp(prefix="splitserve-ranks-")
        os.chmod(tmpdir, 0o700)
        store_path = os.path.join(tmpdir, "store")
        followers: list[_Follower] = []
        comm = None
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([_REPO_ROOT, *filter(None, [env.get("PYTHONPATH")])])
            cfg_dict = model_config.as_dict()
            for r in range(1, world):
                step_a, step_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                rpc_a, rpc_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    proc = _SPAWNER.submit(
                        subprocess.Popen,
                        [sys.executable, "-m", "worker.parallel.rank_worker", "--step-fd", str(step_b.fileno()),
                         "--rpc-fd", str(rpc_b.fileno()), "--leader-pid", str(os.getpid())],
                        pass_fds=(step_b.fileno(), rpc_b.fileno()), env=env, cwd=_REPO_ROOT,
                        stdin=subprocess.DEVNULL).result()
                finally:
                    step_b.close()
                    rpc_b.close()
                f = _Follower(r, proc, step_a, rpc_a)
                followers.append(f)
                rdev = f"cuda:{device.index + r}" if device.type == "cuda" else "cpu"
                send_msg(step_a, {
                    "op": "init", "rank": r, "tp_size": tp_size, "pp_size": pp_size,
                    "model": model, "config": cfg_dict, "device": rdev,
                    "dtype": str(dtype).removeprefix("torch."), "num_blocks": num_blocks,
                    "block_size": block_size, "store_path": store_path, "timeout_s": timeout_s,
                    "log_level": log_level, "cpu_threads": cpu_threads})
            comm = cls._rendezvous(layout, store_path, device, timeout_s, followers, startup_timeout_s)
            model_shard = build_rank_model(model, model_config, layout, comm, device, dtype)
            runner = ModelRunner(model_shard, num_blocks, block_size, device=device, dtype=dtype,
                                 cuda_graphs=False)
            deadline = time.monotonic() + startup_timeout_s
            for f in followers:
                f.step.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    msg = recv_msg(f.step)
                except (socket.timeout, WireClosed, OSError) as e:
                    raise RankStartupError(f"rank {f.rank} (pid {f.proc.pid}) did not start: "
                                          f"{_exit_note(f.proc) or e}") from None
                finally:
                    f.step.settimeout(None)
                if msg.get("op") != "ready":
                    raise RankStartupError(f"rank {f.rank} failed to start: {msg.get('error', msg)}")
                f.page_table = msg["page_table"]
        except BaseException:
            if comm is not None:
                comm.abort()
            _kill_all(followers)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        log.info("rank group up: tp=%d pp=%d, follower pids %s", tp_size, pp_size,
                 [f.proc.pid for f in followers])
        return cls(layout, model, model_config, runner, comm, followers, tmpdir)

    @staticmethod
    def _rendezvous(layout, store_path, device, timeout_s, followers, startup_timeout_s) -> RankComm:
        """Join the process groups on a helper thread so a follower that dies while starting
        fails the launch at once instead of after the store's timeout."""
        box: dict[str, Any] = {}

        def join():
            try:
                box["comm"] = RankComm(layout, store_path, device, timeout_s)
            except BaseException as e:  # handed to the launching thread
                box["error"] = e

        t = threading.Thread(target=join, name="rank-rendezvous", daemon=True)
        t.start()
        deadline = time.monotonic() + startup_timeout_s
        while t.is_alive():
            t.join(0.05)
            for f in followers:
                if f.proc.poll() is not None:
                    raise RankStartupError(f"rank {f.rank} (pid {f.proc.pid}) exited while starting: "
                                          f"{_exit_note(f.proc)}")
            if time.monotonic() > deadline:
                raise RankStartupError(f"ranks did not meet within {startup_timeout_s:.0f}s")
        if "error" in box:
            raise RankStartupError(f"rank 0 could not join the process groups: {box['error']}")
        return box["comm"]

    # ------------------------------------------------------------------ identity
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def pids(self) -> list[int]:
        """Process id of every rank, in rank order (rank 0 is this process)."""
        return [os.getpid()] + [f.proc.pid for f in self.followers]

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._closing

    def _check(self) -> None:
        if self.failure is not None:
            raise RankGroupFailed(self.failure)
        if self._closing:
            raise RankGroupFailed("the rank group is shut down")

    # ------------------------------------------------------------------ steps
    def broadcast_step(self, chunks) -> None:
        """Send one step's chunks to every follower (they run it as soon as it arrives)."""
        self._check()
        msg = {"op": "step", "chunks": encode_chunks(chunks)}
        for f in self.followers:
            try:
                send_msg(f.step, msg)
            except OSError as e:
                self._fail(f"rank {f.rank} (pid {f.proc.pid}) is unreachable: {e}")
                raise RankGroupFailed(self.failure) from None

    # ------------------------------------------------------------------ calls on every rank
    def call(self, rank: int, fn: str, *args) -> Any:
        """Run ``fn(ctx, *args)`` on one rank (``fn`` is ``"module:function"``; arguments and
        result travel as msgpack)."""
        if rank == 0:
            from worker.parallel.rank_worker import resolve_callable

            return resolve_callable(fn)(self.context, *args)
        f = self._follower(rank)
        with f.rpc_lock:
            self._request(f, {"op": "call", "fn": fn, "args": list(args)})
            return self._reply(f)

    def call_all(self, fn: str, *args, per_rank: Sequence[Sequence] | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank concurrently; results in rank order. With
        ``per_rank``, rank ``r`` gets ``*per_rank[r]`` instead of ``*args``. If any rank raised,
        every rank still finished its call and the first error (lowest rank) is raised."""
        from worker.parallel.rank_worker import resolve_callable

        target = resolve_callable(fn)
        arg_of = (lambda r: list(per_rank[r])) if per_rank is not None else (lambda r: list(args))
        if per_rank is not None and len(per_rank) != self.world_size:
            raise ValueError(f"per_rank has {len(per_rank)} entries for {self.world_size} ranks")
        locks = [f.rpc_lock for f in self.followers]
        for lk in locks:
            lk.acquire()
        try:
            for f in self.followers:
                self._request(f, {"op": "call", "fn": fn, "args": arg_of(f.rank)})
            results: list[Any] = [None] * self.world_size
            errors: list[tuple[int, BaseException]] = []
            try:
                results[0] = target(self.context, *arg_of(0))
            except Exception as e:
                errors.append((0, e))
            for f in self.followers:
                try:
                    results[f.rank] = self._reply(f)
                except RankGroupFailed:
                    raise
                except Exception as e:
                    errors.append((f.rank, e))
        finally:
            for lk in locks:
                lk.release()
        if errors:
            raise min(errors, key=lambda x: x[0])[1]
        return results

    def rpc(self, rank: int, op: str, **fields) -> Any:
        """A built-in RPC (``ping``, ``page_table``, ``read_blocks``) on a follower."""
        f = self._follower(rank)
        with f.rpc_lock:
            self._request(f, {"op": op, **fields})
            return self._reply(f)

    def rank_page_tables(self) -> list[dict]:
        """Every rank's page table (its runner's ``page_table()`` plus its rank fields), rank order.
        Base pointers are addresses in each rank's own process."""
        return [self.context.page_table()] + [self.rpc(f.rank, "page_table") for f in self.followers]

    def _follower(self, rank: int) -> _Follower:
        if not 1 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), found {rank}")
        return self.followers[rank - 1]

    def _request(self, f: _Follower, msg: dict) -> None:
        self._check()
        f.next_id += 1
        msg["id"] = f.next_id
        try:
            send_msg(f.rpc, msg)
        except OSError as e:
            self._fail(f"rank {f.rank} (pid {f.proc.pid}) is unreachable: {e}")
            raise RankGroupFailed(self.failure) from None

    def _reply(self, f: _Follower) -> Any:
        try:
            reply = recv_msg(f.rpc)
        except (WireClosed, OSError) as e:
            self._fail(f"rank {f.rank} (pid {f.proc.pid}) closed its RPC channel: "
                       f"{_exit_note(f.proc) or e}")
            raise RankGroupFailed(self.failure) from None
        if reply.get("id") != f.next_id:
            self._fail(f"rank {f.rank} answered RPC {reply.get('id')} while {f.next_id} was pending")
            raise RankGroupFailed(self.failure)
        if reply.get("ok"):
            return reply.get("result")
        raise _rethrow(f.rank, reply)

    # ------------------------------------------------------------------ failure and shutdown
    def step_failed(self, exc: BaseException, grace_s: float = 2.0) -> str:
        """A step raised on rank 0: name the cause — usually a follower that died (its sockets
        close a moment before the watchdog sees it exit) — fail the group, return the reason."""
        deadline = time.monotonic() + grace_s
        while self.failure is None and time.monotonic() < deadline:
            dead = next((f for f in self.followers if f.proc.poll() is not None), None)
            if dead is not None:
                self._fail(f"rank {dead.rank} (pid {dead.proc.pid}) exited: {_exit_note(dead.proc)}")
                break
            time.sleep(0.01)
        self._fail(f"rank 0's step failed: {type(exc).__name__}: {exc}")
        return self.failure or f"{type(exc).__name__}: {exc}"

    def _watchdog(self) -> None:
        while not self._closing and self.failure is None:
            for f in self.followers:
                if f.proc.poll() is not None and not self._closing:
                    self._fail(f"rank {f.rank} (pid {f.proc.pid}) exited: {_exit_note(f.proc)}")
                    return
            time.sleep(WATCH_INTERVAL_S)

    def _fail(self, reason: str) -> None:
        with self._state_lock:
            if self.failure is not None or self._closing:
                return
            self.failure = reason
        log.error("multi-rank worker failed: %s", reason)
        self.comm.abort()
        _kill_all(self.followers)
        for cb in list(self.on_failure):
            try:
                cb(reason)
            except Exception:
                log.exception("rank-failure callback")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell every follower to stop, wait for them (killing stragglers), release resources.
        Idempotent."""
        with self._state_lock:
            if self._closing:
                return
            self._closing = True
        for f in self.followers:
            try:
                send_msg(f.step, {"op": "stop"})
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for f in self.followers:
            try:
                f.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d (pid %d) did not stop in time; killing it", f.rank, f.proc.pid)
        _kill_all(self.followers)
        self.context.run_at_exit()
        if self.failure is None:
            self.comm.shutdown()
        else:
            self.comm.abort()
        for f in self.followers:
            for s in (f.step, f.rpc):
                s.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _exit_note(proc: subprocess.Popen) -> str:
    rc = proc.poll()
    if rc is None:
        return ""
    if rc < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _kill_all(followers: list[_Follower]) -> None:
    for f in followers:
        if f.proc.poll() is None:
            try:
                f.proc.kill()
            except ProcessLookupError:
                pass
    for f in followers:
        try:
            f.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.error("rank %d (pid %d) survived SIGKILL for 5 s", f.rank, f.proc.pid)


class ParallelRunner:
    """Rank 0's :class:`worker.runner.ModelRunner` seen as the whole worker's runner.

    ``step`` broadcasts the chunks then runs rank 0's part; the collectives inside pair it with
    the followers. ``cfg`` is the *full* model config (what the engine and the transfer layer
    size things by); ``shard_cfg`` is rank 0's. Pool geometry (``num_blocks``, ``block_size``)
    is the same on every rank. ``page_table()`` is rank 0's; ``rank_page_tables()`` has all."""

    def __init__(self, group: RankGroup, inner) -> None:
        self.group = group
        self.inner = inner
        self.cfg = group.model_config
        self.shard_cfg = inner.cfg
        self.num_blocks = inner.num_blocks
        self.block_size = inner.block_size
        self.device = inner.device
        self.dtype = inner.dtype
        self.vocab_size = inner.vocab_size
        #: Every rank resolves ``auto`` alike (worker/attention): rank 0's answer is the worker's.
        self.attention_backend = inner.attention_backend

    @property
    def kv_cache(self):
        return self.inner.kv_cache

    @kv_cache.setter
    def kv_cache(self, t) -> None:
        self.inner.kv_cache = t

    def step(self, chunks):
        from worker.runner import RunnerInputError

        g = self.group
        g.broadcast_step(chunks)
        try:
            return self.inner.step(chunks)
        except RunnerInputError:
            raise  # rejected identically on every rank before any collective: still in step
        except Exception as e:
            # Anything else leaves the ranks' collectives out of step: the group is finished.
            raise RankGroupFailed(g.step_failed(e)) from e

    def page_table(self) -> dict:
        return self.group.context.page_table()

    def rank_page_tables(self) -> list[dict]:
        return self.group.rank_page_tables()

    def read_blocks(self, block_ids):
        return self.inner.read_blocks(block_ids)

    def write_blocks(self, block_ids, data) -> None:
        self.inner.write_blocks(block_ids, data)

    @property
    def block_bytes(self) -> int:
        return self.inner.block_bytes

    @property
    def block_stride(self) -> int:
        return self.inner.block_stride
