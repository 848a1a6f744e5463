"""`kvstore bench`: a thin runner over tools/bench/<suite>.py.

Each suite is a module with main(argv) that prints markdown; this runs it in its own
Python process (so one suite's MLX state and memory never leak into the next) and
writes what it printed to DIR/<suite>.md. Suites that feed a plot also get
`--json DIR/<suite>.json`. Then tools.bench.report writes DIR/report.md (every table)
and the PNG plots from those files; the tables and plots are its business, not this one's.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from tools.commands.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    JsonOption,
    emit_json,
    fail,
    stderr,
    stdout,
)

SUITES = ("store", "http", "ttft", "engine", "attention", "dedup", "server")
PLOT_SUITES = ("ttft", "attention", "dedup")  # get --json OUT/<suite>.json for the report's plots
SUITE_PACKAGE = "tools.bench"  # each suite is SUITE_PACKAGE.<suite>, run with -m
SuiteOption = typer.Option(None, "--suite", "-s", help=f"run only these ({', '.join(SUITES)}); repeatable")
OutOption = typer.Option(Path("bench-results"), "--out", "-o", help="directory for <suite>.md")
SuiteArgsOption = typer.Option(
    None, "--suite-args", help="extra arguments for one suite, as SUITE='ARGS' (e.g. "
    "attention='--contexts 256,512'); they follow --quick, so they override its sizes; repeatable")


def run_suite(suite: str, quick: bool, out_dir: Path, extra: list[str]) -> dict:
    if suite in PLOT_SUITES:
        extra = ["--json", str(out_dir / f"{suite}.json"), *extra]
    argv = [sys.executable, "-m", f"{SUITE_PACKAGE}.{suite}", *(["--quick"] if quick else []), *extra]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    path = out_dir / f"{suite}.md"
    path.write_text(done.stdout)
    if done.returncode != 0:
        (out_dir / f"{suite}.stderr.txt").write_text(done.stderr)
    return {"suite": suite, "ok": done.returncode == 0, "returncode": done.returncode,
            "seconds": round(elapsed, 2), "output": str(path),
            "stderr_tail": done.stderr[-2000:] if done.returncode else ""}


def bench(
    suite: Optional[list[str]] = SuiteOption,
    quick: bool = typer.Option(False, "--quick", help="each suite's --quick: small sizes, few repeats"),
    out: Path = OutOption,
    suite_args: Optional[list[str]] = SuiteArgsOption,
    as_json: bool = JsonOption,
) -> None:
    """Run the benchmark suites; write each one's tables to OUT/<suite>.md, then OUT/report.md and the PNG plots.

    Suites: store (save and restore), http (HTTP vs fast path vs embedded), ttft (restore vs recompute vs mlx-lm files), engine (bytes per token per page format), attention (decode time and error per format), dedup (checkpoints sharing a system prompt), server (serve-model vs stock mlx_lm.server: TTFT after a restart, throughput uncached). Each runs in its own process; a suite that fails is reported (its stderr kept in OUT/<suite>.stderr.txt) and the exit code is 1.

    Full sizes are scaled for a 2-core CPU, where the whole run takes about 40 minutes (--quick: under 3); each suite's --help says what it scaled down and the command for a bigger machine, e.g. --suite-args "ttft=--size 1b --formats native k8v8 k8v4 k4v4".

    Example:

        kvstore bench --quick --out bench-results --suite store --suite ttft
        kvstore bench --quick --suite-args "dedup=--checkpoints 5 --system-tokens 512"
    """
    chosen = list(dict.fromkeys(suite or SUITES))
    unknown = [s for s in chosen if s not in SUITES]
    if unknown:
        fail(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}", EXIT_USAGE)
    extras: dict[str, list[str]] = {}
    for item in suite_args or []:
        name, sep, text = item.partition("=")
        if not sep or name not in SUITES:
            fail(f"--suite-args wants SUITE='ARGS' with SUITE one of {', '.join(SUITES)}; got {item!r}",
                 EXIT_USAGE)
        extras.setdefault(name, []).extend(shlex.split(text))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in chosen:
        if not as_json:
            stderr.print(f"running {name}{' --quick' if quick else ''} ...")
        results.append(run_suite(name, quick, out, extras.get(name, [])))
    ok = all(r["ok"] for r in results)
    command = shlex.join(["kvstore", "bench", *(["--quick"] if quick else []), "--out", str(out),
                          *(a for s in suite or [] for a in ("--suite", s)),
                          *(a for x in suite_args or [] for a in ("--suite-args", x))])
    try:
        from tools.bench.report import write_report

        plots = [str(p) for p in write_report(out, command, {r["suite"]: r["seconds"] for r in results})]
    except ImportError as error:  # matplotlib is in the `bench` extra
        ok, plots = False, []
        stderr.print(f"[red]no report: {error} (pip install -e '.[bench]')[/red]")
    if as_json:
        emit_json({"out": str(out), "quick": quick, "ok": ok, "suites": results,
                   "report": str(out / "report.md"), "plots": plots})
    else:
        table = Table(box=None, header_style="bold")
        for column in ("suite", "status", "seconds", "output"):
            table.add_column(column)
        for r in results:
            table.add_row(r["suite"], "ok" if r["ok"] else f"[red]failed ({r['returncode']})[/red]",
                          f"{r['seconds']:.1f}", r["output"])
        stdout.print(table)
        stdout.print(f"report: {out / 'report.md'}; plots: {', '.join(plots) or 'none'}")
    raise typer.Exit(EXIT_OK if ok else EXIT_PROBLEMS)
