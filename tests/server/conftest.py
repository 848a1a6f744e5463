"""Fixtures: model directories built offline (tests/server/model_dir.py) and a scratch
HF_HOME with hub/ in it (stock mlx_lm.server's /v1/models scans the hub cache)."""

from __future__ import annotations

import pytest

from tests.server.harness import server_env, stock_server
from tests.server.model_dir import build_model_dir
from tests.server.requests import REQUESTS, chat


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
def gemma_dir(tmp_path_factory):
    """A gemma3-style model: layers 0 and 2 slide (RotatingKVCache of 64 tokens, so the
    fixture prompts rotate the ring), layers 1 and 3 are full attention (KVCache)."""
    return build_model_dir(tmp_path_factory.mktemp("models") / "tiny-gemma3",
                           model_type="gemma3_text", num_layers=4, head_dim=16)


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory):
    """Same config and tokenizer as model_dir, other random weights."""
    return build_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama", seed=1)


@pytest.fixture(scope="session")
def other_tokenizer_dir(tmp_path_factory):
    """Same weights (seed) and config as model_dir, a tokenizer trained on another corpus
    of the same vocabulary size."""
    return build_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer_seed=1)


@pytest.fixture(scope="session")
def stock_answers(model_dir, env, tmp_path_factory):
    """What stock mlx_lm.server answers to each of REQUESTS, with its prompt cache off
    (--prompt-cache-size 0): every answer recomputed from the whole prompt, the
    reference that a restored answer must equal."""
    log = tmp_path_factory.mktemp("logs") / "stock.log"
    with stock_server(model_dir, env, log, "--prompt-cache-size", "0") as stock:
        answers = {name: chat(stock, msgs) for name, msgs in REQUESTS.items()}
    assert answers["A"]["ids"] != answers["B"]["ids"], "the fixture model ignores its prompt"
    assert len(set(answers["A"]["ids"])) > 3, f"greedy output degenerated: {answers['A']}"
    return answers
