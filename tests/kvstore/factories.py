"""Factories for kvstore tests, shared with the reliability suite (issue 8).

Everything here is a plain function over a Store, so a test builds exactly the
objects it needs. The nouns:

  identity      a small FormatIdentity (make_identity), cheap enough for thousands of
                saves: two paged layers (native-bf16 and k8v4) and one sliding layer.
  page_payload  the bytes of one layer's page of one block, a pure function of the
                block's chain key and the layer index. Two saves of the same prefix
                therefore produce the same pages (as the engine would), and a restore
                can be checked against bytes recomputed from the keys alone, without a
                log of the bytes. About 1 in 5 pages is all zeros: compressible, and
                shared between blocks, so dedup and reference counts > 1 occur.
  save_prefix   what the engine does to publish a prompt: chain the tokens, skip
                blocks already stored (has_blocks), upload only missing() pages,
                commit the records; optionally a checkpoint.
  restore_prefix
                lookup_prefix + get_pages, every page compared with page_payload.
  flip_bit      damage one bit of a page where it lies in the LMDB data file.

Worker entry points for subprocess tests live in tests/kvstore/workers.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import blake3

from kvstore.format import FormatIdentity, LayerSpec
from kvstore.gc import gc_history
from kvstore.ids import ROOT_KEY, ChainKey, PageDigest, page_digest
from kvstore.pages import HEADER_NBYTES
from kvstore.records import BlockRecord, Checkpoint, blocks_for_tokens
from kvstore.segments import PAGE_VALUE_AT, RECORD_ALIGN
from kvstore.store import Store, StoreConfig

BLOCK_SIZE_TOKENS = 4
TINY_MAP_NBYTES = 64 * 1024


def make_layer(**overrides) -> LayerSpec:
    fields = dict(kind="full", kv_heads=2, k_head_dim=16, v_head_dim=16, page_format="native-bf16")
    fields.update(overrides)
    return LayerSpec(**fields)


def make_identity(**overrides) -> FormatIdentity:
    """A three-layer identity: native-bf16 (512-byte pages per 4 tokens), k8v4 (448
    bytes), and a sliding-window layer that has no pages."""
    layers = (
        make_layer(),
        make_layer(page_format="k8v4", group_size=8, scale_dtype="float32",
                   rotation="signed-hadamard:7"),
        make_layer(kind="sliding", page_format="none", window=64),
    )
    fields = dict(model_id="test/tiny", model_fingerprint="f" * 64, block_size_tokens=BLOCK_SIZE_TOKENS,
                  layers=layers, tokenizer_fingerprint="t" * 64)
    fields.update(overrides)
    return FormatIdentity(**fields)


def make_store(path, *, map_nbytes: int = TINY_MAP_NBYTES, **config) -> Store:
    """A Store with a tiny initial map by default, so map growth runs in every test."""
    return Store(path, StoreConfig(map_nbytes=map_nbytes, **config))


def page_payload(key: bytes, layer_index: int, nbytes: int) -> bytes:
    """Deterministic page bytes for (chain key, layer). ~1 in 5 is all zeros."""
    seed = blake3.blake3(bytes(key) + layer_index.to_bytes(4, "little")).digest()
    if seed[0] % 5 == 0:
        return bytes(nbytes)
    return blake3.blake3(seed).digest(length=nbytes)


@dataclass(frozen=True)
class SavedPrefix:
    namespace: str
    tokens: tuple[int, ...]
    records: tuple[BlockRecord, ...]

    @property
    def chain_keys(self) -> tuple[ChainKey, ...]:
        return tuple(r.key for r in self.records)


def plan_prefix(identity: FormatIdentity, namespace: str, tokens: Sequence[int]
                ) -> tuple[list[BlockRecord], dict[PageDigest, bytes]]:
    """Block records for `tokens` and the payload of every page they name."""
    tokens = tuple(tokens)
    bs = identity.block_size_tokens
    fid = identity.format_id
    pages_per_block, payload, parent = [], {}, ROOT_KEY
    for start in range(0, len(tokens), bs):
        chunk = tokens[start : start + bs]
        record = BlockRecord(fid, namespace, parent, chunk, ())
        row = []
        for li in identity.paged_layers:
            data = page_payload(record.key, li, identity.layers[li].page_nbytes(len(chunk)))
            digest = page_digest(data)
            payload[digest] = data
            row.append(digest)
        pages_per_block.append(row)
        parent = record.key
    return blocks_for_tokens(fid, namespace, tokens, bs, pages_per_block), payload


def save_prefix(store: Store, identity: FormatIdentity, namespace: str, tokens: Sequence[int],
                *, checkpoint: str | None = None) -> SavedPrefix:
    """Publish `tokens` the way the engine does; durable when it returns."""
    store.put_format(identity)
    records, payload = plan_prefix(identity, namespace, tokens)
    known = store.has_blocks([r.key for r in records])
    needed = list(dict.fromkeys(d for r, k in zip(records, known, strict=True) if not k for d in r.pages))
    absent = store.missing(needed)
    if absent:
        store.put_pages({d: payload[d] for d in absent})
    store.commit_blocks(records)
    if checkpoint is not None:
        store.create_checkpoint(Checkpoint(checkpoint, namespace, identity.format_id, tuple(tokens),
                                           tuple(r.key for r in records)), replace=True)
    return SavedPrefix(namespace, tuple(tokens), tuple(records))


def save_salted(store, identity: FormatIdentity, namespace: str, tokens: Sequence[int],
                *, checkpoint: str | None = None) -> list[BlockRecord]:
    """Publish synthetic pages for `tokens` keyed with the store's chain salt for
    `namespace` (a Store or a RemoteStore); durable when it returns."""
    fid = store.put_format(identity)
    bs = identity.block_size_tokens
    pages, payload = [], {}
    for i in range(-(-len(tokens) // bs)):
        row = []
        for li in identity.paged_layers:
            nbytes = identity.layers[li].page_nbytes(len(tokens[i * bs:(i + 1) * bs]))
            data = page_payload(f"{namespace}/{tokens[0]}/{i}".encode(), li, nbytes)
            payload[page_digest(data)] = data
            row.append(page_digest(data))
        pages.append(row)
    records = blocks_for_tokens(fid, namespace, tokens, bs, pages, salt=store.chain_salt(namespace))
    store.put_pages(payload)
    store.commit_blocks(records)
    if checkpoint is not None:
        store.create_checkpoint(Checkpoint(checkpoint, namespace, fid, tuple(tokens),
                                           tuple(r.key for r in records)))
    return records


def expected_pages(identity: FormatIdentity, records: Sequence[BlockRecord]) -> list[bytes]:
    """What a restore of `records` must return, page by page, in block then layer order."""
    out = []
    for r in records:
        for li in identity.paged_layers:
            out.append(page_payload(r.key, li, identity.layers[li].page_nbytes(len(r.tokens))))
    return out


def restore_prefix(store: Store, identity: FormatIdentity, namespace: str,
                   tokens: Sequence[int]) -> tuple[int, list[BlockRecord]]:
    """lookup_prefix + get_pages; asserts every page equals its payload. Returns
    (tokens matched, matched records)."""
    match = store.lookup_prefix(identity.format_id, namespace, tokens)
    digests = [d for b in match.blocks for d in b.pages]
    want = expected_pages(identity, match.blocks)
    with store.get_pages(digests) as views:
        for i, (view, data) in enumerate(zip(views, want, strict=True)):
            assert bytes(view) == data, f"page {i} ({digests[i].short}) restored wrong bytes"
    return match.tokens_matched, list(match.blocks)


def assert_check_clean(store: Store, read_data: bool = False) -> None:
    report = store.check(read_data=read_data)
    assert report.problems == [], f"check found {len(report.problems)} problem(s): {report.problems[:5]}"


def gc_now(store: Store) -> dict:
    """GC with grace 0: every unreferenced page and orphan goes."""
    return store.plan_gc(0.0).execute()


def assert_no_garbage(store: Store) -> None:
    """After a GC: no unreferenced pages, no quarantine, no stale grace entries; and
    after a GC with grace 0, no dead segment record left unpunched (with a grace, the
    records its deletes made wait for the next GC, by design), no mostly-dead segment
    left uncompacted and no retired segment's file left (kvstore/gc.py)."""
    plan = store.plan_gc(0.0)
    summary = plan.summary()
    dead = {k: summary.pop(k) for k in ("dead_records", "dead_nbytes", "compact_segments",
                                        "compact_live_nbytes", "compact_tail_nbytes",
                                        "retired_segments")}
    assert summary == {"grace_s": 0.0, "unreferenced_pages": 0, "unreferenced_nbytes": 0,
                       "quarantined_pages": 0, "stale_time_entries": 0}, plan.summary()
    history = gc_history(store)
    if history and history[-1]["grace_s"] == 0:
        assert set(dead.values()) == {0}, dead
    stats = store.stats()
    with store.lmdb.read() as txn:
        times = txn.stat(store.lmdb.dbs["page_times"])["entries"]
    assert times == stats.page_count, f"{times} grace entries for {stats.page_count} pages"


