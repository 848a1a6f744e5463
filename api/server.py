"""serve(settings): run the service under uvicorn, refusing an unsafe bind.

Binding a non-loopback address without any token would expose every namespace and
the admin routes to the network, so it is refused (UnsafeBind). One worker process:
the store is one LMDB environment per process, and the service is I/O bound on it.

The HTTP parser is h11, not httptools: h11 refuses a request line plus headers longer
than its max incomplete event size (max_header_nbytes) before the app or the token
check sees anything, where httptools buffers header lines without limit (two
connections of 50 MB of headers added 198 MiB of RSS, issue 23). The header count is
capped in the app (api/limits.py HeaderLimitMiddleware).

The allocator (glibc only): allocations of at least MMAP_THRESHOLD_NBYTES are mapped
and unmapped one by one. glibc's default threshold rises to the size of the largest
block freed (up to 32 MiB), after which decoded pages of several MiB come from the
per-thread heaps and stay there when freed: with a 128 MiB decode budget the
amplification probe peaked at +254 MiB RSS that way, +135 MiB with the fixed
threshold (docs/reliability.md). Buffers under it (the 1 MiB stream pieces) are
unaffected.
"""

from __future__ import annotations

import ctypes
import ipaddress
import sys

import uvicorn

from api.app import create_app
from api.settings import Settings

MMAP_THRESHOLD_NBYTES = 4 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_NBYTES) -> bool:
    """Pin glibc's mmap threshold (see the module docstring). False where the C library
    is not glibc or refuses; nothing changes then."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


class UnsafeBind(ValueError):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    if not is_loopback(settings.host) and not settings.auth_enabled:
        raise UnsafeBind(
            f"refusing to listen on {settings.host}: it is not a loopback address and no "
            "token is set. Set KVSTORE_TOKEN (and KVSTORE_ADMIN_TOKEN) or a tokens file, "
            "or bind 127.0.0.1")


def serve(settings: Settings) -> None:
    check_bind(settings)
    fix_mmap_threshold()
    app = create_app(settings=settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                workers=1, server_header=False, date_header=True, timeout_keep_alive=30,
                proxy_headers=False, http="h11",
                h11_max_incomplete_event_size=settings.max_header_nbytes)
