"""Pages whose checksum is compared after the read: DeferredPages.

Every page read is verified against the xxh3-128 its record carries. get_pages does that
on the host before it yields a view. A restore onto a GPU copies every page to the device
anyway, and the device can hash what it received faster than the host can hash what it
sends (kernels/page_hash.py). get_pages_deferred(digests) is that read: it yields the
views after every check of a record but the xxh3-128 (record header, digest, lengths),
with the checksum each view still owes; the caller hashes the bytes it copied and hands
the results to settle(), which raises before anything is served from a page that does not
match. The page is then read again on the host: a page damaged in the store is quarantined
and IntegrityError names it, as get_pages would have; a page that verifies there was damaged
on its way (staging, the bus, the device): CopyDamaged, an IntegrityError that
quarantines nothing.

A store that cannot defer a check (a RemoteStore, a schema-1 store, a zstd page, a page
shorter than the device hashes) verifies on the host as get_pages does and owes nothing
for that page: its `expected` entry is None, and settle() ignores what was computed for it.

What it assumes: the caller settles every DeferredPages it took before it uses what it
copied. The restore does (engine/restore.py _read_into_staging); nothing else reads this way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from kvstore.errors import CopyDamaged
from kvstore.ids import PageDigest

# Records whose stored bytes are shorter than this are verified on the host: the device
# hashes XXH3's long inputs only (kernels/page_hash.py MIN_NBYTES; not imported: kvstore
# never imports MLX).
MIN_DEFERRED_NBYTES = 241


class DeferredPages:
    """The result of one get_pages_deferred: `views` (valid inside its with-block, as
    get_pages' views are) and, per view, `expected`: the 16-byte xxh3-128 digest its bytes
    must have (big-endian high then low, as python-xxhash prints it), or None where the
    store verified it already. `settle` stays usable after the with-block."""

    def __init__(self, digests: Sequence[PageDigest], views: list, expected: list[bytes | None],
                 recheck: Callable[[list[PageDigest]], None]):
        assert len(digests) == len(views) == len(expected), (len(digests), len(views), len(expected))
        self.digests, self.views, self.expected = list(digests), views, expected
        self._recheck = recheck

    @property
    def owed(self) -> int:
        """How many views still owe their checksum."""
        return sum(e is not None for e in self.expected)

    def settle(self, computed: Sequence[bytes | None]) -> None:
        """computed[i]: the xxh3-128 digest of the bytes the caller copied from views[i]
        (anything where expected[i] is None). Returns when every owed checksum matches;
        otherwise reads the first mismatched pages again on the host and raises
        IntegrityError (module docstring)."""
        if len(computed) != len(self.expected):
            raise ValueError(f"{len(computed)} checksums for {len(self.expected)} pages")
        wrong = [d for d, want, got in zip(self.digests, self.expected, computed, strict=True)
                 if want is not None and bytes(got) != want]
        if not wrong:
            return
        self._recheck(wrong)  # raises IntegrityError for a page damaged in the store
        raise CopyDamaged(wrong[0].hex())


@contextmanager
def verified_now(get_pages, digests: Sequence) -> Iterator[DeferredPages]:
    """get_pages_deferred for a store that defers nothing: get_pages' views, each verified
    already, owing nothing."""
    wanted = [PageDigest.coerce(d) for d in digests]
    with get_pages(wanted) as views:
        yield DeferredPages(wanted, views, [None] * len(views), _nothing_owed)


def _nothing_owed(digests: list[PageDigest]) -> None:
    raise AssertionError(f"settle found {len(digests)} mismatches where nothing was owed")


__all__ = ["DeferredPages", "MIN_DEFERRED_NBYTES", "verified_now"]
