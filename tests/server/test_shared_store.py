"""Two serve-model processes share one `kvstore serve` over HTTP; then the store dies.

One store service (a user token bound to namespace team-a), servers A and B on the same
model. B's first request restores the system prompt that A published. A token for
team-a may not serve another namespace (refused at start-up, exit 6). The store is
killed while B streams an answer: the answer is still the stock one, the lost
publication is counted as failed, and the next lookup is a counted miss.
"""

from __future__ import annotations

import secrets
import subprocess
import time

from tests.server.harness import REPO, kvstore_serve, serve_model
from tests.server.requests import (
    BLOCK,
    REQUESTS,
    chat,
    chat_stream,
    common_prefix,
    prompt_ids,
)

NAMESPACE = "team-a"


def settled(server, timeout_s: float = 20.0) -> dict:
    """/metrics once every queued publication is published, failed or dropped, and
    stayed so for 0.3 s (the answer's own segment is offered just after the response)."""
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        m = server.metrics()
        queued = m.get('kvstore_publish_offers_total{decision="queued"}', 0)
        ended = sum(m.get(f'kvstore_publish_uploads_total{{result="{r}"}}', 0)
                    for r in ("published", "failed", "dropped"))
        if queued == ended:
            if seen == queued:
                return m
            seen = queued
        else:
            seen = None
        time.sleep(0.3)
    raise AssertionError(f"publications did not settle: {m}\n{server.log()}")


def test_two_servers_share_one_store_and_survive_its_death(model_dir, env, stock_answers,
                                                           tmp_path):
    token = secrets.token_hex(16)
    store = kvstore_serve(tmp_path / "store", {**env, "KVSTORE_NAMESPACE": NAMESPACE},
                          tmp_path / "store.log", token)
    # --lookup-min-gain 1: the store is asked even when L1 holds all but a few tokens of
    # a prompt, so the request after the store died does reach it (and fails fast)
    # --lookup-timeout 30s: a loaded CI machine must not turn a hit into a timeout (the
    # dead store below refuses connections at once)
    remote = ["--url", None, "--token", token, "--namespace", NAMESPACE, "--retry-after", "30s",
              "--lookup-min-gain", "1", "--lookup-timeout", "30s"]
    with store:
        remote[1] = store.base_url
        a = serve_model(model_dir, env, tmp_path / "a.log", *remote)
        b = serve_model(model_dir, env, tmp_path / "b.log", *remote)
        with a, b:
            got_a = chat(a, REQUESTS["A"])
            assert got_a["cached"] == 0 and got_a["ids"] == stock_answers["A"]["ids"]
            metrics_a = settled(a)
            queued = metrics_a['kvstore_publish_offers_total{decision="queued"}']
            assert queued >= 2  # the system prompt and the exchange
            assert metrics_a['kvstore_publish_uploads_total{result="published"}'] == queued, a.log()

            ids_a, ids_b = prompt_ids(model_dir, REQUESTS["A"]), prompt_ids(model_dir, REQUESTS["B"])
            shared = common_prefix(ids_a, ids_b)
            got_b = chat_stream(b, REQUESTS["B"])  # B's first request
            assert got_b["cached"] >= shared - BLOCK, b.log()
            assert got_b["text"] == stock_answers["B"]["text"]
            assert b.metrics()['kvstore_l2_lookups_total{outcome="hit"}'] == 1

            # a team-a token does not open another namespace: refused before serving
            denied = subprocess.run(
                [*a.argv[: a.argv.index("--url")], "--url", store.base_url, "--token", token,
                 "--namespace", "team-b"],
                cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            assert denied.returncode == 6, denied.stdout + denied.stderr
            assert "team-b" in denied.stderr

            # the store dies while B streams C: the answer is still stock's
            got_c = chat_stream(b, REQUESTS["C"], after_first_chunk=store.kill)
            assert got_c["text"] == stock_answers["C"]["text"]
            # ... and the next request's lookup fails fast, a miss; the answer is stock's
            start = time.monotonic()
            got_d = chat(a, REQUESTS["D"])
            assert time.monotonic() - start < 10
            assert got_d["ids"] == stock_answers["D"]["ids"]
            metrics_a, metrics_b = a.metrics(), settled(b)
        assert a.proc.returncode == 0 and b.proc.returncode == 0, a.log() + b.log()
    assert metrics_a['kvstore_l2_lookups_total{outcome="error"}'] == 1, a.log()
    assert metrics_a.get('kvstore_l2_lookups_total{outcome="hit"}', 0) == 0
    # C's publication reached a dead store: counted, never raised into generation
    assert metrics_b['kvstore_publish_uploads_total{result="failed"}'] >= 1, b.log()
