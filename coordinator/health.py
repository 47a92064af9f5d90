"""Active health: prepares servers (`GET /server_info`) and probes them (`GET /health`) on an interval.

One tick checks every server concurrently, each call bounded by `timeout_s`, so a hung worker
delays nothing but its own probe. Ticks start every `interval_s` (fixed rate), and a tick starts
its checks spread evenly over the first `SPREAD` of the interval rather than all at once: each
server is still checked once per interval, but the coordinator's event loop never takes every
server's answer in one burst (32 answers at once can hold placements behind them; the first
tick, at start-up, still prepares every server at once). The loop only reports results; every
decision (eject, readmit, refuse) is the registry's, applied through the coordinator's
`on_prepared` hook so that the KV side (subscribe, resync on restart) follows the same transition.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import aiohttp
import orjson

from coordinator.registry import Registry, ServerEntry, ServerState

log = logging.getLogger("splitserve.coordinator.health")

PreparedHook = Callable[[ServerEntry, dict], None]

SPREAD = 0.5     # part of the interval over which one tick's checks start


class HealthMonitor:
    """Drives `Registry` from real HTTP calls. `start()` spawns the loop; `kick(url)` prepares a
    server now (new registration) instead of waiting for the next tick."""

    def __init__(self, registry: Registry, *, interval_s: float, timeout_s: float,
                 on_prepared: PreparedHook, on_tick: Callable[[float], Awaitable[None] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, info_refresh_s: float = 30.0):
        self.registry = registry
        self.interval_s = interval_s
        # A healthy server's /server_info is re-read this often (instead of one probe): a worker
        # restarted between two probes may have new KV-event ports and a new worker id.
        self.info_refresh_s = info_refresh_s
        self._info_at: dict[str, float] = {}
        self.timeout_s = timeout_s
        self.on_prepared = on_prepared
        self.on_tick = on_tick
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._inflight: dict[str, asyncio.Task] = {}
        self.ticks = 0
        self.probes = 0
        self.probe_failures = 0
        self.check_errors = 0
        self._reported: dict[str, float] = {}

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            # Probes must not be slowed or confused by proxies configured for client traffic.
            trust_env=False,
        )
        await self.tick()  # first preparation happens before the service reports its URL
        self._task = asyncio.create_task(self._loop(), name="coordinator-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for t in list(self._inflight.values()):
            t.cancel()
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        self._inflight.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("HealthMonitor.start() has not been called")
        return self._session

    def reread(self, url: str) -> None:
        """Re-read the server's `/server_info` at its next check (a restart may have replaced
        it), and check it now."""
        self._info_at.pop(url, None)
        self.kick(url)

    def kick(self, url: str) -> None:
        """Check one server now (registration, readmission), unless a check is already running."""
        if self._session is None or url in self._inflight:
            return
        t = asyncio.get_running_loop().create_task(self._check(url))
        self._inflight[url] = t
        t.add_done_callback(lambda _t, u=url: self._check_done(u, _t))

    def _check_done(self, url: str, t: asyncio.Task) -> None:
        self._inflight.pop(url, None)
        if not t.cancelled() and t.exception() is not None:
            self._report(url, t.exception())

    def _report(self, url: str, exc: BaseException) -> None:
        """A check that raised (a bug, e.g. in the on_prepared hook): never swallowed. Logged
        with the server, counted, and retried by the next tick."""
        self.check_errors += 1
        now = self.clock()
        if now - self._reported.get(url, -1e18) >= 30.0:
            self._reported[url] = now
            log.error("checking %s failed: %s: %s", url, type(exc).__name__, exc,
                      exc_info=(type(exc), exc, exc.__traceback__))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            # fixed rate: a tick slowed by a hung server's probe does not push the later ones back,
            # and ticks never overlap (one that overran its interval is followed at once)
            due = max(due + self.interval_s, loop.time())
            try:
                await self.tick(self.interval_s * SPREAD)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one tick must not end health checking
                log.exception("health tick failed")

    async def tick(self, spread_s: float = 0.0) -> None:
        """Check every server once; their starts spread evenly over `spread_s` seconds."""
        self.ticks += 1
        now = self.clock()
        self.registry.expire_registrations(now)
        urls = [u for u in list(self.registry.servers) if u not in self._inflight]
        step = spread_s / len(urls) if spread_s > 0 and len(urls) > 1 else 0.0
        loop = asyncio.get_running_loop()
        tasks = []
        for i, u in enumerate(urls):
            if step and i:
                await asyncio.sleep(step)
                if u in self._inflight:
                    continue      # kicked while the tick was spreading its checks (`_check`
                                  # itself skips a server removed meanwhile)
            t = loop.create_task(self._check(u))
            self._inflight[u] = t
            t.add_done_callback(lambda _t, uu=u: self._check_done(uu, _t))
            tasks.append(t)
        if tasks:
            # Exceptions are reported by _check_done (per server); gather only waits.
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.on_tick is not None:
            r = self.on_tick(self.clock())
            if r is not None:
                await r

    async def _check(self, url: str) -> None:
        e = self.registry.get(url)
        if e is None:
            return
        state = e.state
        if state is ServerState.HEALTHY and \
                self.clock() - self._info_at.get(url, -1e18) >= self.info_refresh_s:
            await self._prepare(url)
            return
        if state is ServerState.HEALTHY:
            err = await self._probe(url)
            now = self.clock()
            if err is None:
                self.registry.probe_ok(url, now)
            else:
                self.registry.probe_failed(url, err, now)
            return
        if state is ServerState.UNHEALTHY:
            if not self.registry.may_readmit(e, self.clock()):
                return
            err = await self._probe(url)
            if err is not None:
                e.last_error = err
                return
        # pending, refused, or an ejected server that answers again: (re)read its /server_info.
        await self._prepare(url)

    async def _probe(self, url: str) -> str | None:
        self.probes += 1
        try:
            async with self.session.get(url + "/health", allow_redirects=False) as r:
                await r.read()
                if r.status == 200:
                    return None
                err = f"GET /health answered {r.status}"
        except asyncio.TimeoutError:
            err = f"GET /health timed out after {self.timeout_s:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            err = f"GET /health failed: {type(exc).__name__}: {exc}"
        self.probe_failures += 1
        return err

    def _info_failed(self, url: str, error: str) -> None:
        e = self.registry.get(url)
        if e is not None and e.state is ServerState.HEALTHY:
            self.probe_failures += 1
            self.registry.probe_failed(url, error, self.clock())
        else:
            self.registry.prepare_failed(url, error, self.clock())

    async def _prepare(self, url: str) -> None:
        try:
            async with self.session.get(url + "/server_info", allow_redirects=False) as r:
                body = await r.read()
                status = r.status
        except asyncio.TimeoutError:
            self._info_failed(url, f"GET /server_info timed out after {self.timeout_s:g}s")
            return
        except (aiohttp.ClientError, OSError) as exc:
            self._info_failed(url, f"GET /server_info failed: {type(exc).__name__}: {exc}")
            return
        if status == 404:
            # A stock engine without /server_info: admit it once it is healthy; its KV events, if
            # any, come from the config (`kv_events`).
            err = await self._probe(url)
            if err is not None:
                self._info_failed(url, err)
                return
            info: dict = {}
        elif status != 200:
            self._info_failed(url, f"GET /server_info answered {status}")
            return
        else:
            try:
                info = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                self._info_failed(url, f"GET /server_info returned invalid JSON: {exc}")
                return
            if not isinstance(info, dict):
                self._info_failed(url, f"GET /server_info returned {type(info).__name__}, "
                                       "expected an object")
                return
        e = self.registry.get(url)
        if e is not None:
            self._info_at[url] = self.clock()
            self.on_prepared(e, info)
