"""Bucket: the few S3 calls the tier makes, over one boto3 client and one bounded pool.

TierConfig holds where the bucket is and how hard to push it; it comes from the
service settings (api/settings.py: s3_endpoint, s3_bucket, s3_prefix, s3_access_key,
s3_secret_key, s3_region) or from KVSTORE_S3_* in the environment (from_env). Nothing
names one server: any S3 endpoint (Ceph RGW, MinIO, AWS) takes the same calls.

Transport. One boto3 client (thread-safe) with a urllib3 pool of `max_connections`
kept-alive connections, and one ThreadPoolExecutor of `threads` workers for parallel
GETs, PUTs and DELETEs; more in flight than connections would only queue in urllib3.
botocore's own retries (standard mode) absorb single transient failures; the upload
queue adds backoff over minutes. Checksums are computed only where S3 requires them:
the tier verifies every body against its name itself (kvstore/tier/layout.py), and
the trailing-checksum encoding newer botocore defaults to is not something every
S3 server (Ceph 16.2 among them) speaks.

Immutable objects (pages, block records, formats) go through put_immutable:
  HEAD  absent                   -> PUT with If-None-Match: *  (a racing writer's copy
                                    wins; 412 means the same bytes are already there)
        present, younger than
        refresh_after_s          -> nothing to send
        present, older           -> PUT again (same name, same bytes): its Last-Modified
                                    becomes now, so a remote GC that sweeps by age keeps
                                    it while this writer's records come to depend on it
Ceph RGW 16.2 honours If-None-Match: * on PUT (412 PreconditionFailed; tests check it).
Where a server ignores it the HEAD still prevents the overwrite in all but a race
between two writers of the same name, which write identical bytes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Iterator, Mapping

from kvstore.errors import InvalidInput
from kvstore.tier.errors import RemoteUnavailable
from kvstore.tier.layout import OBJECT_SCHEMA_VERSION, SCHEMA_META_KEY

ENV_FIELDS = {  # TierConfig field -> environment variable
    "endpoint_url": "KVSTORE_S3_ENDPOINT", "bucket": "KVSTORE_S3_BUCKET",
    "prefix": "KVSTORE_S3_PREFIX", "access_key": "KVSTORE_S3_ACCESS_KEY",
    "secret_key": "KVSTORE_S3_SECRET_KEY", "region": "KVSTORE_S3_REGION",
    "sync": "KVSTORE_S3_SYNC", "threads": "KVSTORE_S3_THREADS",
    "backlog_max_nbytes": "KVSTORE_S3_BACKLOG_MAX_NBYTES",
    "refresh_after_s": "KVSTORE_S3_REFRESH_AFTER_S",
}


@dataclass(frozen=True)
class TierConfig:
    bucket: str
    endpoint_url: str | None = None     # None: AWS's own endpoint for the region
    prefix: str = ""                    # key prefix inside the bucket
    access_key: str | None = None       # None: boto3's credential chain
    secret_key: str | None = None
    region: str = "us-east-1"
    threads: int = 8                    # parallel requests; the pool holds as many connections
    sync: bool = False                  # acknowledge a save only once the bucket has it
    backlog_max_nbytes: int = 4 << 30   # upload backlog cap; past it saves stay local only
    refresh_after_s: float = 1800.0     # re-PUT an immutable object older than this before
                                        # uploading a record that depends on it
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    attempts: int = 3                   # botocore attempts per request

    def __post_init__(self):
        if not self.bucket:
            raise InvalidInput("the S3 tier needs a bucket name")
        if not 1 <= int(self.threads) <= 256:
            raise InvalidInput("threads must be in [1, 256]")

    def __repr__(self) -> str:  # never print the secret
        return (f"TierConfig(bucket={self.bucket!r}, endpoint_url={self.endpoint_url!r}, "
                f"prefix={self.prefix!r}, sync={self.sync})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "TierConfig | None":
        """From KVSTORE_S3_*; None when no bucket is named."""
        env = os.environ if env is None else env
        values = {k: env[v] for k, v in ENV_FIELDS.items() if env.get(v)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values.get("bucket"):
            return None
        for name, kind in (("threads", int), ("backlog_max_nbytes", int), ("refresh_after_s", float)):
            if name in values:
                values[name] = kind(values[name])
        if isinstance(values.get("sync"), str):
            values["sync"] = values["sync"].lower() in ("1", "true", "yes", "on")
        return cls(**values)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    nbytes: int
    last_modified: datetime
    etag: str = ""
    server_date: datetime | None = None  # the response's Date header (HEAD only)

    @property
    def age_s(self) -> float:
        """Age by the server's clock where the response carried it, else by ours."""
        now = self.server_date or datetime.now(timezone.utc)
        return (now - self.last_modified).total_seconds()


