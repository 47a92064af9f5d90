"""Where NIXL's UCX backend listens: restrict it to the worker's configured host.

UCX's TCP transport opens one listening socket per network interface it uses, bound to that
interface's address (UCX 1.23 `src/uct/tcp/tcp_iface.c`: the iface address comes from
`ucs_netif_get_addr(if_name, af)` in `src/ucs/sys/sock.c` — the first active, non-link-local address
of the interface, in `UCX_TCP_AF_PRIO` order, IPv4 first). Left alone, a NIXL agent therefore listens
on every interface of the machine, whatever `--host` says. The TCP transport cannot be dropped on
CPU: NIXL creates endpoints with peer error handling (`ucx_error_handling_mode=peer`), which the
shared-memory transports do not offer ("no peer failure handler"), so TCP carries UCX's active
messages (NIXL notifications) even between two processes of one host.

So the TCP transport is kept and pinned to the one interface whose UCX address *is* the configured
host (`NET_DEVICES=<ifname>`, plus `TCP_AF_PRIO=inet6` for an IPv6 host). A host that no interface
has as its UCX address (say 127.0.0.2: `lo` answers for all of 127/8 but UCX binds 127.0.0.1) cannot
be honoured by UCX at all; `UcxBindError` says so, and `--transfer-agent auto` falls back to the TCP
agent, which binds exactly the configured host. A wildcard host (0.0.0.0, ::) leaves UCX's defaults.

The settings reach UCX through the UCX backend's `engine_config` parameter (NIXL
`src/plugins/ucx/ucx_backend.cpp` → `nixlUcxContext`, `src/plugins/ucx/ucx_utils.cpp`), applied with
`nixl::ucx::config::modify` (`src/plugins/ucx/config.cpp`), which skips a key whose `UCX_<KEY>`
variable is set in the environment: an operator's `UCX_NET_DEVICES` (e.g. to add RDMA ports) wins.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from .errors import AgentUnavailable

# <linux/sockios.h>, <net/if.h>
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_RUNNING = 0x40

# The UCX keys set here; each may be overridden by the operator's UCX_<KEY> environment variable.
KEYS = ("NET_DEVICES", "TCP_AF_PRIO")


class UcxBindError(AgentUnavailable):
    """UCX cannot listen on the configured host (no interface has it as its UCX address)."""


def _ioctl(name: str, req: int) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            return fcntl.ioctl(s.fileno(), req, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None


def _active(name: str) -> bool:
    r = _ioctl(name, _SIOCGIFFLAGS)
    if r is None:
        return False
    flags = struct.unpack_from("H", r, 16)[0]
    return bool(flags & _IFF_UP and flags & _IFF_RUNNING)


def _ipv4(name: str) -> str | None:
    """The interface's primary IPv4 address (the first one `getifaddrs` lists), or None."""
    r = _ioctl(name, _SIOCGIFADDR)
    if r is None:
        return None
    a = socket.inet_ntoa(r[20:24])
    return None if a.startswith("169.254.") else a


def _ipv6(name: str) -> str | None:
    """The interface's first non-link-local IPv6 address from /proc/net/if_inet6, or None."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [r.split() for r in f]
    except OSError:
        return None
    for r in rows:
        if len(r) >= 6 and r[5] == name:
            a = ipaddress.IPv6Address(bytes.fromhex(r[0]))
            if not a.is_link_local:
                return str(a)
    return None


def interface_addresses() -> dict[str, dict[str, str]]:
    """{ifname: {"inet": addr, "inet6": addr}} for active interfaces: the address UCX's TCP
    transport binds on each, per family."""
    out = {}
    for _, name in socket.if_nameindex():
        if not _active(name):
            continue
        fams = {k: v for k, v in (("inet", _ipv4(name)), ("inet6", _ipv6(name))) if v}
        if fams:
            out[name] = fams
    return out


def ucx_settings(host: str, interfaces: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """UCX settings that make the TCP transport listen only on `host`.

    {} for a wildcard host; raises `UcxBindError` when no interface has `host` as its UCX address.
    `interfaces` defaults to this machine's (`interface_addresses()`).
    """
    h = (host or "").strip("[]")
    if h in ("", "0.0.0.0", "::", "*"):
        return {}
    if h == "localhost":
        h = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(h))
        except (OSError, ValueError):
            raise UcxBindError(f"UCX needs the worker host as an interface address; {host!r} "
                               f"does not resolve") from None
    fam = "inet" if ip.version == 4 else "inet6"
    ifaces = interface_addresses() if interfaces is None else interfaces
    for name, addrs in ifaces.items():
        a = addrs.get(fam)
        if a is None or ipaddress.ip_address(a) != ip:
            continue
        if fam == "inet6" and "inet" in addrs:
            return {"NET_DEVICES": name, "TCP_AF_PRIO": "inet6"}
        return {"NET_DEVICES": name}
    have = ", ".join(f"{n}={a.get(fam)}" for n, a in ifaces.items() if a.get(fam)) or "none"
    raise UcxBindError(
        f"UCX's TCP transport listens on an interface's own address; no interface has {host} "
        f"(UCX would bind: {have}). Use an interface address or 0.0.0.0 as --host, set "
        f"UCX_NET_DEVICES yourself, or a transfer agent that binds the host (tcp)")


def operator_overrides() -> dict[str, str]:
    """The UCX_<KEY> environment variables that take precedence over `ucx_settings`."""
    return {k: os.environ[f"UCX_{k}"] for k in KEYS if f"UCX_{k}" in os.environ}


def engine_config(settings: dict[str, str]) -> str:
    """NIXL's UCX `engine_config` string: comma-separated KEY=VALUE (no value may hold a comma)."""
    for k, v in settings.items():
        if "," in v or "=" in k:
            raise ValueError(f"UCX setting {k}={v!r} cannot travel in engine_config")
    return ",".join(f"{k}={v}" for k, v in settings.items())
