"""RankInfo wire format and the compatibility check at exchange time; page-table wrapping."""
from __future__ import annotations

import msgspec
import pytest

from tests.transfer.geometry import Model, Side, build_instance
from transfer.errors import ConfigMismatch, ProtocolError, UnsupportedTopology
from transfer.page_table import PageTable
from transfer.rank_info import RankInfo, check_compatible, decode_rank_info


def _info(**kw) -> RankInfo:
    model = Model(num_layers=2, kv_heads=2, head_bytes=4, tpb=4, groups=[(0, 2)])
    info = build_instance(model, Side(1, 1, "NHD", True, 4), "inst", 0)[0].info
    return msgspec.structs.replace(info, **kw)


def test_round_trip_is_msgpack_and_typed():
    info = _info(agent_kind="tcp", agent_desc=b"\x00\x01")
    data = info.encode()
    assert b"__reduce__" not in data and data[:1] != b"\x80"  # not pickle
    back = decode_rank_info(data)
    assert back == info
    assert back.page_table.groups[0].views[0].role == frozenset(["kv"])


def test_garbage_and_future_versions_are_clear_errors():
    with pytest.raises(ProtocolError, match="not msgpack"):
        decode_rank_info(b"\xc1")
    with pytest.raises(ProtocolError, match="does not validate"):
        decode_rank_info(msgspec.msgpack.encode({"instance_id": 3}))
    with pytest.raises(ConfigMismatch, match="wire version 99"):
        decode_rank_info(msgspec.msgpack.encode({"v": 99}))


@pytest.mark.parametrize("field,a,b,what", [
    ("agent_kind", "nixl", "tcp", "agent kind"),
    ("num_layers", 2, 3, "layer count"),
    ("total_kv_heads", 2, 4, "KV head count"),
])
def test_mismatch_detected_at_exchange(field, a, b, what):
    x, y = _info(**{field: a}), _info(**{field: b}, instance_id="other")
    with pytest.raises(ConfigMismatch, match=what):
        check_compatible(x, y)


def test_block_size_and_layout_version_mismatch():
    x = _info()
    pt = msgspec.structs.replace(x.page_table, tokens_per_block=8)
    with pytest.raises(ConfigMismatch, match="block size"):
        check_compatible(x, msgspec.structs.replace(x, page_table=pt, instance_id="o"))
    pt = msgspec.structs.replace(x.page_table, layout_version=2)
    with pytest.raises(ConfigMismatch, match="layout version"):
        check_compatible(x, msgspec.structs.replace(x, page_table=pt, instance_id="o"))
    check_compatible(x, msgspec.structs.replace(x, instance_id="o"))


def test_from_runner_dict_wraps_the_worker_page_table():
    pytest.importorskip("torch")
    from worker.presets import build_preset
    from worker.runner import ModelRunner

    r = ModelRunner(build_preset("tiny"), 8, 4)
    pt = PageTable.from_runner_dict(r.page_table(), layer_offset=0)
    (pool,) = pt.pools
    t = r.kv_cache
    assert pool.base == t.data_ptr() and pool.extent == r.num_blocks * r.block_stride
    # address(layer, slot) must be the runner's element address of (block, layer, K, 0, 0, 0)
    for layer, slot in [(0, 0), (2, 5), (3, 7)]:
        assert pool.address(layer, slot) == t[slot, layer, 0].data_ptr()
    view = pt.groups[0].views[0]
    v_off = view.entries_of(1)[1][0]
    assert pool.address(1, 3) + v_off == t[3, 1, 1].data_ptr()
    assert view.layout == "NHD" and view.kv_heads == r.cfg.num_key_value_heads
    with pytest.raises(UnsupportedTopology, match="missing or has a bad field"):
        PageTable.from_runner_dict({"block_size": 4, "pools": [{}]})
