"""Process-table helpers (Linux /proc): what a process tree holds, leaves behind and costs."""
from __future__ import annotations

import os


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state first), or None once it is gone.

    The command name may hold spaces and parentheses, so the split starts after the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
    except OSError:
        return None
    return st[st.rfind(")") + 2:].split()


def children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (zombies excluded)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        fields = _stat_fields(d)
        if fields and int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if alive(p):
            out.append(p)
            todo.extend(children(p))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _hex_addr(h: str) -> tuple[str, int]:
    """A /proc/net/{tcp,udp}[6] ``local_address`` field → (ip text, port)."""
    import ipaddress

    ip, port = h.split(":")
    raw = bytes.fromhex(ip)
    # the kernel prints each 32-bit word of the address in host (little-endian) byte order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    if addr.version == 6 and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return str(addr), int(port, 16)


_TCP_LISTEN = "0A"
_TCP_ESTABLISHED = "01"


def _own_sockets(pid: int, protos: tuple[str, ...]):
    """``(proto, ip, port, state)`` of each socket ``pid`` holds: the socket inodes of
    /proc/<pid>/fd matched against the process's /proc/<pid>/net/<proto> tables (its network
    namespace)."""
    inodes = _socket_inodes(pid)
    for proto in protos:
        try:
            with open(f"/proc/{pid}/net/{proto}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[9]) in inodes:
                yield (proto, *_hex_addr(cols[1]), cols[3])


def listening_sockets(pid: int) -> list[tuple[str, str, int]]:
    """Every TCP socket in LISTEN state and every bound UDP socket ``pid`` holds, as
    ``(proto, address, port)``."""
    return [(proto, ip, port) for proto, ip, port, state in _own_sockets(pid, ("tcp", "tcp6", "udp", "udp6"))
            if (state == _TCP_LISTEN if proto.startswith("tcp") else port != 0)]


def connections_on(pid: int, port: int) -> int:
    """Established TCP connections ``pid`` holds on its local ``port`` (e.g. the clients a server
    process accepted there)."""
    return sum(1 for _, _, p, state in _own_sockets(pid, ("tcp", "tcp6"))
               if p == port and state == _TCP_ESTABLISHED)


def splitserve_role(pid: int) -> str | None:
    """What a splitserve process is, read from its command line: ``"fleet-<i>"`` (a launcher's
    fleet process i), the ``splitserve_cli`` command (``"coordinator"``, ``"serve"``, ``"worker"``,
    ...), or None (another program, or gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "--child-index" in argv:
        i = argv.index("--child-index")
        return f"fleet-{argv[i + 1]}" if i + 1 < len(argv) else None
    for i, a in enumerate(argv[:-1]):
        if a.endswith(("splitserve_cli", "splitserve_cli.py")):   # python -m splitserve_cli <command>
            return argv[i + 1]
    return None


def group_members(pgid: int) -> list[tuple[int, list[str]]]:
    """``(pid, stat fields)`` of every process whose process group is ``pgid`` (a process started
    with ``start_new_session`` leads a group of its own pid, and its children stay in it). Zombies
    are included: their CPU ticks count until their parent reaps them."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        fields = _stat_fields(d)
        if fields and int(fields[2]) == pgid:
            out.append((int(d), fields))
    return out


def cpu_ticks(fields: list[str]) -> int:
    """utime + stime (clock ticks) of one process from its stat fields."""
    return int(fields[11]) + int(fields[12])
