"""Run on the H200 (not collected by pytest): compile the CUDA kernels, check a few cases
against the reference, then time k4v4 decode over a small grid of launch parameters.

  python3 tests/kernels/h200_smoke.py [--tune]
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

from kernels import direct
from kernels.attention import paged_attention
from tests.kernels.pages import make_case


def check() -> bool:
    ok = True
    for layout, dim, gqa, block, lens, queries, mask, window in [
        ("k4v4", 128, 4, 16, [1000], 1, None, None),
        ("bf16", 128, 4, 16, [1000], 1, None, None),
        ("k8v4-rot", 64, 8, 64, [77, 300], 3, "causal", None),
        ("f32", 256, 1, 16, [300], 8, "causal", 50),
    ]:
        case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                         context_lens=lens, num_queries=queries)
        opts = dict(scale=dim**-0.5, mask=mask, window=window)
        ref = paged_attention(case.queries, case.planes, case.block_tables, case.context_lens,
                              case.layout, impl="reference", **opts)
        got = paged_attention(case.queries, case.planes, case.block_tables, case.context_lens,
                              case.layout, impl="cuda", **opts)
        err = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
        print(f"check {layout} d{dim} g{gqa} b{block} {lens} L{queries} {mask} w{window}: max err {err:.3g}")
        ok = ok and err < 3e-2
    return ok


def time_k4v4(tokens: int, repeats: int = 15, inner: int = 20) -> float:
    case = make_case("k4v4-rot", head_dim=128, n_kv_heads=8, gqa=4, block_size=16,
                     context_lens=[tokens], num_queries=1)
    fn = lambda: paged_attention(case.queries, case.planes, case.block_tables, case.context_lens,
                                 case.layout, impl="cuda", scale=128**-0.5)
    mx.eval([fn() for _ in range(inner)])
    samples = []
    for _ in range(repeats):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        mx.synchronize()
        samples.append((time.perf_counter() - t) / inner)
    return statistics.median(samples) * 1e6


if __name__ == "__main__":
    print("device", mx.default_device())
    good = check()
    if "--tune" in sys.argv:
        for unroll in (2, 4, 8):
            for target in (264, 528, 1056):
                direct.UNROLL, direct.TARGET_BLOCKS = unroll, target
                print(f"tune unroll={unroll} target_blocks={target}: "
                      f"32K {time_k4v4(32768):.1f} us, 128K {time_k4v4(131072):.1f} us", flush=True)
    sys.exit(0 if good else 1)
