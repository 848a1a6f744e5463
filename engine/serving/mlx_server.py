"""mlx_lm.server with the two-tier prompt cache: the hooks, checked before they are used.

serve(argv, ...) runs mlx-lm's own main() on argv (every mlx_lm.server flag, parsed by
mlx-lm itself), with one module attribute replaced for the duration: mlx_lm.server.run,
the function main() calls with (host, port, ModelProvider). The replacement does what
mlx-lm's run() does (build the prompt cache, a ResponseGenerator over it, then
_run_http_server, or join() on a non-zero distributed rank) with these differences: the
prompt cache is a TwoTierPromptCache; the ResponseGenerator is mlx-lm's with generate()
extended (on the HTTP handler thread, before the request is queued, the prompt is
tokenized with mlx-lm's own _tokenize and looked up in the store, so the generation
thread never waits on it); the ModelProvider's load() also builds the store tier, on
the generation thread, once the model is loaded; and the request handler is mlx-lm's
APIHandler with one more GET route, /metrics. mlx-lm's request handling, batching,
tokenisation and HTTP API are its own, unchanged; nothing of them is copied here.

Those hooks are mlx-lm internals, so check_mlx_lm() refuses, before anything starts,
an mlx-lm outside SUPPORTED_MLX_LM or one whose hook signatures differ from what this
file was written against (mlx-lm 0.32.2).
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import EngineError
from engine.serving.identity import ModelFingerprint, fingerprint_model
from engine.serving.prompt_cache import ServingMetrics, TwoTierPromptCache
from engine.serving.store_cache import ServingSettings, StoreTier, unsupported_reason
from kvstore.errors import IncompatibleFormat

log = logging.getLogger("kvstore.serve_model")

SUPPORTED_MLX_LM = ((0, 32, 2), (0, 33, 0))  # [lowest, first unsupported)
METRICS_PATH = "/metrics"
# name -> parameter names its signature must start with (self included for methods)
_HOOKS = {
    "run": ("host", "port", "model_provider"),
    "main": (),
    "_run_http_server": ("host", "port", "response_generator", "server_class", "handler_class"),
    "ResponseGenerator.__init__": ("self", "model_provider", "prompt_cache"),
    "ResponseGenerator.generate": ("self", "request", "generation_args", "progress_callback"),
    "ResponseGenerator._tokenize": ("self", "tokenizer", "request", "args"),
    "ResponseGenerator.generation_available": ("self",),
    "ModelProvider.load": ("self", "model_path", "adapter_path", "draft_model_path"),
    "LRUPromptCache.__init__": ("self", "max_size", "max_bytes"),
    "LRUPromptCache.fetch_nearest_cache": ("self", "model", "tokens"),
    "LRUPromptCache.insert_cache": ("self", "model", "tokens", "prompt_cache", "cache_type"),
    "APIHandler.do_GET": ("self",),
}


class UnsupportedMlxLm(EngineError):
    """The installed mlx-lm is not one whose server hooks this code knows."""

    code = "unsupported_mlx_lm"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_mlx_lm():
    """mlx_lm.server, after checking its version and hook signatures (UnsupportedMlxLm)."""
    import mlx_lm
    import mlx_lm.server as server

    low, high = SUPPORTED_MLX_LM
    version = _version(mlx_lm.__version__)
    wanted = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    if not low <= version < high:
        raise UnsupportedMlxLm(
            f"kvstore serve-model hooks into mlx_lm.server internals and supports mlx-lm "
            f"{wanted}; this is mlx-lm {mlx_lm.__version__}. Install a supported one: "
            f"pip install 'mlx-lm{wanted}'")
    problems = []
    for name, params in _HOOKS.items():
        obj = server
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if not callable(obj):
            problems.append(f"mlx_lm.server.{name} is missing")
            continue
        got = tuple(inspect.signature(obj).parameters)[: len(params)]
        if got != params:
            problems.append(f"mlx_lm.server.{name}{got} where {params} was expected")
    from mlx_lm.models.cache import LRUPromptCache, PromptTrie
    if server.LRUPromptCache is not LRUPromptCache:
        problems.append("mlx_lm.server.LRUPromptCache is not mlx_lm.models.cache.LRUPromptCache")
    # TwoTierPromptCache.l1_tokens_hint reads L1's trie (search, get) on handler threads
    if not isinstance(getattr(LRUPromptCache(1), "_trie", None), PromptTrie):
        problems.append("LRUPromptCache() has no PromptTrie _trie")
    for name, params in (("search", ("self", "model", "tokens")),
                         ("get", ("self", "model", "tokens"))):
        method = getattr(PromptTrie, name, None)
        got = tuple(inspect.signature(method).parameters)[:3] if callable(method) else None
        if got != params:
            problems.append(f"mlx_lm.models.cache.PromptTrie.{name}{got} where {params} was expected")
    if problems:
        raise UnsupportedMlxLm(f"mlx-lm {mlx_lm.__version__}'s server hooks differ from the ones "
                               f"serve-model was written against: " + "; ".join(problems))
    return server


@dataclass
class StoreConnection:
    """The store a server reads and publishes through (a Store, or two RemoteStores:
    one with the lookup deadline as its timeout, one for uploads)."""

    lookup_store: object
    publish_store: object
    describe: str

    def probe(self, namespace: str) -> str | None:
        """A lookup in `namespace` under no format (matches nothing): None when the store
        answered, else why not. Raises what the store raises for a refused token (a
        configuration error, unlike a store that is down)."""
        try:
            self.lookup_store.lookup_prefix(bytes(32), namespace, [0])
        except PermissionError:
            raise
        except Exception as exc:  # noqa: BLE001 - down or slow: serve from L1 meanwhile
            return f"{type(exc).__name__}: {exc}"
        return None

    def close(self) -> None:
        for store in {id(s): s for s in (self.lookup_store, self.publish_store)}.values():
            store.close()


def model_name(model: str) -> str:
    """The name pages are filed under: a Hugging Face repo id as given, a local
    directory by its own name (so hosts that keep it at other paths still share)."""
    path = Path(model)
    return path.resolve().name if path.exists() else model


def local_model_dir(model: str) -> Path | None:
    """The directory mlx-lm loads `model` from, without downloading (None if not yet)."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from mlx_lm.utils import hf_repo_to_path
        return hf_repo_to_path(model)
    except Exception:  # noqa: BLE001 - not in the hub cache yet: mlx-lm will fetch it
        return None


