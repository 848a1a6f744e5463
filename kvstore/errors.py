"""Every error kvstore raises. Callers catch these; api/errors.py maps them to HTTP.

    KVStoreError                      base of everything below
    ├── InvalidInput                  the caller's mistake: a bad digest, name, length or record
    │   ├── DigestMismatch            uploaded bytes do not hash to the digest they claim
    │   └── MissingReferences         a record names pages, blocks or a format not stored
    ├── NotFound                      no such format, block, page or checkpoint
    ├── AlreadyExists                 a checkpoint of that name exists (pass replace=True)
    ├── IncompatibleFormat            format identities differ; .diff names every field
    │   └── UnsupportedVersion        a schema version newer than this code knows
    │       └── NeedsMigration        a write to a store of an older schema (read-only
    │                                 until `kvstore migrate`)
    ├── IntegrityError                stored bytes do not match their digest (page quarantined)
    │   └── CopyDamaged               a copy of a page that verifies in the store did not match
    │                                 on arrival (kvstore/deferred.py); nothing quarantined
    ├── StoreCorrupt                  the LMDB environment is not a whole store (a declared
    │                                 sub-database or the meta record is missing, or LMDB
    │                                 refuses the file); refused at open, nothing written
    ├── StoreFull                     the disk or the configured map limit is full;
    │                                 nothing of the failed write was committed
    ├── GCAborted                     a GC paused past its grace period, or another GC runs
    └── StoreIOError                  the operating system failed a read, write or sync;
                                      the write it belonged to did not happen

Three levels, as the style guide asks: these exceptions for a caller's mistake or a
failed operation; returned decisions (for example an eviction plan) for "cannot now";
assertions with a diagnostic for broken invariants.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class. `code` is a stable machine-readable name used on the wire."""

    code = "kvstore_error"


class InvalidInput(KVStoreError, ValueError):
    code = "invalid_input"


class DigestMismatch(InvalidInput):
    code = "digest_mismatch"

    def __init__(self, claimed: str, actual: str):
        super().__init__(
            f"page bytes hash to {actual}, not to the claimed digest {claimed}; "
            "nothing was stored"
        )
        self.claimed = claimed
        self.actual = actual


class MissingReferences(InvalidInput):
    code = "missing_references"

    def __init__(self, what: str, missing: list[str]):
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        super().__init__(
            f"{what} references {len(missing)} object(s) the store does not have: {shown}. "
            "Upload them first (see missing()); nothing was committed"
        )
        self.missing = missing


class NotFound(KVStoreError, KeyError):
    code = "not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class AlreadyExists(KVStoreError):
    code = "already_exists"


class IncompatibleFormat(KVStoreError):
    """Two format identities differ. `diff` is a list of (field path, ours, theirs)."""

    code = "incompatible_format"

    def __init__(self, message: str, diff: list[tuple[str, object, object]] | None = None):
        self.diff = list(diff or [])
        if self.diff:
            lines = "\n".join(f"  {path}: {a!r} != {b!r}" for path, a, b in self.diff)
            message = f"{message}\n{lines}"
        super().__init__(message)


class UnsupportedVersion(IncompatibleFormat):
    code = "unsupported_version"


class NeedsMigration(UnsupportedVersion):
    """A write to a store whose schema version this code reads but no longer writes
    (schema 1: page bodies as LMDB values). Nothing was written."""

    code = "needs_migration"


class IntegrityError(KVStoreError):
    code = "integrity_error"

    def __init__(self, digest: str, detail: str):
        super().__init__(
            f"page {digest} failed its integrity check ({detail}); it was quarantined and "
            "will not be returned again. Run `kvstore check --read-data` and re-publish it"
        )
        self.digest = digest


class CopyDamaged(IntegrityError):
    """The device's copy of a page failed the page's checksum while the stored page
    verifies (kvstore/deferred.py): damage on the way, nothing in the store to quarantine."""

    code = "copy_damaged"

    def __init__(self, digest: str):
        KVStoreError.__init__(
            self, f"the copy of page {digest} that the device hashed does not match the page's "
                  "xxh3-128, while the stored page verifies: it was damaged on its way (host "
                  "staging, the bus or device memory); nothing was quarantined. Retry the "
                  "restore; if it recurs, check the machine's memory and GPU")
        self.digest = digest


class StoreCorrupt(KVStoreError):
    """The store directory's LMDB environment is damaged: it is refused at open, before
    anything is written, and never re-initialised. docs/reliability.md says what next."""

    code = "store_corrupt"


class StoreFull(KVStoreError):
    code = "store_full"


class GCAborted(KVStoreError):
    code = "gc_aborted"


class StoreIOError(KVStoreError, OSError):
    code = "io_error"
