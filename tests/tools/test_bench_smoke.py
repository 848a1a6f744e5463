"""`kvstore bench --quick` end to end on tiny sizes: every suite runs, every table and
plot is produced and well formed. No timing is asserted (speed targets are printed by
the benchmarks as ratios against peers, never checked in tests).

The sizes are cut through --suite-args so the whole run stays near a minute on a 2-core
machine; the http suite has no size knob (its 512 MiB prefix is the scenario), so it
runs with one repetition."""

from __future__ import annotations

import json
import struct

import pytest

from tests.tools.helpers import run
from tools.commands.bench import SUITES
from tools.commands.common import EXIT_OK

pytestmark = pytest.mark.slow

TINY = {
    "store": "--repeats 1",
    "http": "--reps 1",
    "ttft": "--prompts 128 256 --formats native k4v4 --repeats 1",
    "engine": "--prompt 64 --decode 4",
    "attention": "--contexts 256,512 --formats native,k4v4 --repeats 1",
    "dedup": "--checkpoints 4 --system-tokens 512",
}
PLOTS = ("restore_vs_prompt.png", "dedup_stored_bytes.png", "attention_vs_context.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every pipe table in text, as rows of cells (the separator row dropped)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|") and line.rstrip().endswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    out = []
    for rows in tables:
        assert len(rows) >= 3, f"a table needs a header, a separator and a row: {rows}"
        assert all(set(c) <= set("-:") and c for c in rows[1]), f"bad separator row {rows[1]}"
        widths = {len(r) for r in rows}
        assert widths == {len(rows[0])}, f"rows of unequal width {widths} in {rows[0]}"
        out.append([rows[0], *rows[2:]])
    return out


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_markdown_tables_rejects_a_ragged_table():
    assert markdown_tables("| a | b |\n|---|---:|\n| 1 | 2 |\n") == [[["a", "b"], ["1", "2"]]]
    with pytest.raises(AssertionError):
        markdown_tables("| a | b |\n|---|---|\n| 1 |\n")
    with pytest.raises(AssertionError):
        markdown_tables("| a | b |\n| 1 | 2 |\n")


def test_bench_quick_writes_every_table_and_plot(tmp_path):
    out = tmp_path / "results"
    args = [a for suite, text in TINY.items() for a in ("--suite-args", f"{suite}={text}")]
    ran = run("bench", "--quick", "--out", out, "--json", *args)
    doc = ran.json()
    failed = {s["suite"]: s["stderr_tail"] for s in doc["suites"] if not s["ok"]}
    assert ran.code == EXIT_OK and not failed, failed or ran.stderr
    assert [s["suite"] for s in doc["suites"]] == list(SUITES)

    for suite in SUITES:
        tables = markdown_tables((out / f"{suite}.md").read_text())
        assert tables, f"{suite}.md has no markdown table"
        assert all(len(t) >= 2 for t in tables), f"{suite}.md has a table without data rows"
    for suite in ("ttft", "attention", "dedup"):
        assert json.loads((out / f"{suite}.json").read_text()), f"{suite}.json is empty"

    assert sorted(doc["plots"]) == sorted(str(out / p) for p in PLOTS)
    for name in PLOTS:
        width, height = png_size((out / name).read_bytes())
        assert width > 100 and height > 100, (name, width, height)

    report = (out / "report.md").read_text()
    for suite in SUITES:
        assert f"## {suite}:" in report, f"report.md lacks the {suite} section"
    for name in PLOTS:
        assert f"]({name})" in report
    assert "load average" in report
    # the page-format summary: one row per non-reference method and format at 512 tokens
    summary = report.split("### Page formats")[1]
    rows = markdown_tables(summary)[0][1:]
    assert {r[0] for r in rows} >= {"dense bf16", "mlx-lm q4"}
    assert len(rows) == 4  # dense, mlx-lm q4, direct native, direct k4v4


def test_ttft_quick_covers_every_format_and_restores_what_the_first_recompute_published(tmp_path):
    """--quick without --formats runs all four page formats (the full default runs only the
    two ends, for the CPU budget). No separate prefill fills the store: the first timed
    recompute's cache is published, and the suite itself asserts that every restore gives
    the recompute's first token and restores all but the last prompt token."""
    from tools.bench import ttft

    out = tmp_path / "ttft.json"
    assert ttft.main(["--quick", "--prompts", "300", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["format"] for r in rows] == ["native", "k8v8", "k8v4", "k4v4"]
    assert all(r["prompt_tokens"] == 300 and r["restored_bytes"] > 0 for r in rows)


def test_store_json_prints_one_object_with_every_ratio(capsys):
    """--json: one JSON object on stdout; "ratios" holds issue 19's stable names, each a
    positive ratio of this run's medians (computed from the cases it reports)."""
    from tools.bench import store

    assert store.main(["--quick", "--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = {"restore_pages_vs_load_prompt_cache", "restore_pools_vs_load_prompt_cache",
             "restore_kvcache_vs_load_prompt_cache", "restore_pages_vs_limit",
             "restore_pools_vs_limit",
             "save_vs_save_prompt_cache", "resave_vs_save", "capture_vs_memcpy"}
    assert set(doc["ratios"]) == names
    medians = {name: case["median_s"] for name, case in doc["cases"].items()}
    assert all(m > 0 for m in medians.values())
    for name, numerator, denominator, _ in store.RATIOS:
        assert doc["ratios"][name] == medians[numerator] / medians[denominator]