# -- damage ------------------------------------------------------------------------------
def stored_value(store: Store, digest: bytes) -> bytes:
    """The page's stored value as a schema-1 page record (48-byte header || stored
    bytes): at schema 2, a copy of bytes [80, length) of its segment record."""
    with store.index.read() as index:
        value = index.page(bytes(digest))
        value = bytes(value) if value is not None else None
    assert value is not None, f"page {bytes(digest).hex()} is not stored"
    return value


def stored_places(store_path: Path, value: bytes) -> list[tuple[Path, int]]:
    """Every (file, offset) where the stored value lies, found by content (use random
    page bytes): at schema 2 inside a segment record (the value starts 80 bytes into a
    4 KiB-aligned record, kvstore/segments.py); at schema 1 inside data.mdb, where LMDB
    leaves stale copies of rewritten pages in free pages and leaf gaps (all of them)."""
    seg_dir = Path(store_path) / "segments"
    segment_files = sorted(seg_dir.glob("*.seg")) if seg_dir.is_dir() else []
    places = []
    for path in segment_files:
        blob = path.read_bytes()
        at = blob.find(value)
        while at >= 0:
            if (at - PAGE_VALUE_AT) % RECORD_ALIGN == 0:
                places.append((path, at))
            at = blob.find(value, at + 1)
    if segment_files:
        assert places, "page value not found in any segment record"
        return places
    blob = (Path(store_path) / "data.mdb").read_bytes()
    at = blob.find(value)
    while at >= 0:
        places.append((Path(store_path) / "data.mdb", at))
        at = blob.find(value, at + 1)
    assert places, "page value not found in data.mdb"
    return places


