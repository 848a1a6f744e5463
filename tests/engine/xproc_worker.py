"""Subprocess side of the cross-process publish/restore tests (python -m tests.engine.xproc_worker).

publish:  prefill a prompt with the engine's paged cache and publish it (with a
          checkpoint, so non-paged layers travel as attachments).
restore:  restore the longest stored prefix of another prompt, prefill the rest,
          generate greedily; then recompute the same prompt from scratch in this process
          and print both, as JSON on the last line.

With "cache": "quantized" (and "bits", "group_size") both roles use mlx-lm's
QuantizedKVCache under an mlx-qB policy instead, report a blake3 of every state array
(the tokens held, codes, scales and biases), and the restore role reports every step's
logprobs digest, its from-scratch reference's, and a native KVCache's as a control.
"""

from __future__ import annotations

import json
import sys

import blake3
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from engine import EngineModel, KVPolicy, RestoreRequest, publish, restore
from engine.attention import installed
from engine.models import make_cache
from kvstore.store import Store
from tests.engine.factories import tiny_model

DTYPES = {"bfloat16": mx.bfloat16, "float32": mx.float32}


def _greedy(model, tokens, cache, n):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, prompt_cache=cache,
                                               max_tokens=n)]


def _digest(x: mx.array) -> str:
    host = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
    return blake3.blake3(host.tobytes()).hexdigest()


def _state_digests(caches) -> list[str]:
    """Per QuantizedKVCache layer, per array (codes, scales, biases of K then V): the
    held tokens' bytes."""
    return [_digest(a[..., : c.offset, :]) for c in caches if isinstance(c, QuantizedKVCache)
            for a in (*c.keys, *c.values)]


def _greedy_logprobs(model, tokens, cache, n) -> tuple[list[int], list[str]]:
    out, digests = [], []
    for token, logprobs in generate_step(mx.array(tokens), model, prompt_cache=cache, max_tokens=n):
        out.append(int(token))
        digests.append(_digest(logprobs))
    return out, digests


def _quantized_caches(model, group_size, bits):
    return [c.to_quantized(group_size, bits) if type(c) is KVCache else c
            for c in make_prompt_cache(model)]


def quantized(spec, model, store) -> dict:
    """The QuantizedKVCache roles (see the module docstring)."""
    group, bits = spec["group_size"], spec["bits"]
    policy = KVPolicy(default_format=f"mlx-q{bits}", block_size_tokens=spec["block_size"],
                      group_size=group)
    prompt = spec["prompt"]
    engine_model = EngineModel(model, "test/tiny", policy=policy)
    if spec["role"] == "publish":
        caches = _quantized_caches(model, group, bits)
        mx.eval(model(mx.array([prompt]), cache=caches))
        result = publish(engine_model, store, prompt, caches, checkpoint="q")
        return {"blocks": result.blocks, "state": _state_digests(caches),
                "format_id": engine_model.identity.format_id_hex}
    restored = restore(engine_model, store, RestoreRequest(prompt, cache_kind="quantized"))
    n = restored.tokens_restored
    state = _state_digests(restored.cache)
    got, got_lp = _greedy_logprobs(model, prompt[n:], restored.cache, spec["generate"])
    want, want_lp = _greedy_logprobs(model, prompt, _quantized_caches(model, group, bits),
                                     spec["generate"])
    _, native_lp = _greedy_logprobs(model, prompt, make_prompt_cache(model), spec["generate"])
    return {"tokens_restored": n, "source": restored.source, "state": state,
            "types": sorted({type(c).__name__ for c in restored.cache}),
            "got": got, "want": want, "got_logprobs": got_lp, "want_logprobs": want_lp,
            "native_logprobs": native_lp}


def main(argv):
    spec = json.loads(argv[0])
    model = tiny_model(spec["model_type"], DTYPES[spec["dtype"]])
    model.load_weights(spec["weights"])
    if spec.get("cache") == "quantized":
        with Store(spec["store"]) as store, installed(model):  # the router passes them through
            print(json.dumps(quantized(spec, model, store)))
        return
    policy = KVPolicy(default_format=spec["format"], block_size_tokens=spec["block_size"])
    engine_model = EngineModel(model, "test/tiny", policy=policy)
    out = {}
    with Store(spec["store"]) as store, installed(model):
        if spec["role"] == "publish":
            cache = make_cache(model, policy)
            mx.eval(model(mx.array([spec["prompt"]]), cache=cache))
            result = publish(engine_model, store, spec["prompt"], cache, checkpoint="a")
            out = {"blocks": result.blocks, "pages_sent": result.pages_sent}
        else:
            prompt = spec["prompt"]
            restored = restore(engine_model, store, RestoreRequest(prompt))
            got = _greedy(model, prompt[restored.tokens_restored:], restored.cache, spec["generate"])
            fresh = make_cache(model, policy)
            want = _greedy(model, prompt, fresh, spec["generate"])
            out = {"tokens_restored": restored.tokens_restored, "source": restored.source,
                   "got": got, "want": want}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
