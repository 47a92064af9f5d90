"""The HTTP-poll feed against a real HTTP server answering like a stock `trtllm-serve`:
`POST /kv_cache_events` (route in `tensorrt_llm/serve/openai_server.py`) drains the engine's event
buffer and returns the JSON of `tensorrt_llm/_utils.py::KVCacheEventSerializer`:
`{"event_id", "data": {"type": "created"|"stored"|"removed"|"updated", ...}, "window_size",
"attention_dp_rank"?}`, stored blocks `{"type": "stored_block", "block_hash", "tokens":
[{"type": "unique_token", "token_id", "token_extra_id"}], "cache_level", "priority"}`.
Same ordering, gap and clear semantics as the ZMQ feed: `seq` is `event_id` per attention-DP rank.
"""
from __future__ import annotations

import logging

from aiohttp import web

from router.block_keys import block_keys_list, salt_seed

from .conftest import cfg, wait_for
from .test_kv_ingest import TOK_A, TOK_B, keys_of, matched


def _block(h: int, tokens: list[int], **extra) -> dict:
    return {"type": "stored_block", "block_hash": h,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
            "cache_level": 0, "priority": 35, **extra}


def stored_ev(eid: int, tokens: list[int], hashes: list[int], parent=None, rank=None, **blk) -> dict:
    blocks = [_block(h, tokens[i * 16:(i + 1) * 16], **blk) for i, h in enumerate(hashes)]
    ev = {"event_id": eid, "data": {"type": "stored", "parent_hash": parent, "blocks": blocks},
          "window_size": 4096}
    if rank is not None:
        ev["attention_dp_rank"] = rank
    return ev


def removed_ev(eid: int, hashes: list[int]) -> dict:
    return {"event_id": eid, "data": {"type": "removed", "block_hashes": hashes}, "window_size": 4096}


def created_ev(eid: int) -> dict:
    return {"event_id": eid, "data": {"type": "created", "num_blocks_per_cache_level": [512, 0]},
            "window_size": 4096}


class FakeTrtllmServe:
    """/health, and POST /kv_cache_events as a destructive drain of `queue` (status switchable)."""

    def __init__(self):
        self.queue: list[dict] = []
        self.status = 200
        self.polls = 0
        self.url = ""
        self._runner = None

    async def _events(self, request):
        self.polls += 1
        if self.status != 200:
            return web.json_response({"error": "down"}, status=self.status)
        out, self.queue = self.queue, []
        return web.json_response(out)

    async def start(self):
        app = web.Application()
        async def health(_r):
            return web.Response(text="ok")
        app.router.add_get("/health", health)
        app.router.add_post("/kv_cache_events", self._events)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self):
        await self._runner.cleanup()


async def poll_cluster(coordinator, interval=0.05):
    trt = FakeTrtllmServe()
    await trt.start()
    c, s = await coordinator(cfg([trt.url], [trt.url], extra={}) | {
        "context_servers": {"urls": [trt.url], "router": {"type": "kv_cache_aware"},
                            "kv_events": [{"server": trt.url, "transport": "http_poll",
                                           "engine": "trtllm", "poll_interval_s": interval}]}})
    await wait_for(lambda: trt.url in c.kv.feeds and c.kv.kv_ready(trt.url), what="poll feed ready")
    return trt, c, s


