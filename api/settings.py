"""Settings of the service: defaults < TOML file < environment (KVSTORE_*) < flags.

    [server]                            # every key is optional; env names in brackets
    host = "127.0.0.1"                  # KVSTORE_HOST; non-loopback needs a token
    port = 8700                         # KVSTORE_PORT
    data_dir = "./var/kvstore"          # KVSTORE_DIR
    token = "..."                       # KVSTORE_TOKEN: user token for `namespace`
    namespace = "default"               # KVSTORE_NAMESPACE
    admin_token = "..."                 # KVSTORE_ADMIN_TOKEN: admin, every namespace
    tokens_file = "/etc/kvstore/tokens.toml"   # KVSTORE_TOKENS_FILE (see api/auth.py)
    max_page_nbytes = 67108864          # KVSTORE_MAX_PAGE_NBYTES: one PUT page body
    max_json_nbytes = 16777216          # KVSTORE_MAX_JSON_NBYTES: any other body
    max_batch_pages = 16384             # KVSTORE_MAX_BATCH_PAGES: digests per request
    max_batch_nbytes = 1073741824       # KVSTORE_MAX_BATCH_NBYTES: one batch read
    max_concurrent_uploads = 8          # KVSTORE_MAX_CONCURRENT_UPLOADS: page bodies in
                                        # memory at once (others wait); 8 x 64 MiB
    max_uploads_per_token = 4           # KVSTORE_MAX_UPLOADS_PER_TOKEN: of those, one token's
    max_concurrent_reads = 4            # KVSTORE_MAX_CONCURRENT_READS: batch reads at once
    body_timeout_s = 10.0               # KVSTORE_BODY_TIMEOUT_S: a body must have arrived
    min_body_bytes_per_s = 1048576      # KVSTORE_MIN_BODY_BYTES_PER_S: by timeout + bytes /
                                        # this rate after its first read, or it is a 408
    max_header_nbytes = 65536           # KVSTORE_MAX_HEADER_NBYTES: request line + headers
    max_header_count = 100              # KVSTORE_MAX_HEADER_COUNT: header lines per request
    max_read_decoded_nbytes = 469762048 # KVSTORE_MAX_READ_DECODED_NBYTES: page bytes decoded
                                        # for batch reads in flight, all tokens together
                                        # (448 MiB: with 64 MiB of slack, 512 MiB of RSS)
    max_read_decoded_nbytes_per_token = 268435456  # ..._PER_TOKEN: one token's share; also
                                        # the most one batch read may decode
    read_budget_wait_s = 10.0           # KVSTORE_READ_BUDGET_WAIT_S: a read waits this long
                                        # for decode budget, then is a 503 busy
    budget_nbytes = 0                   # KVSTORE_BUDGET_NBYTES: 0 = no eviction budget
    map_nbytes = 1073741824             # KVSTORE_MAP_NBYTES: initial LMDB map
    max_map_nbytes = 1099511627776      # KVSTORE_MAX_MAP_NBYTES
    reserve_nbytes = 67108864           # KVSTORE_RESERVE_NBYTES: disk (and map limit) kept
                                        # for deletes, eviction and GC
    s3_bucket = "kv-pages"              # KVSTORE_S3_BUCKET: set it to put the S3 tier
                                        # behind the store (kvstore/tier, docs/distributed.md)
    s3_endpoint = "http://rgw:7480"     # KVSTORE_S3_ENDPOINT; unset = AWS for s3_region
    s3_prefix = "fleet-a"               # KVSTORE_S3_PREFIX: key prefix inside the bucket
    s3_access_key = "..."               # KVSTORE_S3_ACCESS_KEY / KVSTORE_S3_SECRET_KEY;
    s3_secret_key = "..."               # unset = boto3's credential chain
    s3_region = "us-east-1"             # KVSTORE_S3_REGION
    s3_sync = false                     # KVSTORE_S3_SYNC: acknowledge saves after the bucket
    s3_threads = 8                      # KVSTORE_S3_THREADS: requests in flight
    s3_backlog_max_nbytes = 4294967296  # KVSTORE_S3_BACKLOG_MAX_NBYTES: upload backlog cap

Secrets never appear in repr() or logs (SecretStr).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from kvstore.ids import check_namespace

ENV_PREFIX = "KVSTORE_"
ENV_NAMES = {"data_dir": "KVSTORE_DIR"}  # the one name that is not KVSTORE_<FIELD>


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8700, ge=0, le=65535)
    data_dir: Path = Path("./var/kvstore")
    token: SecretStr | None = None
    namespace: str = "default"
    admin_token: SecretStr | None = None
    tokens_file: Path | None = None
    max_page_nbytes: int = Field(64 << 20, ge=1, le=256 << 20)
    max_json_nbytes: int = Field(16 << 20, ge=1024, le=1 << 30)
    max_batch_pages: int = Field(16384, ge=1, le=1 << 20)
    max_batch_nbytes: int = Field(1 << 30, ge=1, le=1 << 36)
    max_concurrent_uploads: int = Field(8, ge=1, le=1024)
    max_uploads_per_token: int = Field(4, ge=1, le=1024)
    max_concurrent_reads: int = Field(4, ge=1, le=1024)
    body_timeout_s: float = Field(10.0, gt=0, le=3600)
    min_body_bytes_per_s: int = Field(1 << 20, ge=1)
    max_header_nbytes: int = Field(64 << 10, ge=4096, le=1 << 20)
    max_header_count: int = Field(100, ge=8, le=10_000)
    max_read_decoded_nbytes: int = Field(448 << 20, ge=1 << 20)
    max_read_decoded_nbytes_per_token: int = Field(256 << 20, ge=1 << 20)
    read_budget_wait_s: float = Field(10.0, ge=0, le=3600)
    budget_nbytes: int = Field(0, ge=0)
    map_nbytes: int = Field(1 << 30, ge=1 << 20)
    max_map_nbytes: int = Field(1 << 40, ge=1 << 20)
    reserve_nbytes: int = Field(64 << 20, ge=0)
    log_level: str = "info"
    s3_bucket: str | None = None
    s3_endpoint: str | None = None
    s3_prefix: str = ""
    s3_access_key: SecretStr | None = None
    s3_secret_key: SecretStr | None = None
    s3_region: str = "us-east-1"
    s3_sync: bool = False
    s3_threads: int = Field(8, ge=1, le=256)
    s3_backlog_max_nbytes: int = Field(4 << 30, ge=0)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return check_namespace(value)

    @field_validator("token", "admin_token")
    @classmethod
    def _secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("tokens must be at least 16 characters")
        return value

    def tier_config(self):
        """The S3 tier's TierConfig, or None when no s3_bucket is set."""
        if not self.s3_bucket:
            return None
        from kvstore.tier import TierConfig

        secret = lambda v: v.get_secret_value() if v is not None else None  # noqa: E731
        return TierConfig(bucket=self.s3_bucket, endpoint_url=self.s3_endpoint,
                          prefix=self.s3_prefix, access_key=secret(self.s3_access_key),
                          secret_key=secret(self.s3_secret_key), region=self.s3_region,
                          sync=self.s3_sync, threads=self.s3_threads,
                          backlog_max_nbytes=self.s3_backlog_max_nbytes)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.token or self.admin_token or self.tokens_file)

    @classmethod
    def load(cls, config_file: str | os.PathLike | None = None,
             env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """defaults < config_file (or KVSTORE_CONFIG) < env < overrides (None = unset)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        config_file = config_file or env.get("KVSTORE_CONFIG")
        if config_file:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
            values.update(data.get("server", data))
        for name in cls.model_fields:
            key = ENV_NAMES.get(name, ENV_PREFIX + name.upper())
            if key in env and env[key] != "":
                values[name] = env[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
