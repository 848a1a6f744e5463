"""The restore's lookup alone: Store.lookup_prefix of an 8K-token prompt whose 32 blocks
are stored (issue 19). Each block costs an index get, the decode of its record (which
derives the record's chain key again, to refuse a record stored under another block's
key) and a presence check of its pages. Any machine; to compare two trees, run it with
each tree first on PYTHONPATH, alternately:

  PYTHONPATH=<tree> python3 tools/bench/profile/issue19_lookup.py [--rounds 30] [--sizes 1b]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import kvstore
from kvstore.store import Store
from tools.bench.profile.issue19_groups import QUICK, SHAPES, probe_parser
from tools.bench.store import Prefix, engine_model, save_prefix


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__, rounds=30).parse_args(argv)
    print(f"kvstore from {kvstore.__file__}", file=sys.stderr)
    for size in (["quick"] if args.quick else args.sizes):
        shape = QUICK if size == "quick" else SHAPES[size]
        model = engine_model(shape)
        prefix = Prefix(shape, model.identity)
        with tempfile.TemporaryDirectory() as tmp, Store(f"{tmp}/store") as store:
            save_prefix(store, prefix)
            tokens = prefix.tokens + [0]
            times = []
            for r in range(args.rounds + 3):  # three warm-up rounds
                began = time.perf_counter()
                match = store.lookup_prefix(model.identity, "bench", tokens)
                if r >= 3:
                    times.append((time.perf_counter() - began) * 1e3)
            assert match.tokens_matched == shape.tokens, match.tokens_matched
        print(f"{size:>5} lookup_prefix of {len(match.blocks)} blocks: median {statistics.median(times):.3f} ms "
              f"(min {min(times):.3f}, max {max(times):.3f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
