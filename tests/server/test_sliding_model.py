"""serve-model on a gemma3-style model (sliding layers: RotatingKVCache) end to end.

The store tier publishes checkpoints at exact segment boundaries (the system prompt,
the whole exchange) and restores the longest one that prefixes a prompt into the
caches mlx-lm's batching merges (RotatingKVCache for the sliding layers, KVCache for
the others). After a restart, the answers are stock mlx_lm.server's, token for token
(tolerance 0), and the system prompt is restored, not recomputed.
"""

from __future__ import annotations

import shutil

import pytest

from tests.server.harness import PATIENT, serve_model, stock_server
from tests.server.requests import (
    BLOCK,
    REQUESTS,
    chat,
    chat_stream,
    common_prefix,
    prompt_ids,
)


@pytest.fixture(scope="module")
def gemma_stock(gemma_dir, env, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "stock-gemma.log"
    with stock_server(gemma_dir, env, log, "--prompt-cache-size", "0") as stock:
        answers = {name: chat(stock, REQUESTS[name]) for name in ("A", "B")}
    assert answers["A"]["ids"] != answers["B"]["ids"], "the fixture model ignores its prompt"
    assert len(set(answers["A"]["ids"])) > 3, f"greedy output degenerated: {answers['A']}"
    return answers


def test_sliding_model_restarts_from_checkpoints_and_answers_as_stock(
        gemma_dir, env, gemma_stock, tmp_path):
    store = tmp_path / "store"
    with serve_model(gemma_dir, env, tmp_path / "first.log", "--store", str(store),
                     *PATIENT) as first:
        cold = chat(first, REQUESTS["A"])
        published = first.metrics()
    assert first.proc.returncode == 0, first.log()
    assert cold["cached"] == 0 and cold["ids"] == gemma_stock["A"]["ids"]
    assert published['kvstore_publish_offers_total{decision="queued"}'] >= 2, first.log()
    assert "store tier (L2) on" in first.log()

    ids_a, ids_b = prompt_ids(gemma_dir, REQUESTS["A"]), prompt_ids(gemma_dir, REQUESTS["B"])
    shared = common_prefix(ids_a, ids_b)
    assert shared > 2 * BLOCK
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    with serve_model(gemma_dir, env, tmp_path / "second.log", "--store", str(copy),
                     *PATIENT) as second:
        got_b = chat_stream(second, REQUESTS["B"])  # L1 is empty: only the store has it
        got_a = chat(second, REQUESTS["A"])
        metrics = second.metrics()
    assert got_b["cached"] >= shared - BLOCK, second.log()
    assert got_b["text"] == gemma_stock["B"]["text"]
    assert got_a["cached"] >= shared - BLOCK, second.log()
    assert got_a["ids"] == gemma_stock["A"]["ids"]
    assert metrics['kvstore_l2_lookups_total{outcome="hit"}'] >= 1
    assert metrics["kvstore_l2_tokens_restored_total"] >= shared - BLOCK
