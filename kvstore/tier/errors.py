"""Errors of the S3 tier, placed in kvstore's hierarchy (kvstore/errors.py) so callers,
api/errors.py and the CLI treat them as the local ones:

    KVStoreError
    ├── IntegrityError
    │   └── RemoteIntegrityError   an object in the bucket fails its check against its
    │                              name (digest, chain key, format id) or its envelope;
    │                              it is refused and never served or cached
    ├── StoreIOError
    │   └── RemoteUnavailable      the bucket did not answer (after retries), or refused
    │                              the credentials; the local store is unaffected
    └── GCAborted                  (kvstore.errors) a remote GC ran past its grace period

A write that committed locally never fails because of the bucket (the write-behind
queue retries); only the synchronous mode (sync=True) raises RemoteUnavailable, and
the data stays committed locally and queued.
"""

from __future__ import annotations

from kvstore.errors import IntegrityError, StoreIOError


class RemoteIntegrityError(IntegrityError):
    code = "remote_integrity_error"

    def __init__(self, key: str, detail: str):
        Exception.__init__(
            self, f"object {key} in the bucket failed its integrity check ({detail}); it was "
            "refused and not cached. Delete the object; a host that still holds it uploads "
            "it again when a record next depends on it (docs/distributed.md, Failures)")
        self.digest = key.rsplit("/", 1)[-1]
        self.key = key


class RemoteUnavailable(StoreIOError):
    code = "remote_unavailable"
