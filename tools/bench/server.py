"""serve-model against stock mlx_lm.server: TTFT after a restart, and throughput uncached.

Usage:
  python -m tools.bench.server              # CPU-scaled model, 2K and 8K system prompts
  python -m tools.bench.server --quick      # 2K only, smaller model (about a minute)
  python -m tools.bench.server --size 8b    # Llama-3-8B geometry (for a GPU machine)
  python -m tools.bench.server --json out.json

Everything goes through the official openai client to servers started as subprocesses
on 127.0.0.1, on one model directory built offline (tools/bench/model_dir.py: random
weights, a trained BPE tokenizer, a chat template), in one run:

  TTFT after restart  a long system prompt (2K, 8K tokens) and a short user turn,
                      streamed; time to the first content chunk. stock: a freshly
                      started mlx_lm.server recomputes the prompt (its prompt cache died
                      with the last process). serve-model: a freshly started server whose
                      store a previous run filled (a request with the same system prompt
                      and another user turn, then SIGINT, which drains the uploads);
                      the system prompt is restored, the turn computed. Median of
                      --repeats fresh starts each; the ratio is stock / serve-model.
  throughput          --clients concurrent clients, each a distinct ~256-token prompt
                      (nothing cached anywhere), --max-tokens each; completion tokens /
                      wall time, in rounds alternating between a stock server and a
                      serve-model server running side by side. serve-model runs with an
                      empty store, so it pays for lookups and publication and never hits.

Sizes: "cpu" keeps an 8B's per-layer KV geometry (8 KV heads of 128) with 2 layers and
hidden 1024 (about 19M parameters): MLX's CPU matmul runs at a few GFLOP/s on this
project's 2-core machines, so a real 8B's 8K prefill would take hours. Restored bytes and
recompute work both scale with the layer count, so the ratio is that of a deeper model
of the same width (up to the fixed per-request costs, which favour stock).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tools.bench.model_dir import build_model_dir, text

SIZES = {
    "8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=4096),
    "cpu": dict(hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=128,
                intermediate_size=2048, vocab_size=4096),
    "quick": dict(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64,
                  intermediate_size=1024, vocab_size=2048),
}


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)


def _messages(system_words: int, user: str, seed: int = 1) -> list[dict]:
    return [{"role": "system", "content": text(system_words, seed=seed)},
            {"role": "user", "content": user}]


def _tokens_per_word(model_dir: Path) -> float:
    """Tokens per word of the synthetic text under the model's tokenizer."""
    from tokenizers import Tokenizer

    sample = text(4000, seed=7)
    return len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(sample).ids) / 4000