class _TierResolver:
    """model_key -> the StoreTier serving it (built on first use, once the generation
    thread has loaded the model), or None: only the --model the server started with,
    and only when unsupported_reason() has nothing against it, gets an L2."""

    def __init__(self, provider, connection: StoreConnection, settings: ServingSettings,
                 metrics: ServingMetrics, fingerprint: ModelFingerprint | None):
        args = provider.cli_args
        self._provider, self._connection = provider, connection
        self._settings, self._metrics = settings, metrics
        self._fingerprint = fingerprint
        self._default_key = (args.model, args.adapter_path, args.draft_model)
        self._resolved, self._tier = False, None
        self.resolved = threading.Event()  # set once the default model's tier is decided
        self.threads = []  # TierThreads of the tiers built: closed at shutdown

    def __call__(self, model_key):
        """Generation thread: the tier for model_key, built on first use."""
        if model_key != self._default_key or self._provider.model_key != model_key:
            return None
        if not self._resolved:
            try:
                self._tier = self._build()
            except Exception:  # noqa: BLE001 - L2 is an optimisation: never fail a request for it
                log.exception("the store tier (L2) could not start for %s; L1 serves as usual",
                              self._provider.cli_args.model)
            finally:
                self._resolved = True
                self.resolved.set()
        return self._tier

    def built(self, model_key):
        """Any thread: the tier for model_key if it is built and its model loaded, else
        None (never builds: the probe runs the model, which only the generation thread
        may do)."""
        if not self._resolved or model_key != self._default_key:
            return None
        return self._tier if self._provider.model_key == model_key else None

    def _build(self):
        args = self._provider.cli_args
        reason = unsupported_reason(self._provider.model, args)
        if getattr(self._provider, "is_distributed", False):
            reason = ("distributed serving: only rank 0 sees requests (and prefetches), so "
                      "the ranks would restore different caches")
        if reason is not None:
            log.warning("the store tier (L2) is off for %s: %s; L1 serves as usual",
                        args.model, reason)
            return None
        fingerprint = self._fingerprint
        if fingerprint is None:
            directory = local_model_dir(args.model)
            fingerprint = fingerprint_model(directory, name=model_name(args.model),
                                            adapter_dir=args.adapter_path)
        try:
            tier = StoreTier(self._provider.model, fingerprint, self._connection.lookup_store,
                             self._connection.publish_store, self._settings, self._metrics)
        except IncompatibleFormat as exc:  # e.g. a --kv-policy of packed pages
            log.warning("the store tier (L2) is off for %s: %s; L1 serves as usual",
                        args.model, exc)
            return None
        self._metrics.publisher_stats = tier.publisher.stats  # not tier.*: no model ref
        self.threads.append(tier.threads)
        log.info("store tier (L2) on: %s, namespace %s, model id %s, format %s",
                 self._connection.describe, tier.namespace, tier.model_id,
                 tier.identity.format_id_hex[:16])
        return tier



