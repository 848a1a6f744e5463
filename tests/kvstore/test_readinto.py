"""kvstore/readinto.py: every intact page reaches the sink once, verified; a damaged one
never does and comes back with its reason, on one thread or several."""

from __future__ import annotations

import os

import pytest

from kvstore.ids import page_digest
from kvstore.pages import HEADER_NBYTES, Compression, encode_page
from kvstore.readinto import read_verified


def records(count: int, nbytes: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(count):
        raw = os.urandom(nbytes) if i % 3 else bytes(nbytes)  # zeros compress: zstd records too
        digest = bytes(page_digest(raw))
        header, stored = encode_page(raw, Compression(), digest)
        out.append((digest, header + bytes(stored), raw))
    return out


@pytest.mark.parametrize("workers", [1, 3])
def test_read_verified_gives_every_page_once_and_refuses_damage(workers):
    pages = records(12, 512 * 1024)  # 6 MiB: above the threaded threshold
    damaged = {4: HEADER_NBYTES + 100, 9: 30}  # a stored byte; the header's xxh3 field
    pairs = []
    for i, (digest, record, _) in enumerate(pages):
        if i in damaged:
            record = bytearray(record)
            record[damaged[i]] ^= 0x01
        pairs.append((digest, bytes(record)))
    seen: dict[int, bytes] = {}

    def sink(index, raw):
        assert index not in seen, f"page {index} reached the sink twice"
        seen[index] = bytes(raw)

    bad = read_verified(pairs, sink, workers=workers)
    assert [i for i, _ in bad] == sorted(damaged)
    assert all(reason for _, reason in bad)
    assert sorted(seen) == [i for i in range(len(pages)) if i not in damaged]
    assert all(seen[i] == pages[i][2] for i in seen)


def test_read_verified_refuses_a_record_filed_under_another_digest():
    (d0, r0, _), (d1, r1, _) = records(2, 4096)
    seen = []
    bad = read_verified([(d0, r1), (d1, r0)], lambda i, raw: seen.append(i), workers=1)
    assert [i for i, _ in bad] == [0, 1] and not seen
