"""Dedup benchmark: N checkpoints sharing a system prompt, content-addressed pages against
one file per checkpoint.

Usage:
  python -m tools.bench.dedup                  # 50 checkpoints, 2048 + 256 tokens, 4 layers
  python -m tools.bench.dedup --quick          # the same scenario, 1 layer
  python -m tools.bench.dedup --checkpoints 5 --system-tokens 512 --layers 1 --json out.json

The scenario (issue 9): N checkpoints whose prompts share a --system-tokens system prompt
and differ in a --suffix-tokens suffix. K/V are synthetic, shaped like Llama-3-8B's cache
per layer (8 KV heads, head dim 128, bf16; 256-token blocks, so one page is 1 MiB) with
--layers layers instead of 32: every arm's bytes and write time scale linearly with the
layer count, so the ratios are those of the full 32-layer model, at 1/8 (or 1/32) of the
disk traffic. No model runs: this measures storage, not prefill.

Arms, taking turns checkpoint by checkpoint (the first of the three rotates):
  kvstore          the engine's publish path into one Store: chain keys, has_blocks, then
                   digests, missing, put_pages and commit_blocks for the blocks it lacks.
                   Durable on return (LMDB syncs). The shared system-prompt blocks are
                   stored once; each later checkpoint writes its suffix block only.
  mlx-lm files     save_prompt_cache of KVCache objects holding the checkpoint's K and V,
                   one .safetensors per checkpoint (mlx-lm does not fsync).
  file + fsync     the checkpoint's K/V bytes written to their own file and fsynced: the
                   plain-file peer that is as durable as the store.
Stored bytes after each checkpoint: the store's LMDB file bytes in use (pages, records,
free pages: what the disk holds) and the sum of file sizes for the other two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, save_prompt_cache

from kvstore.format import FormatIdentity, LayerSpec
from kvstore.ids import chain_keys, page_digest
from kvstore.records import blocks_for_tokens
from kvstore.store import Store
from tools.bench.common import machine_line, markdown_table

KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 128, 256
NAMESPACE = "bench-dedup"
ARMS = ("kvstore", "mlx-lm files", "file + fsync")


class Scenario:
    """The shared system prompt's K/V (built once) and each checkpoint's suffix K/V.

    kv arrays: [layers, 2, heads, tokens, dim] u16 (bf16 bit patterns), K then V."""

    def __init__(self, layers: int, system_tokens: int, suffix_tokens: int, seed: int = 0):
        assert system_tokens % BLOCK_TOKENS == 0 and suffix_tokens % BLOCK_TOKENS == 0, \
            "system and suffix lengths must be whole 256-token blocks"
        self.layers, self.system_tokens, self.suffix_tokens = layers, system_tokens, suffix_tokens
        self.rng = np.random.default_rng(seed)
        self.system_ids = self.rng.integers(0, 128_000, system_tokens).tolist()
        self.system_kv = self._random_kv(system_tokens)
        layer = LayerSpec(kv_heads=KV_HEADS, k_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                          page_format="native-bf16")
        self.identity = FormatIdentity("bench/llama-8b-shaped", "bench", BLOCK_TOKENS,
                                       (layer,) * layers)

    def _random_kv(self, tokens: int) -> np.ndarray:
        return self.rng.integers(0, 2**16, (self.layers, 2, KV_HEADS, tokens, HEAD_DIM), dtype=np.uint16)

    def checkpoint(self) -> tuple[list[int], np.ndarray]:
        """A new checkpoint: (token ids, kv [layers, 2, heads, system+suffix, dim])."""
        ids = self.system_ids + self.rng.integers(0, 128_000, self.suffix_tokens).tolist()
        kv = np.concatenate([self.system_kv, self._random_kv(self.suffix_tokens)], axis=3)
        return ids, kv

    @property
    def checkpoint_nbytes(self) -> int:
        return self.layers * 2 * KV_HEADS * (self.system_tokens + self.suffix_tokens) * HEAD_DIM * 2


def pages_of(kv: np.ndarray, block: int) -> list[bytes]:
    """One page per layer of block `block`: K [heads, block, dim] then V (docs/format.md)."""
    window = slice(block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS)
    return [np.ascontiguousarray(kv[layer][:, :, window, :]).tobytes() for layer in range(kv.shape[0])]


def save_to_store(store: Store, identity: FormatIdentity, ids: list[int], kv: np.ndarray) -> int:
    """The engine's publish path; only blocks the store lacks are cut into pages and
    hashed. Returns pages written."""
    fid = store.put_format(identity)
    keys = chain_keys(fid, NAMESPACE, ids, BLOCK_TOKENS)
    stored = store.has_blocks(keys)
    digests, wanted = [], {}
    for block, known in enumerate(stored):
        if known:
            digests.append(list(store.get_blocks([keys[block]])[0].pages))
            continue
        pages = pages_of(kv, block)
        row = [page_digest(p) for p in pages]
        wanted.update(zip(row, pages, strict=True))
        digests.append(row)
    absent = store.missing(list(wanted))
    store.put_pages({d: wanted[d] for d in absent})
    store.commit_blocks(blocks_for_tokens(fid, NAMESPACE, ids, BLOCK_TOKENS, digests))
    return len(absent)


def save_mlx_lm(path: Path, kv: np.ndarray) -> float:
    caches = []
    for layer in kv:
        cache = KVCache()
        cache.update_and_fetch(mx.array(layer[0][None]).view(mx.bfloat16),
                               mx.array(layer[1][None]).view(mx.bfloat16))
        caches.append(cache)
    mx.eval([c.state for c in caches])
    start = time.perf_counter()
    save_prompt_cache(str(path), caches)
    return time.perf_counter() - start


def save_plain(path: Path, kv: np.ndarray) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(kv.data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def run(checkpoints: int, layers: int, system_tokens: int, suffix_tokens: int, root: Path) -> dict:
    scenario = Scenario(layers, system_tokens, suffix_tokens)
    seconds = {arm: [] for arm in ARMS}
    stored = {arm: [] for arm in ARMS}
    files = {"mlx-lm files": 0, "file + fsync": 0}
    (root / "mlx-lm").mkdir()
    (root / "plain").mkdir()
    with Store(root / "store") as store:
        for i in range(checkpoints):
            ids, kv = scenario.checkpoint()

            def ours(ids=ids, kv=kv):
                start = time.perf_counter()
                save_to_store(store, scenario.identity, ids, kv)
                return time.perf_counter() - start

            arms = {"kvstore": ours,
                    "mlx-lm files": lambda kv=kv, i=i: save_mlx_lm(root / "mlx-lm" / f"{i}.safetensors", kv),
                    "file + fsync": lambda kv=kv, i=i: save_plain(root / "plain" / f"{i}.bin", kv)}
            order = list(arms.items())
            for name, arm in order[i % 3:] + order[:i % 3]:
                seconds[name].append(arm())
            files["mlx-lm files"] += (root / "mlx-lm" / f"{i}.safetensors").stat().st_size
            files["file + fsync"] += (root / "plain" / f"{i}.bin").stat().st_size
            stats = store.stats()
            stored["kvstore"].append(stats.file_nbytes)
            stored["mlx-lm files"].append(files["mlx-lm files"])
            stored["file + fsync"].append(files["file + fsync"])
        match = store.lookup_prefix(scenario.identity.format_id, NAMESPACE, ids)
        assert match.tokens_matched == len(ids), f"last checkpoint matched {match.tokens_matched} tokens"
        stats = store.stats()
    return {"checkpoints": checkpoints, "layers": layers, "system_tokens": system_tokens,
            "suffix_tokens": suffix_tokens, "checkpoint_nbytes": scenario.checkpoint_nbytes,
            "seconds": seconds, "stored_nbytes": stored,
            "store_unique_page_nbytes": stats.raw_nbytes, "store_page_count": stats.page_count}


def report(result: dict) -> str:
    n, mib = result["checkpoints"], 2**20
    seconds, stored = result["seconds"], result["stored_nbytes"]
    total = {arm: sum(seconds[arm]) for arm in ARMS}
    rows = []
    for arm in ARMS:
        per = seconds[arm]
        rows.append([arm, f"{stored[arm][-1] / mib:.1f}", f"{stored[arm][-1] / stored['kvstore'][-1]:.2f}x",
                     f"{total[arm]:.2f}", f"{total[arm] / total['kvstore']:.2f}x",
                     f"{1e3 * statistics.median(per):.1f}", f"{1e3 * min(per):.1f}-{1e3 * max(per):.1f}"])
    lines = [
        f"## Dedup: {n} checkpoints sharing a {result['system_tokens']}-token system prompt, "
        f"{result['suffix_tokens']}-token suffixes",
        "",
        f"synthetic K/V shaped like Llama-3-8B per layer (8 KV heads, head dim 128, bf16, "
        f"256-token blocks, 1 MiB pages), {result['layers']} layer(s) instead of 32 (bytes and "
        f"write times scale linearly with layers); one checkpoint is "
        f"{result['checkpoint_nbytes'] / mib:.1f} MiB of K/V; arms interleaved checkpoint by checkpoint",
        "",
        machine_line(),
        "",
        markdown_table(["arm", "stored MiB", "bytes vs kvstore", "total save s", "time vs kvstore",
                        "per checkpoint ms (median)", "min-max ms"], rows),
        "",
        f"kvstore holds {result['store_page_count']} unique pages "
        f"({result['store_unique_page_nbytes'] / mib:.1f} MiB of page bytes) for "
        f"{n * (result['system_tokens'] + result['suffix_tokens']) // BLOCK_TOKENS * result['layers']} "
        f"page references; the first checkpoint writes the system prompt, each later one its suffix.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 layer instead of 4")
    parser.add_argument("--checkpoints", type=int, default=50, help="checkpoints saved (50)")
    parser.add_argument("--system-tokens", type=int, default=2048, help="shared system prompt (2048)")
    parser.add_argument("--suffix-tokens", type=int, default=256, help="per-checkpoint suffix (256)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers instead of the 8B's 32: 4 (1 with --quick); bytes and write "
                             "times scale linearly, so the ratios hold; --layers 32 writes about "
                             "30 GiB over the three arms")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (a temp dir)")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    layers = args.layers or (1 if args.quick else 4)
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-dedup-", dir=args.dir))
    try:
        result = run(args.checkpoints, layers, args.system_tokens, args.suffix_tokens, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
