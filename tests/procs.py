"""Process-table helpers for tests that check what a process tree leaves behind (Linux /proc)."""
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
