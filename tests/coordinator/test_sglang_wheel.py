"""SGLang 0.5.23's own publisher (`sglang/srt/disaggregation/kv_events.py` from the
sglang-0.5.23 wheel: `ZmqEventPublisher`, its event structs and `parse_advertisable_tcp`) with two
attention-DP ranks, advertised the way `describe_kv_events_publisher`
(`sglang/srt/runtime_context.py`) composes the `/server_info` descriptor, into a running
coordinator. Import-only stand-ins: `sglang.srt.runtime_context.get_parallel` (not called on these
paths) and, when psutil is absent, an empty `psutil` (`sglang/srt/utils/network.py`, loaded from the
wheel, imports it for helpers these paths do not call). Needs the wheel:

    pip download --no-deps sglang==0.5.23 -d /tmp/sglang-wheel
    SPLITSERVE_SGLANG_WHEEL=/tmp/sglang-wheel/sglang-0.5.23-....whl pytest ...
"""
from __future__ import annotations

import asyncio
import glob
import importlib.util
import os
import sys
import time
import zipfile

import pytest

from router.block_keys import block_keys_list, salt_seed

from .conftest import cfg, free_ports, wait_for
from .test_kv_ingest import TOK_A, TOK_B, matched

WHEEL = os.environ.get("SPLITSERVE_SGLANG_WHEEL") or next(
    iter(sorted(glob.glob("/tmp/interop_dl/sglang/sglang-0.5.23-*.whl"))), None)
pytestmark = pytest.mark.skipif(not WHEEL or not os.path.exists(WHEEL),
                                reason="needs the sglang-0.5.23 wheel (not downloaded in CI): "
                                       "set SPLITSERVE_SGLANG_WHEEL to its path")


@pytest.fixture
def sgl(tmp_path):
    root = tmp_path / "sgl_src"
    stand = {"sglang/__init__.py": "", "sglang/srt/__init__.py": "",
             "sglang/srt/runtime_context.py": (
                 "def get_parallel():\n    raise NotImplementedError('not on the tested paths')\n"),
             "sglang/srt/utils/__init__.py": "", "sglang/srt/disaggregation/__init__.py": ""}
    if importlib.util.find_spec("psutil") is None:
        stand["psutil.py"] = ""
    for rel, text in stand.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    with zipfile.ZipFile(WHEEL) as z:
        for rel in ("sglang/srt/disaggregation/kv_events.py", "sglang/srt/utils/network.py"):
            (root / rel).write_bytes(z.read(rel))
    names = ("sglang", "psutil") if "psutil.py" in stand else ("sglang",)
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in names}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        import sglang.srt.disaggregation.kv_events as mod
        yield mod
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k.split(".")[0] in names]:
            del sys.modules[k]
        sys.modules.update(saved)


async def test_sglang_publisher_and_descriptor(sgl, workers, coordinator):
    base, rbase = free_ports(2), free_ports(2)
    ep, rep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{rbase}"
    pubs = [sgl.ZmqEventPublisher(attn_dp_rank=r, endpoint=ep, replay_endpoint=rep, bind=True,
                                  topic="") for r in range(2)]
    try:
        host, port = sgl.parse_advertisable_tcp(ep)
        _, rport = sgl.parse_advertisable_tcp(rep)
        descriptor = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": port,
                      "topic": "", "block_size": 16, "dp_size": 2,
                      "replay_endpoint_port_base": rport}
        w = await workers("both", kv_events=descriptor)
        c, s = await coordinator(cfg([w.url], [w.url]))
        await wait_for(lambda: w.url in c.kv.feeds and c.kv.kv_ready(w.url), what="ready")
        feed = c.kv.feeds[w.url]
        assert feed.source.engine == "sglang" and len(feed.ranks) == 1

        def batch(hashes, tokens, salt=None):
            return sgl.KVEventBatch(ts=time.time(), events=[sgl.BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16,
                lora_id=None, medium="GPU", cache_salt=salt)])

        salted = block_keys_list(TOK_B, 16, salt_seed("tenant", None))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
                matched(c, w.url, TOK_A) == 4
                and c.index.longest_prefix(salted, [w.url])[w.url] == 2):
            pubs[0].publish(batch([-(2**63) + 1, -2, -3, -4], TOK_A))
            pubs[1].publish(batch([-21, -22], TOK_B, salt="tenant"))
            await asyncio.sleep(0.05)
        assert matched(c, w.url, TOK_A) == 4
        assert c.index.longest_prefix(salted, [w.url])[w.url] == 2
        assert matched(c, w.url, TOK_B) == 0, "salted blocks do not match an unsalted prompt"
        assert set(salted) <= c.index.keys_of(w.url, 1), "rank 1's events in rank 1's slot"
        assert feed.decode_errors == 0 and feed.ranks[0].decode_errors == 0
    finally:
        for p in pubs:
            p.shutdown()
