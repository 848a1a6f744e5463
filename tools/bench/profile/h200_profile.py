"""Run on the H200: where the time of one k4v4 decode call goes.

Times (eval of --inner calls built beforehand, median of repeats) against context length:
dense SDPA, the tensor-core split kernel alone, split + merge, a plain streaming read of the
same page bytes through mx.fast.cuda_kernel (the bandwidth floor for this launch path) and
an empty kernel (the launch floor); then the tensor-core kernel's launch parameters.

From the repository root, with PYTHONPATH=$PWD:
  python3 tools/bench/profile/h200_profile.py
  python3 tools/bench/profile/h200_profile.py --tune        # launch floors, then TUNINGS against
                                                            # dense, timed as the benchmark times them
  python3 tools/bench/profile/h200_profile.py --tune-8bit   # warps and ring depth for k8v8, k8v4
  ncu ... python3 tools/bench/profile/h200_profile.py --ncu # one 128K call, repeated
Tunings are DirectTuning texts (kernels/tuning.py) over the environment's tuning.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from kernels import cuda, cuda_mma, direct
from kernels.call import PagedAttentionCall
from kernels.tuning import environment_tuning
from tests.kernels.pages import make_case
from tools.bench.attention import timed

INNER = 100  # calls per sample: the cost of starting a sample (~250 us on the H200) spread thin
TUNE = True


def eval_us(fn, repeats: int = 9) -> float:
    """Median microseconds per call, graphs built before the clock (the benchmark's "eval")."""
    return timed(fn, repeats, INNER)[0] * 1e6


def case_call(case, queries=None) -> PagedAttentionCall:
    return PagedAttentionCall(case.queries if queries is None else queries, case.planes, case.block_tables,
                              case.context_lens, case.layout, scale=128**-0.5)


def stream_kernel():
    """A plain streaming read of every page plane (the bandwidth floor of this launch path)."""
    return mx.fast.cuda_kernel(
        name="kvstore_stream_read",
        input_names=["a", "b", "c", "d", "e", "f"],
        output_names=["out"],
        source=(Path(__file__).parent / "stream_read.cu").read_text(),
    )


def empty_kernel():
    return mx.fast.cuda_kernel(name="kvstore_empty", input_names=["a"], output_names=["out"],
                               source="  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = a[0];")


def ncu_target() -> None:
    """One 128K k4v4 decode call, repeated: the process `ncu` profiles."""
    case = make_case("k4v4-rot", head_dim=128, n_kv_heads=8, gqa=4, block_size=16,
                     context_lens=[131072], num_queries=1)
    plan = direct.plan_launch(case_call(case), environment_tuning(), kernel="mma")
    for _ in range(5):
        mx.eval(cuda.launch(plan))


def tune_only(repeats: int = 7, layout: str = "k4v4-rot", contexts=(32768, 131072), tunings=None) -> None:
    """Dense SDPA beside the tensor-core kernel's tunings at 32K and 128K, as the benchmark
    times them: interleaved rounds, each sample a chain of calls (each call's output the next
    call's queries) filling about 10 ms; ratios are medians of within-round ratios."""
    from dataclasses import replace
    from statistics import median

    from tools.bench.attention import timed_rounds

    tunings = tunings or TUNINGS
    for tokens in contexts:
        case = make_case(layout, head_dim=128, n_kv_heads=8, gqa=4, block_size=16,
                         context_lens=[tokens], num_queries=1)
        keys = mx.random.normal((1, 8, tokens, 128)).astype(mx.bfloat16)
        values = mx.random.normal((1, 8, tokens, 128)).astype(mx.bfloat16)
        q = case.queries.astype(mx.bfloat16)
        mx.eval(keys, values, q)
        fns = {"dense": lambda x, k=keys, v=values: mx.fast.scaled_dot_product_attention(x, k, v, scale=128**-0.5)}
        plans = {}
        for tuning in tunings:
            plans[tuning] = direct.plan_launch(case_call(case, q), environment_tuning().parse(tuning),
                                               kernel="mma")
            mx.eval(plans[tuning].meta)
            fns[tuning] = lambda x, plan=plans[tuning]: cuda.launch(
                replace(plan, split_inputs=[x, *plan.split_inputs[1:]]))
        samples, calls = timed_rounds(fns, repeats, 10, 0.01, chain_from=q)
        dense = median(t for t, _ in samples["dense"]) * 1e6
        print(f"{layout} T={tokens}: dense {dense:.1f} us ({calls['dense']} calls per sample)", flush=True)
        for tuning in tunings:
            us = median(t for t, _ in samples[tuning]) * 1e6
            ratio = median(d[0] / m[0] for d, m in zip(samples["dense"], samples[tuning], strict=True))
            print(f"  tune {tuning}: split+merge {us:.1f} us = {ratio:.2f}x dense "
                  f"(splits {plans[tuning].num_splits})", flush=True)


TUNINGS = (
    "2,4,264,16,4,264,0,4,1,1,1",  # raw codes, one step per iteration, 4 warps (8 per SM)
    "2,4,264,16,4,264,0,4,2,1,1",  # raw codes, two steps per iteration
    "2,4,264,16,4,264,0,4,2,0,1",  # per-pair dequantization, two steps (121 registers)
    "2,4,264,16,6,264,0,4,1,1,1",  # 6 warps per block: 12 per SM (dynamic shared memory)
    "2,4,264,16,8,264,0,4,2,0,1",  # 8 warps per block: 16 per SM
    "2,4,264,16,4,396,0,4,2,0,1",  # three blocks of 4 warps per SM
    "2,4,264,16,4,528,0,4,2,0,1",  # four
    "2,4,264,16,4,198,0,4,1,1,1",  # fewer, longer splits
)


def floors() -> None:
    """Per-call time of an empty kernel and of small dense SDPA against calls per sample:
    the part of every benchmark figure that is launch and synchronization, not attention."""
    empty = empty_kernel()
    one = mx.zeros((1,), mx.float32)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16)
    mx.eval(q, k)
    for inner in (1, 10, 40):
        e = timed(lambda: empty(inputs=[one], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
                                output_dtypes=[mx.float32])[0], 9, inner)[0] * 1e6
        d = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=128**-0.5), 9, inner)[0] * 1e6
        print(f"floor: {inner} calls per sample: empty kernel {e:.1f} us, dense SDPA 4K {d:.1f} us per call",
              flush=True)


