"""generate_with_store writes a checkpoint at the prompt boundary for models with
non-paged layers (issue 20 item 4), and a checkpoint never pairs stored pages of one
computation with state of another."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from engine.attention import installed
from engine.engine_model import EngineModel
from engine.errors import MixedComputation
from engine.generate import generate_with_store, prompt_checkpoint_name
from engine.policy import KVPolicy
from engine.publish import capture, publish, upload
from kvstore.store import Store
from tests.engine.test_model_sweep import build

POLICY = KVPolicy(block_size_tokens=8)


def _recompute(model, prompt, steps):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model,
                                              prompt_cache=make_prompt_cache(model),
                                              max_tokens=steps)]


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next", "mamba", "gpt_oss"])
def test_second_run_restores_the_prompt_checkpoint(tmp_path, model_type):
    model = build(model_type)  # sliding, recurrent + full, recurrent only, sliding + sinks
    engine_model = EngineModel(model, f"test/{model_type}", policy=POLICY)
    prompt = [(5 * i + 2) % 97 for i in range(29)]
    with Store(str(tmp_path / "store")) as store:
        first = generate_with_store(engine_model, None, prompt, store, max_new_tokens=8)
        assert first.tokens_restored == 0
        assert first.published["checkpoint"] == prompt_checkpoint_name(prompt[:-1])
        again = generate_with_store(engine_model, None, prompt, store, max_new_tokens=8)
        longer = generate_with_store(engine_model, None, prompt + [4, 5, 6], store,
                                     max_new_tokens=8)
    assert again.tokens_restored == len(prompt) - 1 and again.tokens == first.tokens
    assert first.tokens == _recompute(model, prompt, 8)
    assert longer.tokens_restored == len(prompt) - 1
    assert longer.tokens == _recompute(model, prompt + [4, 5, 6], 8)


def test_a_checkpoint_over_pages_of_another_computation_is_refused(tmp_path):
    model = build("gemma3_text")
    engine_model = EngineModel(model, "test/mixed", policy=POLICY)
    tokens = [(3 * i + 1) % 97 for i in range(24)]
    with Store(str(tmp_path / "store")) as store, installed(model):
        one_chunk = engine_model.make_cache()
        mx.eval(model(mx.array([tokens]), cache=one_chunk))
        publish(engine_model, store, tokens, one_chunk, checkpoint="one-chunk")
        # The same tokens, K/V perturbed the way another chunking's last bits could be.
        other = engine_model.make_cache()
        mx.eval(model(mx.array([tokens]), cache=other))
        cap = capture(engine_model.identity, tokens, other, attachments=True)
        first = bytearray(cap.layers[0].pages[0])
        first[0] ^= 1  # one bit of the first key
        cap.layers[0].pages[0] = memoryview(bytes(first))
        with pytest.raises(MixedComputation, match="another computation"):
            upload(store, cap, checkpoint="mixed")
        names = [c.name for c in store.list_checkpoints("default")]
    assert names == ["one-chunk"]


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next"])
def test_publish_checkpoints_a_prompt_boundary_by_itself(tmp_path, model_type):
    """publish() of a hybrid model's cache that sits exactly at the tokens writes the
    prompt checkpoint without being asked, so a later restore reuses it; a cache that ran
    past the tokens publishes its full-attention prefix only. (A model with no layer that
    counts its tokens, e.g. mamba, cannot show where it sits: it is checkpointed only when
    asked, as generate_with_store asks.)"""
    from engine.restore import RestoreRequest, restore

    model = build(model_type)
    engine_model = EngineModel(model, f"test/{model_type}", policy=POLICY)
    tokens = [(7 * i + 3) % 97 for i in range(24)]
    with Store(str(tmp_path / "store")) as store, installed(model):
        cache = engine_model.make_cache()
        mx.eval(model(mx.array([tokens]), cache=cache))
        result = publish(engine_model, store, tokens, cache)
        assert result.checkpoint == prompt_checkpoint_name(tokens)
        restored = restore(engine_model, store, RestoreRequest(tokens + [1]))
        assert restored.tokens_restored == len(tokens)
        got = model(mx.array([[1]]), cache=restored.cache)[:, -1]
        want = model(mx.array([[1]]), cache=cache)[:, -1]
        assert mx.array_equal(got, want).item()  # tolerance 0
        mx.eval(model(mx.array([[2]]), cache=cache))  # one step past the tokens
        assert publish(engine_model, store, tokens[:16], cache).checkpoint is None
