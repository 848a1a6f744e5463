"""Fixtures: model directories built offline (tests/server/model_dir.py) and a scratch
HF_HOME with hub/ in it (stock mlx_lm.server's /v1/models scans the hub cache)."""

from __future__ import annotations

import pytest

from tests.server.harness import server_env
from tests.server.model_dir import build_model_dir


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    (home / "hub").mkdir()
    return home


@pytest.fixture(scope="session")
def env(hf_home):
    return server_env(hf_home)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory):
    """Same config and tokenizer as model_dir, other random weights."""
    return build_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama", seed=1)


@pytest.fixture(scope="session")
def other_tokenizer_dir(tmp_path_factory):
    """Same weights (seed) and config as model_dir, a tokenizer trained on another corpus
    of the same vocabulary size."""
    return build_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer_seed=1)
