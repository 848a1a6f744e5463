"""Issue 22, k4v4 decode: what one decode step's plane writes cost, by the way they are built.

A k4v4 decode step writes one token into six planes per layer (engine/pool.py BlockPool.write:
`plane[b:b + 1, :, s:s + 1, :] = values`, one SliceUpdate each, ~4.5 us of Python per plane on
the H200 host by run 3's profile). `mx.slice_update` with the start as an index array builds
the same update without parsing Python slices; one index array serves every plane of every
layer of a step. This probe measures both on the pool shapes of the 8B-shaped model (32
layers, 8 KV heads of 128, blocks of 128, 4-bit codes, float32 scales and offsets per group),
the arms taking turns over `--rounds` rounds of `--steps` steps:
  build   host ms per step to build the 192 updates
  eval    ms per step for mx.eval of the planes (and synchronize): a copy of the whole
          pool instead of an update in place would show here, and grow with --blocks
and checks that both arms leave the planes bit-identical (tolerance 0). Nothing in the
engine uses the index-array form; this is the measurement that decides whether it should.
    python tools/bench/profile/issue22_plane_write_h200.py [--blocks 260 --rounds 5 --steps 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlx.core as mx  # noqa: E402

from kernels.layout import PageLayout  # noqa: E402

LAYERS, HEADS, BLOCK, DIM = 32, 8, 128, 128


def make_planes(blocks: int, layout: PageLayout) -> list[dict[str, mx.array]]:
    widths = layout.plane_widths(DIM, DIM)
    planes = []
    for _ in range(LAYERS):
        layer = {name: mx.zeros((blocks, HEADS, BLOCK, width),
                                mx.uint8 if name.endswith("codes") else mx.float32)
                 for name, width in widths.items()}
        planes.append(layer)
    mx.eval(planes)
    return planes


def updates(layout: PageLayout, step: int) -> list[dict[str, mx.array]]:
    widths = layout.plane_widths(DIM, DIM)
    key = mx.random.key(step)
    out = []
    for layer in range(LAYERS):
        k = mx.random.split(key, LAYERS)[layer]
        out.append({name: (mx.random.randint(0, 256, (1, HEADS, 1, width), key=k).astype(mx.uint8)
                           if name.endswith("codes") else mx.random.normal((1, HEADS, 1, width), key=k))
                    for name, width in widths.items()})
    mx.eval(out)
    return out


def write_setitem(planes, values, block: int, slot: int) -> None:
    for layer, update in zip(planes, values, strict=True):
        for name, v in update.items():
            layer[name][block:block + 1, :, slot:slot + 1, :] = v


def write_indexed(planes, values, block: int, slot: int) -> None:
    start = mx.array([block, slot], dtype=mx.int32)  # one per step, shared by every write
    for layer, update in zip(planes, values, strict=True):
        for name, v in update.items():
            layer[name] = mx.slice_update(layer[name], v, start, (0, 2))


ARMS = {"setitem (BlockPool.write today)": write_setitem, "mx.slice_update, index array": write_indexed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=260)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    layout = PageLayout(4, 4, rotation_seed=7)
    pools = {name: make_planes(args.blocks, layout) for name in ARMS}
    steps = [updates(layout, step) for step in range(args.steps)]
    timings = {name: {"build": [], "eval": []} for name in ARMS}
    for round_ in range(args.rounds):
        names = list(ARMS) if round_ % 2 == 0 else list(ARMS)[::-1]
        for name in names:
            for step, values in enumerate(steps):
                position = round_ * args.steps + step
                block, slot = (position // BLOCK) % args.blocks, position % BLOCK
                began = time.perf_counter()
                ARMS[name](pools[name], values, block, slot)
                built = time.perf_counter()
                mx.eval(pools[name])
                mx.synchronize()
                done = time.perf_counter()
                if round_:  # the first round compiles and warms up
                    timings[name]["build"].append((built - began) * 1e3)
                    timings[name]["eval"].append((done - built) * 1e3)
    first, second = (pools[name] for name in ARMS)
    identical = all(mx.array_equal(a[n], b[n]).item() for a, b in zip(first, second, strict=True) for n in a)
    report = {"device": str(mx.default_device()), "blocks": args.blocks, "writes_per_step": LAYERS * 6,
              "identical": identical, "arms": {}}
    print(f"{mx.default_device()}, {args.blocks} blocks per plane, {LAYERS} layers x 6 planes per step; "
          f"planes bit-identical across arms: {identical}")
    for name, t in timings.items():
        build, evaluated = statistics.median(t["build"]), statistics.median(t["eval"])
        report["arms"][name] = {"build_ms": build, "eval_ms": evaluated, "steps": len(t["build"])}
        print(f"  {name:32s} build {build:.3f} ms, eval {evaluated:.3f} ms per step (medians of {len(t['build'])})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
