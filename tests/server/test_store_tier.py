"""StoreTier and the mlx-lm hook check, in process: policy, identity, bounded misses."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.policy import KVPolicy
from engine.serving.identity import fingerprint_model
from engine.serving.mlx_server import UnsupportedMlxLm, check_mlx_lm
from engine.serving.prompt_cache import ServingMetrics
from engine.serving.store_cache import ServingSettings, StoreTier
from kvstore.store import Store

BLOCK = 16
POLICY = KVPolicy(block_size_tokens=BLOCK)


@pytest.fixture(scope="module")
def loaded(model_dir):
    model, tokenizer = load(str(model_dir))
    return model, fingerprint_model(model_dir)


def prefill(model, tokens):
    """KVCaches holding `tokens`, computed by the model in one pass."""
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def tier_for(loaded, store, fingerprint=None, **settings):
    model, default = loaded
    settings.setdefault("policy", POLICY)
    return StoreTier(model, fingerprint or default, store, store,
                     ServingSettings(namespace="test", **settings), ServingMetrics())


def look(tier, tokens, l1_tokens, l1_hint=None):
    """What a request goes through: the prefetch (HTTP handler thread) with what L1 held
    on arrival, then the lookup (generation thread) with what L1 gives when served."""
    tier.prefetch(tokens, l1_tokens if l1_hint is None else l1_hint)
    return tier.lookup(tokens, l1_tokens)


TOKENS = [(7 * i + 11) % 300 + 6 for i in range(70)]  # 70 tokens: 4 full blocks + 6


@pytest.fixture
def caches(loaded):
    """The model's KVCaches holding TOKENS, fresh for each test."""
    return prefill(loaded[0], TOKENS)


def test_published_prefix_restores_bit_exact(loaded, tmp_path):
    model, _ = loaded
    with Store(tmp_path / "s") as store:
        tier = tier_for(loaded, store)
        caches = prefill(model, TOKENS)
        assert tier.offer(TOKENS, caches, "system") == "queued"
        assert tier.publisher.drain(10)
        assert tier.publisher.stats()["published"] == 1
        fresh = tier_for(loaded, store)  # another process: nothing remembered
        prompt = TOKENS + [9, 10, 11]
        got = look(fresh, prompt, l1_tokens=0)
        assert got.outcome == "hit" and got.tokens == len(TOKENS)
        assert got.bytes_read > 0
        for restored, computed in zip(got.cache, caches, strict=True):
            assert restored.offset == computed.offset
            k1, v1 = restored.keys[..., : restored.offset, :], restored.values[..., : restored.offset, :]
            k2, v2 = computed.keys[..., : computed.offset, :], computed.values[..., : computed.offset, :]
            assert mx.array_equal(k1, k2).item() and mx.array_equal(v1, v2).item()  # tolerance 0
        # leaves at least one token to compute, and never beats a longer L1 match
        assert look(fresh, TOKENS, l1_tokens=0).tokens == 4 * BLOCK
        assert look(fresh, prompt, l1_tokens=len(TOKENS)).outcome == "shorter"
        # with an L1 match, the store must add a block (min gain) to be worth re-reading
        assert look(fresh, prompt, l1_tokens=len(TOKENS) - BLOCK).outcome == "hit"
        assert look(fresh, prompt, l1_tokens=len(TOKENS) - BLOCK + 1).outcome == "shorter"
        eager = tier_for(loaded, store, lookup_min_gain_tokens=1)
        assert look(eager, prompt, l1_tokens=len(TOKENS) - 1).outcome == "hit"
        eager.close(1)
        tier.close(5)
        fresh.close(5)


def test_policy_segment_types_min_length_second_sighting_budget(loaded, caches, tmp_path):
    with Store(tmp_path / "s") as store:
        tier = tier_for(loaded, store, publish_segments=("system",), publish_min_tokens=40,
                        publish_on_second_sighting=True)
        assert tier.offer(TOKENS, caches, "assistant") == "skipped_type"
        assert tier.offer(TOKENS[:39], caches, "system") == "skipped_short"
        assert tier.offer(TOKENS, caches, "system") == "skipped_first_sighting"
        assert tier.offer(TOKENS, caches, "system") == "queued"
        assert tier.offer(TOKENS, caches, "system") == "skipped_known"
        tier.close(10)
        one_block = tier.identity.block_nbytes(BLOCK)
        budget = tier_for(loaded, store, namespace_budget_nbytes=3 * one_block)
        assert budget.offer(TOKENS[:40], caches, "user") == "queued"       # 3 blocks' bytes
        assert budget.offer(TOKENS[:50], caches, "user") == "skipped_budget"
        budget.close(10)
        # the default minimum is one block
        default = tier_for(loaded, store)
        assert default.offer(TOKENS[: BLOCK - 1], caches, "user") == "skipped_short"
        default.close(1)


