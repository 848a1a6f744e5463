"""A short end-to-end demo of the embedded store: save a prefix, restore it, check, GC.

Run with `python -m tools.demo [DIR]` (default: a temporary directory).
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np

from kvstore.format import FormatIdentity, LayerSpec
from kvstore.ids import page_digest
from kvstore.records import Checkpoint, blocks_for_tokens
from kvstore.store import Store


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else tempfile.mkdtemp(prefix="kvstore-demo-")
    layer = LayerSpec(kv_heads=8, k_head_dim=128, v_head_dim=128, page_format="native-bf16")
    identity = FormatIdentity("demo/llama-like", "demo-config", 256, (layer,) * 4)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, size=1000).tolist()
    with Store(path) as store:
        fid = store.put_format(identity)
        pages, payload = [], {}
        for start in range(0, len(tokens), 256):
            n = min(256, len(tokens) - start)
            row = []
            for _ in identity.paged_layers:
                data = rng.bytes(layer.page_nbytes(n))
                digest = page_digest(data)
                payload[digest] = data
                row.append(digest)
            pages.append(row)
        t0 = time.perf_counter()
        store.put_pages({d: payload[d] for d in store.missing(payload)})
        records = blocks_for_tokens(fid, "default", tokens, 256, pages)
        store.commit_blocks(records)
        store.create_checkpoint(Checkpoint("demo", "default", fid, tuple(tokens),
                                           tuple(r.key for r in records)))
        t1 = time.perf_counter()
        match = store.lookup_prefix(fid, "default", tokens + [1, 2, 3])
        restored = store.read_pages([d for b in match.blocks for d in b.pages])
        t2 = time.perf_counter()
        assert b"".join(restored) == b"".join(payload[d] for row in pages for d in row)
        report = store.check(read_data=True)
        stats = store.stats()
        print(f"store: {path}")
        print(f"saved {len(tokens)} tokens in {len(records)} blocks "
              f"({stats.raw_nbytes / 2**20:.1f} MiB) in {1e3 * (t1 - t0):.1f} ms")
        print(f"restored {match.tokens_matched} tokens in {1e3 * (t2 - t1):.1f} ms, byte-identical")
        print(f"check: {'clean' if report.ok else report.problems}")
        print(f"checkpoints: {[c.name for c in store.list_checkpoints()]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
