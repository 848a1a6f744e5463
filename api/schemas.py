"""Request and response bodies. Every client string that names something is checked
here by a strict pattern, before any route code runs; kvstore re-checks it anyway.

Digests, chain keys and format ids travel as 64 lowercase hex characters; token ids
as JSON integers in [0, 2^32). Page bytes never travel in JSON (see kvstore/wire.py).

Types are strict: a JSON boolean is never a number, a string never an integer. The one
leniency is the one JSON Schema itself makes: an integer field takes a number with no
fractional part (12169280.0), since the OpenAPI document calls that an integer and a
client that follows the document must not be refused (JsonInt). Bounds are checked on
both branches; ints stay on pydantic's native path (a 4M-token lookup validates in
about as long as with StrictInt).

Checkpoint metadata is free-form JSON within the limits kvstore holds every writer to
(kvstore/records.py check_metadata: depth, keys and list items, key length, bytes,
finite numbers). The Checkpoint the route builds refuses metadata past them (400
invalid_input) before anything is stored.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    WithJsonSchema,
)

from kvstore.format import MAX_LAYERS
from kvstore.records import (
    MAX_ATTACHMENTS,
    MAX_METADATA_DEPTH,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_NBYTES,
)

HEX64_PATTERN = r"^[0-9a-f]{64}$"
NAMESPACE_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$"
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-:@+]{0,127}$"
MAX_DIGESTS_PER_REQUEST = 1 << 20
MAX_TOKENS_PER_REQUEST = 1 << 22
MAX_BLOCK_TOKENS = 65536


def _integral(value: float) -> int:
    if not value.is_integer():
        raise ValueError("expected an integer")
    return int(value)


def json_int(ge: int | None = None, le: int | None = None):
    """An integer field as JSON Schema means it: a JSON int, or a float with no
    fractional part; never a boolean or a string."""
    schema = {"type": "integer", **({"minimum": ge} if ge is not None else {}),
              **({"maximum": le} if le is not None else {})}
    return Annotated[Union[Annotated[StrictInt, Field(ge=ge, le=le)],
                           Annotated[StrictFloat, Field(ge=ge, le=le), AfterValidator(_integral)]],
                     Field(union_mode="left_to_right"), WithJsonSchema(schema)]


def json_number(ge: float | None = None, le: float | None = None):
    """A number field: a JSON int or float (finite), never a boolean or a string."""
    schema = {"type": "number", **({"minimum": ge} if ge is not None else {}),
              **({"maximum": le} if le is not None else {})}
    return Annotated[Union[Annotated[StrictFloat, Field(ge=ge, le=le, allow_inf_nan=False)],
                           Annotated[StrictInt, Field(ge=ge, le=le), AfterValidator(float)]],
                     Field(union_mode="left_to_right"), WithJsonSchema(schema)]


JsonInt = json_int()
NonNegativeInt = json_int(ge=0)


Hex64 = Annotated[str, StringConstraints(pattern=HEX64_PATTERN, min_length=64, max_length=64)]
Namespace = Annotated[str, StringConstraints(pattern=NAMESPACE_PATTERN, max_length=64)]
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN, max_length=128)]
TokenId = json_int(ge=0, le=2**32 - 1)
ShortText = Annotated[str, StringConstraints(max_length=256)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    code: str = Field(description="stable machine-readable name; see docs/api.md")
    message: str


# -- formats --------------------------------------------------------------------------
class LayerSpecBody(Strict):
    kind: ShortText = "full"
    kv_heads: JsonInt = 0
    k_head_dim: JsonInt = 0
    v_head_dim: JsonInt = 0
    page_format: ShortText = "native-bf16"
    group_size: JsonInt = 0
    scale_dtype: ShortText = ""
    rotation: ShortText = "none"
    window: JsonInt = 0


class FormatBody(Strict):
    model_id: ShortText
    model_fingerprint: ShortText
    block_size_tokens: JsonInt
    layers: list[LayerSpecBody] = Field(max_length=MAX_LAYERS)
    tokenizer_fingerprint: ShortText = ""
    schema_version: JsonInt = 1
    converted_at_token: JsonInt = 0  # schema >= 2 (kvstore/format.py)


class FormatPut(BaseModel):
    format_id: Hex64


class FormatList(BaseModel):
    formats: list[FormatBody]


# -- pages ----------------------------------------------------------------------------
class DigestList(Strict):
    digests: list[Hex64] = Field(max_length=MAX_DIGESTS_PER_REQUEST)


class MissingPages(BaseModel):
    missing: list[Hex64]


class PagePut(BaseModel):
    digest: Hex64
    new: bool
    stored_nbytes: int


class PutPages(BaseModel):
    new: int
    existing: int
    stored_nbytes: int


class PageSizes(BaseModel):
    nbytes: list[int]


# -- blocks and prefixes ----------------------------------------------------------------
class BlockBody(Strict):
    format_id: Hex64
    namespace: Namespace
    parent: Hex64
    tokens: list[TokenId] = Field(min_length=1, max_length=MAX_BLOCK_TOKENS)
    pages: list[Hex64] = Field(max_length=MAX_LAYERS)


class BlockOut(BlockBody):
    key: Hex64
    created_ns: int
    last_used_ns: int


class CommitBlocks(Strict):
    blocks: list[BlockBody] = Field(max_length=1 << 16)


class CommitOut(BaseModel):
    new: int
    existing: int
    evicted_blocks: int


class KeyList(Strict):
    keys: list[Hex64] = Field(max_length=MAX_DIGESTS_PER_REQUEST)


class BlockList(BaseModel):
    blocks: list[BlockOut]


class Presence(BaseModel):
    present: list[bool]


class ChainSaltOut(BaseModel):
    namespace: str
    salted: bool
    salt: str | None = Field(description="64 hex characters; null when unsalted")


class PrefixLookup(Strict):
    format_id: Hex64
    namespace: Namespace
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS_PER_REQUEST)
    max_tokens: NonNegativeInt | None = None


class PrefixMatchOut(BaseModel):
    tokens_matched: int
    blocks: list[BlockOut]


# -- checkpoints ------------------------------------------------------------------------
class CheckpointBody(Strict):
    name: Name
    namespace: Namespace
    format_id: Hex64
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS_PER_REQUEST)
    chain_keys: list[Hex64] = Field(max_length=MAX_DIGESTS_PER_REQUEST)
    attachments: dict[Annotated[str, StringConstraints(min_length=1, max_length=128)], Hex64] = \
        Field(default_factory=dict, max_length=MAX_ATTACHMENTS)
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description=f"free-form JSON: at most {MAX_METADATA_DEPTH} levels deep, "
                    f"{MAX_METADATA_ENTRIES} keys and list items, {MAX_METADATA_NBYTES} bytes")


class CheckpointCreate(CheckpointBody):
    replace: StrictBool = False


class CheckpointOut(CheckpointBody):
    created_ns: int
    num_tokens: int


class CheckpointList(BaseModel):
    checkpoints: list[CheckpointOut]


# -- stats and admin ----------------------------------------------------------------------
class StatsOut(BaseModel):
    page_count: int
    block_count: int
    checkpoint_count: int
    format_count: int
    quarantined_count: int
    pinned_block_count: int
    raw_nbytes: int
    stored_nbytes: int
    referenced_raw_nbytes: int
    evicted_blocks: int
    evicted_nbytes: int
    budget_nbytes: int | None
    map_nbytes: int
    file_nbytes: int
    lookups: int
    lookup_hits: int
    tokens_looked_up: int
    tokens_matched: int
    lookups_stopped_at_damage: int = 0
    dedup_ratio: float
    compression_ratio: float
    # present when an S3 tier is behind the store (kvstore/tier): the upload backlog
    remote_bucket: str | None = None
    backlog_jobs: int | None = None
    backlog_nbytes: int | None = None
    backlog_pages: int | None = None
    backlog_blocks: int | None = None
    backlog_checkpoints: int | None = None
    backlog_oldest_age_s: float | None = None
    backlog_failing: int | None = None
    backlog_max_nbytes: int | None = None
    remote_uploaded: int | None = None
    remote_uploaded_nbytes: int | None = None
    remote_skipped_existing: int | None = None
    remote_dropped: int | None = None
    remote_upload_failures: int | None = None
    remote_refused_nbytes: int | None = None
    remote_fetched_pages: int | None = None
    remote_fetched_nbytes: int | None = None
    remote_fetched_blocks: int | None = None
    remote_integrity_errors: int | None = None
    remote_lookups_unavailable: int | None = None


class Health(BaseModel):
    status: str
    version: str


class GCRequest(Strict):
    grace_s: json_number(ge=0, le=10 * 365 * 86400) = 3600.0
    dry_run: StrictBool = False


class GCOut(BaseModel):
    plan: dict[str, float | int]
    deleted: dict[str, float | int] | None = None


class EvictRequest(Strict):
    to_nbytes: NonNegativeInt


class EvictOut(BaseModel):
    blocks: int
    pages: int
    freed_nbytes: int


class CheckRequest(Strict):
    read_data: StrictBool = False
    subset: tuple[NonNegativeInt, json_int(ge=1)] | None = None


class ProblemOut(BaseModel):
    kind: str
    object: str
    detail: str


class CheckOut(BaseModel):
    ok: bool
    problems: list[ProblemOut]
    pages_checked: int
    pages_read: int
    bytes_read: int
    blocks_checked: int
    checkpoints_checked: int
