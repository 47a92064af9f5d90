"""A target process for agent tests: registers a buffer, keeps progressing, answers queries.

Run through multiprocessing (spawn) with a Connection; commands are tuples:
("read", off, n) -> bytes, ("notifs",) -> dict, ("desc",) -> bytes, ("exit",).
"""
from __future__ import annotations

import os
import time


def target_main(kind: str, conn, nbytes: int, name: str | None = None) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    import numpy as np

    from transfer.agents import make_agent
    from transfer.memory import alloc_shared_array

    agent = make_agent(kind, name)
    buf = alloc_shared_array(nbytes) if kind == "shm" else np.zeros(nbytes, np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0)])
    conn.send(("ready", agent.get_local_agent_desc(), int(buf.ctypes.data), os.getpid()))
    notifs: dict[str, list[bytes]] = {}
    while True:
        agent.progress()
        for k, v in agent.get_notifications().items():
            notifs.setdefault(k, []).extend(v)
        if not conn.poll(0.002):
            continue
        cmd = conn.recv()
        if cmd[0] == "read":
            conn.send(bytes(buf[cmd[1]:cmd[1] + cmd[2]]))
        elif cmd[0] == "notifs":
            deadline = time.monotonic() + cmd[1]
            while not notifs and time.monotonic() < deadline:
                agent.progress()
                for k, v in agent.get_notifications().items():
                    notifs.setdefault(k, []).extend(v)
                time.sleep(0.002)
            conn.send(notifs)
            notifs = {}
        elif cmd[0] == "fill":
            buf[:] = np.frombuffer(cmd[1], np.uint8)
            conn.send(True)
        elif cmd[0] == "exit":
            agent.shutdown()
            conn.send(True)
            return
