"""Issue 18: the engine's public surface is pinned, and restore reads as the data flows."""

from __future__ import annotations

import importlib
import inspect

import engine
from tests.surface import assert_surface_pinned

# engine.restore and engine.publish are the functions; these are their modules.
restore_module, publish_module, generate_module = (
    importlib.import_module(f"engine.{name}") for name in ("restore", "publish", "generate"))

SURFACE = ["EngineModel", "KVPolicy", "RestoreRequest", "WriteBehindPublisher",
           "generate_with_store", "publish", "restore"]


def test_the_public_surface_is_pinned():
    assert_surface_pinned(engine, SURFACE)


def test_restore_and_publish_take_the_engine_model_first_and_few_parameters():
    for function in (engine.restore, engine.publish, engine.generate_with_store):
        assert next(iter(inspect.signature(function).parameters)) == "engine_model"
    assert len(inspect.signature(engine.restore).parameters) <= 6
    for module in (restore_module, publish_module, generate_module):
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") and function.__module__ == module.__name__:
                assert len(inspect.signature(function).parameters) <= 6, name
    # one meaning per name: max_tokens is gone from the engine's entry points
    for function in (engine.restore, engine.generate_with_store):
        assert "max_tokens" not in inspect.signature(function).parameters
    assert "max_tokens" not in engine.RestoreRequest.__dataclass_fields__
