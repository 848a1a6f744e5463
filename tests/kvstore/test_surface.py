"""Issue 18: kvstore's public surface is pinned, and it carries no MLX."""

from __future__ import annotations

import subprocess
import sys

import kvstore
from tests.surface import assert_surface_pinned

SURFACE = ["FormatIdentity", "IncompatibleFormat", "IntegrityError", "InvalidInput",
           "KVStoreError", "LayerSpec", "NotFound", "RemoteStore", "Store", "StoreCorrupt",
           "StoreFull", "blocks_for_tokens"]


def test_the_public_surface_is_pinned():
    assert_surface_pinned(kvstore, SURFACE)


def test_the_surface_names_the_real_classes():
    from kvstore.client import RemoteStore
    from kvstore.records import blocks_for_tokens
    from kvstore.store import Store
    assert (kvstore.Store, kvstore.RemoteStore, kvstore.blocks_for_tokens) == (
        Store, RemoteStore, blocks_for_tokens)


def test_importing_the_surface_loads_no_mlx():
    code = "import sys, kvstore; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
