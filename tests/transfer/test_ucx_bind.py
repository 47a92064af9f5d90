"""NIXL's UCX backend listens only on the configured host (transfer/ucx_bind.py; issue 15 item 6)."""
from __future__ import annotations

import os

import pytest

from splitserve_testing.proctable import listening_sockets
from transfer import ucx_bind
from transfer.errors import AgentUnavailable

IFACES = {"lo": {"inet": "127.0.0.1", "inet6": "::1"},
          "eth0": {"inet": "192.0.2.2", "inet6": "fd00::2"},
          "ib0": {"inet6": "fd00::7"}}


@pytest.mark.parametrize("host,want", [
    ("127.0.0.1", {"NET_DEVICES": "lo"}),
    ("localhost", {"NET_DEVICES": "lo"}),
    ("192.0.2.2", {"NET_DEVICES": "eth0"}),
    # lo has an IPv4 address, which UCX prefers (TCP_AF_PRIO=inet,inet6): ask for inet6 first
    ("::1", {"NET_DEVICES": "lo", "TCP_AF_PRIO": "inet6"}),
    ("[fd00::7]", {"NET_DEVICES": "ib0"}),
    ("0.0.0.0", {}), ("::", {}),
])
def test_settings_pin_the_tcp_transport_to_the_host_interface(host, want):
    assert ucx_bind.ucx_settings(host, IFACES) == want


@pytest.mark.parametrize("host", ["127.0.0.2", "192.0.2.3", "no-such-host.invalid"])
def test_a_host_no_interface_has_cannot_be_honoured(host):
    with pytest.raises(ucx_bind.UcxBindError) as e:
        ucx_bind.ucx_settings(host, IFACES)
    assert isinstance(e.value, AgentUnavailable)   # auto falls back to the tcp agent
    assert host in str(e.value)


def test_engine_config_refuses_values_it_cannot_carry():
    assert ucx_bind.engine_config({"NET_DEVICES": "lo", "TCP_AF_PRIO": "inet6"}) == \
        "NET_DEVICES=lo,TCP_AF_PRIO=inet6"
    with pytest.raises(ValueError):
        ucx_bind.engine_config({"NET_DEVICES": "mlx5_0:1,eth0"})


def _new_listeners(before):
    return [s for s in listening_sockets(os.getpid()) if s not in before]


def _hosts():
    out = ["127.0.0.1"]
    ext = [a["inet"] for n, a in ucx_bind.interface_addresses().items()
           if n != "lo" and "inet" in a]
    return out + ext[:1]


@pytest.mark.parametrize("host", _hosts())
def test_a_real_nixl_agent_listens_only_on_its_host(host):
    pytest.importorskip("nixl")
    from transfer.nixl_agent import NixlAgent

    before = set(listening_sockets(os.getpid()))
    a = NixlAgent(f"bind-test-{host}", host=host)
    try:
        new = _new_listeners(before)
        assert new, "UCX's TCP transport opened no listener (the scan would prove nothing)"
        assert all(s[1] == host for s in new), new
        assert a.describe()["ucx"]["NET_DEVICES"] in ucx_bind.interface_addresses()
    finally:
        a.shutdown()


def test_auto_falls_back_to_a_host_bound_agent_when_ucx_cannot_bind():
    pytest.importorskip("nixl")
    from transfer.agents import make_agent

    before = set(listening_sockets(os.getpid()))
    a = make_agent("auto", host="127.0.0.2")
    try:
        assert a.kind == "tcp" and "127.0.0.2" in a.selection["fallback"]
        new = _new_listeners(before)
        assert new and all(s[1] == "127.0.0.2" for s in new), new
    finally:
        a.shutdown()
    with pytest.raises(AgentUnavailable):
        make_agent("nixl", host="127.0.0.2")   # an explicit choice is never silently replaced
