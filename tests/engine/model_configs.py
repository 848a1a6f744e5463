"""Tiny random configs for every model type in the installed mlx_lm.models (our own).

tiny_config(model_type) starts from GENERIC (the size fields most ModelArgs share, all
tiny), fills any required field the type's ModelArgs (or its text config class) has
with a placeholder of its annotated type, then applies OVERRIDES: per type, what its
code needs beyond that (layer patterns, rope dicts, MoE shapes). Layer counts are kept
at the smallest that still shows each layer kind. The models never see real weights.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import mlx_lm.models

# Modules of mlx_lm.models that hold shared code, not a model type.
HELPER_MODULES = frozenset({"activations", "base", "bitlinear_layers", "cache", "gated_delta",
                            "mla", "pipeline", "rope_utils", "ssm", "switch_layers"})

GENERIC = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, head_dim=16, rms_norm_eps=1e-5, layer_norm_eps=1e-5,
    norm_eps=1e-5, layer_norm_epsilon=1e-5, rope_theta=10000.0, max_position_embeddings=256,
    tie_word_embeddings=True, n_routed_experts=4, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, kv_lora_rank=16,
    q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, sliding_window=8,
    n_group=1, topk_group=1, first_k_dense_replace=1, shared_expert_intermediate_size=32,
    n_layer=2, n_head=4, n_embd=64, n_positions=256, n_inner=64, d_model=64, n_layers=2,
    n_heads=4, n_kv_heads=2, num_layers=2, dim=64, hidden_dim=64, num_heads=4, num_kv_heads=2,
    ffn_dim=64)

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 64, "type": "yarn"}
SW2 = ["sliding_attention", "full_attention"]

OVERRIDES: dict[str, dict] = {
    "afm7": {"num_layers": 4, "num_hidden_layers": 4, "num_kv_reuse_layers": 2},
    "afmoe": {"layer_types": SW2, "num_dense_layers": 1},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2, "tie_word_embeddings": False},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1,
                           "first_k_dense_replace": 0, "num_key_value_heads": 4},
    "cohere2": {"sliding_window_pattern": 2},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "clip_qkv": True, "rope_theta": 10000}},
    "deepseek_v2": {"rope_scaling": _YARN},
    "exaone4": {"sliding_window_pattern": "LG", "rope_scaling": None},
    "exaone_moe": {"layer_types": SW2, "is_moe_layer": [False, True], "num_shared_experts": 1},
    "gear": {"layer_types": None},
    "gemma3_text": {"sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    "gemma4_text": {"num_hidden_layers": 4, "layer_types": SW2 * 2, "num_kv_shared_layers": 2,
                    "vocab_size_per_layer_input": 97, "hidden_size_per_layer_input": 8},
    "phixtral": {"num_vocab": 97, "model_dim": 64, "rotary_dim": 8},
    "glm_moe_dsa": {"rope_parameters": _ROPE, "index_head_dim": 16, "index_n_heads": 2,
                    "index_topk": 4},
    "gptj": {"rotary_dim": 8},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
                         "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_conv": 4,
                         "mamba_n_groups": 1, "shared_intermediate_size": 32},
    "hunyuan": {"rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
                "moe_topk": 2, "num_shared_expert": 1, "use_mixed_mlp_moe": True},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16,
              "mamba_expand": 2},
    "kimi_k3": {"linear_attn_config": {"num_heads": 4, "head_dim": 16, "kda_layers": [1],
                                       "short_conv_kernel_size": 4}},
    "prism_hadamard_qwen35": {"schema_version": 2, "tensor_namespace": "mlx-vlm-qwen3_5"},
    "kimi_linear": {"linear_attn_config": {"num_heads": 4, "head_dim": 16, "kda_layers": [1],
                                           "short_conv_kernel_size": 4}},
    "lfm2": {"full_attn_idxs": [1], "block_dim": 64, "block_ff_dim": 64, "conv_L_cache": 3,
             "layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"full_attn_idxs": [1], "conv_L_cache": 3, "num_dense_layers": 1,
                 "layer_types": ["conv", "full_attention"]},
    "llama4_text": {"no_rope_layers": [0, 1], "intermediate_size_mlp": 64},
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "moe_topk": 2,
                      "ffn_hidden_size": 64, "expert_ffn_hidden_size": 32, "zero_expert_num": 2,
                      "zero_expert_type": "identity", "routed_scaling_factor": 1.0},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "moe_topk": 2,
                            "ffn_hidden_size": 64, "expert_ffn_hidden_size": 32,
                            "zero_expert_num": 2, "zero_expert_type": "identity",
                            "routed_scaling_factor": 1.0},
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "conv_kernel": 3, "n_groups": 2,
               "time_step_limit": (0.01, 10.0), "time_step_rank": "auto"},
    "mellum": {"layer_types": SW2, "rope_parameters": {"sliding_attention": _ROPE,
                                                      "full_attention": _ROPE}},
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1],
                      "sliding_window_size": 8, "head_dim": 16, "v_head_dim": 16,
                      "swa_head_dim": 16, "swa_v_head_dim": 16, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "partial_rotary_factor": 0.5,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "routed_scaling_factor": None},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 64, "short_factor": [1.0] * 4,
                                  "long_factor": [1.0] * 4}},
    "ministral3": {"rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 64}},
    "mistral4": {"rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 64}},
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2, "no_op": False,
                                                      "replace_with_linear": False},
                                        "ffn": {"ffn_mult": 1.0, "no_op": False,
                                                "replace_with_linear": False}}] * 2},
    "nemotron_h": {"hybrid_override_pattern": ["*", "M"], "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "ssm_state_size": 16, "conv_kernel": 3, "n_groups": 2,
                   "time_step_limit": [1.0, 2.0]},
    "olmo3": {"layer_types": SW2},
    "plamo3": {"sliding_window_pattern": 2},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "muse_glimmer": {"layer_types": SW2},
    "openelm": {"num_transformer_layers": 2, "model_dim": 64, "head_dim": 16,
                "num_query_heads": [4, 4], "num_kv_heads": [2, 2], "ffn_multipliers": [1.0, 1.0],
                "ffn_dim_divisor": 16},
    "plamo": {"n_shared_head": 2},
    # Its blocksparse layers abort MLX on CPU at this size (heap corruption in mlx-lm's
    # own forward, stock caches alone); every layer dense keeps the type covered.
    "phi3small": {"dense_attention_every_n_layers": 1},
    "qwen": {"intermediate_size": 128, "kv_channels": 16},
    "qwen3_next": {"full_attention_interval": 2, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 8,
                        "lru_width": 64, "conv1d_width": 4, "logits_soft_cap": 30.0,
                        "embeddings_scale_by_sqrt_dim": True},
    "spark2_5": {"layer_types": SW2, "rope_parameters": {"sliding_attention": _ROPE,
                                                        "full_attention": _ROPE}},
    "muse_spark": {},
}

# Merged into a type's text_config after it is built.
TEXT_OVERRIDES: dict[str, dict] = {
    "gemma3n": {"num_hidden_layers": 4, "layer_types": SW2 * 2, "num_kv_shared_layers": 2,
                "activation_sparsity_pattern": None, "hidden_size_per_layer_input": 8,
                "vocab_size_per_layer_input": 97, "laurel_rank": 8, "altup_num_inputs": 2,
                "altup_active_idx": 0, "altup_correct_scale": True, "altup_coef_clip": None,
                "final_logit_softcapping": None, "sliding_window": 8,
                "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16},
    "kimi_k3": {"linear_attn_config": {"num_heads": 4, "head_dim": 16, "kda_layers": [1],
                                       "short_conv_kernel_size": 4},
                "num_experts": 4, "num_experts_per_token": 2},
    "llama4": {"num_hidden_layers": 4, "num_experts_per_tok": 1, "num_local_experts": 2, "rope_scaling": None, "attention_chunk_size": 8, "interleave_moe_layer_step": 2,
               "use_qk_norm": True, "intermediate_size_mlp": 64, "attention_bias": False},
    "muse_spark": {"rope_parameters": _ROPE, "num_shared_experts": 0, "mlp_layer_types": None,
                   "layer_types": SW2, "layer_rope_theta": [10000.0, 10000.0]},
    "qwen3_5": {"full_attention_interval": 2, "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
}
TEXT_OVERRIDES["qwen3_5_moe"] = TEXT_OVERRIDES["prism_hadamard_qwen35"] = TEXT_OVERRIDES["qwen3_5"]

# Types whose ModelArgs wraps a text model's config: (field, text model type or None for
# the module's own TextArgs / TextConfig class).
TEXT_CONFIGS = {"gemma3": "gemma3_text", "lfm2-vl": "lfm2", "mistral3": "llama",
                "pixtral": "llama", "qwen2_vl": "qwen2", "qwen3_vl": "qwen3",
                "qwen3_vl_moe": "qwen3_moe", "kimi_vl": "deepseek_v3", "kimi_k25": "deepseek_v3",
                "minimax_m3_vl": None, "gemma4": "gemma4_text"}
# Text config classes by module, for types whose ModelArgs names a class of another module.
TEXT_CLASSES = {"qwen3_5_moe": ("qwen3_5", "TextModelArgs"),
                "prism_hadamard_qwen35": ("qwen3_5", "TextModelArgs")}


def model_types() -> list[str]:
    """Every model type the installed mlx_lm.models holds (one module each)."""
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
                  if m.name not in HELPER_MODULES)


def _placeholder(annotation: str):
    text = annotation.lower()
    for marker, value in (("list", []), ("tuple", []), ("dict", {}), ("bool", False),
                          ("float", 1.0), ("int", 4), ("str", "silu")):
        if marker in text:
            return value
    return 4


def _fill(args_class, model_type: str | None) -> dict:
    fields = {f.name: f for f in dataclasses.fields(args_class)}
    config = {"model_type": model_type} if model_type and "model_type" in fields else {}
    config.update({k: v for k, v in GENERIC.items() if k in fields})
    for name, f in fields.items():
        if name in config or name == "text_config":
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            config[name] = _placeholder(str(f.type))
    return config


def tiny_config(model_type: str) -> dict:
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = _fill(module.ModelArgs, model_type)
    config["model_type"] = model_type
    field_names = {f.name for f in dataclasses.fields(module.ModelArgs)}
    if "text_config" in field_names:
        inner = TEXT_CONFIGS.get(model_type)
        if inner is not None:
            text = tiny_config(inner)
        else:
            where, name = TEXT_CLASSES.get(model_type, (model_type, None))
            holder = importlib.import_module(f"mlx_lm.models.{where}")
            names = (name,) if name else ("TextArgs", "TextConfig", "TextModelArgs")
            text_class = next(getattr(holder, n) for n in names if hasattr(holder, n))
            text = _fill(text_class, model_type)
        config["text_config"] = {**text, **TEXT_OVERRIDES.get(model_type, {})}
    config.update(OVERRIDES.get(model_type, {}))
    return config
