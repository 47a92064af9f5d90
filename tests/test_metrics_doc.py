"""docs/metrics.md lists every metric family the fleet, coordinator and worker register, with its
type and labels, and nothing else.

The families come from the real collectors: the fleet's module-level metrics, a coordinator serving
its API on loopback (so the listener-only `shed`/`channel_*` families exist too), and a sim worker
with a real ZMQ KV-event publisher.
"""
from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `(splitserve_\w+)` \| (\w+) \| ([^|]*) \| (\w+) \|")


def _exposed(name: str, typ: str) -> str:
    return name + "_total" if typ == "counter" else name


def _families(collector) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {_exposed(f.name, f.type): (f.type, tuple(f._labelnames)) for f in collector.collect()}


def _fleet() -> dict[str, tuple[str, tuple[str, ...]]]:
    import fleet.metrics as fm

    out = {}
    for m in vars(fm).values():
        if isinstance(m, MetricWrapperBase):
            for f in m.describe():
                out[_exposed(f.name, f.type)] = (f.type, tuple(m._labelnames))
    return out


async def _coordinator() -> dict[str, tuple[str, tuple[str, ...]]]:
    from coordinator.metrics import CoordinatorCollector
    from coordinator.listeners import CoordinatorServer
    from coordinator.service import Coordinator

    c = Coordinator({"generation_servers": {"urls": ["http://127.0.0.1:9"]}})
    s = CoordinatorServer(c, host="127.0.0.1", port=0, uds_path=None, http="fast")
    await s.start()
    try:
        return _families(CoordinatorCollector(lambda: c.snapshot(s.counters())))
    finally:
        await s.stop()


def _worker() -> dict[str, tuple[str, tuple[str, ...]]]:
    from protocol.tokenizer import ByteTokenizer
    from worker.kv_events import KvEventPublisher
    from worker.metrics import WorkerCollector
    from worker.sim import SimEngine

    pub = KvEventPublisher(host="127.0.0.1")
    try:
        return _families(WorkerCollector(SimEngine(ByteTokenizer(), num_blocks=16, block_size=4), pub))
    finally:
        pub.close()


def _documented() -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    out: dict[str, dict] = {"fleet": {}, "coordinator": {}, "worker": {}}
    for line in (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            name, typ, labels, proc = m.groups()
            assert name not in out[proc], f"docs/metrics.md lists {name} twice"
            out[proc][name] = (typ, tuple(re.findall(r"`(\w+)`", labels)))
    return out


async def test_metrics_table_matches_the_registered_families():
    doc = _documented()
    live = {"fleet": _fleet(), "coordinator": await _coordinator(), "worker": _worker()}
    for proc, fams in live.items():
        assert len(fams) > 15, f"{proc}: too few families found ({sorted(fams)})"
        missing = sorted(set(fams) - set(doc[proc]))
        extra = sorted(set(doc[proc]) - set(fams))
        assert not missing, f"docs/metrics.md lacks {proc} metrics {missing}"
        assert not extra, f"docs/metrics.md lists {proc} metrics that are not registered: {extra}"
        wrong = {n: (doc[proc][n], fams[n]) for n in fams if doc[proc][n] != fams[n]}
        assert not wrong, f"{proc}: (documented, registered) type/labels differ: {wrong}"
