"""kvstore.tier: an S3 bucket as the shared tier behind each host's local Store.

Nouns:
  bucket        one S3 bucket (Ceph RGW, MinIO, AWS) shared by every host, under an
                optional key prefix; Bucket wraps the few calls made on it (bucket.py).
  layout        the object names and the envelope every object carries, with its
                schema version (layout.py; docs/format.md "S3 layout").
  upload queue  the persistent write-behind backlog of a store directory: jobs that
                name objects to upload, in lanes (pages, then block records, then
                checkpoints), capped in bytes (queue.py).
  uploader      the thread that drains the queue with retries and backoff, uploading a
                record only once everything it names is in the bucket (uploader.py).
  TieredStore   the Store protocol over a local Store (the cache) and the bucket:
                writes commit locally then upload; reads fall through to the bucket on
                a local miss, verified and inserted locally (store.py).
  remote GC     mark-and-sweep of the bucket with a grace period (gc.py).

No MLX here, as in the rest of kvstore. boto3 is imported only when a Bucket is made.
"""

from kvstore.tier.bucket import Bucket, TierConfig  # noqa: F401
from kvstore.tier.errors import RemoteIntegrityError, RemoteUnavailable  # noqa: F401
from kvstore.tier.store import TieredStats, TieredStore, open_tiered  # noqa: F401
