"""The store's own file I/O, in one module, so faults can be injected at one boundary.

What goes through here (and what does not):
  commit_txn(txn)     the end of every LMDB write transaction (LmdbEnv.write). LMDB does
                      its own page writes and fdatasync inside mdb_txn_commit; this is the
                      boundary we own around it. A fault injected as "write" or "fsync"
                      aborts the transaction instead of committing it, which is what LMDB
                      itself does when its pwrite or fdatasync fails: the meta page is not
                      updated, so the commit did not happen. Either way StoreIOError is
                      raised and never retried into a success.
  open_lock(path)     the GC lock file: O_NOFOLLOW, so a symlink planted in the store
                      directory is refused instead of followed out of it.
  AtomicFile(path)    files written next to the store (exports): a temporary file opened
                      O_CREAT|O_EXCL|O_NOFOLLOW, then write -> fsync -> rename -> fsync of
                      the directory. A failure at any step unlinks the temporary file and
                      leaves the target untouched.
Not covered: LMDB's own reads, page writes and syncs inside the library (only their
outcome at commit_txn), the lock.mdb reader table, and reads of the mmap.

Fault injection. inject(op, k) makes the k-th call of `op` from now raise OSError(EIO)
(or the errno given), once. KVSTORE_IO_FAULT="op:k" does the same in a
subprocess. OPS lists the operations; `calls` counts every call, so a test can check
that a failed fsync was not retried.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from kvstore.errors import StoreFull, StoreIOError

OPS = ("open", "write", "fsync", "rename", "unlink")
_lock = threading.Lock()
_armed: dict[str, int] = {}     # op -> calls left before it fails (1 = the next one)
_errnos: dict[str, int] = {}    # op -> errno of its armed fault
_env_used: list = []            # KVSTORE_IO_FAULT is armed once per process
calls: dict[str, int] = {op: 0 for op in OPS}


def inject(op: str, k: int = 1, err: int = errno.EIO) -> None:
    """Fail the k-th call of `op` from now (once) with OSError(err)."""
    assert op in OPS, f"unknown I/O operation {op!r}"
    assert k >= 1
    with _lock:
        _armed[op] = k
        _errnos[op] = err



def clear() -> None:
    with _lock:
        _armed.clear()
        _errnos.clear()


def _from_env() -> None:
    spec = os.environ.get("KVSTORE_IO_FAULT")
    if spec and not _armed and not _env_used:
        op, _, k = spec.partition(":")
        inject(op, int(k or 1))
        _env_used.append(True)



def _point(op: str, path) -> None:
    """Count one call of `op`; raise the injected fault when it is due."""
    _from_env()
    with _lock:
        calls[op] += 1
        left = _armed.get(op)
        if left is None:
            return
        if left > 1:
            _armed[op] = left - 1
            return
        del _armed[op]
        err = _errnos.pop(op, errno.EIO)
    raise OSError(err, f"injected {op} fault ({os.strerror(err)})", str(path))


def _typed(exc: OSError, what: str):
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"{what} failed: the disk is full ({exc}); nothing was committed")
    return StoreIOError(f"{what} failed and did not happen: {exc}")


# -- LMDB commit ---------------------------------------------------------------------------
def commit_txn(txn, what: str = "write") -> None:
    """Commit one LMDB write transaction (see the module docstring)."""
    try:
        _point("write", "data.mdb")
        _point("fsync", "data.mdb")
    except OSError as exc:
        txn.abort()
        raise _typed(exc, what) from None
    txn.commit()


# -- lock files ----------------------------------------------------------------------------
def open_lock(path: Path) -> int:
    """Open (creating) a lock file inside the store directory; never follows a symlink."""
    try:
        _point("open", path)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreIOError(f"{path} is a symlink; refusing to follow it out of the store "
                               "directory. Remove it") from None
        raise _typed(exc, f"opening {path}") from None


# -- whole files ---------------------------------------------------------------------------
class AtomicFile:
    """Write a file so that it is either absent or complete and durable:

        with AtomicFile(path) as f:
            f.write(b"...")          # any number of times
        # here: fsynced, renamed over path, directory fsynced

    An exception inside the block (or a failed write, fsync or rename) unlinks the
    temporary file, leaves `path` as it was, and raises (StoreIOError / StoreFull for
    I/O). A failed fsync of the directory after the rename raises StoreIOError too,
    with `path` complete but its rename perhaps not durable. The temporary is <path>.partial, opened O_EXCL|O_NOFOLLOW: a leftover from a
    crash is replaced only after unlinking it (unlink never follows a symlink)."""

    def __init__(self, path):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self._fd = -1
        self.nbytes = 0

    def __enter__(self) -> "AtomicFile":
        try:
            try:
                _point("unlink", self.tmp)
                os.unlink(self.tmp)  # a crashed earlier export's leftover
            except FileNotFoundError:
                pass
            _point("open", self.tmp)
            self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _typed(exc, f"creating {self.tmp}") from None
        return self

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            _point("write", self.tmp)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
                self.nbytes += n
        except OSError as exc:
            raise _typed(exc, f"writing {self.tmp}") from None
        return len(data)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                _point("fsync", self.tmp)
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
                _point("rename", self.tmp)
                os.rename(self.tmp, self.path)
            except OSError as exc:
                self._discard()
                raise _typed(exc, f"writing {self.path}") from None
            try:
                _fsync_dir(self.path.parent)
            except OSError as exc:
                raise StoreIOError(f"{self.path} was written in full, but syncing its directory "
                                   f"failed ({exc}): the rename may not survive a crash") from None
            return False
        self._discard()
        return False

    def _discard(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            _point("unlink", self.tmp)
            os.unlink(self.tmp)
        except OSError:
            pass  # best effort: the target was never touched; a leftover is replaced next time


def _fsync_dir(directory: Path) -> None:
    _point("fsync", directory)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
