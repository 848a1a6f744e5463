"""The fixture model directory loads as a downloaded model would, and is worth testing with."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from tests.server.model_dir import SPECIALS, text


def test_mlx_lm_loads_the_directory_and_greedy_output_varies(model_dir, env, monkeypatch):
    monkeypatch.setenv("HF_HOME", env["HF_HOME"])
    model, tokenizer = load(str(model_dir))
    msgs = [{"role": "system", "content": text(40, seed=3)}, {"role": "user", "content": "hello"}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert tokenizer.encode("the quick brown fox", add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode("the quick brown fox", add_special_tokens=False)) == \
        "the quick brown fox"
    assert tokenizer.eos_token_ids == {SPECIALS.index("<|im_end|>")}
    out = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=32), range(32),
                                  strict=False)]
    assert len(set(out)) >= 4, f"greedy output degenerated: {out}"
    assert not set(out) & set(range(len(SPECIALS))), "a special token was generated"
