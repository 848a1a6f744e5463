"""TwoTierPromptCache: mlx-lm's LRUPromptCache (L1) over a StoreTier (L2), and its metrics.

mlx-lm's generation thread calls fetch_nearest_cache(model_key, tokens) before a
prompt and insert_cache(model_key, tokens, cache, cache_type=...) at each segment
boundary (system prompt, user turn) and after the answer. This subclass keeps L1's
behaviour exactly (it calls it first) and:

  prefetch (HTTP handler thread, before the request is queued) asks the StoreTier to
          find and read the longest stored prefix that beats what L1 holds now (a
          read of L1's trie under this cache's lock: a hint, L1 may change before
          the request is served);
  fetch   when L1 matched fewer tokens than the prefetched prefix, restores that
          instead (never a wait on the store); mlx-lm then reports
          len(prompt) - len(rest) as usage.prompt_tokens_details.cached_tokens, so
          the count covers both tiers;
  insert  after L1 took the cache, offers it to the StoreTier's publish policy (a host
          copy, then write-behind upload; never a wait on the store).

fetch and insert run on the generation thread; nothing here raises into it for store
trouble. One log line per request (the fetch) says what each tier gave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, List

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from engine.serving.store_cache import Lookup

log = logging.getLogger("kvstore.serve_model")


class ServingMetrics:
    """Counters of both tiers, rendered as Prometheus text at /metrics. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self.lookups: Counter = Counter()  # L2 outcome -> count
        self.offers: Counter = Counter()   # publish decision -> count
        self.publisher_stats: Callable[[], dict] | None = None

    def record_request(self, prompt_tokens: int, l1_tokens: int, lookup: Lookup) -> None:
        with self._lock:
            c = self.counts
            c["requests"] += 1
            c["l1_hits" if l1_tokens else "l1_misses"] += 1
            c["l1_tokens"] += l1_tokens
            self.lookups[lookup.outcome] += 1
            if lookup.outcome != "off":
                c["l2_lookup_seconds_sum"] += lookup.seconds
                c["l2_lookup_seconds_count"] += 1
                c["l2_prefetch_seconds_sum"] += lookup.prefetch_seconds
                c["l2_prefetch_seconds_count"] += 1
            if lookup.cache is not None:
                c["l2_tokens_restored"] += lookup.tokens
                c["l2_bytes_read"] += lookup.bytes_read
            cached = lookup.tokens if lookup.cache is not None else l1_tokens
            c["tokens_computed"] += prompt_tokens - cached

    def record_offer(self, decision: str, seconds: float) -> None:
        with self._lock:
            self.offers[decision] += 1
            if decision == "queued":
                self.counts["publish_capture_seconds_sum"] += seconds
                self.counts["publish_capture_seconds_count"] += 1

    def snapshot(self) -> dict:
        with self._lock:
            out = {"counts": dict(self.counts), "l2_lookups": dict(self.lookups),
                   "publish_offers": dict(self.offers)}
        out["publisher"] = self.publisher_stats() if self.publisher_stats else None
        return out

    def render(self) -> str:
        """Prometheus text exposition (version 0.0.4)."""
        snap = self.snapshot()
        c = snap["counts"]
        lines = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP kvstore_{name} {help_text}")
            lines.append(f"# TYPE kvstore_{name} {kind}")
            for labels, value in samples:
                lines.append(f"kvstore_{name}{labels} {value}")

        metric("requests_total", "counter", "prompts looked up", [("", c.get("requests", 0))])
        metric("l1_lookups_total", "counter", "L1 (in-memory) lookups by result",
               [('{result="hit"}', c.get("l1_hits", 0)), ('{result="miss"}', c.get("l1_misses", 0))])
        metric("l2_lookups_total", "counter",
               "L2 (store) lookups by outcome: hit, miss, shorter (no longer than L1), "
               "timeout, error, skipped (store backing off), off (L2 not serving this model)",
               [(f'{{outcome="{k}"}}', v) for k, v in sorted(snap["l2_lookups"].items())])
        metric("l1_tokens_total", "counter", "prompt tokens matched in L1", [("", c.get("l1_tokens", 0))])
        metric("l2_tokens_restored_total", "counter", "prompt tokens restored from the store",
               [("", c.get("l2_tokens_restored", 0))])
        metric("tokens_computed_total", "counter", "prompt tokens neither tier had",
               [("", c.get("tokens_computed", 0))])
        metric("l2_bytes_read_total", "counter", "page bytes read from the store",
               [("", c.get("l2_bytes_read", 0))])
        metric("l2_lookup_seconds", "summary", "L2 time on the generation thread (taking the "
               "prefetched prefix and restoring it)",
               [("_sum", round(c.get("l2_lookup_seconds_sum", 0.0), 6)),
                ("_count", c.get("l2_lookup_seconds_count", 0))])
        metric("l2_prefetch_seconds", "summary", "L2 lookup and page reads on the HTTP handler "
               "thread, before the request is queued (bounded by --lookup-timeout)",
               [("_sum", round(c.get("l2_prefetch_seconds_sum", 0.0), 6)),
                ("_count", c.get("l2_prefetch_seconds_count", 0))])
        metric("publish_offers_total", "counter", "segment boundaries offered for publication, "
               "by policy decision", [(f'{{decision="{k}"}}', v)
                                      for k, v in sorted(snap["publish_offers"].items())])
        metric("publish_capture_seconds", "summary", "host copy of a published segment on the "
               "generation thread", [("_sum", round(c.get("publish_capture_seconds_sum", 0.0), 6)),
                                     ("_count", c.get("publish_capture_seconds_count", 0))])
        pub = snap["publisher"]
        if pub is not None:
            metric("publish_uploads_total", "counter", "write-behind uploads by result",
                   [('{result="published"}', pub["published"]), ('{result="failed"}', pub["failed"]),
                    ('{result="dropped"}', pub["dropped"])])
            metric("publish_queue_bytes", "gauge", "host bytes pinned by queued captures",
                   [("", pub["pinned_nbytes"])])
        return "\n".join(lines) + "\n"


