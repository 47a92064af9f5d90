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


def listening_sockets(pid: int) -> list[tuple[str, str, int]]:
    """Every TCP socket in LISTEN state and every bound UDP socket ``pid`` holds, as
    ``(proto, address, port)``: the socket inodes of /proc/<pid>/fd matched against the process's
    /proc/<pid>/net/{tcp,tcp6,udp,udp6} tables (its network namespace)."""
    inodes = _socket_inodes(pid)
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/{pid}/net/{proto}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], int(cols[9])
            if inode not in inodes:
                continue
            ip, port = _hex_addr(local)
            if proto.startswith("tcp") and state != _TCP_LISTEN:
                continue
            if proto.startswith("udp") and port == 0:
                continue
            out.append((proto, ip, port))
    return out


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
