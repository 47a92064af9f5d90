"""Stopping background tasks: cancel them and wait until they have ended, whatever way they end.

The one copy of the shutdown step the worker's and the fleet's `stop()` methods share (step loop,
scheduler sweep, registration heartbeat, sim engine notifications, placement refresher). It lives
here, at the bottom of the package graph, because both sides import it.
"""
from __future__ import annotations

import asyncio

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(*tasks: asyncio.Future | None) -> None:
    """Cancel every task given (None is skipped) and return once all have finished, swallowing
    their own ends: a task's CancelledError, or an exception it raised on the way out (a stopping
    service has no one to report it to, and one background task's failure must not stop the rest
    of a shutdown).

    The caller's own cancellation is not swallowed: if the task running this is cancelled while it
    waits, CancelledError propagates (a bare `try: await task / except CancelledError: pass`
    cannot tell the two apart and eats it). The tasks stay cancelled either way.
    """
    live = [t for t in tasks if t is not None]
    if not live:
        return
    for t in live:
        t.cancel()
    # asyncio.wait never raises the tasks' outcomes, only the waiter's own cancellation.
    await asyncio.wait(live)
    for t in live:
        if not t.cancelled():
            t.exception()   # retrieved: no "exception was never retrieved" when collected
