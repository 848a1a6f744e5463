"""Shared test helpers for the engine: a spy proving the paged path ran."""

from __future__ import annotations

import pytest

import engine.attention


@pytest.fixture
def paged_calls(monkeypatch):
    """Counts calls into kernels.attention.paged_attention made by the engine router."""
    calls = []
    original = engine.attention.paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("impl"))
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.attention, "paged_attention", spy)
    return calls