def flip_bit(store_path: Path, value: bytes, bit: int) -> int:
    """Flip bit `bit` (0 = the first bit of the 48-byte page header) of one stored page
    value, with no Store open: inside its segment record at schema 2 (the page header
    at record offset 80, the stored bytes at 128), inside data.mdb at schema 1 (every
    copy, see stored_places). Returns the file offset of the first bit flipped."""
    assert 0 <= bit < 8 * len(value), f"bit {bit} is outside the {len(value)}-byte value"
    places = stored_places(store_path, value)
    for path, at in places:
        with open(path, "r+b") as f:
            f.seek(at + bit // 8)
            byte = f.read(1)[0]
            f.seek(at + bit // 8)
            f.write(bytes([byte ^ (1 << (bit % 8))]))
            f.flush()
            os.fsync(f.fileno())
    return places[0][1] + bit // 8


def header_field_bits() -> dict[str, int]:
    """One bit inside each meaningful field of the page header (kvstore/pages.py)."""
    return {"magic": 0, "codec": 4 * 8, "reserved": 6 * 8 + 2, "raw_nbytes": 15 * 8,
            "stored_nbytes": 23 * 8, "xxh3": 24 * 8 + 3, "digest_prefix": 45 * 8,
            "body": HEADER_NBYTES * 8 + 1001}


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(interval_s)
