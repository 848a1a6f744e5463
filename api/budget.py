"""DecodeBudget: the page bytes batch reads hold decoded in memory, per principal and
in all.

Why: a zstd page of 32 MiB of zeros is stored in about 1 KB, so a 2 KB request naming
it 32 times makes the store decode 1 GiB, and a few such requests exhaust memory
(issue 23). Store.get_pages yields zero-copy views of the LMDB map for raw pages and
decoded copies for zstd pages; only the copies cost memory.

How: before a read opens its pages it reserves their raw total (the api cannot tell
which are compressed before the store decodes them), from its principal's share
(max_read_decoded_nbytes_per_token) and from the global budget
(max_read_decoded_nbytes). Once the pages are open, the reservation is cut to the raw
bytes of the zstd pages, and those stay reserved until the response has sent its last
byte. The stream decodes them while it sends them, 1 MiB at a time
(kvstore/pagestream.py), so what a read holds in memory is one piece; the budget
bounds the decode work in flight (CPU, and the time a read transaction stays open). A read larger than one principal's share is a 413
(split it; kvstore.client reads in batches of 256 MiB); a read that finds the budget
full waits up to read_budget_wait_s (10 s), then is a 503 busy with Retry-After, which
RemoteStore retries. The anonymous principal of a server without tokens is its only
tenant: the global budget alone bounds it.

All methods run on the event loop (no locks): routes call acquire/shrink/release from
async code, and the stream response releases in its `finally`.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from api.errors import Busy, PayloadTooLarge

READ_BUDGET_WAIT_S = 10.0


@dataclass
class Grant:
    """One read's reservation: who holds it and how many bytes."""

    key: object
    nbytes: int


class DecodeBudget:
    def __init__(self, total_nbytes: int, per_principal_nbytes: int,
                 wait_s: float = READ_BUDGET_WAIT_S):
        self.total_nbytes = total_nbytes
        self.per_principal_nbytes = min(per_principal_nbytes, total_nbytes)
        self.wait_s = wait_s
        self.used_nbytes = 0
        self.peak_nbytes = 0
        self._by_key: dict[object, int] = {}
        self._changed: anyio.Event | None = None  # made on the loop, by the first waiter

    @staticmethod
    def key_of(principal) -> object:
        return None if principal is None or getattr(principal, "anonymous", False) else principal

    def _fits(self, key, nbytes: int) -> bool:
        if self.used_nbytes + nbytes > self.total_nbytes:
            return False
        return key is None or self._by_key.get(key, 0) + nbytes <= self.per_principal_nbytes

    async def acquire(self, principal, nbytes: int) -> Grant:
        key = self.key_of(principal)
        limit = self.total_nbytes if key is None else self.per_principal_nbytes
        if nbytes > limit:
            raise PayloadTooLarge(
                f"{nbytes} bytes of pages in one read; a read may decode at most {limit} "
                "(max_read_decoded_nbytes_per_token). Split the request")
        with anyio.move_on_after(self.wait_s):
            while not self._fits(key, nbytes):
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
        if not self._fits(key, nbytes):
            raise Busy(f"the server is decoding {self.used_nbytes} bytes of pages for other "
                       f"reads (budget {self.total_nbytes}); retry", retry_after_s=1)
        self.used_nbytes += nbytes
        self.peak_nbytes = max(self.peak_nbytes, self.used_nbytes)
        if key is not None:
            self._by_key[key] = self._by_key.get(key, 0) + nbytes
        return Grant(key, nbytes)

    def shrink(self, grant: Grant, nbytes: int) -> None:
        """Keep only nbytes of the grant (the decoded copies); give back the rest."""
        self._give_back(grant, grant.nbytes - min(nbytes, grant.nbytes))

    def release(self, grant: Grant) -> None:
        self._give_back(grant, grant.nbytes)

    def _give_back(self, grant: Grant, nbytes: int) -> None:
        if nbytes <= 0:
            return
        grant.nbytes -= nbytes
        self.used_nbytes -= nbytes
        if grant.key is not None:
            left = self._by_key[grant.key] - nbytes
            if left:
                self._by_key[grant.key] = left
            else:
                del self._by_key[grant.key]
        if self._changed is not None:  # wake every waiter; each re-checks its fit
            self._changed.set()
            self._changed = None
