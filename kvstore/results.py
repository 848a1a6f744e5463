"""The value types a store's calls return: what a put, a commit, a prefix lookup and
stats() report. Plain frozen records, shared by Store, RemoteStore and TieredStore."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvstore.ids import ChainKey
from kvstore.records import BlockRecord


@dataclass(frozen=True)
class PutResult:
    new: int
    existing: int
    stored_nbytes: int


@dataclass(frozen=True)
class CommitResult:
    new: int
    existing: int
    evicted_blocks: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """The longest stored prefix: how many tokens, and the block records in chain order."""

    tokens_matched: int
    blocks: tuple[BlockRecord, ...]

    @property
    def chain_keys(self) -> list[ChainKey]:
        return [b.key for b in self.blocks]


@dataclass(frozen=True)
class StoreStats:
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
    # lookups whose match stopped before a block naming a missing or quarantined page
    # (this process, since open; the caller recomputed from there)
    lookups_stopped_at_damage: int = 0

    @property
    def dedup_ratio(self) -> float:
        return self.referenced_raw_nbytes / self.raw_nbytes if self.raw_nbytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_nbytes / self.stored_nbytes if self.stored_nbytes else 1.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["dedup_ratio"] = self.dedup_ratio
        out["compression_ratio"] = self.compression_ratio
        return out
