"""vLLM 0.33's own KV-event code against our coordinator and our encoder, no re-implementation:
`vllm/distributed/kv_events.py` and `vllm/config/kv_events.py` are loaded from the vllm-0.33.0
wheel (import-only stand-ins for vLLM's logger, its network helpers and one type alias, which
that module imports but these paths never call). Needs the wheel:

    pip download --no-deps vllm==0.33.0 -d /tmp/vllm-wheel
    SPLITSERVE_VLLM_WHEEL=/tmp/vllm-wheel/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl pytest ...

Skipped without it (CI does not download a 336 MB wheel).
"""
from __future__ import annotations

import asyncio
import glob
import os
import sys
import time
import zipfile

import msgspec
import pytest

from router.events import BlocksRemoved, BlocksStored, encode_vllm_batch

from .conftest import cfg, keys_of, wait_for
from .test_kv_ingest import TOK_A, TOK_B, matched

WHEEL = os.environ.get("SPLITSERVE_VLLM_WHEEL") or next(
    iter(sorted(glob.glob("/tmp/interop_dl/vllm/vllm-0.33.*.whl"))), None)
pytestmark = pytest.mark.skipif(not WHEEL or not os.path.exists(WHEEL),
                                reason="needs the vllm-0.33.0 wheel (336 MB, not downloaded in CI): "
                                       "set SPLITSERVE_VLLM_WHEEL to its path")

STANDINS = {
    "vllm/__init__.py": "",
    "vllm/logger.py": "import logging\ninit_logger = logging.getLogger\n",
    "vllm/config/__init__.py": "",
    # vLLM's @config is a pydantic dataclass; a plain dataclass runs the same __post_init__
    "vllm/config/utils.py": "from dataclasses import dataclass as config\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": (
        "def _unused(*a, **k):\n    raise NotImplementedError('not on the tested paths')\n"
        "get_ip = get_tcp_uri = is_valid_ipv6_address = split_zmq_path = _unused\n"),
    "vllm/v1/__init__.py": "", "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/kv_cache_utils.py": "ExternalBlockHash = bytes | int\n",
    "vllm/distributed/__init__.py": "",
}


@pytest.fixture
def vllm_events(tmp_path):
    root = tmp_path / "vllm_src"
    for rel, text in STANDINS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    with zipfile.ZipFile(WHEEL) as z:
        for rel in ("vllm/distributed/kv_events.py", "vllm/config/kv_events.py"):
            (root / rel).write_bytes(z.read(rel))
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        import vllm.distributed.kv_events as mod
        yield mod
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_our_encoder_writes_vllms_bytes(vllm_events):
    m = vllm_events
    enc = msgspec.msgpack.Encoder()
    theirs = m.KVEventBatch(ts=1.5, events=[
        m.BlockStored(block_hashes=[13233661041218796127], parent_block_hash=None,
                      token_ids=[1, 2, 3, 4], block_size=4, lora_id=None, medium="GPU",
                      lora_name=None, group_idx=0),
        m.BlockRemoved(block_hashes=[13233661041218796127], medium="GPU"),
        m.AllBlocksCleared()], data_parallel_rank=0)
    from router.events import AllCleared
    ours = encode_vllm_batch(1.5, [
        BlocksStored([13233661041218796127], None, [1, 2, 3, 4], 4, group=0),
        BlocksRemoved([13233661041218796127]), AllCleared()], 0)
    assert ours == enc.encode(theirs)
    # and vLLM's typed decoder reads what our workers publish
    back = msgspec.msgpack.Decoder(type=m.KVEventBatch).decode(ours)
    assert back == theirs


async def test_vllm_publisher_feeds_the_coordinator(vllm_events, workers, coordinator, tmp_path):
    m = vllm_events
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = m.ZmqEventPublisher(data_parallel_rank=0, endpoint=pub_ep,
                                    replay_endpoint=replay_ep, topic="kv@pod@m", buffer_steps=100)
    try:
        # published before anyone subscribes: only vLLM's replay can deliver it
        publisher.publish(m.KVEventBatch(ts=time.time(), events=[m.BlockStored(
            block_hashes=[101, 102, 103, 104], parent_block_hash=None, token_ids=TOK_A,
            block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
        await asyncio.sleep(0.2)
        w = await workers("both")
        w.info_status = 404          # stock vLLM has no /server_info
        c, s = await coordinator(cfg([w.url], [w.url], extra={}) | {
            "context_servers": {"urls": [w.url], "router": {"type": "kv_cache_aware"},
                                "kv_events": [{"server": w.url, "endpoint": pub_ep,
                                               "replay_endpoint": replay_ep, "topic": "kv@pod@m",
                                               "engine": "vllm"}]}})
        await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="feed ready")
        feed = c.kv.feeds[w.url]
        assert feed.sync_outcome == "replay", "initial rebuild through vLLM's ROUTER replay"
        assert matched(c, w.url, TOK_A) == 4
        # live batches, vLLM's seq counter continuing
        deadline = time.monotonic() + 10
        while matched(c, w.url, TOK_B) < 2 and time.monotonic() < deadline:
            publisher.publish(m.KVEventBatch(ts=time.time(), events=[
                m.BlockStored(block_hashes=[201, 202], parent_block_hash=None, token_ids=TOK_B,
                              block_size=16, lora_id=None, medium="GPU", lora_name=None),
                m.BlockRemoved(block_hashes=[104], medium="GPU")]))
            await asyncio.sleep(0.05)
        assert matched(c, w.url, TOK_B) == 2 and matched(c, w.url, TOK_A) == 3
        assert feed.decode_errors == 0 and feed.last_seq >= 1
        assert c.index.keys_of(w.url) >= set(keys_of(TOK_B))
    finally:
        publisher.shutdown()