class TwoTierPromptCache(LRUPromptCache):
    """See the module docstring. resolve_tier(model_key) -> StoreTier | None, built on
    the generation thread; resolve_tier.built(model_key) -> the tier if it is built."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *,
                 resolve_tier: Callable[[Any], Any], metrics: ServingMetrics):
        super().__init__(max_size, max_bytes)
        self._resolve_tier = resolve_tier
        self.metrics = metrics
        # L1's trie is changed on the generation thread and read by prefetch() on
        # handler threads: changes and those reads hold this lock (fetch only reads)
        self._l1_lock = threading.Lock()

    def prepare(self, model: Any) -> None:
        """Generation thread, after a model load: build its tier now (not at the first
        request), so handler threads can prefetch for it."""
        self._resolve_tier(model)

    def l1_tokens_hint(self, model: Any, tokens: List[int]) -> int:
        """The tokens fetch_nearest_cache would take from L1 now (its rule: an exact
        entry, a longer trimmable one's common prefix, else the longest shorter one),
        without copying anything. Reads mlx-lm's trie (checked by check_mlx_lm)."""
        with self._l1_lock:
            result = self._trie.search(model, tokens)
            if result.exact is not None:
                return len(tokens)
            short = len(result.shorter) if result.shorter is not None else 0
            if result.longer is not None and result.common_prefix > short:
                entry = self._trie.get(result.model, result.longer)
                if can_trim_prompt_cache(entry.prompt_cache):
                    return min(len(tokens) - 1, result.common_prefix)
            return short

    def prefetch(self, model: Any, tokens: List[int]) -> None:
        """HTTP handler thread: start and await (bounded) the store lookup for a prompt
        about to be queued, when the model's tier is built. Never raises."""
        tier = self._resolve_tier.built(model)
        if tier is None:
            return
        try:
            tier.prefetch(tokens, self.l1_tokens_hint(model, tokens))
        except Exception:  # noqa: BLE001 - the request is served without it (unprefetched)
            log.exception("L2 prefetch failed; the request is served as a miss")

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        l1_tokens = len(tokens) - len(rest)
        tier = self._resolve_tier(model)
        lookup = Lookup(None, outcome="off")
        if tier is not None:
            try:
                lookup = tier.lookup(list(tokens), l1_tokens)
            except Exception:  # noqa: BLE001 - a restore bug must not fail the request
                log.exception("L2 restore failed; served as a miss")
                lookup = Lookup(None, outcome="error")
        if lookup.cache is not None:
            cache, rest = lookup.cache, tokens[lookup.tokens:]
        self.metrics.record_request(len(tokens), l1_tokens, lookup)
        cached = len(tokens) - len(rest)
        log.info("prompt %d tokens: cached %d (L1 %d, L2 restored %d, L2 %s, prefetch %.1f ms, "
                 "restore %.1f ms, %d bytes), computed %d", len(tokens), cached, l1_tokens,
                 lookup.tokens if lookup.cache is not None else 0, lookup.outcome,
                 lookup.prefetch_seconds * 1e3, lookup.seconds * 1e3, lookup.bytes_read,
                 len(rest))
        return cache, rest

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *,
                     cache_type: str = "assistant"):
        with self._l1_lock:
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        tier = self._resolve_tier(model)
        if tier is None:
            return
        start = time.perf_counter()
        try:
            decision = tier.offer(tokens, prompt_cache, cache_type)
        except Exception:  # noqa: BLE001 - publishing never fails generation
            log.exception("could not capture a %s segment for publication", cache_type)
            decision = "error"
        self.metrics.record_offer(decision, time.perf_counter() - start)

    def trim_to(self, *, n_sequences=None, n_bytes=None):
        with self._l1_lock:
            super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
