"""Child processes for the tests and benchmarks: start one in its own session with its output in a
log file, wait until it serves, stop it (and whatever it started) without leaving anything behind.

Each child leads a new session (``start_new_session``), so a terminal's Ctrl-C reaches only the
parent, which stops its children in order, and the child's own children (a fleet launcher's
processes) stay in its process group, where one ``killpg`` reaches them all.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from splitserve_testing.proctable import listening_sockets, tree

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def clean_env(base: dict | None = None, **extra) -> dict:
    """``base`` (default ``os.environ``) without ``SPLITSERVE_*`` variables, which would override the
    flags a caller passes, and ``PROMETHEUS_MULTIPROC_DIR``, which would make a child write its
    metrics into the caller's directory; plus ``extra`` (values as strings)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("SPLITSERVE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Proc:
    """One child process, stdout and stderr into ``log``.

    ``group=False`` (tests): ``stop`` sends SIGTERM to the child alone, so its own shutdown path
    (a launcher stopping its fleet) is what runs, and SIGKILLs its process group only when it does
    not exit within the grace period. ``group=True`` (benchmarks): SIGTERM goes to the whole group
    at once and whatever of the group is left after the child exited is SIGKILLed.
    ``header`` writes ``$ argv`` first into the log; ``append=False`` truncates the log.
    """

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None, *,
                 cwd: Path | str | None = ROOT, group: bool = False, header: bool = False,
                 append: bool = True):
        self.name, self.argv, self.log_path = name, [str(a) for a in argv], Path(log)
        self.env = clean_env() if env is None else env
        self.cwd, self.group, self.header, self.append = cwd, group, header, append
        self.p: subprocess.Popen | None = None
        self._log = None
        self.escalated = False   # the last stop needed SIGKILL
        self.start()

    def start(self) -> None:
        """Start the process (again, after ``stop``: same argv, same log)."""
        self.terminated = False
        if self._log is not None and not self._log.closed:
            self._log.close()
        self._log = open(self.log_path, "ab" if self.append else "wb")
        if self.header:
            self._log.write(("$ " + shlex.join(self.argv) + "\n").encode())
            self._log.flush()
        self.p = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=self.env,
                                  cwd=None if self.cwd is None else str(self.cwd),
                                  start_new_session=True)

    @property
    def pid(self) -> int:
        return self.p.pid

    @property
    def returncode(self) -> int | None:
        return self.p.poll()

    def alive(self) -> bool:
        return self.p.poll() is None

    def log(self) -> str:
        """The whole log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the log."""
        return "\n".join(self.log().splitlines()[-n:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child alone, if it still runs."""
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.p.pid, sig)

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child's process group (ours alone: ``start_new_session``)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.p.pid, sig)

    def terminate(self) -> None:
        """The first step of ``stop``: SIGTERM to the child, or to its group with ``group=True``."""
        if self.p.poll() is None:
            self.terminated = True
            if self.group:
                self.killpg(signal.SIGTERM)
            else:
                self.kill(signal.SIGTERM)

    def stop(self, grace: float = 15.0) -> int | None:
        """``terminate``, wait up to ``grace`` seconds, SIGKILL the group if needed; close the log.
        Returns the exit code (negative: the signal that ended it)."""
        self.escalated = False
        if self.p.poll() is None:
            # Once: a second SIGTERM during a graceful drain (stop_all's terminate, then this) hits
            # a process that already removed its handler and kills it with -15.
            if not self.terminated:
                self.terminate()
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                self.escalated = True
                self.killpg(signal.SIGKILL)
        if self.group:
            # Children of a launcher may outlive it.
            self.killpg(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(5)
        if self._log is not None and not self._log.closed:
            self._log.close()
        return self.p.returncode


def stop_all(procs: Iterable[Proc], grace: float = 10.0) -> dict[str, int | None]:
    """Stop ``procs`` together: ``terminate`` every one first (they shut down in parallel), then
    reap each, last started first. → ``{name: exit code}``, None for one that needed SIGKILL."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    codes: dict[str, int | None] = {}
    for p in reversed(procs):
        code = p.stop(grace)
        codes[p.name] = None if p.escalated else code
    return codes


def _as_list(procs: Proc | Iterable[Proc] | None) -> list[Proc]:
    if procs is None:
        return []
    return [procs] if isinstance(procs, Proc) else list(procs)


def wait_for(pred: Callable[[], T], timeout: float, what: str, proc: Proc | Iterable[Proc] | None = None,
             interval: float = 0.05, error: type[Exception] = AssertionError) -> T:
    """Poll ``pred`` until it returns something true and return that. Raises ``error`` when one of
    ``proc`` exits meanwhile or after ``timeout`` seconds, with the last exception ``pred`` raised and
    the end of the log(s)."""
    procs = _as_list(proc)
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - polling: keep the last error for the message
            last = e
        for p in procs:
            if not p.alive():
                raise error(f"{p.name} exited ({p.p.returncode}) while waiting for {what}; "
                            f"{p.log_path} ends with:\n{p.log()[-3000:]}")
        time.sleep(interval)
    tails = "".join(f"\n--- {p.name} ({p.log_path}):\n{p.log()[-3000:]}" for p in procs)
    raise error(f"timed out after {timeout:g}s waiting for {what} (last error: {last}){tails}")


def http_status(url: str, body: dict | None = None, timeout: float = 2.0) -> int:
    """Status of a GET (or, with ``body``, a JSON POST) to ``url``; 0 when it could not be sent."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return 0


def serves(proc: Proc, port: int) -> bool:
    """Whether ``proc`` or a process it started listens on TCP ``port``."""
    return any(proto.startswith("tcp") and p == port
               for pid in tree(proc.pid) for proto, _, p in listening_sockets(pid))


def wait_http(url: str, timeout: float, proc: Proc | Iterable[Proc] | None = None, body: dict | None = None,
              interval: float = 0.1, error: type[Exception] = RuntimeError, *,
              served_by: Proc | None = None) -> None:
    """Until ``url`` answers 200 (see ``wait_for`` for the failures).

    With ``served_by`` (a child on loopback), until the answer comes from that child: it, or a
    process it started, listens on the url's port. A port picked free (``free_port``) is only
    free when picked: another program that picked the same one, such as another benchmark process
    running beside this one, can bind it first and then answer in the child's place, while the
    child fails to bind and exits; without this check that other process passes for the child
    until it stops. The child's exit is then the failure, with its log ("Address already in use").
    """
    procs = _as_list(proc)
    if served_by is None:
        wait_for(lambda: http_status(url, body) == 200, timeout, url, procs, interval, error)
        return
    port = urllib.parse.urlsplit(url).port
    if port is None:
        raise ValueError(f"served_by needs a url with an explicit port, got {url!r}")
    if served_by not in procs:
        procs.append(served_by)
    wait_for(lambda: http_status(url, body) == 200 and serves(served_by, port),
             timeout, f"{url} served by {served_by.name} (pid {served_by.pid})", procs, interval, error)
