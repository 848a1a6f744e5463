"""open_streamed_pages: a batch read whose compressed pages are decoded while they are
sent, one bounded piece at a time, instead of all at once before the first byte.

Why: a zstd page of 32 MiB of zeros is stored in about 1 KB, so a read naming it 32
times is 1 GiB of decoded copies if Store.get_pages decodes them up front (issue 23).
Here a raw page is a zero-copy view of the map, as get_pages gives it, and a zstd
page is a DeferredPage: its stored bytes (a view of the map) and header, decoded by
`pieces()` in at most `piece_nbytes` at a time. The memory one read holds decoded is
then one piece, whatever the pages' sizes and number.

What is still verified before anything is yielded (so an error stays an answer, never
a cut stream): every page is present, its header, length and xxh3-128 match, and
every zstd frame decodes to exactly the header's raw length. That last check decodes
each zstd page once more and discards the output in pieces: a zstd page costs two
decodes, its memory one piece. A read with a damaged or absent page is handed to the
store's own get_pages, which quarantines the page and raises IntegrityError (or
NotFound), exactly as before.

The store is an IndexedStore (kvstore/protocol.py: Store, TieredStore): its index is
read in one read transaction, held until the with-block ends. Pages a TieredStore
holds only in its bucket are not pulled here: call page_nbytes (which pulls them)
first, as the service's batch read does; any still absent go through get_pages.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import zstandard

from kvstore.ids import PageDigest
from kvstore.pages import CODEC_RAW, MAX_PAGE_NBYTES, PageHeader, verify_stored

PIECE_NBYTES = 1 << 20


class DeferredPage:
    """A verified zstd page not yet decoded. len() is its raw length."""

    __slots__ = ("digest", "header", "body")

    def __init__(self, digest: PageDigest, header: PageHeader, body: memoryview):
        self.digest, self.header, self.body = digest, header, body

    def __len__(self) -> int:
        return self.header.raw_nbytes

    def pieces(self, piece_nbytes: int = PIECE_NBYTES) -> Iterator[bytes]:
        """The raw bytes in order, at most piece_nbytes each. Raises ValueError when the
        frame does not decode to exactly the header's raw length."""
        total = 0
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(self.body, read_across_frames=False)
            while True:
                piece = reader.read(min(piece_nbytes, self.header.raw_nbytes - total + 1))
                if not piece:
                    break
                total += len(piece)
                if total > self.header.raw_nbytes:
                    break
                yield piece
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd frame does not decode: {exc}") from None
        if total != self.header.raw_nbytes:
            raise ValueError(f"zstd frame gives {'more than ' if total > self.header.raw_nbytes else ''}"
                             f"{total} bytes, header says {self.header.raw_nbytes}")

    def check(self, piece_nbytes: int = PIECE_NBYTES) -> None:
        """Decode once and discard: ValueError unless the frame gives exactly raw_nbytes."""
        for _ in self.pieces(piece_nbytes):
            pass


@contextmanager
def open_streamed_pages(store, digests: Sequence) -> Iterator[list]:
    """Yields, per digest in order, a memoryview of a raw page in the map or a
    DeferredPage, every one verified (see the module docstring); valid inside the
    with-block only."""
    wanted = [PageDigest.coerce(d) for d in digests]
    refused = None
    with store.index.read(buffers=True) as index:
        out = []
        for d in wanted:
            value = index.page(d)
            if value is None:
                refused = d
                break
            try:
                header, body = verify_stored(value, d)
                if header.codec == CODEC_RAW:
                    out.append(body)
                    continue
                if header.raw_nbytes > MAX_PAGE_NBYTES:
                    raise ValueError(f"header's raw_nbytes {header.raw_nbytes} exceeds the page limit")
                page = DeferredPage(d, header, body)
                page.check()
                out.append(page)
            except ValueError:
                refused = d
                break
        if refused is None:
            yield out
            return
    # absent here, quarantined or damaged: the store's own read says which (and
    # quarantines a damaged page); a TieredStore may still pull an absent one, and then
    # the read is served as get_pages serves it, decoded up front
    with store.get_pages(wanted) as views:
        yield views
