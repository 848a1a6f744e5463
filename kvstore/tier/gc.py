"""Remote GC: mark-and-sweep over the bucket, with a grace period.

S3 has no transactions, so nothing is deleted on the strength of a count; GC lists,
marks from roots, and sweeps what is old and unmarked.

    start    T0 = the server's clock (Date of a HEAD on the bucket); cutoff = T0 - grace
    roots    every checkpoint manifest (any age), and every block record whose
             Last-Modified is after the cutoff (young: a writer may still be building on it)
    mark     the roots' block records and all their ancestors (a young block is only
             reachable through its parents), the pages they name, checkpoint
             attachments, and the formats of all of these
    sweep    (execute) unmarked block records older than the cutoff first, then unmarked
             pages and formats older than the cutoff. Each candidate is HEADed again just
             before its DELETE and spared when it became young (a writer re-PUT it); the
             pages of a spared block record are spared too. Checkpoints are never swept:
             deleting one is delete_checkpoint's job.

Why it is safe while writers upload (kvstore/tier/uploader.py): a writer uploads a
record only after confirming that everything it names is in the bucket and younger
than refresh_after_s, re-PUTting anything older. With grace >= 2 x refresh_after_s, an
object a writer has just confirmed is never older than the cutoff. A GC that has run
for longer than its grace period aborts (GCAborted) instead of deleting. What remains
is the gap between the re-check HEAD and the DELETE (milliseconds): a writer that
re-PUTs an object in exactly that gap can end up with a record naming a page that is
gone; readers treat that as a miss (the prefix ends there), never as wrong bytes.

A manifest or a root block record that fails its check stops the plan
(RemoteIntegrityError): GC cannot know what it references. Objects whose names are
not in the layout are left alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from kvstore.errors import GCAborted, InvalidInput
from kvstore.ids import ChainKey, PageDigest
from kvstore.tier import layout as L
from kvstore.tier.bucket import Bucket, ObjectInfo


@dataclass
class RemoteGCPlan:
    bucket: Bucket
    layout: L.Layout
    grace_s: float
    started: datetime
    started_monotonic: float
    checkpoints: int = 0
    marked_blocks: int = 0
    marked_pages: int = 0
    blocks: list[ObjectInfo] = field(default_factory=list)   # candidates, by kind
    pages: list[ObjectInfo] = field(default_factory=list)
    formats: list[ObjectInfo] = field(default_factory=list)
    young: int = 0        # unmarked objects spared because they are younger than the cutoff
    chain_salts: object = None  # a ChainSalts: salted block records decode with it

    @property
    def cutoff(self) -> datetime:
        return self.started - timedelta(seconds=self.grace_s)

    @property
    def freed_nbytes(self) -> int:
        return sum(o.nbytes for o in self.blocks + self.pages + self.formats)

    def summary(self) -> dict:
        return {"bucket": self.bucket.name, "prefix": self.layout.prefix, "grace_s": self.grace_s,
                "cutoff": self.cutoff.isoformat(), "checkpoints": self.checkpoints,
                "marked_blocks": self.marked_blocks, "marked_pages": self.marked_pages,
                "unreferenced_blocks": len(self.blocks), "unreferenced_pages": len(self.pages),
                "unreferenced_formats": len(self.formats),
                "unreferenced_nbytes": self.freed_nbytes, "spared_young": self.young}

    def _check_fresh(self) -> None:
        elapsed = time.monotonic() - self.started_monotonic
        if self.grace_s > 0 and elapsed > self.grace_s:
            raise GCAborted(f"the remote GC plan is {elapsed:.1f}s old, longer than its grace "
                            f"period of {self.grace_s:.1f}s; nothing more was deleted. Plan again")

    def execute(self, progress=None) -> dict:
        """Sweep: block records first, then pages and formats, each re-checked by HEAD."""
        deleted = {"blocks": 0, "pages": 0, "formats": 0, "freed_nbytes": 0, "skipped": 0}
        self._check_fresh()
        spared_pages: set[str] = set()
        for info, gone in self._sweep(self.blocks, progress):
            if gone:
                deleted["blocks"] += 1
                deleted["freed_nbytes"] += info.nbytes
                continue
            deleted["skipped"] += 1
            chain = ChainKey.parse(info.key.rsplit("/", 1)[-1])
            body = self.bucket.get(info.key)
            if body is not None:
                record = L.decode_block(info.key, chain, body, self.chain_salts)
                spared_pages.update(self.layout.page_key(d) for d in record.pages)
        self._check_fresh()
        rest = [o for o in self.pages if o.key not in spared_pages] + self.formats
        deleted["skipped"] += len(self.pages) + len(self.formats) - len(rest)
        for info, gone in self._sweep(rest, progress):
            kind = "pages" if "/pages/" in "/" + info.key else "formats"
            if gone:
                deleted[kind] += 1
                deleted["freed_nbytes"] += info.nbytes
            else:
                deleted["skipped"] += 1
        return deleted

    def _sweep(self, candidates: list[ObjectInfo], progress):
        cutoff = self.cutoff

        def one(info: ObjectInfo) -> bool:
            now = self.bucket.head(info.key)
            if now is None:
                return False
            if now.last_modified > cutoff:
                return False
            self.bucket.delete(info.key)
            return True
        for start in range(0, len(candidates), 256):
            self._check_fresh()
            batch = candidates[start : start + 256]
            results = list(self.bucket.pool.map(one, batch))
            if progress:
                progress(len(batch), sum(o.nbytes for o in batch))
            yield from zip(batch, results, strict=True)


def plan_remote_gc(bucket: Bucket, layout: L.Layout, grace_s: float = 3600.0,
                   chain_salts=None) -> RemoteGCPlan:
    """chain_salts: the store's ChainSalts; without a salted namespace's salt its block
    records do not decode and the plan refuses (RemoteIntegrityError), never guesses."""
    if grace_s < 0:
        raise InvalidInput("grace period must be >= 0 seconds")
    plan = RemoteGCPlan(bucket, layout, float(grace_s), bucket.server_now(), time.monotonic(),
                        chain_salts=chain_salts)
    cutoff = plan.cutoff
    root_blocks: set[ChainKey] = set()
    marked_pages: set[PageDigest] = set()
    marked_formats: set[bytes] = set()

    ckpt_prefix = layout.checkpoint_prefix(None)
    for info in bucket.list(ckpt_prefix):
        namespace, _, name = info.key[len(ckpt_prefix):].partition("/")
        body = bucket.get(info.key)
        if body is None:
            continue  # deleted since the listing
        ckpt = L.decode_checkpoint(info.key, namespace, name, body)
        plan.checkpoints += 1
        root_blocks.update(ckpt.chain_keys)
        marked_pages.update(ckpt.attachments.values())
        marked_formats.add(ckpt.format_id)

    blocks = {}
    for o in bucket.list(layout.kind_prefix("blocks")):
        k = _parsed(ChainKey.parse, o)
        if k is not None:
            blocks[k] = o
    root_blocks.update(k for k, o in blocks.items() if o.last_modified > cutoff)

    marked_blocks: set[ChainKey] = set()
    todo = [k for k in root_blocks if k in blocks]
    while todo:
        records = list(bucket.pool.map(lambda k: (k, bucket.get(layout.block_key(k))), todo))
        todo = []
        for k, body in records:
            marked_blocks.add(k)
            if body is None:
                continue
            record = L.decode_block(layout.block_key(k), k, body, chain_salts)
            marked_pages.update(record.pages)
            marked_formats.add(record.format_id)
            parent = ChainKey(record.parent)
            if not record.is_root and parent in blocks and parent not in marked_blocks:
                marked_blocks.add(parent)
                todo.append(parent)
    plan.marked_blocks, plan.marked_pages = len(marked_blocks), len(marked_pages)

    def sweepable(info: ObjectInfo, marked: bool) -> bool:
        if marked:
            return False
        if info.last_modified > cutoff:
            plan.young += 1
            return False
        return True
    plan.blocks = [o for k, o in blocks.items() if sweepable(o, k in marked_blocks)]
    plan.pages = [o for o in bucket.list(layout.kind_prefix("pages"))
                  if (d := _parsed(PageDigest.parse, o)) is not None and sweepable(o, d in marked_pages)]
    plan.formats = [o for o in bucket.list(layout.kind_prefix("formats"))
                    if (f := _parsed(PageDigest.parse, o)) is not None
                    and sweepable(o, bytes(f) in marked_formats)]
    return plan


def _parsed(parse, info: ObjectInfo):
    """The digest an object is named by, or None for a name outside the layout (never
    swept: GC deletes only what it can name)."""
    try:
        return parse(info.key.rsplit("/", 1)[-1])
    except InvalidInput:
        return None
