"""Factories for tiny random-weight mlx-lm models (no downloads) and their inputs.

Sizes are kept tiny on purpose: CI runs on 2 CPU cores with a slow reference BLAS.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 97,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}

CONFIGS = {
    # head_dim 64 (one quantization group per head)
    "llama": {**BASE, "model_type": "llama", "head_dim": 64},
    "qwen2": {**BASE, "model_type": "qwen2", "hidden_size": 128},  # head_dim 128 / 4 = 32? see below
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 64},
    "gemma3_text": {**BASE, "model_type": "gemma3_text", "num_hidden_layers": 4,
                    "head_dim": 64, "sliding_window": 8, "sliding_window_pattern": 2,
                    "query_pre_attn_scalar": 64},
}
# qwen2 derives head_dim = hidden / heads: 256 / 4 = 64.
CONFIGS["qwen2"]["hidden_size"] = 256


def model_config(model_type: str, **overrides) -> dict:
    return {**CONFIGS[model_type], **overrides}


def tiny_model(model_type: str = "llama", dtype=mx.float32, seed: int = 0, **overrides):
    """A random-weight mlx-lm model of the given type, weights cast to dtype."""
    config = model_config(model_type, **overrides)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def prompt_tokens(count: int, vocab: int = 97, seed: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, vocab, size=count), dtype=mx.int32)


ROOT = Path(__file__).resolve().parents[2]


def run_worker(module: str, spec: dict) -> dict:
    """Run `python -m module <spec as JSON>` in a fresh process from the repository root;
    its last stdout line is the JSON result. A failing worker fails the test with its
    stderr."""
    # the repository first, then whatever the parent had (on the H200, MLX lives in
    # /root/site, which a bare PYTHONPATH=ROOT hid from the worker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", module, json.dumps(spec)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
