"""serve-model against stock mlx_lm.server: TTFT after a restart, and throughput uncached.

Usage:
  kvstore bench --suite server [--quick]    # as part of `make bench` (tools/commands/bench.py)
  python -m tools.bench.server              # CPU-scaled model, 2K and 8K system prompts
  python -m tools.bench.server --quick      # 2K only, smaller model (about a minute)
  python -m tools.bench.server --size 8b    # Llama-3-8B geometry (for a GPU machine)
  python -m tools.bench.server --json out.json --logs DIR   # DIR: the servers' logs
  python -m tools.bench.server --warm-start  # a short request after each restart first
  bash tools/bench/profile/issue21_h200.sh   # the H200 run (8b size, its two calls)

Everything goes through the official openai client to servers started as subprocesses
on 127.0.0.1, on one model directory built offline (tools/bench/model_dir.py: random
weights, a trained BPE tokenizer, a chat template), in one run:

  TTFT after restart  a long system prompt (2K, 8K tokens) and a short user turn,
                      streamed; time to the first content chunk. stock: a freshly
                      started mlx_lm.server recomputes the prompt (its prompt cache died
                      with the last process). serve-model: a freshly started server whose
                      store a previous run filled (a request with the same system prompt
                      and another user turn, then SIGINT, which drains the uploads; filled
                      once per prompt length, each repeat restarts on a copy of it);
                      the system prompt is restored, the turn computed. Median of
                      --repeats fresh starts each; the ratio is stock / serve-model.
  throughput          --clients concurrent clients, each a distinct ~256-token prompt
                      (nothing cached anywhere), --max-tokens each; completion tokens /
                      wall time, in --rounds rounds alternating (ABBA) between a stock
                      server and a serve-model server running side by side, after one
                      unmeasured round each. serve-model runs with an empty store, so it
                      pays for lookups and publication and never hits. Also each server
                      process's CPU seconds per completion token over all rounds
                      (/proc/PID/stat): on a shared, loaded machine the rates swing by
                      tens of percent from round to round, the CPU cost far less.

Sizes: "cpu" keeps an 8B's per-layer KV geometry (8 KV heads of 128) with 2 layers and
hidden 1024 (about 19M parameters): MLX's CPU matmul runs at a few GFLOP/s on this
project's 2-core machines, so a real 8B's 8K prefill would take hours. Restored bytes and
recompute work both scale with the layer count, so the ratio is that of a deeper model
of the same width (up to the fixed per-request costs, which favour stock). "8b" is
written in bfloat16 (14 GB, built on the GPU in 17 s on the H200); "8b-rehearsal" is its
CPU stand-in for rehearsing the GPU driver, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
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
    # the 8b shape at 1/8 width and 1/16 depth: a CPU rehearsal of the GPU run's driver
    "8b-rehearsal": dict(hidden_size=512, num_layers=2, num_heads=4, num_kv_heads=1,
                         head_dim=128, intermediate_size=1792, vocab_size=4096),
}
# How a size's weights are written: the 8B-shaped one in bfloat16 (as Llama-3-8B ships),
# generated on MLX's default device and saved shard by shard (model_dir.write_model's
# lazy: 14 GB written without first holding the model in float32); the others as before.
BUILD = {"8b": dict(dtype="bfloat16", lazy=True),
         "8b-rehearsal": dict(dtype="bfloat16", lazy=True)}
# serve-model settings a size needs beyond the defaults. An 8B's bf16 KV is 128 KiB per
# token, so one 2K-token capture (about 259 MiB) is over the write-behind queue's default
# cap (--publish-queue 256MiB); the first H200 run predates the publisher keeping the
# newest capture over the cap, and published nothing. 2GiB holds a backlog of 8K
# captures (about 1 GiB each); a 1 GiB drain gets a minute.
SERVE_ARGS = {"8b": ("--publish-queue", "2GiB", "--drain-timeout", "60s")}


def _serve_metrics(server) -> dict[str, float]:
    """serve-model's store-tier counters (publication, lookups) from its /metrics."""
    try:
        return {k: v for k, v in server.metrics().items()
                if any(w in k for w in ("publish", "l2_", "l1_", "tokens_computed"))}
    except OSError as e:
        return {"error": str(e)}


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
    """(seconds to the first content chunk, prompt tokens, cached tokens). The client is
    built before the clock starts (its SSL context and connection pool cost 20-60 ms
    here, the same for either server)."""
    client = _client(server)
    start = time.perf_counter()
    first, usage = None, None
    stream = client.chat.completions.create(
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


def _stat_cpu(stat: Path) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a /proc/.../stat file (OSError if gone)."""
    comm, rest = stat.read_text().rsplit(")", 1)
    fields = rest.split()
    return comm.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc; 0.0 elsewhere)."""
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat"))[1]
    except OSError:
        return 0.0


def thread_cpu(pid: int, top: int = 8) -> list[tuple[str, float]]:
    """The process's busiest threads since they started: (name, CPU seconds), from
    /proc/PID/task (Linux; [] elsewhere). Where a run's extra CPU goes."""
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            name, seconds = _stat_cpu(task / "stat")
        except OSError:
            continue
        out.append((f"{name}/{task.name}", seconds))
    return sorted(out, key=lambda x: -x[1])[:top]


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def throughput(server, clients: int, system_words: int, max_tokens: int, round_: int) -> tuple[float, int]:
    """(completion tokens per second, completion tokens) of `clients` concurrent
    distinct requests (distinct in every round too, so nothing is ever cached)."""
    done = [0] * clients
    openai_clients = [_client(server) for _ in range(clients)]

    def one(i):
        r = openai_clients[i].chat.completions.create(
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
    return sum(done) / (time.perf_counter() - start), sum(done)


def _warm_start(server) -> float:
    """Seconds of one short unrelated request (a 2-word system prompt, 1 token): it
    waits out the model load that mlx-lm runs on its generation thread after /health
    answers, and MLX's first-use kernel compilation; both arms pay it alike."""
    start = time.perf_counter()
    _client(server).chat.completions.create(
        model="default_model", messages=_messages(2, "warm", seed=99), temperature=0,
        max_tokens=1)
    return time.perf_counter() - start


def run(size: str, contexts: list[int], repeats: int, clients: int, max_tokens: int,
        work: Path, rounds: int, model_dir: Path | None = None,
        warm_start: bool = False, warmup_rounds: int = 1) -> dict:
    from tools.bench.server_process import serve_model, server_env, stock_server

    load_start = load_average()

    (work / "hf" / "hub").mkdir(parents=True)
    env = server_env(work / "hf")
    sizes = dict(SIZES[size])
    model = model_dir or work / f"bench-{size}"
    if not (model / "config.json").exists():  # an 8B-shaped build writes 14 GB: reuse it
        start = time.perf_counter()
        build_model_dir(model, vocab_size=sizes.pop("vocab_size"), **sizes, **BUILD.get(size, {}))
        _progress(f"model directory {model} built in {time.perf_counter() - start:.1f} s "
                  f"({sum(f.stat().st_size for f in model.iterdir()) / 1e9:.2f} GB)")
    logs = work / "logs"
    logs.mkdir()
    extra = SERVE_ARGS.get(size, ())
    rows = []
    per_word = _tokens_per_word(model)
    for context in contexts:
        words = int(context / per_word)
        warm, turn = _messages(words, "first question"), _messages(words, "second question")
        stock_s, served_s, prompt, cached = [], [], 0, 0
        warmups = {"stock": [], "served": []}
        filled = work / f"store-{context}-filled"
        with serve_model(model, env, logs / "fill.log", "--store", str(filled), *extra) as server:
            ttft(server, warm)  # publishes the system prompt; SIGINT drains it
            time.sleep(0.5)  # insert_cache runs after the last chunk
            fill_metrics = _serve_metrics(server)
        filled_mb = sum(f.stat().st_size for f in filled.rglob('*') if f.is_file()) / 1e6
        _progress(f"{context}: store filled ({filled_mb:.0f} MB); fill server's publish "
                  f"counters {({k: v for k, v in fill_metrics.items() if 'publish' in k})}")
        for _ in range(repeats):
            began = time.perf_counter()
            with stock_server(model, env, logs / "stock.log") as server:
                up = time.perf_counter() - began
                if warm_start:
                    warmups["stock"].append(_warm_start(server))
                seconds, prompt, _ = ttft(server, turn)
            stock_s.append(seconds)
            _progress(f"{context}: stock TTFT {seconds:.3f} s (up in {up:.1f} s"
                      + (f", warm-up {warmups['stock'][-1]:.2f} s)" if warm_start else ")"))
            fresh = work / f"store-{context}-{len(served_s)}"
            shutil.copytree(filled, fresh)  # each restart finds the store the fill left
            began = time.perf_counter()
            with serve_model(model, env, logs / "served.log", "--store", str(fresh), *extra) as server:
                up = time.perf_counter() - began
                if warm_start:
                    warmups["served"].append(_warm_start(server))
                seconds, prompt, cached = ttft(server, turn)
                served_metrics = _serve_metrics(server)
            served_s.append(seconds)
            _progress(f"{context}: serve-model TTFT {seconds:.3f} s, {cached} cached (up in "
                      f"{up:.1f} s" + (f", warm-up {warmups['served'][-1]:.2f} s)" if warm_start
                                       else ")"))
        rows.append({"context_tokens": prompt, "cached_tokens": cached,
                     "stock_ttft_s": statistics.median(stock_s),
                     "serve_model_ttft_s": statistics.median(served_s),
                     "speedup": statistics.median(stock_s) / statistics.median(served_s),
                     "stock_ttft_all_s": stock_s, "serve_model_ttft_all_s": served_s,
                     "warm_start_s": warmups if warm_start else None,
                     "store_filled_mb": filled_mb, "fill_metrics": fill_metrics,
                     "serve_model_metrics_last": served_metrics})
    result = {"size": size, "model": {**SIZES[size], **BUILD.get(size, {})}, "repeats": repeats,
              "serve_model_args": list(SERVE_ARGS.get(size, ())),
              "warm_start": warm_start,
              "ttft": rows, "load_average": {"start": load_start, "end": None},
              "throughput": None}
    if rounds == 0:  # TTFT only
        result["load_average"]["end"] = load_average()
        return result
    words = int(256 / per_word)
    tps = {"stock": [], "served": []}
    cpu = {"stock": 0.0, "served": 0.0}
    tokens = {"stock": 0, "served": 0}
    with stock_server(model, env, logs / "stock-tput.log") as stock, \
            serve_model(model, env, logs / "served-tput.log", "--store",
                        str(work / "store-tput"), *extra) as served:
        arms = {"stock": stock, "served": served}
        for warm in range(warmup_rounds):  # first-request and first-shape costs out of the rounds
            for name, server in arms.items():
                throughput(server, clients, words, max_tokens, 10_000 + 2 * warm + (name == "served"))
        for round_ in range(rounds):  # interleaved, ABBA: both see the same machine load
            order = ("stock", "served") if round_ % 2 == 0 else ("served", "stock")
            for name in order:
                before = cpu_seconds(arms[name].proc.pid)
                rate, n = throughput(arms[name], clients, words, max_tokens,
                                     2 * round_ + (name == "served"))
                cpu[name] += cpu_seconds(arms[name].proc.pid) - before
                tps[name].append(rate)
                tokens[name] += n
                _progress(f"throughput round {round_} {name}: {rate:.1f} tok/s")
        # what the write-behind thread still had to upload belongs to the served arm
        served_cpu_tail = _settle_cpu(served)
        cpu["served"] += served_cpu_tail
        threads = {name: thread_cpu(arms[name].proc.pid) for name in arms}
    ratios = [b / a for a, b in zip(tps["stock"], tps["served"], strict=True)]
    cpu_per_token = {k: cpu[k] / tokens[k] if tokens[k] else float("nan") for k in cpu}
    result["load_average"]["end"] = load_average()
    return {**result, "throughput": {"clients": clients, "prompt_tokens": 256, "max_tokens": max_tokens,
                           "rounds": len(ratios),
                           "stock_tokens_per_s": statistics.median(tps["stock"]),
                           "serve_model_tokens_per_s": statistics.median(tps["served"]),
                           "ratio": statistics.median(ratios),
                           "ratios": [round(r, 3) for r in ratios],
                           "stock_cpu_ms_per_token": 1e3 * cpu_per_token["stock"],
                           "serve_model_cpu_ms_per_token": 1e3 * cpu_per_token["served"],
                           "cpu_ratio": cpu_per_token["served"] / cpu_per_token["stock"],
                           "warmup_rounds": warmup_rounds,
                           "busiest_threads_cpu_s": threads}}


def _progress(line: str) -> None:
    """One measurement as it is taken, on stderr (a run cut short still shows them)."""
    print(f"[{time.strftime('%H:%M:%S')}] {line} (load {load_average()})", file=sys.stderr,
          flush=True)


def _settle_cpu(server, quiet_s: float = 1.0, timeout_s: float = 60.0) -> float:
    """CPU seconds the server uses until it is idle (its uploads done): sampled until a
    quiet_s interval costs under 2% of a core."""
    start = last = cpu_seconds(server.proc.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = cpu_seconds(server.proc.pid)
        if now - last < 0.02 * quiet_s:
            break
        last = now
    return last - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--contexts", default=None, help="system prompt tokens, e.g. 2048,8192")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved throughput rounds [default: 6, --quick 4; 0: "
                             "TTFT only]")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="untimed throughput rounds per arm before the timed ones")
    parser.add_argument("--warm-start", action="store_true",
                        help="after each restart, one short unrelated request before the "
                             "timed one (waits out the model load and first-use kernel "
                             "compilation, which both arms pay): TTFT of the prompt alone")
    parser.add_argument("--json", default=None)
    parser.add_argument("--logs", default=None, type=Path,
                        help="copy the servers' logs here at the end")
    parser.add_argument("--model-dir", default=None, type=Path,
                        help="build the model directory here and reuse it if it is there "
                             "(it must have been built at the same --size)")
    args = parser.parse_args(argv)
    # `timeout` stops a run with SIGTERM: exit through the with-blocks (servers stopped,
    # --logs copied) instead of dying with the servers still running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    size = args.size or ("quick" if args.quick else "cpu")
    contexts = [int(c) for c in (args.contexts or ("2048" if args.quick else "2048,8192")).split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="bench-server-") as work:
        try:
            result = run(size, contexts, repeats, args.clients, args.max_tokens, Path(work),
                         (4 if args.quick else 6) if args.rounds is None else args.rounds,
                         args.model_dir, args.warm_start, args.warmup_rounds)
        finally:  # a run cut short (or killed by SIGTERM from timeout) keeps them too
            if args.logs is not None and (Path(work) / "logs").is_dir():
                shutil.copytree(Path(work) / "logs", args.logs, dirs_exist_ok=True)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def render(result: dict) -> str:
    m = result["model"]
    lines = [f"## serve-model vs stock mlx_lm.server (size {result['size']}: {m['num_layers']} "
             f"layers, hidden {m['hidden_size']}, {m['num_kv_heads']} KV heads of {m['head_dim']}; "
             f"median of {result['repeats']}"
             + ("; each timed request after one short warm-up request" if result.get("warm_start") else "")
             + ")", "",
             "| prompt tokens | cached after restart | stock TTFT | serve-model TTFT | stock / serve-model |",
             "|---:|---:|---:|---:|---:|"]
    for r in result["ttft"]:
        lines.append(f"| {r['context_tokens']} | {r['cached_tokens']} | {r['stock_ttft_s']:.3f} s "
                     f"| {r['serve_model_ttft_s']:.3f} s | {r['speedup']:.1f}x |")
    t = result["throughput"]
    if t is None:
        return "\n".join([*lines, "", "(throughput not measured: --rounds 0)", ""])
    lines += ["", f"Throughput, {t['clients']} concurrent clients, distinct ~{t['prompt_tokens']}-token "
              f"prompts, {t['max_tokens']} tokens each, nothing cached; medians of "
              f"{t['rounds']} interleaved rounds (ABBA; the ratio is the median of per-round "
              f"ratios {t['ratios']}); CPU per completion token is each server process's "
              "user + system time over all rounds (serve-model's includes its uploads "
              "until idle), a figure the machine's load moves far less than the rates:", "",
              "| stock | serve-model (empty store) | serve-model / stock | stock CPU | "
              "serve-model CPU | CPU ratio |", "|---:|---:|---:|---:|---:|---:|",
              f"| {t['stock_tokens_per_s']:.1f} tok/s | {t['serve_model_tokens_per_s']:.1f} tok/s "
              f"| {t['ratio']:.3f} | {t['stock_cpu_ms_per_token']:.0f} ms/tok "
              f"| {t['serve_model_cpu_ms_per_token']:.0f} ms/tok | {t['cpu_ratio']:.3f} |", "",
              f"Load average (1, 5, 15 min) at start {result['load_average']['start']}, "
              f"at end {result['load_average']['end']} (2 cores here).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