def test_image_placeholders_are_neither_looked_up_nor_published(loaded, caches, tmp_path):
    """mlx-lm keys a prompt with images by negative ids per image: not KV of text."""
    with Store(tmp_path / "s") as store:
        tier = tier_for(loaded, store)
        with_image = [-5] * 3 + TOKENS[3:]
        assert tier.offer(with_image, caches, "user") == "skipped_images"
        assert look(tier, with_image, l1_tokens=0).outcome == "off"
        assert look(tier, TOKENS, l1_tokens=0).outcome == "miss"  # the store still serves
        tier.close(1)


def test_another_tokenizer_fingerprint_never_hits(loaded, caches, tmp_path):
    _, fingerprint = loaded
    with Store(tmp_path / "s") as store:
        tier = tier_for(loaded, store)
        tier.offer(TOKENS, caches, "system")
        assert tier.publisher.drain(10)
        other = type(fingerprint)(fingerprint.name, fingerprint.weights_digest, "0" * 64)
        stranger = tier_for(loaded, store, fingerprint=other)
        assert stranger.identity.format_id != tier.identity.format_id
        assert look(stranger, TOKENS + [1], l1_tokens=0).outcome == "miss"
        assert look(tier_for(loaded, store), TOKENS + [1], l1_tokens=0).outcome == "hit"
        tier.close(1)


class _SlowStore:
    def __init__(self, delay_s):
        self.delay_s, self.calls = delay_s, 0

    def chain_salt(self, namespace):
        return None

    def lookup_prefix(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)
        raise AssertionError("a lookup past its deadline must not be used")


class _BrokenStore:
    def chain_salt(self, namespace):
        raise ConnectionRefusedError("store is down")

    def lookup_prefix(self, *args, **kwargs):
        raise ConnectionRefusedError("store is down")


def test_slow_store_is_a_bounded_miss_then_skipped(loaded):
    slow = _SlowStore(2.0)
    tier = tier_for(loaded, slow, lookup_timeout_s=0.2, retry_after_s=30)
    start = time.monotonic()
    waited = tier.prefetch(TOKENS, 0)  # the handler thread waits, boundedly
    assert 0.15 < waited < 1.0 and time.monotonic() - start < 1.0
    start = time.monotonic()
    assert tier.lookup(TOKENS, l1_tokens=0).outcome == "timeout"
    assert time.monotonic() - start < 0.05  # the generation thread does not wait
    start = time.monotonic()
    assert look(tier, TOKENS, l1_tokens=0).outcome == "skipped"
    assert time.monotonic() - start < 0.05 and slow.calls == 1
    tier.close(0.1)


def test_generation_thread_never_waits_on_the_store(loaded):
    """fetch_nearest_cache's lookup takes a prefetched result or misses at once: with a
    store that takes 2 s, a prompt nobody prefetched costs the generation thread
    nothing and the store is not asked (it used to wait up to the lookup timeout)."""
    slow = _SlowStore(2.0)
    tier = tier_for(loaded, slow, lookup_timeout_s=1.5)
    start = time.monotonic()
    assert tier.lookup(TOKENS, l1_tokens=0).outcome == "unprefetched"
    assert time.monotonic() - start < 0.1 and slow.calls == 0
    tier.close(0.1)


def test_prefetch_skips_page_reads_l1_holds_and_reports_stale(loaded, caches, tmp_path):
    """The prefetch reads pages only when they beat what L1 held on arrival; if L1 drops
    the prefix before the request is served, the request is a counted miss ("stale")."""
    with Store(tmp_path / "s") as store:
        tier = tier_for(loaded, store)
        tier.offer(TOKENS, caches, "system")
        assert tier.publisher.drain(10)
        fresh = tier_for(loaded, store)
        prompt = TOKENS + [9]
        assert look(fresh, prompt, l1_tokens=0, l1_hint=len(TOKENS)).outcome == "stale"
        assert look(fresh, prompt, l1_tokens=len(TOKENS), l1_hint=0).outcome == "shorter"
        assert look(fresh, prompt, l1_tokens=0, l1_hint=0).outcome == "hit"
        tier.close(1)
        fresh.close(1)


