"""Both transceivers the worker can drive offer exactly the `transfer.transceiver.Transceiver`
surface: every method with the protocol's parameters, in order, with the same defaults."""
from __future__ import annotations

import inspect

import pytest

from transfer.session import KvTransceiver
from transfer.transceiver import Transceiver
from worker.parallel.rank_transfer import MultiRankTransceiver

METHODS = sorted(n for n, v in vars(Transceiver).items()
                 if inspect.isfunction(v) and not n.startswith("_"))
DATA = sorted(n for n in Transceiver.__annotations__)


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("impl", [KvTransceiver, MultiRankTransceiver])
def test_implements_the_transceiver_protocol(impl):
    assert Transceiver in impl.__mro__   # declared, not only structurally alike
    assert {"begin_send", "begin_receive", "cancel_send", "shutdown"} <= set(METHODS)
    for name in METHODS:
        assert _params(getattr(impl, name)) == _params(getattr(Transceiver, name)), name
    # data members: properties on the class, or set by __init__ (named in its source)
    init_src = inspect.getsource(impl.__init__)
    for name in DATA:
        assert isinstance(getattr(impl, name, None), property) or f"self.{name} =" in init_src, name


def test_a_live_rank_transceiver_is_a_transceiver():
    from tests.transfer.geometry import Model, Side, build_rank, realize
    from transfer.states import RankTopology, TransferConfig

    model = Model(num_layers=2, kv_heads=2, head_bytes=16, tpb=4, groups=[(0, 2)])
    rank = realize(build_rank(model, Side(tp=1, pp=1, layout="NHD", block_major=True, num_slots=8),
                              0, 0, "inst", 0))
    tx = KvTransceiver(rank.info.page_table, RankTopology(role="context", num_layers=2,
                                                           total_kv_heads=2),
                       TransferConfig(agent="tcp"))
    try:
        assert isinstance(tx, Transceiver)
        assert tx.endpoint.startswith("tcp://127.0.0.1:") and tx.tokens_per_block == 4
    finally:
        tx.shutdown()
