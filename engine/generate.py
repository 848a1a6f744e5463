"""generate_with_store(engine_model, tokenizer, prompt, store): restore, prefill the
rest, generate max_new_tokens, publish the prompt, report.

A thin layer over mlx-lm's generate_step: the cache it is handed is the restored one,
so mlx-lm prefills only the tokens the store did not have. A policy of paged formats
generates with PagedKVCaches; an mlx-qB policy with mlx-lm's QuantizedKVCache, restored
and published byte for byte (engine/restore.py). Publication goes through a
WriteBehindPublisher when one is given (never blocking generation), else inline after
generation. Rates are recorded per execution identity (engine/rates.py) and decide
between restoring and recomputing.

Models with non-paged layers (sliding windows, chunked attention, recurrent state) are
served from checkpoints only: their state is valid at exactly one offset. For them the
prompt is prefilled here up to its boundary (all but the last token, in generate_step's
own chunks, so the computation is the one generate_step would do) and captured there,
pages and attachments together from that one computation; then generate_step runs from
the last token. The checkpoint is named by the prompt (PROMPT_CHECKPOINT_PREFIX + blake3
of its tokens), so the same prompt replaces its own checkpoint. A checkpoint that would
pair stored pages of another computation with this state is skipped (MixedComputation).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine.attention import installed
from engine.cache import PagedKVCache
from engine.engine_model import EngineModel
from engine.errors import InvalidRequest, MixedComputation
from engine.publish import (  # noqa: F401 - PROMPT_CHECKPOINT_PREFIX: its documented home
    DEFAULT_NAMESPACE,
    PROMPT_CHECKPOINT_PREFIX,
    capture,
    prompt_checkpoint_name,
    upload,
)
from engine.rates import ExecutionKey, RateBook
from engine.restore import RestoreRequest, empty_cache, restore

DEFAULT_RATES = RateBook()
PREFILL_STEP_TOKENS = 2048  # generate_step's default prefill_step_size
log = logging.getLogger(__name__)


def _prefill(model, tokens: Sequence[int], cache) -> None:
    """What generate_step does before its first step, for all of `tokens`: chunks of
    PREFILL_STEP_TOKENS, each evaluated (the cache state with it)."""
    for start in range(0, len(tokens), PREFILL_STEP_TOKENS):
        model(mx.array(tokens[start : start + PREFILL_STEP_TOKENS])[None], cache=cache)
        mx.eval([c.state for c in cache])


@dataclass
class GenerationReport:
    tokens: list[int]
    text: str | None
    prompt_tokens: int
    tokens_restored: int
    tokens_computed: int
    restore_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    time_saved_s: float | None  # restored tokens at the measured prefill rate, minus restore time
    decision: str
    published: dict | None = field(default=None)


def _device() -> str:
    return str(mx.default_device())


def generate_with_store(engine_model: EngineModel, tokenizer, prompt: str | Sequence[int],
                        store, *, namespace: str = DEFAULT_NAMESPACE,
                        max_new_tokens: int = 64, sampler=None, publisher=None,
                        publish_prompt: bool = True,
                        rates: RateBook | None = None) -> GenerationReport:
    """Generate max_new_tokens tokens from `prompt` (text, or token ids) reusing the
    store's longest prefix. Restores once: when the rates say recomputing is faster, the
    restored caches are freed and fresh ones are prefilled instead.

    The caches follow the policy's page format: PagedKVCache for paged formats, mlx-lm's
    QuantizedKVCache for mlx-qB (bits and group size from the policy)."""
    if engine_model.admission is not None:
        raise InvalidRequest("generate_with_store does not wait for admission: restore with "
                             "the engine model and generate under its grant instead")
    rates = rates or DEFAULT_RATES
    model, identity = engine_model.model, engine_model.identity
    tokens = list(prompt) if not isinstance(prompt, str) else list(tokenizer.encode(prompt))
    if not tokens:
        raise ValueError("the prompt has no tokens")
    cache_kind = "paged" if engine_model.paged else "quantized"
    page_format = identity.layers[identity.paged_layers[0]].page_format if identity.paged_layers else "none"
    compute_key = ExecutionKey(identity.model_fingerprint, page_format, "engine", _device())
    restore_key = ExecutionKey(identity.model_fingerprint, page_format, "restore",
                               type(store).__name__)

    with installed(model):
        t0 = time.perf_counter()
        restored = restore(engine_model, store, RestoreRequest(
            tokens, max_new_tokens=max_new_tokens, cache_kind=cache_kind, namespace=namespace))
        restore_s = time.perf_counter() - t0
        decision = rates.decide_restore(compute_key, restore_key, restored.tokens_restored,
                                        restored.bytes_read)
        cache, n = restored.cache, restored.tokens_restored
        if n and not decision.restore:
            for c in cache:
                if isinstance(c, PagedKVCache):
                    c.free()
            cache, n = empty_cache(engine_model, RestoreRequest(tokens, cache_kind=cache_kind)), 0
        elif n:
            rates.record(restore_key, "restore_bytes_per_s", restored.bytes_read, restore_s)

        out: list[int] = []
        t1 = time.perf_counter()
        ttft = prefill_s = 0.0
        boundary, start, checkpoint_cap = len(tokens) - 1, n, None
        if publish_prompt and not all(layer.paged for layer in identity.layers) and n < boundary:
            _prefill(model, tokens[n:boundary], cache)
            checkpoint_cap = capture(identity, tokens[:boundary], cache, attachments=True)
            start = boundary
        for i, (token, _) in enumerate(generate_step(mx.array(tokens[start:]), model,
                                                     prompt_cache=cache, max_tokens=max_new_tokens,
                                                     sampler=sampler)):
            if i == 0:
                prefill_s = time.perf_counter() - t1
                ttft = time.perf_counter() - t0
            out.append(int(token))
        decode_s = time.perf_counter() - t1 - prefill_s

        computed = len(tokens) - n
        rates.record(compute_key, "prefill_tokens_per_s", computed, prefill_s)
        if len(out) > 1:
            rates.record(compute_key, "decode_tokens_per_s", len(out) - 1, decode_s)
        rates.record_value(compute_key, "ttft_s", ttft)

        published = None
        if checkpoint_cap is not None:
            published = _publish_checkpoint(store, checkpoint_cap, namespace)
        elif publish_prompt and all(layer.paged for layer in identity.layers):
            cap = capture(identity, tokens, cache)
            if publisher is not None:
                publisher.submit(cap, namespace=namespace)
                published = {"queued": True}
            else:
                published = upload(store, cap, namespace=namespace).__dict__

    prefill_rate = rates.rate(compute_key, "prefill_tokens_per_s")
    saved = (n / prefill_rate.mean - restore_s) if (n and prefill_rate) else None
    text = tokenizer.decode(out) if tokenizer is not None else None
    return GenerationReport(out, text, len(tokens), n, computed, restore_s, prefill_s, ttft,
                            decode_s, saved, decision.reason, published)


def _publish_checkpoint(store, cap, namespace: str) -> dict | None:
    """Upload a prompt-boundary checkpoint inline (its pages and attachments are one
    computation's; write-behind would not change that, but a skipped one must be
    known here). None when it would mix computations (logged)."""
    try:
        return upload(store, cap, namespace=namespace,
                      checkpoint=prompt_checkpoint_name(cap.tokens)).__dict__
    except MixedComputation as exc:
        log.info("prompt checkpoint skipped: %s", exc)
        return None