class Bucket:
    """One bucket; every method is thread-safe. close() ends the pool."""

    def __init__(self, config: TierConfig):
        import boto3
        from botocore.config import Config

        self.config = config
        self.name = config.bucket
        self.threads = int(config.threads)
        boto_config = Config(
            max_pool_connections=self.threads + 2, connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s, tcp_keepalive=True,
            retries={"max_attempts": config.attempts, "mode": "standard"},
            s3={"addressing_style": "path"}, signature_version="s3v4",
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required")
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region,
            aws_access_key_id=config.access_key, aws_secret_access_key=config.secret_key,
            config=boto_config)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvstore-s3")
        self._lock = threading.Lock()
        self.requests = {"get": 0, "put": 0, "head": 0, "delete": 0, "list": 0}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()

    def _count(self, op: str) -> None:
        with self._lock:
            self.requests[op] += 1

    def _call(self, op: str, fn, key: str, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        self._count(op)
        try:
            return fn(Bucket=self.name, **({"Key": key} if key is not None else {}), **kwargs)
        except ClientError:
            raise
        except BotoCoreError as exc:
            raise RemoteUnavailable(f"bucket {self.name}: {op} {key or ''} failed: {exc}") from None

    # -- calls -------------------------------------------------------------------------------
    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (tests, first deployment)."""
        from botocore.exceptions import ClientError

        try:
            self._call("head", self.client.head_bucket, None)
        except ClientError:
            self._call("put", self.client.create_bucket, None)

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when absent."""
        from botocore.exceptions import ClientError

        try:
            response = self._call("get", self.client.get_object, key)
            return response["Body"].read()
        except ClientError as exc:
            if _status(exc) == 404:
                return None
            raise _unavailable(exc, "get", key) from None

    def head(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import ClientError

        try:
            r = self._call("head", self.client.head_object, key)
        except ClientError as exc:
            if _status(exc) == 404:
                return None
            raise _unavailable(exc, "head", key) from None
        date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        return ObjectInfo(key, r["ContentLength"], r["LastModified"], r.get("ETag", ""),
                          parsedate_to_datetime(date) if date else None)

    def put(self, key: str, pieces, *, if_none_match: bool = False) -> bool:
        """PUT the concatenated pieces. False when If-None-Match found the object there."""
        from botocore.exceptions import ClientError

        body = pieces if isinstance(pieces, bytes) else b"".join(pieces)
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            self._call("put", self.client.put_object, key, Body=body,
                       Metadata={SCHEMA_META_KEY: str(OBJECT_SCHEMA_VERSION)}, **extra)
            return True
        except ClientError as exc:
            if if_none_match and _status(exc) in (409, 412):
                return False
            raise _unavailable(exc, "put", key) from None

    def put_immutable(self, key: str, pieces, refresh_after_s: float) -> str:
        """'new', 'exists' or 'refreshed' (see the module docstring)."""
        info = self.head(key)
        if info is None:
            return "new" if self.put(key, pieces, if_none_match=True) else "exists"
        if info.age_s < refresh_after_s:
            return "exists"
        self.put(key, pieces)
        return "refreshed"

    def delete(self, key: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("delete", self.client.delete_object, key)
        except ClientError as exc:
            if _status(exc) != 404:
                raise _unavailable(exc, "delete", key) from None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.name, Prefix=prefix,
                                           PaginationConfig={"PageSize": 1000}):
                self._count("list")
                for item in page.get("Contents", ()):
                    yield ObjectInfo(item["Key"], item["Size"], item["LastModified"],
                                     item.get("ETag", ""))
        except (ClientError, BotoCoreError) as exc:
            raise RemoteUnavailable(f"bucket {self.name}: list {prefix} failed: {exc}") from None

    def server_now(self) -> datetime:
        """The server's clock (the Date header of a HEAD on the bucket): object ages are
        measured against the clock that stamped Last-Modified, not ours."""
        r = self._call("head", self.client.head_bucket, None)
        date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        return parsedate_to_datetime(date) if date else datetime.now(timezone.utc)


def _status(exc) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _unavailable(exc, op: str, key: str) -> RemoteUnavailable:
    code = exc.response.get("Error", {}).get("Code", "")
    return RemoteUnavailable(f"bucket: {op} {key} refused ({_status(exc)} {code})")
