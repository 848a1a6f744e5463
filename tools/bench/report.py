"""The combined benchmark report: the suites' markdown tables, a page-format summary,
and three PNG plots, written next to the suites' output.

Usage (after `kvstore bench --out DIR`, which calls this itself):
  python -m tools.bench.report DIR

Reads DIR/<suite>.md (each suite's printed tables) and the JSON the plotting suites wrote
(DIR/ttft.json, DIR/dedup.json, DIR/attention.json); writes DIR/report.md and
  DIR/restore_vs_prompt.png      TTFT against prompt tokens: restore from the store (per
                                 page format), mlx-lm prompt-cache file, recompute
  DIR/dedup_stored_bytes.png     stored bytes against checkpoints sharing a system prompt
  DIR/attention_vs_context.png   decode attention time against context, per method
A plot whose data is missing (its suite was not run, or failed) is left out and said so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.bench.common import machine_line, markdown_table

SUITE_TITLES = {
    "store": "Store save and restore (8B-shaped prefix; peers: mlx-lm prompt-cache files, plain file)",
    "http": "Restore over HTTP vs same-host fast path vs embedded (peer: bare uvicorn)",
    "ttft": "Time to first token: restore vs recompute vs mlx-lm prompt-cache file",
    "engine": "Engine: paged caches per page format vs mlx-lm KVCache / QuantizedKVCache (bytes per token)",
    "attention": "Decode attention per implementation and page format (error per format)",
    "dedup": "Dedup: checkpoints sharing a system prompt, content addressing vs one file each",
    "server": "serve-model vs stock mlx_lm.server: TTFT after a restart, throughput uncached",
}
PLOTS = ("restore_vs_prompt.png", "dedup_stored_bytes.png", "attention_vs_context.png")
KV_HEADS = 8  # the attention suite's geometry: 8 KV heads of 128


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_restore(rows: list[dict], path: Path) -> None:
    """ttft rows -> TTFT (ms, log) against prompt tokens."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
    formats = list(dict.fromkeys(r["format"] for r in rows))
    for i, fmt in enumerate(formats):  # one colour per format: solid restore, dashed recompute
        mine = sorted((r for r in rows if r["format"] == fmt), key=lambda r: r["prompt_tokens"])
        x = [r["prompt_tokens"] for r in mine]
        ax.plot(x, [1e3 * r["restore_s"] for r in mine], "o-", color=f"C{i}", label=f"kvstore restore ({fmt})")
        ax.plot(x, [1e3 * r["recompute_s"] for r in mine], "x--", color=f"C{i}",
                label=f"recompute ({fmt} cache)")
    first = sorted((r for r in rows if r["format"] == formats[0]), key=lambda r: r["prompt_tokens"])
    if first and "mlx_lm_load_s" in first[0]:
        ax.plot([r["prompt_tokens"] for r in first], [1e3 * r["mlx_lm_load_s"] for r in first],
                "s-", color="black", label="mlx-lm prompt-cache file")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (ms)",
           title=f"restore vs recompute ({rows[0]['size']} model, {rows[0]['device']})")
    ticks = sorted({r["prompt_tokens"] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_dedup(result: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
    # the two one-file-per-checkpoint arms hold the same bytes: dashes keep both visible
    for (arm, values), style in zip(result["stored_nbytes"].items(), ("-", "-", "--"), strict=False):
        ax.plot(range(1, len(values) + 1), [v / 2**20 for v in values], style, label=arm)
    ax.set(xlabel="checkpoints saved", ylabel="stored MiB",
           title=f"{result['system_tokens']}-token shared prompt + {result['suffix_tokens']}-token "
                 f"suffixes, {result['layers']} layer(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_attention(doc: dict, path: Path) -> None:
    """attention rows at batch 1 -> eval time (us, log) against context, per method+format."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
    rows = [r for r in doc["rows"] if r["batch"] == 1]
    # colour by page format, line style by method: the peers solid black/grey, the
    # reference dotted, the direct path solid
    colours = {"bf16": "black", "q4": "grey", "native": "C0", "k8v8": "C1", "k8v4": "C2", "k4v4": "C3"}
    for method, fmt in dict.fromkeys((r["method"], r["format"]) for r in rows):
        mine = sorted((r for r in rows if (r["method"], r["format"]) == (method, fmt)),
                      key=lambda r: r["context"])
        style = ":" if method == "reference" else "s-" if method in ("dense", "mlx-lm") else "o-"
        ax.plot([r["context"] for r in mine], [r["us"] for r in mine], style,
                color=colours.get(fmt), label=f"{method} {fmt}")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="eval time per call (us)",
           title="decode attention, batch 1, 32 q / 8 kv heads of 128")
    ticks = sorted({r["context"] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_table(doc: dict) -> str:
    """Bytes per token per page format (one layer, 8 KV heads of 128) and the attention
    error each format costs, from the attention suite's rows at its longest context."""
    rows = [r for r in doc["rows"] if r["batch"] == 1]
    longest = max(r["context"] for r in rows)
    at = [r for r in rows if r["context"] == longest]
    dense = next(r for r in at if r["method"] == "dense")
    dense_per_token = dense["page_bytes"] / longest / KV_HEADS
    out = []
    for r in at:
        if r["method"] == "reference":
            continue
        per_token = r["page_bytes"] / longest / KV_HEADS
        out.append([f"{r['method']} {r['format']}", f"{per_token * KV_HEADS:.0f}",
                    f"{dense_per_token / per_token:.2f}x", f"{r['rel_err']:.1e}" if "rel_err" in r else "-",
                    f"{r['us']:.0f}", f"{r.get('vs_dense', dense['us'] / r['us']):.2f}x"])  # paired, if measured so
    return (f"At context {longest}, batch 1 (K/V bytes one layer holds per token: 8 KV heads x "
            f"head dim 128; rel err against float32 SDPA; time vs dense bf16 SDPA):\n\n"
            + markdown_table(["method, format", "bytes/token/layer", "x smaller", "rel err",
                              "eval us", "vs dense"], out))


def write_report(out: Path, command: str, seconds: dict[str, float] | None = None) -> list[Path]:
    """Write out/report.md and the plots whose data exists; returns the plot paths."""
    made: list[Path] = []
    missing: list[str] = []
    ttft, dedup, attention = (_load(out / f"{s}.json") for s in ("ttft", "dedup", "attention"))
    for data, name, plot in ((ttft, "restore_vs_prompt.png", plot_restore),
                             (dedup, "dedup_stored_bytes.png", plot_dedup),
                             (attention, "attention_vs_context.png", plot_attention)):
        if data:
            plot(data, out / name)
            made.append(out / name)
        else:
            missing.append(name)
    lines = ["# mlx-kvstore benchmarks", "", f"command: `{command}`", "", machine_line(), ""]
    if seconds:
        lines += [markdown_table(["suite", "seconds"], [[s, f"{t:.1f}"] for s, t in seconds.items()]
                                 + [["total", f"{sum(seconds.values()):.1f}"]]), ""]
    for suite, title in SUITE_TITLES.items():
        path = out / f"{suite}.md"
        if not path.exists():
            continue
        # a suite's own headings sit one level under its section
        body = "\n".join("#" + line if line.startswith("#") else line
                         for line in path.read_text().strip().splitlines())
        lines += [f"## {suite}: {title}", "", body or f"(no output: see {suite}.stderr.txt)", ""]
        if suite == "attention" and attention:
            lines += ["### Page formats: bytes per token and attention error", "",
                      format_table(attention), ""]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in made]
    if missing:
        lines += ["", f"Not drawn (their suite's data is missing): {', '.join(missing)}"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return made


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    write_report(Path(argv[0]), f"python -m tools.bench.report {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
