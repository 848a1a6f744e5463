"""Client processes for the live-server tests: `python -m tests.api.workers CMD ...`.

    save URL TOKEN NAMESPACE SEED COUNT     save COUNT prefixes (seeds SEED..), checkpoint each
    restore URL TOKEN NAMESPACE SEED REPS [LOCAL_DIR]
                                            restore prefix SEED REPS times; print blake3 of
                                            the restored bytes (fast path with LOCAL_DIR)
Every line printed is JSON, so the test reads results without parsing prose.
"""

from __future__ import annotations

import json
import sys

import blake3
import numpy as np

from kvstore.client import RemoteStore
from tests.kvstore.factories import make_identity, make_layer, save_prefix

BLOCK_SIZE_TOKENS = 64


def identity():
    """Pages of 256 KiB (8 heads x 64 tokens x (128 + 128) x bf16): several stream chunks."""
    big = make_layer(kv_heads=8, k_head_dim=128, v_head_dim=128)
    return make_identity(block_size_tokens=BLOCK_SIZE_TOKENS, layers=(big, big))


def prompt(seed: int) -> list[int]:
    """A 1000-token prompt (15 full blocks and a 40-token tail); seeds share a prefix
    of 5 blocks so later saves dedup against earlier ones."""
    shared = list(range(5 * BLOCK_SIZE_TOKENS))
    return shared + np.random.default_rng(seed).integers(0, 50000, 1000 - len(shared)).tolist()


def save(url, token, namespace, seed, count):
    with RemoteStore(url, token) as store:
        for s in range(int(seed), int(seed) + int(count)):
            saved = save_prefix(store, identity(), namespace, prompt(s), checkpoint=f"p{s}")
            print(json.dumps({"saved": s, "blocks": len(saved.records)}), flush=True)


def restore(url, token, namespace, seed, reps, local_dir=None):
    fmt = identity()
    with RemoteStore(url, token, local_dir=local_dir) as store:
        for _ in range(int(reps)):
            tokens = prompt(int(seed))
            match = store.lookup_prefix(fmt.format_id, namespace, tokens)
            digests = [d for b in match.blocks for d in b.pages]
            sizes = store.page_nbytes(digests)
            buffers = [np.empty(n, np.uint8) for n in sizes]
            store.read_pages_into(digests, buffers)
            hasher = blake3.blake3()
            for b in buffers:
                hasher.update(b)
            print(json.dumps({"matched": match.tokens_matched, "pages": len(digests),
                              "blake3": hasher.hexdigest()}), flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"save": save, "restore": restore}[command](*args)
