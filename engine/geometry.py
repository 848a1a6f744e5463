"""Layer geometry of an mlx-lm model, read from the model itself: which caches are paged.

No per-type rules. mlx-lm decides what each layer keeps by the caches its
make_prompt_cache(model) builds; the engine reads that decision and one graph-only
forward pass of one token (probe_geometry), which records what every cache's
update_and_fetch receives: keys [B, kv_heads, L, Dk] and values [B, kv_heads, L, Dv] in
the dtype the model computes K/V in. Nothing is evaluated (no mx.eval), so probing a
large model builds a graph and discards it. The result is cached per model object.

Per cache entry (one per entry of mlx-lm's cache list, not per config layer: models that
share KV across layers build fewer caches, and one entry per cache stores shared KV
once) the engine records:

  kind        "full"     a KVCache the model updates once per token and touches only
                         through its methods: one page per block
              "sliding"  a RotatingKVCache (window = max_size) or a ChunkedKVCache
                         (window = chunk_size, llama4): an attachment
              "state"    an ArraysCache (recurrent state: Mamba, linear attention), or a
                         KVCache the model does not update exactly once per token, or
                         whose keys/values it reads or writes itself (deepseek_v32's
                         indexer cache): an attachment
  cache_class the mlx-lm class name (part of the fingerprint); a sub-cache of a
              CacheList is named by its place, "CacheList[1].KVCache"
  kv_heads, k_head_dim, v_head_dim, window

A CacheList (one model layer keeping several caches: an MLA cache and an indexer cache,
a Mamba state and a KVCache) is flattened into its sub-caches, depth first: each is an
entry of its own, so a full-attention KVCache inside one is paged like any other and
its siblings travel as attachments. leaf_caches(caches) gives that flat list of a
model's cache list, with_leaves(caches, leaves) puts a flat list back in its places.

A cache class outside mlx-lm's registered ones (engine/attachments.py CACHE_CLASSES) is
refused by name (UnsupportedModel), never guessed.

The model fingerprint is blake3 of the canonical config (the model's ModelArgs with
their defaults, when it has them) and the probed geometry, so a model without
model.args (baichuan_m1, plamo2, ...) still gets one, and two configs that build the
same caches differently get different ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import blake3
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from engine.errors import UnsupportedModel

# Config keys mlx-lm ignores but checkpoints carry: they must not change a fingerprint.
_IGNORED_KEYS = ("quantization", "quantization_config", "torch_dtype", "architectures",
                 "transformers_version", "_name_or_path")
_DTYPE_NAMES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}


@dataclass(frozen=True)
class LayerGeometry:
    kind: str  # "full" | "sliding" | "state"
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int = 0  # tokens a sliding layer keeps; 0 otherwise
    cache_class: str = "KVCache"


@dataclass(frozen=True)
class ModelGeometry:
    """What the engine knows of a model's caches, probed once (see the module docstring)."""

    layers: tuple[LayerGeometry, ...]
    kv_dtype: mx.Dtype  # what the model's K/V arrive in (the native page format's dtype)
    config: dict[str, Any]  # canonical config ({} when the model carries none)
    vocab_size: int  # from the probe's logits
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int

    @property
    def fingerprint(self) -> str:
        """blake3 hex of the canonical config and the layer geometry (sorted-key JSON)."""
        text = json.dumps({"config": self.config,
                           "layers": [dataclasses.asdict(g) for g in self.layers]},
                          sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
        return blake3.blake3(text.encode()).hexdigest()


# -- canonical config ----------------------------------------------------------------
def _config_dict(config) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    raise UnsupportedModel(f"a model config is a dict or a ModelArgs, not {type(config).__name__}")


def _canonical(data: dict) -> dict[str, Any]:
    data = {k: v for k, v in data.items() if k not in _IGNORED_KEYS}
    return json.loads(json.dumps(data, sort_keys=True, default=str))


def model_type_of(config) -> str:
    model_type = _config_dict(config).get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedModel("the model config has no model_type")
    return model_type


@lru_cache(maxsize=64)
def _classes(config_json: str):
    # mlx-lm's own lookup (its MODEL_REMAPPING included), so a config resolves to the
    # code mlx_lm.load would run. Keyed by the config's JSON.
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(json.loads(config_json))
    except ValueError as exc:
        raise UnsupportedModel(str(exc)) from exc


def canonical_config(config) -> dict[str, Any]:
    """The config as the model code sees it: ModelArgs fields with their defaults (keys
    mlx-lm ignores dropped, so weight quantization cannot leak into the KV format)."""
    data = _config_dict(config)
    if isinstance(config, dict):
        model_type_of(data)
        _, args_class = _classes(json.dumps(data, sort_keys=True, default=str))
        data = dataclasses.asdict(_args(args_class, data))
    return _canonical(data)


def _model_config(model: nn.Module) -> dict[str, Any]:
    """The canonical config an mlx-lm model carries (as .args or .config), or {}."""
    for name in ("args", "config"):
        value = getattr(model, name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return _canonical(dataclasses.asdict(value))
    return {}


# -- the probe -----------------------------------------------------------------------
_PROBES: dict[int, tuple[weakref.ref, ModelGeometry]] = {}


def probe_geometry(model: nn.Module) -> ModelGeometry:
    """The model's geometry, probed once per model object (module docstring)."""
    hit = _PROBES.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    geometry = _probe(model, _model_config(model))
    key = id(model)
    _PROBES[key] = (weakref.ref(model, lambda _: _PROBES.pop(key, None)), geometry)
    return geometry


def leaf_caches(caches) -> list:
    """A model's cache list with every CacheList replaced by its sub-caches, depth first:
    one entry per LayerGeometry of the model (the module docstring)."""
    out = []
    for cache in caches:
        if isinstance(cache, CacheList):
            out.extend(leaf_caches(cache.caches))
        else:
            out.append(cache)
    return out


def with_leaves(caches, leaves) -> list:
    """caches (a model's cache list) with its leaves (leaf_caches order) replaced by
    `leaves`; each CacheList keeps its identity and gets the new sub-caches. Returns the
    top-level list (a new list; the CacheLists are updated in place)."""
    leaves = list(leaves)
    at = 0

    def place(items):
        nonlocal at
        out = []
        for cache in items:
            if isinstance(cache, CacheList):
                cache.caches = tuple(place(cache.caches))
                out.append(cache)
            else:
                out.append(leaves[at])
                at += 1
        return out

    result = place(caches)
    assert at == len(leaves), f"{len(leaves)} leaves for a cache list of {at}"
    return result


def _leaf_names(caches) -> list[str]:
    """cache_class per leaf: the class name, a CacheList's k-th sub-cache prefixed
    "CacheList[k]." (nested ones repeat it)."""
    names = []
    for cache in caches:
        if isinstance(cache, CacheList):
            names.extend(f"CacheList[{k}].{name}" for k, child in enumerate(cache.caches)
                         for name in _leaf_names([child]))
            continue
        names.append(type(cache).__name__)
    return names


def _own_code(cls) -> set:
    """The code objects of cls's own methods and properties (and its bases' in mlx-lm):
    an access to keys/values from anywhere else is the model's own."""
    codes = set()
    for klass in cls.__mro__:
        for value in vars(klass).values():
            for fn in ((value.fget, value.fset) if isinstance(value, property) else
                       (getattr(value, "__func__", value),)):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    codes.add(code)
    return codes


class _WatchedKVCache(KVCache):
    """A probe's KVCache that records whether anything outside KVCache's own methods
    reads or writes its keys or values (a PagedKVCache holds neither)."""

    _OWN = None

    def __getattribute__(self, name):
        if name in ("keys", "values"):
            _WatchedKVCache._note(self)
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        if name in ("keys", "values"):
            _WatchedKVCache._note(self)
        object.__setattr__(self, name, value)

    @staticmethod
    def _note(cache) -> None:
        if _WatchedKVCache._OWN is None:
            _WatchedKVCache._OWN = _own_code(KVCache)
        if sys._getframe(2).f_code not in _WatchedKVCache._OWN:
            object.__setattr__(cache, "_touched", True)


def _probe(model: nn.Module, config: dict) -> ModelGeometry:
    top = make_prompt_cache(model)
    caches = leaf_caches(top)
    names = _leaf_names(top)
    calls: dict[int, list[tuple]] = {}

    def record(cache):
        original = getattr(cache, "update_and_fetch", None)
        if original is None:
            return
        if type(cache) is KVCache:
            cache.__class__ = _WatchedKVCache  # this probe's caches only
            object.__setattr__(cache, "_touched", False)

        def update_and_fetch(keys, values, *args, **kwargs):
            calls.setdefault(id(cache), []).append(
                (tuple(keys.shape), tuple(values.shape), keys.dtype))
            return original(keys, values, *args, **kwargs)

        object.__setattr__(cache, "update_and_fetch", update_and_fetch)

    for cache in caches:
        record(cache)
    try:
        logits = model(mx.array([[0]], dtype=mx.int32), cache=top)
    except Exception as exc:  # the model's own error, named
        raise UnsupportedModel(f"a one-token forward of the model failed: "
                               f"{type(exc).__name__}: {exc}") from exc
    layers = tuple(_layer(index, cache, calls.get(id(cache), []), name)
                   for index, (cache, name) in enumerate(zip(caches, names, strict=True)))
    dtypes = [c[0][2] for c in calls.values() if c]
    full = [calls[id(c)][0][2] for c, g in zip(caches, layers) if g.kind == "full"]
    kv_dtype = (full or dtypes or [_parameter_dtype(model)])[0]
    kv_heads = max([g.kv_heads for g in layers] or [1]) or 1
    hidden = _first_int(config, ("hidden_size", "d_model", "n_embd", "dim")) or _embed_dim(model)
    return ModelGeometry(
        layers, kv_dtype, config, vocab_size=int(logits.shape[-1]), hidden_size=hidden,
        num_attention_heads=_first_int(config, ("num_attention_heads", "n_head", "n_heads"))
        or kv_heads,
        intermediate_size=_first_int(config, ("intermediate_size", "ffn_dim",
                                              "moe_intermediate_size")) or 4 * hidden)


def _layer(index: int, cache, calls: list[tuple], name: str) -> LayerGeometry:
    heads = k_dim = v_dim = 0
    if calls and len(calls[0][0]) == 4 and len(calls[0][1]) == 4:
        (_, heads, _, k_dim), (_, _, _, v_dim), _ = calls[0]
    if isinstance(cache, _WatchedKVCache):
        once = len(calls) == 1 and calls[0][0][0] == 1 and calls[0][0][2] == 1 and heads
        if once and not object.__getattribute__(cache, "_touched"):
            return LayerGeometry("full", heads, k_dim, v_dim, 0, name)
        return LayerGeometry("state", heads, k_dim, v_dim, 0, name)
    if type(cache) is RotatingKVCache:
        return LayerGeometry("sliding", heads, k_dim, v_dim, int(cache.max_size), name)
    if type(cache) is ChunkedKVCache:
        return LayerGeometry("sliding", heads, k_dim, v_dim, int(cache.chunk_size), name)
    if type(cache) is ArraysCache:
        return LayerGeometry("state", heads, k_dim, v_dim, 0, name)
    raise UnsupportedModel(
        f"cache {index} ({name}) is a {type(cache).__module__}.{type(cache).__name__}, "
        "which the engine does not know how to store: only mlx-lm's KVCache, "
        "RotatingKVCache, ChunkedKVCache, ArraysCache and CacheList of them are "
        "registered (engine/attachments.py)")


def _first_int(config: dict, names) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _embed_dim(model: nn.Module) -> int:
    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            return int(module.weight.shape[-1])
    return 0


def _parameter_dtype(model: nn.Module) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if value.dtype in _DTYPE_NAMES:
            return value.dtype
    return mx.float32


# -- config-only entry points ----------------------------------------------------------
@lru_cache(maxsize=32)
def _config_geometry(config_json: str) -> ModelGeometry:
    # A model built from the config but never evaluated: its weights are lazy random
    # arrays, so building and probing it allocates no weights.
    data = json.loads(config_json)
    model_class, args_class = _classes(config_json)
    args = _args(args_class, data)
    try:
        model = model_class(args)
    except Exception as exc:
        raise UnsupportedModel(f"the config does not build a {data['model_type']} model: "
                               f"{type(exc).__name__}: {exc}") from exc
    return _probe(model, _canonical(dataclasses.asdict(args)))


def _args(args_class, data: dict):
    try:
        return args_class.from_dict(data)
    except (TypeError, ValueError, KeyError) as exc:
        raise UnsupportedModel(f"the config is not a {data.get('model_type')} config: "
                               f"{exc}") from exc


def geometry_of(source) -> ModelGeometry:
    """The geometry of a model, or of a config (dict or ModelArgs) through a lazily
    built, never evaluated model of that config."""
    if isinstance(source, nn.Module):
        return probe_geometry(source)
    data = _config_dict(source)
    model_type_of(data)
    return _config_geometry(json.dumps(data, sort_keys=True, default=str))


def layer_geometry(source) -> list[LayerGeometry]:
    """One LayerGeometry per entry of mlx-lm's cache list, in order."""
    return list(geometry_of(source).layers)


def model_fingerprint(source) -> str:
    """blake3 hex of the canonical config and the probed geometry. It covers the
    architecture, not the weights: the model id names the weights."""
    return geometry_of(source).fingerprint


def dtype_name(dtype: mx.Dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))
