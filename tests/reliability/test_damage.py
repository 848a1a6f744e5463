"""6. Damage sweep. A store of 520 pages (raw and zstd); 200 of them are damaged through
their segment records (schema 2): bit flips anywhere in the record (its header or its
page), 1-byte truncation (the index names one byte less, through a raw LMDB write), a
zeroed 4 KiB run overlapping the record, and pairs of records swapped (each record's
bytes moved under the other's location: self-consistent records under the wrong
name). Then:
  - check(read_data=True) lists exactly the damaged set: 0 missed, 0 false alarms;
  - restore detects 100%: reading a damaged page raises IntegrityError naming it, never
    returns bytes, and every undamaged page reads back exactly.
Two seeds in CI, twenty with KVSTORE_SOAK=1."""

from __future__ import annotations

import os
import random
from pathlib import Path

import lmdb
import pytest

from kvstore.errors import IntegrityError
from kvstore.ids import page_digest
from kvstore.segments import Location
from kvstore.store import Store
from tests.reliability.common import SOAK, metric

PAGES = 520
PAGE_NBYTES = 8192
PER_KIND = 50  # bit flips, truncations, zeroed runs, swapped (25 pairs): 200 pages
SEEDS = range(1, 21) if SOAK else [1, 2]


def _pages(rng: random.Random) -> dict:
    out = {}
    while len(out) < PAGES:
        if len(out) % 4 == 3:  # compressible: zstd-coded
            data = rng.randbytes(64) * (PAGE_NBYTES // 64)
        else:
            data = rng.randbytes(PAGE_NBYTES)
        out[page_digest(data)] = data
    return out


def _damage(store_dir, rng: random.Random, pages: dict) -> dict:
    """Damage 200 pages in place, inside their segment records (schema 2, kvstore/
    segments.py); returns digest -> kind. Locations come from a raw LMDB read."""
    env = lmdb.open(str(store_dir), max_dbs=16, subdir=True)
    db = env.open_db(b"pages", create=False)
    digests = sorted(pages)
    rng.shuffle(digests)
    with env.begin(db=db) as txn:
        where = {d: Location.unpack(txn.get(bytes(d))) for d in digests}
    damaged: dict = {}
    files: dict = {}

    def segment(loc):
        if loc.segment not in files:
            files[loc.segment] = open(Path(store_dir) / "segments" / f"{loc.segment:08x}.seg", "r+b")
        return files[loc.segment]

    def read(loc, n=None):
        f = segment(loc)
        f.seek(loc.offset)
        return bytearray(f.read(loc.length if n is None else n))

    def write(loc, data):
        f = segment(loc)
        f.seek(loc.offset)
        f.write(bytes(data))

    # swaps first, among raw pages of equal length: the hardest case (each record's
    # bytes moved under the other's location: self-consistent records, wrong name)
    raw_ones = [d for d in digests if len(pages[d]) == PAGE_NBYTES and where[d].flags == 0]
    swap = raw_ones[: PER_KIND]
    for a, b in zip(swap[0::2], swap[1::2], strict=True):
        ra, rb = read(where[a]), read(where[b])
        write(where[a], rb)
        write(where[b], ra)
        damaged[a] = damaged[b] = "swapped"
    rest = [d for d in digests if d not in damaged]
    truncated = {}
    for i, d in enumerate(rest[: 3 * PER_KIND]):
        loc = where[d]
        kind = ("bit_flip", "truncated", "zeroed_4k")[i % 3]
        if kind == "bit_flip":  # anywhere in the record: its header or its page
            v = read(loc)
            bit = rng.randrange(8 * len(v))
            v[bit // 8] ^= 1 << (bit % 8)
            write(loc, v)
        elif kind == "truncated":  # the index names one byte less than the record holds
            truncated[d] = Location(loc.segment, loc.offset, loc.length - 1, loc.flags)
        else:  # a zeroed 4 KiB run that overlaps the record
            v = read(loc, loc.span_nbytes)
            before = bytes(v)
            start = rng.randrange(max(1, loc.length - 4096))
            v[start : start + 4096] = bytes(len(v[start : start + 4096]))
            if bytes(v[: loc.length]) == before[: loc.length]:  # zero already: the header
                v[0:4096] = bytes(4096)
            write(loc, v)
        damaged[d] = kind
    for f in files.values():
        f.flush()
        os.fsync(f.fileno())
        f.close()
    with env.begin(write=True, db=db) as txn:
        for d, loc in truncated.items():
            txn.put(bytes(d), loc.pack())
    env.close()
    assert len(damaged) == 4 * PER_KIND
    return damaged


@pytest.mark.parametrize("seed", SEEDS)
def test_damage_sweep(tmp_path, seed):
    rng = random.Random(seed)
    pages = _pages(rng)
    with Store(tmp_path) as store:
        store.put_pages(pages)
        assert store.check(read_data=True).ok
    damaged = _damage(tmp_path, rng, pages)

    with Store(tmp_path) as store:
        report = store.check(read_data=True)
        listed = {p.object for p in report.problems if p.kind == "page_damaged"}
        want = {d.hex() for d in damaged}
        missed, false_alarms = want - listed, listed - want
        others = [p for p in report.problems if p.kind != "page_damaged"]

        detected = wrong_bytes = intact_ok = 0
        for d, data in pages.items():
            try:
                got = store.read_pages([d])[0]
            except IntegrityError as exc:
                assert exc.digest == d.hex()
                detected += d in damaged
                assert d in damaged, f"undamaged page {d.hex()} refused: {exc}"
                continue
            wrong_bytes += got != data
            intact_ok += d not in damaged and got == data
        by_kind = {k: sum(1 for v in damaged.values() if v == k) for k in set(damaged.values())}
        metric("damage_sweep", seed=seed, pages=PAGES, damaged=len(damaged),
               **{f"damaged_{k}": n for k, n in sorted(by_kind.items())},
               check_listed=len(listed), check_missed=len(missed),
               check_false_alarms=len(false_alarms), restore_detected=detected,
               restore_detected_pct=round(100 * detected / len(damaged), 1),
               damaged_bytes_returned=wrong_bytes, intact_pages_ok=intact_ok)
        assert not missed and not false_alarms, (sorted(missed)[:3], sorted(false_alarms)[:3])
        assert detected == len(damaged) and wrong_bytes == 0
        assert intact_ok == PAGES - len(damaged)
        assert store.stats().quarantined_count == len(damaged)
        assert not others, others[:3]
        # after the damage is quarantined and collected, check is clean again
        store.plan_gc(0.0).execute()
        after = store.check(read_data=True)
        assert after.ok, after.problems[:3]
