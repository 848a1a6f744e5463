"""S3 tier benchmark: restoring an 8B-shaped 4096-token prefix from the bucket.

Usage:
  python -m tools.bench.remote              # 32 layers x 16 blocks of 1 MiB pages: 512 MiB
  python -m tools.bench.remote --quick      # 4 layers x 4 blocks: 16 MiB (seconds)
  python -m tools.bench.remote --endpoint http://rgw:7480 --bucket b --access-key .. --secret-key ..

Without --endpoint it starts a throwaway single-node Ceph cluster with a RADOS Gateway
on 127.0.0.1 (tools/ceph_dev.py; installs the Debian packages when missing) and stops
every daemon at the end.

The prefix is shaped like Llama-3-8B's KV cache (32 layers, 8 KV heads, head dim 128,
bf16, 256-token blocks): one page is 1 MiB. Host A publishes it through a TieredStore
(pages, then block records, through the write-behind queue; the upload is timed until
the backlog is empty). Then, repeats interleaved so drift cancels out of the ratios:

  restore from bucket, cold local store
                 a fresh store directory on host B: lookup_prefix finds nothing
                 locally, GETs the block records (in parallel, from chain keys
                 computed from the tokens), GETs the pages 8 in flight, verifies
                 each against its blake3 name, inserts them into B's LMDB store
                 (durable), then read_pages_into preallocated buffers.
  restore from local store
                 the same on B again: everything is local now (the fast path).
  lookup miss   a prompt nobody stored, on a fresh store: the local miss costs one
                 round of parallel GETs of block records (404s) before "0 tokens".
  GET x1 / x4 / x8
                 the raw page objects, 1, 4 and 8 requests in flight, into memory,
                 unverified: what the bucket gives this client.
  recompute      (only where MLX imports) an estimate, not a measurement of a model:
                 2 x 8.0e9 x 4096 FLOPs of prefill at the bf16 matmul rate MLX reaches
                 here on a 1024 x 1024 x 1024 product (tools/bench/ttft.py measures
                 real recompute on a small model).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstore.format import FormatIdentity, LayerSpec
from kvstore.ids import page_digest
from kvstore.records import blocks_for_tokens
from kvstore.store import Store
from kvstore.tier import Bucket, TierConfig, TieredStore

NAMESPACE = "bench"
MODEL_PARAMS = 8.0e9


@dataclass(frozen=True)
class Shape:
    layers: int
    blocks: int
    kv_heads: int = 8
    head_dim: int = 128
    block_size_tokens: int = 256

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size_tokens

    @property
    def page_nbytes(self) -> int:
        return 2 * self.kv_heads * self.block_size_tokens * self.head_dim * 2

    @property
    def nbytes(self) -> int:
        return self.layers * self.blocks * self.page_nbytes


FULL = Shape(layers=32, blocks=16)
QUICK = Shape(layers=4, blocks=4)


def identity_for(shape: Shape) -> FormatIdentity:
    layer = LayerSpec(kind="full", kv_heads=shape.kv_heads, k_head_dim=shape.head_dim,
                      v_head_dim=shape.head_dim, page_format="native-bf16")
    return FormatIdentity(model_id="bench/llama-8b-shaped", model_fingerprint="b" * 64,
                          block_size_tokens=shape.block_size_tokens,
                          layers=(layer,) * shape.layers)


def build_prefix(shape: Shape):
    identity = identity_for(shape)
    tokens = [(i * 7919) % 128000 for i in range(shape.tokens)]
    pages, rows = {}, []
    for _ in range(shape.blocks):
        row = []
        for _ in range(shape.layers):
            data = os.urandom(shape.page_nbytes)
            d = page_digest(data)
            pages[d] = data
            row.append(d)
        rows.append(row)
    records = blocks_for_tokens(identity.format_id, NAMESPACE, tokens, shape.block_size_tokens, rows)
    return identity, tokens, pages, records


def restore(store, identity, tokens, buffers) -> int:
    match = store.lookup_prefix(identity.format_id, NAMESPACE, tokens)
    digests = [d for b in match.blocks for d in b.pages]
    assert len(digests) == len(buffers), f"restored {len(digests)} of {len(buffers)} pages"
    return store.read_pages_into(digests, buffers[: len(digests)])


def get_all(bucket: Bucket, keys: list[str], in_flight: int) -> int:
    with ThreadPoolExecutor(in_flight) as pool:
        return sum(len(b) for b in pool.map(bucket.get, keys))


def recompute_estimate_s(tokens: int) -> tuple[float, float] | None:
    """(seconds, GFLOP/s) for an 8B prefill of `tokens` at MLX's measured bf16 matmul
    rate here, or None without MLX."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    n = 1024
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a @ b)
    start = time.perf_counter()
    reps = 3
    for _ in range(reps):
        mx.eval(a @ b)
    rate = reps * 2 * n**3 / (time.perf_counter() - start)
    return 2 * MODEL_PARAMS * tokens / rate, rate / 1e9


