"""Cross-process publish and restore, bit-exact with recompute, for the model families
issue 20 names: native pages, a 600-token prompt, 32 greedy tokens (tolerance 0 on
tokens and on every step's logprobs, compared as blake3 digests of their bytes).

  phi3         GQA 4:1, head dim 64 (all layers paged, the router attends)
  gpt_oss      sliding windows and attention sinks (sliding layers as attachments)
  qwen3_moe    mixture of experts (float32: MLX's CPU expert kernel refuses bf16)
  deepseek_v3  MLA: the latent stored as pages (1 head, Dk = kv_lora_rank), gathered
  qwen3_next   hybrid recurrent (gated delta state as attachments)
"""

from __future__ import annotations

import pytest

from tests.engine.factories import run_worker
from tests.engine.xproc_sweep_worker import build

PROMPT_TOKENS = 600
GENERATE_TOKENS = 32
BLOCK_TOKENS = 64

CASES = {
    "phi3": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1},
    "gpt_oss": {"sliding_window": 128},
    "qwen3_moe": {},
    "deepseek_v3": {},
    "qwen3_next": {},
}


def _run(spec: dict) -> dict:
    return run_worker("tests.engine.xproc_sweep_worker", spec)


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_cross_process_restore_is_bit_exact(tmp_path, model_type):
    model = build(model_type, CASES[model_type])
    weights = tmp_path / "weights.safetensors"
    model.save_weights(str(weights))
    prompt = [(13 * i + 7) % 97 for i in range(PROMPT_TOKENS)]
    common = {"model_type": model_type, "overrides": CASES[model_type], "weights": str(weights),
              "block_size": BLOCK_TOKENS, "store": str(tmp_path / "store"), "prompt": prompt}
    published = _run({**common, "role": "publish"})
    assert published["blocks"] == -(-(PROMPT_TOKENS - 1) // BLOCK_TOKENS)
    result = _run({**common, "role": "restore", "generate": GENERATE_TOKENS})
    assert result["format_id"] == published["format_id"]
    assert result["tokens_restored"] == PROMPT_TOKENS - 1
    assert len(result["got"][0]) == GENERATE_TOKENS
    assert result["got"] == result["want"]  # tokens and logprob digests, tolerance 0
    assert result["got"] == result["stock"]  # and equal to mlx-lm's own caches
    print(f"\n{model_type}: {result['source']}, attention {result['attention']}, "
          f"{result['tokens_restored']} tokens restored, {GENERATE_TOKENS} equal")