async def test_poll_feed_orders_applies_and_clears(coordinator):
    trt, c, s = await poll_cluster(coordinator)
    url = trt.url
    try:
        feed = c.kv.feeds[url]
        assert feed.endpoint == url + "/kv_cache_events" and feed.source.transport == "http_poll"
        trt.queue += [created_ev(0), stored_ev(1, TOK_A, [11, 12, 13, 14]),
                      stored_ev(2, TOK_B, [21, 22])]
        await wait_for(lambda: matched(c, url, TOK_A) == 4 and matched(c, url, TOK_B) == 2)
        trt.queue.append(removed_ev(3, [22]))
        await wait_for(lambda: matched(c, url, TOK_B) == 1, what="removal applied")
        assert feed.last_seq == 3 and feed.polls >= 2
        # a lost event (id 4 never seen): no replay over HTTP, so the entries are cleared
        trt.queue.append(stored_ev(5, TOK_B, [21, 22]))
        await wait_for(lambda: feed.clears.get("gap_unrepaired") == 1, what="gap cleared")
        await wait_for(lambda: matched(c, url, TOK_B) == 2, what="stream resumed after the gap")
        assert matched(c, url, TOK_A) == 0 and feed.gaps == 1
        # the engine restarted: event ids start over with `created`
        trt.queue += [created_ev(0), stored_ev(1, TOK_A, [11, 12, 13, 14])]
        await wait_for(lambda: feed.resets == 1 and matched(c, url, TOK_A) == 4, what="restart")
        assert matched(c, url, TOK_B) == 0
        ke = c.cluster_info()["servers"]["context"][0]["kv_events"]
        assert ke["transport"] == "http_poll" and ke["ready"] is True and ke["format"] == "trtllm"
    finally:
        await trt.stop()


async def test_per_block_cache_salt_and_attention_dp_ranks(coordinator):
    trt, c, s = await poll_cluster(coordinator)
    url = trt.url
    try:
        # blocks salted per block: they must land in the salt's namespace, not the default one
        trt.queue.append(stored_ev(0, TOK_A, [31, 32, 33, 34], cache_salt="tenant-a"))
        salted = block_keys_list(TOK_A, 16, salt_seed("tenant-a", None))
        await wait_for(lambda: c.index.longest_prefix(salted, [url])[url] == 4, what="salted")
        assert matched(c, url, TOK_A) == 0, "an unsalted prompt must not match salted blocks"
        # multimodal blocks (mm_keys, KV cache manager V2) are not named by their tokens alone
        trt.queue.append(stored_ev(1, TOK_B, [41, 42], mm_keys=[["ab" * 32, 0, None]]))
        # events of attention-DP rank 1 carry their own event ids and land in rank 1's slot
        trt.queue.append(stored_ev(0, TOK_B, [51, 52], rank=1))
        await wait_for(lambda: c.index.keys_of(url, 1) == set(keys_of(TOK_B)), what="rank 1")
        feed = c.kv.feeds[url]
        assert feed.last_seq == 1 and [r.dp_rank for r in feed.ranks] == [1]
        assert c.index.keys_of(url, 0) == set(salted), "only the salted blocks, no mm blocks, on rank 0"
        assert feed.gaps == 0 and feed.resets == 0
    finally:
        await trt.stop()


async def test_failing_polls_are_not_ready_logged_once_and_recover(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="splitserve.coordinator.kv_ingest")
    trt, c, s = await poll_cluster(coordinator, interval=0.02)
    url = trt.url
    try:
        feed = c.kv.feeds[url]
        trt.status = 503
        await wait_for(lambda: feed.connect_failures >= 3, what="failed polls")
        assert not c.kv.kv_ready(url) and "answered 503" in feed.error
        row = c.cluster_info()["servers"]["context"][0]
        assert row["kv_ready"] is False and "503" in row["kv_events"]["error"]
        assert len([r for r in caplog.records if "answered 503" in r.getMessage()]) == 1
        trt.status = 200
        trt.queue.append(stored_ev(0, TOK_A, [11, 12, 13, 14]))
        await wait_for(lambda: c.kv.kv_ready(url) and matched(c, url, TOK_A) == 4, timeout=15,
                       what="polls recovered")
        # garbage JSON from the drain is lost state: counted and cleared, polling goes on
        trt.queue.append({"event_id": 1, "data": {"type": "stored", "blocks": "x"}})
        await wait_for(lambda: feed.decode_errors == 1 and matched(c, url, TOK_A) == 0)
        trt.queue.append(stored_ev(2, TOK_B, [21, 22]))
        await wait_for(lambda: matched(c, url, TOK_B) == 2, what="feed alive after bad JSON")
    finally:
        await trt.stop()