def run(shape: Shape, repeats: int, config: TierConfig, root: Path) -> dict:
    identity, tokens, pages, records = build_prefix(shape)
    times: dict[str, list[float]] = {}
    a = TieredStore(Store(root / "a"), config)
    try:
        start = time.perf_counter()
        a.put_format(identity)
        a.put_pages(pages)
        a.commit_blocks(records)
        local_s = time.perf_counter() - start
        assert a.drain(900), "the upload backlog did not drain"
        times["publish to bucket (local save + drain)"] = [time.perf_counter() - start]
        times["publish: local save part"] = [local_s]
    finally:
        a.close()

    buffers = [bytearray(shape.page_nbytes) for _ in pages]
    page_keys = [f"{config.prefix}/pages/{d.hex()}" if config.prefix else f"pages/{d.hex()}"
                 for d in pages]
    bucket = Bucket(config)
    try:
        for r in range(repeats):
            b_dir = root / f"b{r}"
            b = TieredStore(Store(b_dir), config)
            try:
                start = time.perf_counter()
                assert restore(b, identity, tokens, buffers) == shape.nbytes
                times.setdefault("restore from bucket, cold local", []).append(time.perf_counter() - start)
                start = time.perf_counter()
                assert restore(b, identity, tokens, buffers) == shape.nbytes
                times.setdefault("restore from local store", []).append(time.perf_counter() - start)
            finally:
                b.close()
                shutil.rmtree(b_dir, ignore_errors=True)
            # a prompt nobody stored: the local miss costs one round of parallel GETs
            # (one per full block, all 404) before the answer "0 tokens"
            miss = TieredStore(Store(b_dir), config)
            try:
                start = time.perf_counter()
                assert miss.lookup_prefix(identity.format_id, NAMESPACE,
                                          [t + 1 for t in tokens]).tokens_matched == 0
                times.setdefault("lookup miss via bucket (no pages)", []).append(time.perf_counter() - start)
            finally:
                miss.close()
                shutil.rmtree(b_dir, ignore_errors=True)
            for n in (1, 4, 8):
                start = time.perf_counter()
                assert get_all(bucket, page_keys, n) >= shape.nbytes
                times.setdefault(f"GET x{n} in flight", []).append(time.perf_counter() - start)
    finally:
        bucket.close()
    assert bytes(buffers[-1]) == pages[list(pages)[-1]], "restored bytes differ"
    return times


def table(shape: Shape, times: dict, recompute) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    gib = shape.nbytes / 2**30
    lines = [f"S3 tier: {shape.layers} layers x {shape.blocks} blocks x "
             f"{shape.page_nbytes >> 10} KiB pages = {shape.nbytes / 2**20:.0f} MiB, "
             f"{shape.tokens} tokens; medians of {max(len(v) for v in times.values())}",
             f"{'case':42} {'median s':>9} {'GiB/s':>7}"]
    for k, v in med.items():
        rate = f"{gib / v:7.2f}" if "miss" not in k else f"{'-':>7}"
        lines.append(f"{k:42} {v:9.3f} {rate}")
    if recompute is not None:
        seconds, gflops = recompute
        lines.append(f"{'recompute (estimate: 8B prefill at matmul rate)':42} {seconds:9.3f} "
                     f"{'':>7}  ({gflops:.0f} GFLOP/s bf16 matmul here)")
    cold, warm = med["restore from bucket, cold local"], med["restore from local store"]
    lines.append("ratios:")
    lines.append(f"  cold bucket restore / local restore      {cold / warm:6.1f}x slower")
    lines.append(f"  GET x4 speedup over x1                   {med['GET x1 in flight'] / med['GET x4 in flight']:6.2f}x")
    lines.append(f"  GET x8 speedup over x1                   {med['GET x1 in flight'] / med['GET x8 in flight']:6.2f}x")
    lines.append(f"  cold restore / GET x8 (verify + insert)  {cold / med['GET x8 in flight']:6.2f}x")
    if recompute is not None:
        lines.append(f"  recompute estimate / cold bucket restore {recompute[0] / cold:6.1f}x")
    else:
        lines.append("  recompute: MLX is not importable here; no estimate")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers x 4 blocks (16 MiB)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (5; 3 with --quick)")
    parser.add_argument("--dir", type=Path, default=None, help="where the local stores go (a temp dir)")
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint; default: start a local Ceph RGW")
    parser.add_argument("--bucket", default="kvstore-bench")
    parser.add_argument("--prefix", default="bench")
    parser.add_argument("--access-key", default=os.environ.get("KVSTORE_S3_ACCESS_KEY"))
    parser.add_argument("--secret-key", default=os.environ.get("KVSTORE_S3_SECRET_KEY"))
    parser.add_argument("--threads", type=int, default=8, help="requests in flight for the tier")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    repeats = args.repeats or (3 if args.quick else 5)
    cluster = None
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-remote-", dir=args.dir))
    try:
        if args.endpoint is None:
            from tools.ceph_dev import CephCluster

            cluster = CephCluster.start(log=lambda m: print(m, file=sys.stderr))
            args.endpoint, args.access_key, args.secret_key = (
                cluster.endpoint, cluster.access_key, cluster.secret_key)
        config = TierConfig(bucket=args.bucket, endpoint_url=args.endpoint, prefix=args.prefix,
                            access_key=args.access_key, secret_key=args.secret_key,
                            threads=args.threads)
        bucket = Bucket(config)
        bucket.ensure_bucket()
        bucket.close()
        times = run(shape, repeats, config, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if cluster is not None:
            cluster.stop()
    print(table(shape, times, recompute_estimate_s(shape.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
