"""Subprocess side of the cross-process publish/restore tests (python -m tests.engine.xproc_worker).

publish:  prefill a prompt with the engine's paged cache and publish it (with a
          checkpoint, so non-paged layers travel as attachments).
restore:  restore the longest stored prefix of another prompt, prefill the rest,
          generate greedily; then recompute the same prompt from scratch in this process
          and print both, as JSON on the last line.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine.attention import installed
from engine.models import make_cache, model_identity
from engine.policy import KVPolicy
from engine.publish import publish
from engine.restore import restore
from kvstore.store import Store
from tests.engine.factories import tiny_model

DTYPES = {"bfloat16": mx.bfloat16, "float32": mx.float32}


def _greedy(model, tokens, cache, n):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, prompt_cache=cache,
                                               max_tokens=n)]


def main(argv):
    spec = json.loads(argv[0])
    model = tiny_model(spec["model_type"], DTYPES[spec["dtype"]])
    model.load_weights(spec["weights"])
    policy = KVPolicy(default_format=spec["format"], block_size_tokens=spec["block_size"])
    identity = model_identity(model, policy, model_id="test/tiny")
    out = {}
    with Store(spec["store"]) as store, installed(model):
        if spec["role"] == "publish":
            cache = make_cache(model, policy, model_id="test/tiny")
            mx.eval(model(mx.array([spec["prompt"]]), cache=cache))
            result = publish(store, identity, spec["prompt"], cache, checkpoint="a")
            out = {"blocks": result.blocks, "pages_sent": result.pages_sent}
        else:
            prompt = spec["prompt"]
            restored = restore(model, prompt, store, model_id="test/tiny", policy=policy)
            got = _greedy(model, prompt[restored.tokens_restored:], restored.cache, spec["generate"])
            fresh = make_cache(model, policy, model_id="test/tiny")
            want = _greedy(model, prompt, fresh, spec["generate"])
            out = {"tokens_restored": restored.tokens_restored, "source": restored.source,
                   "got": got, "want": want}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
