"""Routing mlx-lm attention through the paged kernels.

mlx-lm model modules call `scaled_dot_product_attention(queries, keys, values, cache=...,
scale=..., mask=...)`, a global each module imported from mlx_lm.models.base. A cache
never sees queries, so install(model) replaces that global, in every module the
model's classes come from, by a router:

  cache is a PagedKVCache   kernels.attention.paged_attention over the cache's pool
                            planes and block table (queries are rotated, packed pages
                            read, inside the kernels)
  anything else             the original function, unchanged

The patch is reference counted per module, so nested installs and several models that
share a module undo cleanly: uninstall(model) restores the original once the last
install of that module is gone. `installed(model)` is the context-manager form.

Which implementation attends is the cache's `attention_impl`: "reference" (gather,
dequantize, mx.fast.scaled_dot_product_attention: the numerical control, bit-exact with
mlx-lm's KVCache for native pages), "partitioned", "cuda", "metal", or None for the
kernels' own dispatch, as resolved when the cache was made (`cache.default_impl`:
$KVSTORE_ATTENTION_IMPL, else the device's kernel), with the cache's `tuning`.

GATHERED ("gathered") is not a kernel: the router passes such a cache through to the
model's own attention, which gets the decoded history from update_and_fetch. Models
whose attention does more with the fetched K/V than hand them to this global (MLA
computes on the latent, phi inspects keys.dtype, gemma2 soft-caps, plamo2 calls
mx.fast directly) are served that way; engine.models.check_paged_attention decides per
model, once, at load time.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import mlx.nn as nn

from engine.cache import ROUTED_MODULES, PagedKVCache
from kernels.attention import paged_attention

_PATCHED_NAME = "scaled_dot_product_attention"
GATHERED = "gathered"  # attention_impl of a paged cache the model attends over itself
_kernel_attention = paged_attention  # the load-time check's calls bypass any test spy
_lock = threading.Lock()
_originals: dict[str, object] = {}  # module name -> its original function while patched
_installs: dict[int, list[str]] = {}  # id(model) -> module names it patched, in order


class _Checking(threading.local):
    active = False
    calls = 0


_checking = _Checking()


@contextlib.contextmanager
def checking():
    """Inside: the router's calls are the load-time check's, not the served model's
    (they go to the kernels directly, past anything that wraps paged_attention).
    Yields a function returning how many calls the router made so far."""
    _checking.active, _checking.calls = True, 0
    try:
        yield lambda: _checking.calls
    finally:
        _checking.active = False


def attend(cache: PagedKVCache, queries, *, scale: float, mask=None, sinks=None):
    """queries [1, Hq, L, Dk] (unrotated, model dtype) -> [1, Hq, L, Dv] over the cache."""
    kernel = paged_attention
    if _checking.active:
        kernel, _checking.calls = _kernel_attention, _checking.calls + 1
    return kernel(queries, cache.pool.planes, cache.block_table(), [cache.offset],
                  cache.spec.layout, scale=scale, mask=mask, sinks=sinks,
                  impl=cache.attention_impl or cache.default_impl, tuning=cache.tuning,
                  fresh=cache.take_fresh_tokens(queries.shape[2]))


def _router(original):
    def scaled_dot_product_attention(queries, keys, values, *args, **kwargs):
        cache = kwargs.get("cache", args[0] if args else None)
        if isinstance(cache, PagedKVCache) and cache.attention_impl != GATHERED:
            scale = kwargs["scale"] if "scale" in kwargs else args[1]
            mask = kwargs.get("mask", args[2] if len(args) > 2 else None)
            sinks = kwargs.get("sinks", args[3] if len(args) > 3 else None)
            return attend(cache, queries, scale=scale, mask=mask, sinks=sinks)
        return original(queries, keys, values, *args, **kwargs)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention._engine_router = True
    return scaled_dot_product_attention


def model_modules(model: nn.Module) -> list[str]:
    """Names of the modules defining the model's classes that hold the attention global."""
    names = []
    for module in [model, *(m for _, m in model.named_modules())]:
        name = type(module).__module__
        if name not in names and hasattr(sys.modules.get(name), _PATCHED_NAME):
            names.append(name)
    return names


def install(model: nn.Module) -> list[str]:
    """Route the model's attention through the engine; returns the patched module names."""
    with _lock:
        names = model_modules(model)
        for name in names:
            if name not in ROUTED_MODULES:
                module = sys.modules[name]
                _originals[name] = getattr(module, _PATCHED_NAME)
                setattr(module, _PATCHED_NAME, _router(_originals[name]))
            ROUTED_MODULES[name] = ROUTED_MODULES.get(name, 0) + 1
        _installs.setdefault(id(model), []).append(",".join(names))
        return names


def uninstall(model: nn.Module) -> None:
    """Undo the latest install(model). A model never installed is a no-op."""
    with _lock:
        stack = _installs.get(id(model))
        if not stack:
            return
        names = [n for n in stack.pop().split(",") if n]
        if not stack:
            del _installs[id(model)]
        for name in names:
            ROUTED_MODULES[name] -= 1
            if ROUTED_MODULES[name] == 0:
                del ROUTED_MODULES[name]
                setattr(sys.modules[name], _PATCHED_NAME, _originals.pop(name))


def is_installed(model: nn.Module) -> bool:
    return bool(_installs.get(id(model)))


@contextlib.contextmanager
def installed(model: nn.Module):
    """with installed(model): ... attends paged layers through the engine."""
    install(model)
    try:
        yield model
    finally:
        uninstall(model)