def test_l1_hint_is_what_fetch_nearest_cache_takes(loaded):
    """TwoTierPromptCache.l1_tokens_hint (read on handler threads) follows L1's rule."""
    from engine.serving.prompt_cache import TwoTierPromptCache

    model, _ = loaded
    l1 = TwoTierPromptCache(10, resolve_tier=lambda key: None, metrics=ServingMetrics())
    l1.insert_cache("m", TOKENS[:40], prefill(model, TOKENS[:40]), cache_type="system")
    l1.insert_cache("m", TOKENS, prefill(model, TOKENS), cache_type="assistant")
    prompts = [TOKENS[:40], TOKENS[:50], TOKENS, TOKENS + [1, 2], TOKENS[:30] + [1, 2], [1, 2, 3],
               TOKENS[:45] + [3]]
    for prompt in prompts:
        hint = l1.l1_tokens_hint("m", prompt)
        _, rest = l1.fetch_nearest_cache("m", prompt)
        assert hint == len(prompt) - len(rest), prompt
    assert l1.l1_tokens_hint("other", TOKENS) == 0


def test_failing_store_is_a_miss(loaded):
    tier = tier_for(loaded, _BrokenStore(), retry_after_s=0)
    assert look(tier, TOKENS, l1_tokens=0).outcome == "error"
    assert look(tier, TOKENS, l1_tokens=0).outcome == "error"  # retried: retry_after 0
    tier.close(0.1)


def test_check_mlx_lm_refuses_other_versions_and_changed_hooks(monkeypatch):
    import mlx_lm
    import mlx_lm.server as server

    assert check_mlx_lm() is server
    monkeypatch.setattr(mlx_lm, "__version__", "0.33.0")
    with pytest.raises(UnsupportedMlxLm, match=r"supports mlx-lm >=0.32.2,<0.33.0"):
        check_mlx_lm()
    monkeypatch.setattr(mlx_lm, "__version__", "0.32.2")

    def fetch_nearest_cache(self, tokens, model):  # arguments swapped
        raise AssertionError

    monkeypatch.setattr(server.LRUPromptCache, "fetch_nearest_cache", fetch_nearest_cache)
    with pytest.raises(UnsupportedMlxLm, match="LRUPromptCache.fetch_nearest_cache"):
        check_mlx_lm()


def test_serve_model_exits_2_on_an_unsupported_mlx_lm(monkeypatch, model_dir, tmp_path):
    import mlx_lm
    from typer.testing import CliRunner

    from tools.cli import app

    monkeypatch.setattr(mlx_lm, "__version__", "0.31.0")
    result = CliRunner().invoke(app, ["serve-model", "--model", str(model_dir),
                                      "--store", str(tmp_path / "s")])
    assert result.exit_code == 2, result.output
    assert "supports mlx-lm" in result.output
    assert not (tmp_path / "s").exists()  # refused before anything was opened


