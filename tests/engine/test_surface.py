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


def _engine_functions():
    """Every function engine's modules define, and every method of the classes they
    define, by qualified name."""
    import pkgutil

    for info in pkgutil.walk_packages(engine.__path__, prefix="engine."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value):
                yield f"{module.__name__}.{name}", value
            elif inspect.isclass(value):
                for attr, member in vars(value).items():
                    member = getattr(member, "__func__", member)  # static/class methods
                    if inspect.isfunction(member):
                        yield f"{module.__name__}.{name}.{attr}", member


def test_model_id_passes_through_at_most_two_signatures():
    """Issue 18: EngineModel binds the model id once; only it and format_identity (which
    writes the id into the identity) take one."""
    functions = dict(_engine_functions())
    assert "engine.models.make_cache" in functions  # the walk sees functions and methods
    assert "engine.admission.AdmissionController.make_pools" in functions
    taking = sorted(name for name, function in functions.items()
                    if "model_id" in inspect.signature(function).parameters)
    assert taking == ["engine.engine_model.EngineModel.__init__",
                      "engine.formats.format_identity"]
