"""CUDA IPC through the driver API (`libcuda.so.1`, which every NVIDIA driver ships): export the
allocation under a device address, map a peer's allocation into this process.

This is what UCX's cuda_ipc transport does under NIXL on one host; doing it ourselves lets one
kernel (transfer/copy_kernels.py) write all of a transfer's scattered blocks into the peer's pool
instead of one copy per descriptor. Memory from `cudaMalloc` (PyTorch's caching allocator without
expandable segments) exports; anything else raises `IpcUnavailable` and the caller keeps NIXL.
"""
from __future__ import annotations

import ctypes
import threading

from .errors import TransferError

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class IpcUnavailable(TransferError):
    """CUDA IPC cannot be used here (no driver, memory that does not export, another host...)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_lib = None
_lock = threading.Lock()


def _driver():
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise IpcUnavailable(f"no CUDA driver library: {e}") from None
            u64p = ctypes.POINTER(ctypes.c_uint64)
            lib.cuMemGetAddressRange_v2.argtypes = [u64p, ctypes.POINTER(ctypes.c_size_t),
                                                    ctypes.c_uint64]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
            lib.cuIpcOpenMemHandle_v2.argtypes = [u64p, _Handle, ctypes.c_uint]
            lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise IpcUnavailable(f"{what}: CUDA driver error {rc} "
                             f"({(name.value or b'?').decode()})")


def _current(device: int) -> None:
    """Make `device`'s primary context current on this thread (the driver API needs one)."""
    import torch

    torch.cuda.set_device(device)


def allocation(addr: int, device: int) -> tuple[int, int]:
    """(base, size) of the allocation holding device address `addr`."""
    _current(device)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                             ctypes.c_uint64(addr)), "cuMemGetAddressRange")
    return int(base.value), int(size.value)


def export(addr: int, device: int) -> tuple[bytes, int, int]:
    """(handle, allocation base, allocation size) for the allocation holding `addr`."""
    base, size = allocation(addr, device)
    h = _Handle()
    _check(_driver().cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(base)),
           "cuIpcGetMemHandle")
    return bytes(bytearray(h)), base, size


def open_handle(handle: bytes, device: int) -> int:
    """Map a peer's exported allocation; returns its base address in this process."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise IpcUnavailable(f"an IPC handle is {IPC_HANDLE_BYTES} bytes; found {len(handle)}")
    _current(device)
    h = _Handle.from_buffer_copy(handle)
    ptr = ctypes.c_uint64()
    _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
           "cuIpcOpenMemHandle")
    return int(ptr.value)


def close(ptr: int, device: int) -> None:
    _current(device)
    _check(_driver().cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


def host_identity() -> str:
    """Which machine (boot) this process runs on: two agents with the same identity share GPUs."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
