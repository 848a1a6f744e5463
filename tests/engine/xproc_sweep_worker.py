"""Subprocess side of tests/engine/test_xproc_models.py (python -m tests.engine.xproc_sweep_worker SPEC).

publish: prefill all but the last prompt token through the engine's paged caches
         (native pages) and publish them with a checkpoint (attachments for non-paged
         layers).
restore: restore the prompt, generate greedily from its last token; then recompute the
         same prompt in this process with fresh paged caches and with mlx-lm's own
         caches, in the same chunking (prompt[:-1] in one step, then generate_step), and
         print tokens and a blake3 of every step's logprobs, as JSON on the last line.
"""

from __future__ import annotations

import importlib
import json
import sys

import blake3
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from engine import EngineModel, KVPolicy, RestoreRequest, publish, restore
from engine.attention import installed
from kvstore.store import Store
from tests.engine.model_configs import tiny_config


def build(model_type: str, overrides: dict):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    return module.Model(module.ModelArgs.from_dict({**tiny_config(model_type), **overrides}))


def _greedy(model, tokens, cache, n) -> tuple[list[int], list[str]]:
    out, digests = [], []
    for token, logprobs in generate_step(mx.array(tokens), model, prompt_cache=cache, max_tokens=n):
        out.append(int(token))
        digests.append(blake3.blake3(np.array(logprobs).tobytes()).hexdigest())
    return out, digests


def main(argv) -> None:
    spec = json.loads(argv[0])
    model = build(spec["model_type"], spec.get("overrides", {}))
    model.load_weights(spec["weights"])
    mx.eval(model.parameters())
    engine_model = EngineModel(model, f"test/{spec['model_type']}",
                               policy=KVPolicy(block_size_tokens=spec["block_size"]))
    prompt, head = spec["prompt"], spec["prompt"][:-1]
    with Store(spec["store"]) as store, installed(model):
        if spec["role"] == "publish":
            cache = engine_model.make_cache()
            mx.eval(model(mx.array([head]), cache=cache))
            result = publish(engine_model, store, head, cache, checkpoint="xproc")
            print(json.dumps({"blocks": result.blocks,
                              "format_id": engine_model.identity.format_id_hex}))
            return
        restored = restore(engine_model, store, RestoreRequest(prompt))
        got = _greedy(model, prompt[restored.tokens_restored:], restored.cache, spec["generate"])
        fresh = engine_model.make_cache()
        mx.eval(model(mx.array([head]), cache=fresh))
        want = _greedy(model, prompt[-1:], fresh, spec["generate"])
        stock = make_prompt_cache(model)
        mx.eval(model(mx.array([head]), cache=stock))
        stock_want = _greedy(model, prompt[-1:], stock, spec["generate"])
        print(json.dumps({"tokens_restored": restored.tokens_restored, "source": restored.source,
                          "format_id": engine_model.identity.format_id_hex,
                          "attention": "routed" if engine_model.attention.routed else "gathered",
                          "got": got, "want": want, "stock": stock_want}))


if __name__ == "__main__":
    main(sys.argv[1:])
