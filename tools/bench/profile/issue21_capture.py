"""Issue 21: what publishing one segment costs serve-model's generation thread.

StoreTier.offer publishes a segment from the thread that runs mlx-lm's decode steps.
This times, on a llama-shaped model with random weights and mlx-lm's own KVCache:
  - the offer's work on that thread: capture() (the host copy, as before) against
    capture_later() (device copies queued, the host copy on another thread);
  - the median decode step before and after it (a capture that moved the live cache
    into CUDA managed memory would slow every later step);
  - the deferred host copy on its own thread, while the steps run.
It checks that both give the same page bytes (tolerance 0).

    python -m tools.bench.profile.issue21_capture                       # CPU, tiny
    python -m tools.bench.profile.issue21_capture --layers 32 --tokens 288 2072  # H200

The 8B-shaped run keeps the KV shape of Llama-3-8B (32 layers, 8 KV heads of 128) with
a narrow residual stream (1024), so the decode step is mostly attention over the cache.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import mlx.core as mx
from mlx_lm.models import llama

from engine.engine_model import EngineModel
from engine.publish import DeferredCapture, capture, capture_later


def _model(layers: int, kv_heads: int, head_dim: int):
    args = llama.ModelArgs(model_type="llama", hidden_size=kv_heads * head_dim,
                           num_hidden_layers=layers, intermediate_size=1024,
                           num_attention_heads=kv_heads, num_key_value_heads=kv_heads,
                           rms_norm_eps=1e-5, vocab_size=1024, head_dim=head_dim)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def _steps(model, caches, count: int) -> list[float]:
    token = mx.array([[7]])
    times = []
    for _ in range(count):
        start = time.perf_counter()
        logits = model(token, cache=caches)
        mx.eval(logits)
        times.append(time.perf_counter() - start)
    return times


def _prefill(model, tokens: int):
    caches = model.make_cache()
    prompt = mx.array([[(i * 31) % 1000 + 1 for i in range(tokens)]])
    mx.eval(model(prompt, cache=caches))
    for c in caches:
        mx.eval(c.keys, c.values)
    return caches, [int(t) for t in prompt[0].tolist()]


def _pages(cap) -> list[bytes]:
    return [bytes(p) for layer in cap.layers for p in layer.pages]


def run_arm(model, identity, tokens: int, deferred: bool, steps: int) -> dict:
    caches, ids = _prefill(model, tokens)
    before = _steps(model, caches, steps)
    start = time.perf_counter()
    if deferred:
        job = capture_later(identity, ids, caches, defer=True)
    else:
        job = capture(identity, ids, caches)
    offer = time.perf_counter() - start
    worker = {}

    def host_copy():
        t = time.perf_counter()
        worker["capture"] = job.result()
        worker["seconds"] = time.perf_counter() - t

    thread = None
    if isinstance(job, DeferredCapture):
        thread = threading.Thread(target=host_copy)
        thread.start()
    after = _steps(model, caches, steps)
    if thread is not None:
        thread.join()
    cap = worker.get("capture", job)
    return {"offer_ms": offer * 1e3, "step_before_ms": statistics.median(before) * 1e3,
            "step_after_ms": statistics.median(after) * 1e3,
            "step_after_first_ms": after[0] * 1e3,
            "worker_ms": worker.get("seconds", 0.0) * 1e3, "nbytes": cap.nbytes,
            "pages": _pages(cap)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[288])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    model = _model(args.layers, args.kv_heads, args.head_dim)
    identity = EngineModel(model, "issue21-capture").identity
    print(f"device {mx.default_device()}, mlx {mx.__version__}, {args.layers} layers, "
          f"{args.kv_heads} KV heads of {args.head_dim}")
    print("| tokens | arm | offer ms (gen thread) | step before ms | step after ms | "
          "first step after ms | host copy ms (worker) | MB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        _ = run_arm(model, identity, tokens, False, 2)  # warm-up: shapes compiled
        _ = run_arm(model, identity, tokens, True, 2)
        rows = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved
            for deferred in (False, True):
                rows[deferred].append(run_arm(model, identity, tokens, deferred, args.steps))
        same = all(a["pages"] == b["pages"] for a, b in zip(rows[False], rows[True], strict=True))
        for deferred, name in ((False, "capture (before)"), (True, "capture_later")):
            r = rows[deferred]
            med = {k: statistics.median(x[k] for x in r)
                   for k in ("offer_ms", "step_before_ms", "step_after_ms",
                             "step_after_first_ms", "worker_ms")}
            print(f"| {tokens} | {name} | {med['offer_ms']:.2f} | {med['step_before_ms']:.2f} | "
                  f"{med['step_after_ms']:.2f} | {med['step_after_first_ms']:.2f} | "
                  f"{med['worker_ms']:.2f} | {r[0]['nbytes'] / 1e6:.1f} |")
        print(f"pages equal, tolerance 0: {same}")
        if not same:
            raise SystemExit("capture_later's pages differ from capture's")


if __name__ == "__main__":
    main()
