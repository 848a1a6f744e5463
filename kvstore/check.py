"""check_store: re-derive everything the index claims and report typed problems.

Without read_data it checks structure: every record decodes, every block's chain key
is its own hash, parents exist and are full blocks of the block's own namespace and
format, pages named by blocks and checkpoint attachments exist (or are quarantined),
reference counts, pins and children equal their recomputed values, and the byte
counters add up.
With read_data it also verifies every page: header, length, xxh3-128 of the stored
bytes and blake3 of the raw bytes against the page's name. subset=(i, n) verifies
only pages whose first digest byte is i modulo n, so a large store can be checked in
n runs.
At schema 2 (segment files, docs/format.md section 10) it also checks that every
location lies inside its segment's file and committed tail (page_past_end); with
read_data, every record header (magic, reserved bytes, checksum, the full digest), and
every segment up to its committed tail for records that no page, quarantine or
dead-record entry names (record_orphan). Bytes past a committed tail are crash
leftovers, unreachable, and not reported: the next save overwrites them. An interrupted
compaction (kvstore/gc.py) leaves the same kind of leftovers and nothing else: copies
past the committed tail before its rebind commit; after it, a retired segment whose
old records are all named by dead-record (or quarantine) entries, or whose file a GC
already removed. None of that is reported: only a page whose location lies in a
retired segment is (page_retired), since removing that file would lose the page.

check never repairs; GC, eviction and re-publishing do.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from kvstore.errors import InvalidInput
from kvstore.ids import ROOT_KEY
from kvstore.index import COUNTERS, SCHEMA_V2, U64
from kvstore.pages import (
    PageHeader,
    decode_stored,
    hash_page,
    trusted_header,
    verify_stored,
)
from kvstore.records import BlockRecord, Checkpoint
from kvstore.segments import parse_record_header

PROBLEM_KINDS = {
    "page_damaged": "a page's stored bytes fail their header, length, xxh3 or blake3 check",
    "page_missing": "a record names a page that is neither stored nor quarantined",
    "page_quarantined": "a record names a page that was quarantined after failing a read",
    "block_bad": "a block record does not decode, is not keyed by its own chain key, or "
                 "names an unknown format",
    "parent_missing": "a block's parent is not stored, or is a partial block",
    "parent_foreign": "a block's parent is of another namespace or format",
    "refcount_wrong": "a page's stored reference count differs from the recount",
    "pin_wrong": "a block's pin count differs from the checkpoints that name it",
    "index_wrong": "a children or lru index entry disagrees with the block records",
    "checkpoint_bad": "a checkpoint does not decode, or names absent blocks",
    "counter_wrong": "a byte counter differs from the recomputed total",
    "page_past_end": "a page's location lies past its segment file's end or committed tail",
    "page_retired": "a page's location lies in a segment that compaction retired (its file "
                    "is removed after the grace period)",
    "record_orphan": "a segment record below its committed tail that no page, quarantine or "
                     "dead-record entry names (leaked space; not a lost page)",
}


@dataclass(frozen=True)
class Problem:
    kind: str
    object: str
    detail: str

    def __post_init__(self):
        assert self.kind in PROBLEM_KINDS, f"unregistered problem kind {self.kind}"


@dataclass
class CheckReport:
    problems: list[Problem] = field(default_factory=list)
    pages_checked: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    blocks_checked: int = 0
    checkpoints_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, obj: str, detail: str) -> None:
        self.problems.append(Problem(kind, obj, detail))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def check_store(store, read_data: bool = False, subset: tuple[int, int] | None = None,
                progress=None) -> CheckReport:
    """store: a kvstore.store.Store (anything with list_formats and index)."""
    if subset is not None:
        i, n = subset
        if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
            raise InvalidInput("subset must be (i, n) with 0 <= i < n")
    report = CheckReport()
    formats = {f.format_id: f for f in store.list_formats()}
    with store.index.read(buffers=True) as index:
        # 1. pages
        page_raw: dict[bytes, int] = {}
        raw_total = stored_total = 0
        for digest, value in index.pages():
            report.pages_checked += 1
            # counted as written even when damaged: counters stay comparable
            raw_nbytes, stored_nbytes = index.page_sizes(digest, value)
            page_raw[digest] = raw_nbytes
            raw_total += raw_nbytes
            stored_total += stored_nbytes
            if trusted_header(value) is None:
                report.add("page_damaged", digest.hex(), _header_damage(value))
            elif read_data and (subset is None or digest[0] % subset[1] == subset[0]):
                _verify_page(report, digest, value)
            if progress:
                progress(1, len(value))
        quarantined = index.quarantined()
        if index.schema == SCHEMA_V2:
            _check_segments(report, index, read_data, subset)

        # 2. blocks
        refs: Counter = Counter()
        children_expected: set[bytes] = set()
        lru_expected: set[bytes] = set()
        blocks: dict[bytes, BlockRecord] = {}
        for key, value in index.block_records():
            report.blocks_checked += 1
            try:
                record = BlockRecord.decode(value, index.chain_salts)
            except (ValueError, InvalidInput) as exc:
                report.add("block_bad", key.hex(), f"does not decode: {exc}")
                continue
            if record.key != key:
                report.add("block_bad", key.hex(), f"record hashes to chain key {record.key.hex()}")
                continue
            if record.format_id not in formats:
                report.add("block_bad", key.hex(), f"unknown format {record.format_id.hex()}")
            blocks[key] = record
            lru_expected.add(U64.pack(record.last_used_ns) + key)
            if not record.is_root:
                children_expected.add(record.parent + key)
            for d in record.pages:
                refs[bytes(d)] += 1
        for key, record in blocks.items():
            if not record.is_root:
                parent = blocks.get(record.parent)
                fmt = formats.get(record.format_id)
                if parent is None:
                    report.add("parent_missing", key.hex(), f"parent {record.parent.hex()} is not stored")
                elif parent.namespace != record.namespace or parent.format_id != record.format_id:
                    report.add("parent_foreign", key.hex(),
                               f"parent {record.parent.hex()} is of namespace {parent.namespace!r} "
                               f"and format {parent.format_id.hex()[:12]}, not the block's own")
                elif fmt is not None and len(parent.tokens) != fmt.block_size_tokens:
                    report.add("parent_missing", key.hex(), "parent is a partial block")

        # 3. checkpoints
        pins: Counter = Counter()
        for key, value in index.checkpoint_records():
            report.checkpoints_checked += 1
            label = key.replace(b"\x00", b"/").decode(errors="replace")
            try:
                ckpt = Checkpoint.decode(value)
            except (ValueError, InvalidInput) as exc:
                report.add("checkpoint_bad", label, f"does not decode: {exc}")
                continue
            parent = ROOT_KEY
            for k in ckpt.chain_keys:
                pins[bytes(k)] += 1
                record = blocks.get(bytes(k))
                if record is None:
                    report.add("checkpoint_bad", label, f"names absent block {k.hex()}")
                elif record.parent != parent:
                    report.add("checkpoint_bad", label, f"block {k.short} breaks the chain")
                parent = bytes(k)
            for d in ckpt.attachments.values():
                refs[bytes(d)] += 1

        # 4. references and indexes against the recount
        for d, count in refs.items():
            if d not in page_raw:
                kind = "page_quarantined" if d in quarantined else "page_missing"
                report.add(kind, d.hex(), f"named by {count} record(s)")
        stored_refs = index.reference_counts()
        for d in set(stored_refs) | set(refs):
            if stored_refs.get(d, 0) != refs.get(d, 0):
                report.add("refcount_wrong", d.hex(), f"stored {stored_refs.get(d, 0)}, recounted {refs.get(d, 0)}")
        stored_pins = index.pin_counts()
        for k in set(stored_pins) | set(pins):
            if stored_pins.get(k, 0) != pins.get(k, 0):
                report.add("pin_wrong", k.hex(), f"stored {stored_pins.get(k, 0)}, recounted {pins.get(k, 0)}")
        children = index.children_entries()
        for entry in children ^ children_expected:
            report.add("index_wrong", entry[32:].hex(), "children index disagrees with block records")
        lru = index.lru_entries()
        for entry in lru ^ lru_expected:
            report.add("index_wrong", entry[8:].hex(), "lru index disagrees with block records")

        referenced_raw = sum(page_raw.get(d, 0) * n for d, n in refs.items())
        recomputed = {"raw_nbytes": raw_total, "stored_nbytes": stored_total,
                      "referenced_raw_nbytes": referenced_raw}
        for name in COUNTERS:
            if name in recomputed:
                stored = index.counter(name)
                if stored != recomputed[name]:
                    report.add("counter_wrong", name, f"stored {stored}, recomputed {recomputed[name]}")
    return report


def _check_segments(report: CheckReport, index, read_data: bool,
                    subset: tuple[int, int] | None) -> None:
    """Schema 2: locations against their segments, record headers, orphan records."""
    segments, tails = index.segments, index.segment_tails()
    retired = index.retired_segments()
    damaged = {p.object for p in report.problems if p.kind == "page_damaged"}
    named: set[tuple[int, int]] = set()
    for digest, loc in index.locations():
        if loc is None:
            if digest.hex() not in damaged:
                report.add("page_damaged", digest.hex(), "its location does not parse")
            continue
        named.add((loc.segment, loc.offset))
        if loc.segment in retired:
            report.add("page_retired", digest.hex(),
                       f"record at {loc.segment:08x}+{loc.offset}: segment {loc.segment:08x} "
                       "was retired by compaction; its file will be removed")
        file_nbytes, tail = segments.file_nbytes(loc.segment), tails.get(loc.segment, 0)
        if loc.offset + loc.length > min(file_nbytes, tail):
            report.add("page_past_end", digest.hex(),
                       f"record at {loc.segment:08x}+{loc.offset} (+{loc.length}) lies past "
                       f"the segment's {'file end' if file_nbytes < tail else 'committed tail'} "
                       f"({min(file_nbytes, tail)})")
            continue
        if (read_data and digest.hex() not in damaged
                and (subset is None or digest[0] % subset[1] == subset[0])):
            try:
                named_digest, _ = parse_record_header(segments.view(loc))
                if named_digest != digest:
                    raise ValueError(f"the record header names page {named_digest.hex()[:16]}...")
            except ValueError as exc:
                report.add("page_damaged", digest.hex(), f"record header: {exc}")
    for _, loc in index.quarantined_locations():
        if loc is not None:
            named.add((loc.segment, loc.offset))
    named.update((loc.segment, loc.offset) for loc, _ in index.dead_records())
    if not read_data or (subset is not None and subset[0] != 0):
        return  # one of the n subset runs scans the segments
    for segment, tail in sorted(tails.items()):
        for record in segments.scan(segment, tail, verify=False):
            if (segment, record.offset) not in named:
                report.add("record_orphan", f"{segment:08x}+{record.offset}",
                           f"an intact record of page {record.digest.hex()} that no index "
                           "entry names")


def _verify_page(report: CheckReport, digest: bytes, value) -> None:
    report.pages_read += 1
    report.bytes_read += len(value)
    try:
        header, body = verify_stored(value, digest)
        raw = decode_stored(header, body)
    except Exception as exc:  # zstd errors are not ValueErrors; every failure is damage
        report.add("page_damaged", digest.hex(), str(exc) or type(exc).__name__)
        return
    if hash_page(raw) != digest:
        report.add("page_damaged", digest.hex(), "blake3 of the raw bytes is not the page's name")


def _header_damage(value) -> str:
    try:
        header = PageHeader.unpack(value)
    except ValueError as exc:
        return f"header: {exc}"
    return f"record of {len(value)} bytes does not hold the header's {header.stored_nbytes} stored bytes"
