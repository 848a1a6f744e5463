"""Where CUDA managed memory lives: advice for host staging buffers, through the driver.

MLX's CUDA backend allocates every array made on the host (mx.array from numpy) in
managed memory (cudaMallocManaged), and an array the host views (memoryview) is moved
there too. By default a managed page migrates to whichever processor touched it last:
a staging buffer the host writes and the GPU then reads would migrate to the GPU page
by page on the GPU's faults, and back on the host's next write (both ways, every
restore). Advised "preferred location: host, accessed by: the GPU", its pages stay in
host memory and the GPU reads them in place over the bus, as from pinned memory.

MLX has no call for this, so it is made through the CUDA driver (libcuda.so.1, which
MLX itself links, so the primary context and the pointers are the same). Everything
here is best effort: without CUDA, or when a call fails, the functions return False
and the buffer keeps the default policy (correct, only slower). Nothing is imported or
loaded until a CUDA restore asks.

Driver calls used (CUDA >= 12.2): cuInit, cuDevicePrimaryCtxRetain, cuCtxGetCurrent,
cuCtxSetCurrent, cuMemAdvise_v2 (CUmemLocation), cuMemPrefetchAsync_v2.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

log = logging.getLogger(__name__)

# cuda.h enums
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_LOCATION_HOST = 2  # CU_MEM_LOCATION_TYPE_HOST
_ADVISE_SET_PREFERRED_LOCATION = 3
_ADVISE_SET_ACCESSED_BY = 5


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda with a context made current on first use, or None (logged once)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuMemAdvise_v2", "cuMemPrefetchAsync_v2"):
            getattr(lib, name)
        lib.cuMemAdvise_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]
        lib.cuMemPrefetchAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location,
                                              ctypes.c_uint, ctypes.c_void_p]
        if lib.cuInit(0) != 0:
            raise OSError("cuInit failed")
        return lib
    except (OSError, AttributeError) as exc:
        log.info("CUDA driver not usable for managed-memory advice (%s): staging buffers "
                 "keep the default migration policy", exc)
        return None


def _current(lib, device: int) -> bool:
    """Make the device's primary context (the one MLX's runtime uses) current on this
    thread if none is."""
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return True
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) != 0:
        return False
    return lib.cuCtxSetCurrent(ctx) == 0


def keep_on_host(address: int, nbytes: int, device: int = 0) -> bool:
    """Advise managed memory [address, address + nbytes): preferred location the host,
    accessed by `device` (its pages stay in host memory; the GPU maps and reads them
    without migrating). True when both pieces of advice were taken."""
    lib = _driver()
    if lib is None or nbytes == 0:
        return False
    with _lock:
        if not _current(lib, device):
            return False
        host, gpu = _Location(_LOCATION_HOST, 0), _Location(_LOCATION_DEVICE, device)
        ok = (lib.cuMemAdvise_v2(address, nbytes, _ADVISE_SET_PREFERRED_LOCATION, host) == 0
              and lib.cuMemAdvise_v2(address, nbytes, _ADVISE_SET_ACCESSED_BY, gpu) == 0)
    if not ok:
        log.info("cuMemAdvise refused %d bytes at %#x: default migration policy", nbytes, address)
    return ok


def prefetch(address: int, nbytes: int, device: int | None = 0) -> bool:
    """Migrate managed memory to `device` (None: the host) ahead of use, on the legacy
    default stream; returns at once (the copy is ordered before later work on that
    stream only, so callers that need it done synchronize). True when accepted."""
    lib = _driver()
    if lib is None or nbytes == 0:
        return False
    with _lock:
        if not _current(lib, device or 0):
            return False
        where = _Location(_LOCATION_HOST, 0) if device is None else _Location(_LOCATION_DEVICE, device)
        return lib.cuMemPrefetchAsync_v2(address, nbytes, where, 0, None) == 0


def synchronize(device: int = 0) -> bool:
    """cuCtxSynchronize on the device's primary context."""
    lib = _driver()
    if lib is None:
        return False
    with _lock:
        return _current(lib, device) and lib.cuCtxSynchronize() == 0


__all__ = ["keep_on_host", "prefetch", "synchronize"]