@pytest.mark.parametrize("args, message", [
    (["--namespace", "no spaces allowed"], "bad namespace"),
    (["--publish-segments", "system,tool"], "unknown segment types"),
    (["--lookup-timeout", "0s"], "lookup_timeout_s must be > 0"),
])
def test_serve_model_exits_2_on_bad_settings(args, message, model_dir, tmp_path):
    from typer.testing import CliRunner

    from tools.cli import app

    result = CliRunner().invoke(app, ["serve-model", "--model", str(model_dir),
                                      "--store", str(tmp_path / "s"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("flag", [["--kv-bits", "8"], ["--kv-bits=4"]])
def test_serve_model_refuses_kv_bits_before_opening_anything(flag, model_dir, tmp_path):
    """A restored prefix would be quantized at another offset than a recompute: refused
    with the reason, exit 2, nothing opened."""
    from typer.testing import CliRunner

    from tools.cli import app

    result = CliRunner().invoke(app, ["serve-model", "--model", str(model_dir),
                                      "--store", str(tmp_path / "s"), *flag])
    assert result.exit_code == 2, result.output
    assert "--kv-bits is not supported by serve-model" in " ".join(result.output.split())
    assert not (tmp_path / "s").exists()


def test_serve_model_wants_exactly_one_store(model_dir, tmp_path):
    from typer.testing import CliRunner

    from tools.cli import app

    for args in ([], ["--store", str(tmp_path / "s"), "--url", "http://127.0.0.1:9"]):
        result = CliRunner().invoke(app, ["serve-model", "--model", str(model_dir), *args])
        assert result.exit_code == 2 and "--store DIR or --url URL" in result.output, result.output


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    model, _ = load(str(gemma_dir))
    return model, fingerprint_model(gemma_dir)


def test_sliding_model_publishes_a_checkpoint_at_the_boundary_and_restores_it_exactly(
        gemma, tmp_path):
    """gemma3-style: the sliding layers' rings (64 tokens, rotated by 70) come back from
    the checkpoint's attachments, the full-attention layers from its pages; the next
    tokens' logits equal a recompute's (tolerance 0)."""
    model, _ = gemma
    caches = prefill(model, TOKENS)
    assert {type(c).__name__ for c in caches} == {"RotatingKVCache", "KVCache"}
    with Store(tmp_path / "s") as store:
        tier = tier_for(gemma, store)
        assert tier.offer(TOKENS, caches, "system") == "queued"
        assert tier.publisher.drain(10) and tier.publisher.stats()["published"] == 1
        [ckpt] = store.list_checkpoints("test")
        assert tuple(ckpt.tokens) == tuple(TOKENS) and ckpt.attachments
        fresh = tier_for(gemma, store)
        prompt = TOKENS + [9, 10, 11]
        got = look(fresh, prompt, l1_tokens=0)
        assert got.outcome == "hit" and got.tokens == len(TOKENS)
        assert [isinstance(c, type(k)) for c, k in zip(got.cache, caches, strict=True)] == [True] * 4
        rest = mx.array([prompt[len(TOKENS):]])
        restored_logits = model(rest, cache=got.cache)
        computed_logits = model(mx.array([prompt]), cache=make_prompt_cache(model))[:, len(TOKENS):]
        assert mx.array_equal(restored_logits, computed_logits).item()  # tolerance 0
        # a prompt only a shorter checkpoint prefixes is not restored partway
        assert look(fresh, TOKENS[:60] + [9, 10], l1_tokens=0).outcome == "miss"
        tier.close(1)
        fresh.close(1)


def test_sliding_model_skips_boundaries_the_cache_ran_past(gemma, tmp_path):
    """A ring that holds more tokens than the segment is not valid at the segment."""
    model, _ = gemma
    caches = prefill(model, TOKENS)
    with Store(tmp_path / "s") as store:
        tier = tier_for(gemma, store)
        assert tier.offer(TOKENS[:50], caches, "user") == "skipped_inexact"
        assert tier.publisher.stats()["published"] == 0
        tier.close(1)


def test_tail_key_is_keyed_with_the_namespace_chain_salt(loaded, caches, tmp_path):
    """In a salted namespace the tier's chain keys are the store's: a prefix it restored
    is known as stored (not captured again), and tail_key names the stored block."""
    from kvstore.ids import ChainSalts
    from kvstore.store import StoreConfig

    salts = ChainSalts({"test": bytes(range(32))})
    with Store(tmp_path / "s", StoreConfig(chain_salts=salts)) as store:
        tier = tier_for(loaded, store)
        assert tier.offer(TOKENS, caches, "system") == "queued"
        assert tier.publisher.drain(10) and tier.publisher.stats()["published"] == 1
        fresh = tier_for(loaded, store)
        fresh.threads.io.submit(lambda: None).result()  # the salt was asked first
        assert fresh.chain_salt() == bytes(range(32))
        match = store.lookup_prefix(fresh.identity.format_id, "test", TOKENS)
        assert match.tokens_matched == len(TOKENS)
        assert fresh.tail_key(TOKENS) == match.blocks[-1].key
        assert look(fresh, TOKENS + [1], l1_tokens=0).outcome == "hit"
        assert fresh.offer(TOKENS, caches, "system") == "skipped_known"
        tier.close(1)
        fresh.close(1)


def test_a_tier_that_cannot_start_leaves_l1_serving(monkeypatch):
    """A store tier whose build fails (on the generation thread, right after the model
    loads) is logged and off: the load, and every request, go on from L1; handler
    threads waiting for the tier are released."""
    from types import SimpleNamespace

    from engine.serving.mlx_server import _TierResolver

    key = ("m", None, None)
    provider = SimpleNamespace(cli_args=SimpleNamespace(model="m", adapter_path=None, draft_model=None),
                               model_key=key, model=None)
    resolver = _TierResolver(provider, None, ServingSettings(), ServingMetrics(), None)
    monkeypatch.setattr(resolver, "_build", lambda: 1 / 0)
    assert resolver(key) is None and resolver.resolved.is_set()
    assert resolver.built(key) is None
