"""`kvstore serve-model` end to end: subprocesses on 127.0.0.1, the official openai client.

The reference is a stock mlx_lm.server on the same model directory, asked the same
requests at temperature 0: serve-model's answers must be the same tokens (ids, from
logprobs), cold and after a restart that restores the prompt from the store. Tolerance
for the token ids: 0 (equal lists).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.server.harness import PATIENT, serve_model
from tests.server.requests import (
    BLOCK,
    REQUESTS,
    chat,
    chat_stream,
    common_prefix,
    prompt_ids,
)

REQUEST_A, REQUEST_B = REQUESTS["A"], REQUESTS["B"]


@pytest.fixture(scope="module")
def published_store(model_dir, env, tmp_path_factory, stock_answers):
    """A store that one serve-model run filled (request A, cold), then stopped."""
    root = tmp_path_factory.mktemp("published")
    store = root / "store"
    server = serve_model(model_dir, env, root / "first.log", "--store", str(store), *PATIENT)
    with server:
        cold = chat(server, REQUEST_A)
        metrics = server.metrics()
    assert server.proc.returncode == 0, server.log()
    return {"store": store, "cold": cold, "metrics": metrics, "log": server.log()}


def test_cold_answer_equals_stock_and_is_published(published_store, stock_answers):
    cold, metrics = published_store["cold"], published_store["metrics"]
    assert cold["cached"] == 0
    assert cold["ids"] == stock_answers["A"]["ids"]
    assert cold["text"] == stock_answers["A"]["text"]
    # the system segment and the whole exchange (assistant) were offered and queued
    assert metrics['kvstore_publish_offers_total{decision="queued"}'] >= 2
    assert metrics['kvstore_l2_lookups_total{outcome="miss"}'] == 1
    assert "prompt " in published_store["log"] and "computed" in published_store["log"]


def test_restart_restores_from_the_store_and_answers_as_stock(
        published_store, stock_answers, model_dir, env, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(published_store["store"], store)
    ids_a, ids_b = prompt_ids(model_dir, REQUEST_A), prompt_ids(model_dir, REQUEST_B)
    shared = common_prefix(ids_a, ids_b)
    assert shared > 2 * BLOCK, "the requests share too short a prefix to test anything"
    with serve_model(model_dir, env, tmp_path / "second.log", "--store", str(store), *PATIENT) as server:
        # B first: L1 is empty, so only the store can know its system prompt
        got_b = chat_stream(server, REQUEST_B)
        got_a = chat(server, REQUEST_A)
        metrics = server.metrics()
    assert got_b["prompt_tokens"] == len(ids_b)
    assert got_b["cached"] >= shared - BLOCK, server.log()
    assert got_b["text"] == stock_answers["B"]["text"]
    assert got_a["cached"] >= len(ids_a) - BLOCK, server.log()
    assert got_a["ids"] == stock_answers["A"]["ids"]
    assert metrics['kvstore_l2_lookups_total{outcome="hit"}'] >= 1
    assert metrics["kvstore_l2_tokens_restored_total"] >= shared - BLOCK
    assert metrics["kvstore_l2_bytes_read_total"] > 0


@pytest.mark.parametrize("which", ["weights", "tokenizer"])
def test_another_model_or_tokenizer_never_hits(which, published_store, stock_answers, model_dir,
                                               other_weights_dir, env, tmp_path):
    """Same directory name (so the same default namespace) and the same prompt token ids:
    only the identity (weights digest, tokenizer fingerprint) keeps the pages apart."""
    if which == "weights":
        other = other_weights_dir
    else:  # same tokenizer.json, so the same ids; another tokenizer_config.json
        other = tmp_path / "tiny-llama"
        shutil.copytree(model_dir, other)
        config = json.loads((other / "tokenizer_config.json").read_text())
        config["model_max_length"] = 8192
        (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert prompt_ids(other, REQUEST_A) == prompt_ids(model_dir, REQUEST_A)
    store = tmp_path / "store"
    shutil.copytree(published_store["store"], store)
    with serve_model(other, env, tmp_path / "other.log", "--store", str(store), *PATIENT) as server:
        got = chat(server, REQUEST_A)
        metrics = server.metrics()
    assert got["cached"] == 0, server.log()
    assert metrics.get('kvstore_l2_lookups_total{outcome="hit"}', 0) == 0
    assert metrics['kvstore_l2_lookups_total{outcome="miss"}'] == 1
    if which == "tokenizer":
        assert got["ids"] == stock_answers["A"]["ids"]  # same weights: same answer, computed
