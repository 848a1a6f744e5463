"""`kvstore bench`: a thin runner over tools/bench/<suite>.py.

Each suite is a module with main(argv) that prints markdown; this runs it in its own
Python process (so one suite's MLX state and memory never leak into the next) and
writes what it printed to DIR/<suite>.md. Plots and cross-suite tables belong to the
suites and to the benchmarks issue, not here.
"""

from __future__ import annotations

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

SUITES = ("store", "http", "ttft", "engine", "attention")
SUITE_PACKAGE = "tools.bench"  # each suite is SUITE_PACKAGE.<suite>, run with -m
SuiteOption = typer.Option(None, "--suite", "-s", help=f"run only these ({', '.join(SUITES)}); repeatable")
OutOption = typer.Option(Path("bench-results"), "--out", "-o", help="directory for <suite>.md")


def run_suite(suite: str, quick: bool, out_dir: Path, extra: list[str]) -> dict:
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
    as_json: bool = JsonOption,
) -> None:
    """Run the benchmark suites and write each one's markdown table to OUT/<suite>.md.

    Suites: store (save and restore), http (HTTP vs fast path vs embedded), ttft (restore vs recompute), engine, attention. Each runs in its own process; a suite that fails is reported (its stderr kept in OUT/<suite>.stderr.txt) and the exit code is 1.

    Example:

        kvstore bench --quick --out bench-results --suite store --suite ttft
    """
    chosen = list(dict.fromkeys(suite or SUITES))
    unknown = [s for s in chosen if s not in SUITES]
    if unknown:
        fail(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}", EXIT_USAGE)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in chosen:
        if not as_json:
            stderr.print(f"running {name}{' --quick' if quick else ''} ...")
        results.append(run_suite(name, quick, out, []))
    ok = all(r["ok"] for r in results)
    if as_json:
        emit_json({"out": str(out), "quick": quick, "ok": ok, "suites": results})
    else:
        table = Table(box=None, header_style="bold")
        for column in ("suite", "status", "seconds", "output"):
            table.add_column(column)
        for r in results:
            table.add_row(r["suite"], "ok" if r["ok"] else f"[red]failed ({r['returncode']})[/red]",
                          f"{r['seconds']:.1f}", r["output"])
        stdout.print(table)
    raise typer.Exit(EXIT_OK if ok else EXIT_PROBLEMS)
