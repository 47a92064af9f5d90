"""Which coordinator replica serves placements (docs/failover.md).

Every replica is a whole coordinator: it probes every server and consumes every server's KV
events, so each one's index is warm. Exactly one of them should answer placements, lease calls
and identity leases; the others answer those with `protocol.coord.NotServing` (421), naming the
one they defer to, and the fleet's `ReplicaClient` (coordinator/client.py) moves there.

Backends (`Election`): `Solo` (one coordinator: always serving), `OrderedReplicas` (the default:
the ordered replica list, no consensus: a replica serves when no replica ahead of it in the list
is up and warm). The coordinator reads
`serving` on every placement (an attribute, no call) and `kick()`s the backend when it had to
refuse one, so a replica that is about to take over re-checks at once instead of at its next tick.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import aiohttp
import orjson

log = logging.getLogger("splitserve.coordinator.election")

REPLICA_PATH = "/replica"


class Election(Protocol):
    serving: bool               # this replica answers placements now
    serving_url: str | None     # the one that does, when known (None: this one, or unknown)

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def kick(self) -> None: ...

    def describe(self) -> dict: ...


class Solo:
    """One coordinator: it always serves."""
    serving = True
    serving_url = None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def kick(self) -> None:
        return None

    def describe(self) -> dict:
        return {"backend": "solo", "serving": True}


def own_index(replicas: list[str], hostname: str) -> int:
    """This machine's position in `replicas`: the one whose host is `hostname` or starts with
    `hostname.` (a StatefulSet pod `coord-1` behind `http://coord-1.coord-hl.ns.svc:8001`)."""
    from urllib.parse import urlsplit
    for i, u in enumerate(replicas):
        host = (urlsplit(u).hostname or "").lower()
        if host == hostname.lower() or host.startswith(hostname.lower() + "."):
            return i
    raise ValueError(f"coordinator.replica_index is not set and no entry of coordinator.replicas "
                     f"{list(replicas)} names this host ({hostname!r}); set replica_index")


class OrderedReplicas:
    """The ordered replica list. Replica `index` probes every replica ahead of it (`GET
    /replica`) every `interval_s`; it serves while none of them is up and warm.

    - Taking over is immediate: the first probe round that finds every replica ahead down (refused,
      timed out after `timeout_s`, or answering not ready) makes this one serve. A refused
      placement kicks an early round, so a fleet that saw the serving replica's connection drop
      waits one probe (a connect on a dead port is refused at once), not a tick.
    - Handing back is damped: a replica ahead must stay up and warm for `failback_s` before this
      one defers to it again, so a flapping replica does not move the fleet back and forth.
    - Nothing here is a consensus: a replica partitioned from the ones ahead of it serves as well
      (split brain). The fleet walks the list in the same order, so a fleet process that can reach
      the first replica keeps using it; docs/failover.md says what a partition costs.
    """

    def __init__(self, replicas: list[str], index: int, *, interval_s: float = 0.05,
                 timeout_s: float = 0.25, failback_s: float = 1.0):
        if not 0 <= index < len(replicas):
            raise ValueError(f"replica_index {index} is outside the {len(replicas)} replicas")
        self.replicas = [u.rstrip("/") for u in replicas]
        self.index = index
        self.url = self.replicas[index]
        self.ahead = self.replicas[:index]
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failback_s = failback_s
        self.serving = index == 0
        self.serving_url: str | None = None if index == 0 else self.ahead[0]
        self._up_since: dict[str, float] = {}     # replica ahead -> when it was first seen up
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.rounds = 0
        self.takeovers = 0
        self.handbacks = 0
        self.changed_at = time.monotonic()

    async def start(self) -> None:
        if not self.ahead:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s), trust_env=False,
            connector=aiohttp.TCPConnector(limit=0, force_close=False))
        # Decided before the API listens: a standby that starts beside a live serving replica
        # never answers a placement.
        await self._round()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="replica-election")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def kick(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:   # a bug must not freeze the decision
                log.exception("replica probe round failed")

    async def _probe(self, url: str) -> bool:
        """Up and warm: it answers `/replica` with `ready: true`."""
        try:
            async with self._session.get(url + REPLICA_PATH, allow_redirects=False) as r:
                body = await r.read()
                if r.status != 200:
                    return False
            ans = orjson.loads(body)
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
            return False
        return isinstance(ans, dict) and ans.get("ready") is True

    async def _round(self) -> None:
        self.rounds += 1
        ups = await asyncio.gather(*(self._probe(u) for u in self.ahead))
        now = time.monotonic()
        first_up = None
        for url, up in zip(self.ahead, ups):
            if not up:
                self._up_since.pop(url, None)
                continue
            since = self._up_since.setdefault(url, now)
            if first_up is None and (not self.serving or now - since >= self.failback_s):
                first_up = url
        if first_up is None and any(ups) and self.serving:
            return          # one ahead is back but not yet for failback_s: keep serving
        if first_up is None:
            if not self.serving:
                self.serving, self.serving_url = True, None
                self.takeovers += 1
                self.changed_at = now
                log.warning("coordinator replica %d (%s): no replica ahead is up; serving "
                            "placements now", self.index, self.url)
        else:
            if self.serving or self.serving_url != first_up:
                if self.serving:
                    self.handbacks += 1
                    log.warning("coordinator replica %d (%s): %s is up and warm again; deferring "
                                "placements to it", self.index, self.url, first_up)
                self.serving, self.serving_url = False, first_up
                self.changed_at = now

    def describe(self) -> dict:
        return {"backend": "ordered", "index": self.index, "replicas": list(self.replicas),
                "serving": self.serving, "serving_url": self.serving_url,
                "takeovers": self.takeovers, "handbacks": self.handbacks,
                "since_s": round(time.monotonic() - self.changed_at, 3)}