def _generator_class(base, resolved: threading.Event):
    class PrefetchingResponseGenerator(base):
        """mlx-lm's ResponseGenerator whose generate() (an HTTP handler thread) first
        looks the prompt up in the store, so the generation thread only takes a ready
        result (engine/serving/store_cache.py, Lookup)."""

        def generate(self, request, generation_args, progress_callback=None):
            self._prefetch(request, generation_args)
            return super().generate(request, generation_args, progress_callback)

        def _prefetch(self, request, args) -> None:
            provider = self.model_provider
            if args.model.model not in ("default_model", provider.cli_args.model):
                return  # another model: L1 only
            # the first requests may arrive while the generation thread loads the
            # model; they wait for that anyway, so wait here until its tier is decided
            while not resolved.wait(0.5):
                if not self.generation_available():
                    return
            prompt_cache = getattr(self, "prompt_cache", None)  # gone after shutdown
            model_key, tokenizer = provider.model_key, provider.tokenizer
            if prompt_cache is None or tokenizer is None:
                return
            try:  # mlx-lm's own tokenisation, on a copy (it edits messages in place)
                tokens = self._tokenize(tokenizer, copy.deepcopy(request), args)[0]
            except Exception:  # noqa: BLE001 - the generation thread reports it to the client
                return
            prompt_cache.prefetch(model_key, list(tokens))

    return PrefetchingResponseGenerator


def _close_threads(threads: list, drain_timeout_s: float) -> None:
    for tier_threads in threads:
        if not tier_threads.close(drain_timeout_s):
            log.warning("stopped with publications still queued after %.0fs", drain_timeout_s)


def _handler_class(base, metrics: ServingMetrics):
    class KVStoreAPIHandler(base):
        """mlx-lm's APIHandler plus GET /metrics (Prometheus text)."""

        def do_GET(self):
            if self.path.split("?", 1)[0] != METRICS_PATH:
                return super().do_GET()
            body = metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

    return KVStoreAPIHandler


def serve(argv: list[str], connection: StoreConnection, settings: ServingSettings, *,
          model: str, adapter_path: str | None = None, drain_timeout_s: float = 30.0,
          on_ready: Callable[[ServingMetrics], None] | None = None) -> None:
    """Run mlx_lm.server's main() on argv with the two-tier cache (module docstring).
    Returns when the server stops (SIGINT), after draining queued publications."""
    server = check_mlx_lm()
    metrics = ServingMetrics()
    directory = local_model_dir(model)
    fingerprint = (fingerprint_model(directory, name=model_name(model), adapter_dir=adapter_path)
                   if directory is not None else None)
    original_run = server.run

    def run(host, port, model_provider, server_class=server.ThreadingHTTPServer,
            handler_class=None):
        import mlx.core as mx

        # Only the prompt cache holds the resolver (and so the tier, its model and every
        # L1 entry): mlx-lm's generation thread deletes it when it stops, which frees
        # them on that thread, as mlx-lm intends. Shutdown keeps only the threads.
        resolver = _TierResolver(model_provider, connection, settings, metrics, fingerprint)
        threads, resolved = resolver.threads, resolver.resolved
        load = model_provider.load
        prompt_cache = TwoTierPromptCache(model_provider.cli_args.prompt_cache_size,
                                          resolve_tier=resolver, metrics=metrics)
        cache_ref = weakref.ref(prompt_cache)  # the provider must not keep the tier alive

        def load_and_build_tier(*args, **kwargs):
            # on the generation thread (mlx-lm loads there): the tier is built before the
            # first request is served, so handler threads can prefetch from then on
            loaded = load(*args, **kwargs)
            if (cache := cache_ref()) is not None:
                cache.prepare(model_provider.model_key)
            return loaded

        model_provider.load = load_and_build_tier
        generator = _generator_class(server.ResponseGenerator, resolved)(
            model_provider, prompt_cache)
        del resolver, prompt_cache
        if on_ready is not None:
            on_ready(metrics)
        try:
            if mx.distributed.init().rank() == 0:
                server._run_http_server(host, port, generator, server_class=server_class,
                                        handler_class=_handler_class(server.APIHandler, metrics))
            else:
                generator.join()
        finally:
            _close_threads(threads, drain_timeout_s)

    # httpx logs every store request at INFO, which mlx-lm's --log-level INFO would print;
    # the per-request line of engine/serving/prompt_cache.py says what matters
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger("httpx").level))
    saved_argv = sys.argv
    server.run = run
    sys.argv = ["mlx_lm.server", *argv]
    try:
        server.main()
    finally:
        server.run = original_run
        sys.argv = saved_argv
        # Cyclic garbage left by mlx-lm's caches and ours holds MLX arrays. Collected here,
        # on the main thread, before the interpreter shuts down: otherwise a worker
        # thread that ends during shutdown may collect it, and freeing MLX arrays there
        # aborts the process ("terminate called without an active exception", SIGABRT).
        gc.collect()