def ttft(server, msgs, max_tokens: int = 8) -> tuple[float, int, int]:
    """(seconds to the first content chunk, prompt tokens, cached tokens)."""
    start = time.perf_counter()
    first, usage = None, None
    stream = _client(server).chat.completions.create(
        model="default_model", messages=msgs, temperature=0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    cached = (usage.prompt_tokens_details.cached_tokens
              if usage.prompt_tokens_details is not None else 0)
    return first, usage.prompt_tokens, cached or 0


def throughput(server, clients: int, system_words: int, max_tokens: int, round_: int) -> float:
    """Completion tokens per second of `clients` concurrent distinct requests (distinct
    in every round too, so nothing is ever cached)."""
    done = [0] * clients

    def one(i):
        r = _client(server).chat.completions.create(
            model="default_model",
            messages=_messages(system_words, f"client {i}", seed=1000 * round_ + 100 + i),
            temperature=0, max_tokens=max_tokens)
        done[i] = r.usage.completion_tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def run(size: str, contexts: list[int], repeats: int, clients: int, max_tokens: int,
        work: Path) -> dict:
    from tools.bench.server_process import serve_model, server_env, stock_server

    (work / "hf" / "hub").mkdir(parents=True)
    env = server_env(work / "hf")
    sizes = dict(SIZES[size])
    model = build_model_dir(work / f"bench-{size}", vocab_size=sizes.pop("vocab_size"), **sizes)
    logs = work / "logs"
    logs.mkdir()
    rows = []
    per_word = _tokens_per_word(model)
    for context in contexts:
        words = int(context / per_word)
        warm, turn = _messages(words, "first question"), _messages(words, "second question")
        stock_s, served_s, prompt, cached = [], [], 0, 0
        for _ in range(repeats):
            with stock_server(model, env, logs / "stock.log") as server:
                seconds, prompt, _ = ttft(server, turn)
            stock_s.append(seconds)
            fresh = work / f"store-{context}-{len(served_s)}"
            with serve_model(model, env, logs / "fill.log", "--store", str(fresh)) as server:
                ttft(server, warm)  # publishes the system prompt; SIGINT drains it
            with serve_model(model, env, logs / "served.log", "--store", str(fresh)) as server:
                seconds, prompt, cached = ttft(server, turn)
            served_s.append(seconds)
        rows.append({"context_tokens": prompt, "cached_tokens": cached,
                     "stock_ttft_s": statistics.median(stock_s),
                     "serve_model_ttft_s": statistics.median(served_s),
                     "speedup": statistics.median(stock_s) / statistics.median(served_s)})
    words = int(256 / per_word)
    stock_tps, served_tps = [], []
    with stock_server(model, env, logs / "stock-tput.log") as stock, \
            serve_model(model, env, logs / "served-tput.log", "--store",
                        str(work / "store-tput")) as served:
        for round_ in range(max(3, repeats)):  # interleaved: both see the same machine load
            stock_tps.append(throughput(stock, clients, words, max_tokens, 2 * round_))
            served_tps.append(throughput(served, clients, words, max_tokens, 2 * round_ + 1))
    ratios = [b / a for a, b in zip(stock_tps, served_tps, strict=True)]
    return {"size": size, "model": SIZES[size], "repeats": repeats, "ttft": rows,
            "throughput": {"clients": clients, "prompt_tokens": 256, "max_tokens": max_tokens,
                           "rounds": len(ratios),
                           "stock_tokens_per_s": statistics.median(stock_tps),
                           "serve_model_tokens_per_s": statistics.median(served_tps),
                           "ratio": statistics.median(ratios)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--contexts", default=None, help="system prompt tokens, e.g. 2048,8192")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    size = args.size or ("quick" if args.quick else "cpu")
    contexts = [int(c) for c in (args.contexts or ("2048" if args.quick else "2048,8192")).split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="bench-server-") as work:
        result = run(size, contexts, repeats, args.clients, args.max_tokens, Path(work))
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def render(result: dict) -> str:
    m = result["model"]
    lines = [f"## serve-model vs stock mlx_lm.server (size {result['size']}: {m['num_layers']} "
             f"layers, hidden {m['hidden_size']}, {m['num_kv_heads']} KV heads of {m['head_dim']}; "
             f"median of {result['repeats']})", "",
             "| prompt tokens | cached after restart | stock TTFT | serve-model TTFT | stock / serve-model |",
             "|---:|---:|---:|---:|---:|"]
    for r in result["ttft"]:
        lines.append(f"| {r['context_tokens']} | {r['cached_tokens']} | {r['stock_ttft_s']:.3f} s "
                     f"| {r['serve_model_ttft_s']:.3f} s | {r['speedup']:.1f}x |")
    t = result["throughput"]
    lines += ["", f"Throughput, {t['clients']} concurrent clients, distinct ~{t['prompt_tokens']}-token "
              f"prompts, {t['max_tokens']} tokens each, nothing cached; medians of "
              f"{t['rounds']} interleaved rounds (the ratio is the median of per-round ratios):", "",
              "| stock | serve-model (empty store) | serve-model / stock |", "|---:|---:|---:|",
              f"| {t['stock_tokens_per_s']:.1f} tok/s | {t['serve_model_tokens_per_s']:.1f} tok/s "
              f"| {t['ratio']:.3f} |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
