"""Issue 22, decode on the H200: what one mx.fast.cuda_kernel call costs the host, by the
size of the source string MLX holds for it.

MLX 0.32's CUDA custom kernel concatenates its header and source into a new string on every
call (custom_kernel.cpp, build_kernel) and hashes that string again when the node is
evaluated (CustomKernel::eval_gpu: the JIT module's name is name + std::hash(source)). The
paged attention kernels carry 13-43 KB of source each, two calls per layer. This probe runs
the same trivial kernel (out = x + 1, one block) with three sources, interleaved:
  small     the body alone (about 100 bytes);
  big       the body plus SIZE bytes of comment in the source;
  include   the SIZE bytes in a file that the source #includes by absolute path (NVRTC reads
            it from the file system), which also checks that such an include compiles.
Each step chains CALLS calls, like a decode step's layers, then evaluates. It prints the
medians per call of building the graph (the Python call) and of evaluating it.
    python tools/bench/profile/issue22_source_size_h200.py [--size 40000 --calls 64 --steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import mlx.core as mx

BODY = "unsigned int i = threadIdx.x; if (i < x_size) out[i] = x[i] + (T)1;\n"


def kernels(size: int, directory: str) -> dict:
    padding = "// " + "x" * 76 + "\n"
    pad = padding * (size // len(padding))
    path = os.path.join(directory, "issue22_padding.cuh")
    with open(path, "w") as f:
        f.write(pad + "#define ISSUE22_INCLUDED 1\n")
    included = f'#include "{path}"\n#ifndef ISSUE22_INCLUDED\n#error include not read\n#endif\n'
    make = lambda name, source: mx.fast.cuda_kernel(  # noqa: E731
        name=name, input_names=["x"], output_names=["out"], source=source)
    return {"small": make("issue22_small", BODY),
            "big": make("issue22_big", pad + BODY),
            "include": make("issue22_include", included + BODY)}


def step(kernel, x: mx.array, calls: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    y = x
    for _ in range(calls):
        y = kernel(inputs=[y], template=[("T", mx.float32), ("x_size", 256)], grid=(256, 1, 1),
                   threadgroup=(256, 1, 1), output_shapes=[y.shape], output_dtypes=[y.dtype])[0]
    t1 = time.perf_counter()
    mx.eval(y)
    mx.synchronize()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=40000)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    x = mx.zeros((256,), dtype=mx.float32)
    with tempfile.TemporaryDirectory() as directory:
        ks = kernels(args.size, directory)
        for name, k in ks.items():  # compile, and check the result
            y = k(inputs=[x], template=[("T", mx.float32), ("x_size", 256)], grid=(256, 1, 1),
                  threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
            assert mx.array_equal(y, x + 1).item(), name
        times = {name: ([], []) for name in ks}
        for _ in range(args.steps):
            for name, k in ks.items():
                build, run = step(k, x, args.calls)
                times[name][0].append(build)
                times[name][1].append(run)
    result = {}
    print(f"source padding {args.size} bytes, {args.calls} chained calls per step, "
          f"{args.steps} steps, medians per call:")
    for name, (build, run) in times.items():
        b = statistics.median(build) / args.calls * 1e6
        r = statistics.median(run) / args.calls * 1e6
        result[name] = {"build_us": b, "eval_us": r}
        print(f"  {name:8s} build {b:7.2f} us   eval {r:7.2f} us   total {b + r:7.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), **result), f, indent=1)


if __name__ == "__main__":
    main()
