"""A package's pinned public surface (issue 18): its __all__ and what a star import gives."""

from __future__ import annotations

from types import ModuleType


def assert_surface_pinned(package: ModuleType, surface: list[str]) -> None:
    """`package.__all__` is `surface`, and `from package import *` gives exactly it."""
    assert sorted(package.__all__) == sorted(surface)
    namespace: dict = {}
    exec(f"from {package.__name__} import *", namespace)  # noqa: S102 - what a star import gives
    assert sorted(k for k in namespace if not k.startswith("__")) == sorted(surface)
