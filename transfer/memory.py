"""Raw memory access for the fallback agents, and shared host buffers.

Host memory (DRAM) is read and written through ctypes at an address; device memory (VRAM) through a
zero-copy torch view built from `__cuda_array_interface__`, so the fallback agents move GPU bytes
without NIXL (slowly, staged through the host — they are the fallback).

`alloc_shared_host(nbytes)` returns a uint8 tensor whose pages live in a file under /dev/shm, so a
`ShmAgent` peer on the same host can map and write them. Files are named
`splitserve-kv-<pid>-<random>`. A file must outlive any Python view of it (peers open it by name
while the pages are mapped through other views), so it is unlinked when the process exits, and
files left by processes that died without cleaning up are swept on the next allocation.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import re
import uuid

import numpy as np

from .errors import InvalidDescriptors

log = logging.getLogger("splitserve.transfer.memory")

SHM_DIR = "/dev/shm"
SHM_PREFIX = "splitserve-kv-"


def host_buffer(addr: int, nbytes: int):
    """A writable buffer-protocol object over host memory at `addr` (no copy)."""
    return (ctypes.c_char * nbytes).from_address(addr)


def host_array(addr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(host_buffer(addr, nbytes), dtype=np.uint8)


class _CudaArray:
    """Minimal `__cuda_array_interface__` exporter so torch can view a raw device pointer."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


def device_view(addr: int, nbytes: int, dev: int):
    import torch

    return torch.as_tensor(_CudaArray(addr, nbytes), device=f"cuda:{dev}")


def read_region(addr: int, nbytes: int, mem_type: str, dev: int):
    """Bytes of a region as a buffer-protocol object. DRAM: zero-copy; VRAM: a host copy."""
    if mem_type == "DRAM":
        return host_buffer(addr, nbytes)
    if mem_type == "VRAM":
        t = device_view(addr, nbytes, dev).cpu()
        return t.numpy()
    raise InvalidDescriptors(f"unknown memory type {mem_type!r}")


def write_region(addr: int, mem_type: str, dev: int, data) -> None:
    """Copy `data` (buffer protocol) into a region."""
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    if not n:
        return
    if mem_type == "DRAM":
        dst = host_array(addr, n)
        dst[:] = np.frombuffer(mv, dtype=np.uint8)
        return
    if mem_type == "VRAM":
        import torch

        src = torch.frombuffer(mv, dtype=torch.uint8)
        device_view(addr, n, dev).copy_(src)
        return
    raise InvalidDescriptors(f"unknown memory type {mem_type!r}")


def memmove(dst: int, src: int, nbytes: int) -> None:
    """Host memcpy (ctypes releases the GIL for the call)."""
    ctypes.memmove(dst, src, nbytes)


# --------------------------------------------------------------------------------------------
# Shared host buffers (/dev/shm files) for ShmAgent
# --------------------------------------------------------------------------------------------

_owned: set[str] = set()


def _unlink(path: str) -> None:
    _owned.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_all() -> None:
    for p in list(_owned):
        _unlink(p)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_shm(directory: str = SHM_DIR) -> int:
    """Remove our shared buffers left by processes that no longer exist. Returns the count."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for n in names:
        m = re.fullmatch(re.escape(SHM_PREFIX) + r"(\d+)-[0-9a-f]+", n)
        if m and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(directory, n))
                removed += 1
            except OSError:
                pass
    return removed


def _new_shm_file(nbytes: int, directory: str) -> str:
    if nbytes <= 0:
        raise ValueError(f"shared buffer size must be positive; found {nbytes}")
    sweep_stale_shm(directory)
    path = os.path.join(directory, f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    _owned.add(path)
    return path


def alloc_shared_host(nbytes: int, directory: str = SHM_DIR):
    """A zero-filled uint8 torch tensor of `nbytes` backed by a shared file (MAP_SHARED)."""
    import torch

    path = _new_shm_file(nbytes, directory)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def alloc_shared_array(nbytes: int, directory: str = SHM_DIR) -> np.ndarray:
    """A zero-filled uint8 numpy array of `nbytes` backed by a shared file (MAP_SHARED)."""
    path = _new_shm_file(nbytes, directory)
    return np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))


def find_file_mapping(addr: int, nbytes: int, maps_path: str = "/proc/self/maps"):
    """(path, file_offset) of the shared file mapping that holds [addr, addr+nbytes), or None.

    The range may span several adjacent mappings of the same file when their file offsets are
    consecutive (the kernel splits VMAs, e.g. after mprotect).
    """
    end = addr + nbytes
    try:
        with open(maps_path) as f:
            lines = f.readlines()
    except OSError:
        return None
    vmas = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        rng, perms, off, _dev, _inode, path = parts
        path = path.strip()
        if not path.startswith("/") or "s" not in perms:
            continue
        lo, hi = (int(x, 16) for x in rng.split("-"))
        vmas.append((lo, hi, int(off, 16), path))
    vmas.sort()
    for i, (lo, hi, off, path) in enumerate(vmas):
        if lo <= addr < hi:
            cur_hi, cur_off_end = hi, off + (hi - lo)
            j = i
            while cur_hi < end:
                j += 1
                if j >= len(vmas):
                    return None
                nlo, nhi, noff, npath = vmas[j]
                if nlo != cur_hi or npath != path or noff != cur_off_end:
                    return None
                cur_hi, cur_off_end = nhi, noff + (nhi - nlo)
            return path, off + (addr - lo)
    return None
