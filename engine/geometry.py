"""Layer geometry of an mlx-lm model, read from its config: which layers are paged.

A model config (the dict of config.json, or the ModelArgs dataclass an mlx-lm model
carries as `model.args`) is normalized through mlx-lm's own ModelArgs.from_dict, so
defaults are the ones the model code uses and the two spellings of one config give the
same canonical dict, hence the same model fingerprint.

Per layer the engine needs: kind ("full": one page per block; "sliding": a window ring
kept by mlx-lm's RotatingKVCache; "state": recurrent arrays), KV heads, key and value
head dims, and the window. The rules are per model type and deliberately explicit: a
model type without rules is refused (UnsupportedModel), never guessed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import blake3

from engine.errors import UnsupportedModel

# mlx-lm loads these model types with another type's code (mlx_lm.utils.MODEL_REMAPPING).
_REMAPPED = {"mistral": "llama"}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass(frozen=True)
class LayerGeometry:
    kind: str  # "full" | "sliding" | "state"
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int = 0  # tokens a sliding layer sees; 0 for full layers


def model_type_of(config) -> str:
    data = config if isinstance(config, dict) else dataclasses.asdict(config)
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedModel("the model config has no model_type")
    return model_type


def model_args(config):
    """The mlx-lm ModelArgs for a config dict or ModelArgs instance."""
    model_type = model_type_of(config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"no paged-cache rules for model type {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    data = config if isinstance(config, dict) else dataclasses.asdict(config)
    return _model_args(model_type, json.dumps(data, sort_keys=True, default=str))


@lru_cache(maxsize=64)
def _model_args(model_type: str, config_json: str):
    # ModelArgs.from_dict inspects signatures (milliseconds); restores ask per request.
    # Keyed by the config's full JSON, so a changed config is a different entry.
    module = importlib.import_module(f"mlx_lm.models.{_REMAPPED.get(model_type, model_type)}")
    return module.ModelArgs.from_dict(json.loads(config_json))


def canonical_config(config) -> dict[str, Any]:
    """The config as the model code sees it: ModelArgs fields with their defaults.

    Keys mlx-lm ignores (torch_dtype, quantization, architectures, ...) are dropped, so
    weight quantization cannot leak into the KV format identity.
    """
    return json.loads(json.dumps(dataclasses.asdict(model_args(config)), sort_keys=True))


def model_fingerprint(config) -> str:
    """blake3 hex of the canonical config JSON (sorted keys, no whitespace).

    It covers the architecture, not the weights: the model id names the weights.
    """
    text = json.dumps(canonical_config(config), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True)
    return blake3.blake3(text.encode()).hexdigest()


def layer_geometry(config) -> list[LayerGeometry]:
    """One LayerGeometry per decoder layer, in order."""
    args = model_args(config)
    model_type = _REMAPPED.get(model_type_of(config), model_type_of(config))
    n_layers = args.num_hidden_layers
    kv_heads = args.num_key_value_heads or args.num_attention_heads
    if model_type == "llama":
        head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
        kinds = [_llama_kind(t) for t in args.layer_types]
        window = args.sliding_window or 0
    elif model_type == "qwen2":
        head_dim = args.hidden_size // args.num_attention_heads
        kinds = ["full"] * n_layers
        window = 0
    elif model_type == "qwen3":
        head_dim = args.head_dim
        kinds = ["full"] * n_layers
        window = 0
    elif model_type == "gemma3_text":
        head_dim = args.head_dim
        pattern = args.sliding_window_pattern
        kinds = ["full" if i % pattern == pattern - 1 else "sliding" for i in range(n_layers)]
        window = args.sliding_window
    else:  # pragma: no cover - model_args already refused it
        raise UnsupportedModel(model_type)
    if len(kinds) != n_layers:
        raise UnsupportedModel(f"{len(kinds)} layer types for {n_layers} layers")
    return [
        LayerGeometry(kind, kv_heads, head_dim, head_dim, window if kind == "sliding" else 0)
        for kind in kinds
    ]


def _llama_kind(layer_type: str) -> str:
    if layer_type == "full_attention":
        return "full"
    if layer_type == "sliding_attention":
        return "sliding"
    raise UnsupportedModel(f"unknown llama layer type {layer_type!r}")
