"""KVPolicy: native by default, exact-model-id overrides, TOML, and no KV precision from
weight quantization."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine import EngineModel, KVPolicy, model_dtype
from engine.errors import InvalidPolicy
from tests.engine.factories import tiny_model

TOML = """
default = "native"
block_size_tokens = 32
rotation = "on"
rotation_seed = 9

[overrides]
"org/model-bf16" = "k8v4"
"org/model-4bit" = "k4v4"
"""


def test_native_is_the_default():
    assert KVPolicy().format_for("anything") == "native"
    assert KVPolicy().format_for(None) == "native"


def test_overrides_match_exact_model_ids_only():
    policy = KVPolicy(overrides={"org/model": "k8v8"})
    assert policy.format_for("org/model") == "k8v8"
    assert policy.format_for("org/model-4bit") == "native"
    assert policy.format_for("org/Model") == "native"
    assert policy.format_for("org") == "native"


def test_toml_text_and_file(tmp_path):
    policy = KVPolicy.from_toml(TOML)
    assert policy.block_size_tokens == 32 and policy.rotation == "on" and policy.rotation_seed == 9
    assert policy.format_for("org/model-bf16") == "k8v4"
    assert policy.format_for("org/model-4bit") == "k4v4"
    path = tmp_path / "kv.toml"
    path.write_text(TOML)
    assert KVPolicy.load(path) == policy
    assert KVPolicy.load(str(path)) == policy


@pytest.mark.parametrize("bad", [
    'default = "k2v2"',
    '[overrides]\n"m" = "int4"',
    'default = "native"\nblock_size = 3',
    'rotation = "maybe"',
    'block_size_tokens = 0',
    'not toml at all ===',
])
def test_bad_policies_are_refused(bad):
    with pytest.raises(InvalidPolicy):
        KVPolicy.from_toml(bad)


def test_weight_quantization_never_selects_kv_precision():
    model = tiny_model("llama", mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4)
    assert model_dtype(model) == mx.bfloat16
    ident = EngineModel(model, "org/model-4bit", policy=KVPolicy()).identity
    assert {layer.page_format for layer in ident.layers} == {"native-bf16"}
    caches = EngineModel(model, "org/model-4bit", policy=KVPolicy()).make_cache()
    assert {c.spec.format.name for c in caches} == {"native-bf16"}
    # only an explicit override for the id picks a packed format
    caches = EngineModel(model, "org/model-4bit", policy=KVPolicy.from_toml(TOML)).make_cache()
    assert {c.spec.format.name for c in caches} == {"k4v4"}
