"""`kvstore serve-model`: mlx-lm's OpenAI-compatible server with a persistent prompt cache.

A thin wrapper over engine.serving.mlx_server.serve: it opens the store (a directory,
or a `kvstore serve` URL), builds the ServingSettings from the options, and hands
every option it does not know to mlx_lm.server's own argument parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tools.commands.common import (
    EXIT_USAGE,
    TokenOption,
    escape,
    fail,
    parse_duration,
    parse_size,
    stderr,
    store_errors,
)

CONTEXT_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True}
REMOTE_UPLOAD_TIMEOUT_S = 60.0
StoreOption = typer.Option(None, "--store", help="store directory, embedded in this process (created if absent)")
KVPolicyOption = typer.Option(None, "--kv-policy", help="KV policy TOML (page format, block_size_tokens)")


def _connection(store_dir: Optional[Path], url: Optional[str], token: Optional[str],
                lookup_timeout_s: float):
    from engine.serving.mlx_server import StoreConnection

    if url:
        from kvstore.client import RemoteStore

        # Lookups get the deadline as their HTTP timeout and no retries beyond it;
        # uploads run in the write-behind thread and may take longer.
        lookup = RemoteStore(url, token, timeout_s=lookup_timeout_s, retries=1)
        publish = RemoteStore(url, token, timeout_s=REMOTE_UPLOAD_TIMEOUT_S)
        return StoreConnection(lookup, publish, url)
    from kvstore.store import Store

    store = Store(store_dir)
    return StoreConnection(store, store, str(store_dir))


def serve_model(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", help="model directory or Hugging Face repo id (as mlx_lm.server --model)"),
    adapter_path: Optional[str] = typer.Option(None, "--adapter-path", help="as mlx_lm.server --adapter-path"),
    store_dir: Optional[Path] = StoreOption,
    url: Optional[str] = typer.Option(None, "--url", envvar="KVSTORE_URL", show_envvar=True,
                                      help="a running `kvstore serve` instead of a directory"),
    token: Optional[str] = TokenOption,
    namespace: Optional[str] = typer.Option(None, "--namespace", help="store namespace [default: named after the model]"),
    lookup_timeout: str = typer.Option("2s", "--lookup-timeout", help="longest a store lookup may take before it is served as a miss"),
    retry_after: str = typer.Option("10s", "--retry-after", help="after a store failure or timeout, skip the store this long"),
    lookup_min_gain: int = typer.Option(0, "--lookup-min-gain", min=0,
                                        help="with an L1 match, tokens the store must add to be used [0: one block]"),
    publish_segments: str = typer.Option("system,user,assistant", "--publish-segments",
                                         help="segment types to publish, comma separated (empty: none)"),
    publish_min_tokens: int = typer.Option(0, "--publish-min-tokens", min=0, help="shortest prefix to publish [0: one block]"),
    second_sighting: bool = typer.Option(False, "--publish-on-second-sighting",
                                         help="publish a prefix only the second time this process sees it"),
    namespace_budget: Optional[str] = typer.Option(None, "--namespace-budget",
                                                   help="bytes this process may publish into its namespace, e.g. 20GiB"),
    publish_queue: str = typer.Option("256MiB", "--publish-queue", help="host bytes the write-behind queue may pin"),
    kv_policy: Optional[Path] = KVPolicyOption,
    drain_timeout: str = typer.Option("30s", "--drain-timeout", help="on stop, wait this long for queued publications"),
) -> None:
    """Start mlx_lm.server (same flags, same HTTP API) whose prompt cache is backed by the store.

    L1 is mlx-lm's in-memory prompt cache, as usual; L2 is the store: a prefix published by this server, an earlier run of it, or another server on the same store is restored instead of recomputed. Every option not listed here goes to mlx_lm.server unchanged (--host, --port, --max-tokens, --prompt-cache-size, ...). A store that is down or slow costs a miss, never a failed request. GET /metrics serves Prometheus counters.

    Example:

        kvstore serve-model --model mlx-community/Qwen3-0.6B-bf16 --store ./var/kvstore --port 8080
    """
    from engine.policy import KVPolicy
    from engine.serving.mlx_server import UnsupportedMlxLm, check_mlx_lm, serve
    from engine.serving.store_cache import ServingSettings

    if (store_dir is None) == (url is None):
        fail("pass one of --store DIR or --url URL (with --token)", EXIT_USAGE)
    if any(arg == "--kv-bits" or arg.startswith("--kv-bits=") for arg in ctx.args):
        from engine.serving.store_cache import KV_BITS_REFUSAL

        fail(KV_BITS_REFUSAL, EXIT_USAGE)
    try:
        check_mlx_lm()
    except UnsupportedMlxLm as exc:
        fail(str(exc), EXIT_USAGE)
    try:
        settings = ServingSettings(
            namespace=namespace, lookup_timeout_s=parse_duration(lookup_timeout),
            retry_after_s=parse_duration(retry_after), lookup_min_gain_tokens=lookup_min_gain,
            publish_segments=tuple(s.strip() for s in publish_segments.split(",") if s.strip()),
            publish_min_tokens=publish_min_tokens, publish_on_second_sighting=second_sighting,
            namespace_budget_nbytes=parse_size(namespace_budget) if namespace_budget else None,
            publish_queue_nbytes=parse_size(publish_queue),
            policy=KVPolicy.load(kv_policy) if kv_policy else KVPolicy())
    except (ValueError, OSError) as exc:
        fail(f"bad settings: {exc}", EXIT_USAGE)
    argv = ["--model", model, *(["--adapter-path", adapter_path] if adapter_path else []), *ctx.args]
    from engine.serving.identity import default_namespace
    from engine.serving.mlx_server import model_name

    with store_errors():
        connection = _connection(store_dir, url, token, settings.lookup_timeout_s)
        trouble = connection.probe(settings.namespace or default_namespace(model_name(model)))
    if trouble is not None:
        stderr.print(f"[yellow]warning:[/yellow] the store at {escape(connection.describe)} does "
                     f"not answer ({escape(trouble)}); serving from L1 until it does")
    try:
        serve(argv, connection, settings, model=model, adapter_path=adapter_path,
              drain_timeout_s=parse_duration(drain_timeout))
    finally:
        connection.close()