def main() -> None:
    print("device", mx.default_device())
    tuning = environment_tuning()
    STREAM, EMPTY = stream_kernel(), empty_kernel()
    one = mx.zeros((1,), mx.float32)
    print(f"empty kernel: {eval_us(lambda: EMPTY(inputs=[one], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0]):.1f} us")
    for tokens in (4096, 32768, 131072, 262144):
        case = make_case("k4v4-rot", head_dim=128, n_kv_heads=8, gqa=4, block_size=16,
                         context_lens=[tokens], num_queries=1)
        planes = [case.planes[n] for n in case.layout.plane_names]
        nbytes = sum(p.nbytes for p in planes) * tokens / (planes[0].shape[0] * 16)
        keys = mx.random.normal((1, 8, tokens, 128)).astype(mx.bfloat16)
        values = mx.random.normal((1, 8, tokens, 128)).astype(mx.bfloat16)
        q = case.queries.astype(mx.bfloat16)
        mx.eval(keys, values, q)
        dense = eval_us(lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=128**-0.5))
        plan = direct.plan_launch(case_call(case, q), tuning, kernel="mma")
        mx.eval(plan.meta)
        split = cuda_mma.split_kernel(plan.shared_memory)

        def split_only():
            return split(inputs=plan.split_inputs, template=plan.split_template,
                         grid=(plan.num_splits * plan.threads, plan.grid_y, plan.batch),
                         threadgroup=(plan.threads, 1, 1),
                         output_shapes=[plan.partial_shape + (128,), plan.partial_shape + (2,)],
                         output_dtypes=[mx.float32, mx.float32])[0]

        s_us = eval_us(split_only)
        for probe in (1, 2, 0):
            for stages in (0, 4):
                template = [(k, v) for k, v in plan.split_template if k not in ("PROBE", "ASYNC", "STAGES")]
                template += [("PROBE", probe), ("ASYNC", stages > 0), ("STAGES", max(1, stages))]

                def probed():
                    return split(inputs=plan.split_inputs, template=template,
                                 grid=(plan.num_splits * plan.threads, plan.grid_y, plan.batch),
                                 threadgroup=(plan.threads, 1, 1),
                                 output_shapes=[plan.partial_shape + (128,), plan.partial_shape + (2,)],
                                 output_dtypes=[mx.float32, mx.float32])[0]

                us = eval_us(probed)
                print(f"  probe {probe} ({['full', 'launch only', 'page reads only'][probe]}) stages {stages}: "
                      f"{us:.1f} us ({nbytes / us / 1e3:.0f} GB/s)", flush=True)
        full = eval_us(lambda: cuda.launch(plan))
        stream = eval_us(lambda: STREAM(inputs=planes, grid=(132 * 8 * 256, 1, 1), threadgroup=(256, 1, 1),
                                        output_shapes=[(2,)], output_dtypes=[mx.float32])[0])
        total_pool = sum(p.nbytes for p in planes)
        print(f"T={tokens}: dense {dense:.1f} us | mma split {s_us:.1f} us ({nbytes / s_us / 1e3:.0f} GB/s), "
              f"split+merge {full:.1f} us, splits {plan.num_splits} | stream read of the pool "
              f"({total_pool / 1e6:.0f} MB) {stream:.1f} us = {total_pool / stream / 1e3:.0f} GB/s", flush=True)
        if tokens in (32768, 131072) and TUNE:
            for text in ("2,4,264,16,4,528,0,0", "2,4,264,16,4,264,0,4", "2,4,264,16,4,396,0,4",
                           "2,4,264,16,4,528,0,4", "2,4,264,16,4,792,0,4", "2,4,264,16,4,528,0,3",
                           "2,4,264,16,4,528,0,2", "2,4,264,16,8,264,0,2", "2,4,264,16,8,528,0,2",
                           "2,4,264,16,2,528,0,4", "2,4,264,16,2,1056,0,4"):
                p2 = direct.plan_launch(case_call(case, q), environment_tuning().parse(text), kernel="mma")
                mx.eval(p2.meta)
                print(f"  tune {text}: split+merge {eval_us(lambda: cuda.launch(p2)):.1f} us "
                      f"(splits {p2.num_splits})", flush=True)
            tuning = environment_tuning().parse("2,4,264,16,4,528,0,4")  # for the longer contexts


if __name__ == "__main__":
    import sys

    if "--ncu" in sys.argv:
        ncu_target()
    elif "--tune" in sys.argv:
        floors()
        tune_only()
    elif "--tune-8bit" in sys.argv:  # ring depth and warps for the 8-bit formats at 128K
        for layout in ("k8v8-rot", "k8v4-rot"):
            tune_only(layout=layout, contexts=(131072,), tunings=(
                "2,4,264,16,4,264,0,2,1,1,1", "2,4,264,16,4,264,0,3,1,1,1",
                "2,4,264,16,6,264,0,3,1,1,1", "2,4,264,16,6,264,0,4,1,1,1"))
    else:
        main()
