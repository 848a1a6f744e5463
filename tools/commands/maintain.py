"""Commands that verify or reclaim: check, gc, evict."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from kvstore.check import PROBLEM_KINDS
from kvstore.gc import DEFAULT_COMPACT_BELOW, plan_gc
from tools.commands.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    DataDirOption,
    JsonOption,
    TokenOption,
    TokensFileOption,
    UrlOption,
    chain_salts,
    emit_json,
    escape,
    fail,
    human_bytes,
    human_duration,
    is_local,
    open_store,
    parse_duration,
    parse_size,
    progress_bar,
    stdout,
    store_errors,
    target,
)
from tools.commands.gc_report import gc_compaction_done_line, gc_compaction_plan_line

_SUBSET = re.compile(r"^(\d+)/(\d+)$")
TierConfigOption = typer.Option(None, "--config", help="TOML settings file with s3_* keys")


def check(
    read_data: bool = typer.Option(False, "--read-data", help="also re-hash every page's bytes (blake3)"),
    subset: Optional[str] = typer.Option(None, "--subset", metavar="I/N",
                                         help="with --read-data, read only pages whose first digest byte is I modulo N"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """Verify the store and print a typed problem report; exit 0 when clean, 1 otherwise.

    Without --read-data it checks structure: every record decodes and is keyed by its own hash, parents, pages and attachments exist, reference counts, pins, indexes and byte counters equal their recount. --read-data also re-hashes every page; --subset 0/4 .. 3/4 splits that over four runs. check never repairs.

    Example:

        kvstore check --read-data --subset 0/4
    """
    parts = None
    if subset is not None:
        match = _SUBSET.match(subset.strip())
        if not match or not int(match.group(1)) < int(match.group(2)):
            fail(f"--subset must be I/N with 0 <= I < N, not {subset!r}", EXIT_USAGE)
        parts = (int(match.group(1)), int(match.group(2)))
    started = time.monotonic()
    with open_store(target(data_dir, url, token, tokens_file)) as store, store_errors():
        if is_local(store):
            totals = store.stats()
            with progress_bar(not as_json) as bar:
                task = bar.add_task("check" + (" --read-data" if read_data else ""),
                                    total=totals.stored_nbytes or None)
                report = store.check(read_data=read_data, subset=parts,
                                     progress=lambda n, nbytes: bar.advance(task, nbytes))
        else:
            report = store.check(read_data=read_data, subset=parts)
    doc = report.to_dict()
    doc["elapsed_s"] = round(time.monotonic() - started, 3)
    doc["problem_counts"] = dict(Counter(p.kind for p in report.problems))
    if as_json:
        emit_json(doc)
    else:
        stdout.print(f"checked {report.pages_checked:,} pages, {report.blocks_checked:,} blocks, "
                     f"{report.checkpoints_checked:,} checkpoints"
                     + (f"; read {report.pages_read:,} pages ({human_bytes(report.bytes_read)})"
                        if read_data else "") + f" in {doc['elapsed_s']:.1f}s")
        if report.ok:
            stdout.print("[green]no problems[/green]")
        else:
            table = Table(box=None, header_style="bold")
            for column in ("kind", "object", "detail"):
                table.add_column(column)
            for p in report.problems[:200]:
                table.add_row(p.kind, p.object[:24], escape(p.detail))
            stdout.print(table)
            if len(report.problems) > 200:
                stdout.print(f"... and {len(report.problems) - 200} more (use --json for all)")
            stdout.print(f"[red]{len(report.problems)} problem(s)[/red]")
            for kind in doc["problem_counts"]:
                stdout.print(f"  {kind}: {PROBLEM_KINDS[kind]}", style="dim")
    raise typer.Exit(EXIT_OK if report.ok else EXIT_PROBLEMS)


def gc(
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan and delete nothing"),
    grace: str = typer.Option("1h", "--grace", metavar="DURATION",
                              help="spare unreferenced pages younger than this (30s, 10m, 1h, 0)"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
    remote: bool = typer.Option(False, "--remote",
                                help="collect the S3 tier's bucket instead (KVSTORE_S3_* or --config)"),
    config: Optional[Path] = TierConfigOption,
    compact_below: float = typer.Option(
        DEFAULT_COMPACT_BELOW, "--compact-below", metavar="FRACTION", min=0.0, max=1.0,
        help="compact a segment whose live records span less than this fraction of it "
             "(0: never); a local store only"),
) -> None:
    """Collect garbage: unreferenced pages older than the grace period, and orphans.

    With --remote it collects the S3 bucket shared by the fleet instead: mark-and-sweep from checkpoint manifests and block records younger than the grace period (docs/distributed.md); keep --grace at least twice the writers' refresh age (30 minutes by default).

    At schema 2 it also punches dead segment records, compacts mostly-dead segments (their live records are verified and copied to where saves append; a damaged one is quarantined) and removes a compacted segment's file once it has been retired for the grace period (a reader may still map it), and prints the segments compacted and the bytes freed.

    Prints the plan (pages and bytes to free) first, then executes it. Safe while writers run: a page uploaded but not yet committed is younger than the grace period, and every candidate is re-checked inside its delete transaction. A GC that outlives its grace period, or meets another GC, stops with exit 5.

    Example:

        kvstore gc --dry-run --grace 10m
    """
    grace_s = parse_duration(grace)
    if remote:
        return _gc_remote(grace_s, dry_run, config, tokens_file, as_json)
    with open_store(target(data_dir, url, token, tokens_file), write=not dry_run) as store, store_errors():
        if is_local(store):
            plan = plan_gc(store, grace_s, compact_below=compact_below)
        elif compact_below != DEFAULT_COMPACT_BELOW:
            fail("--compact-below applies to a local store (-d); a server compacts at its "
                 "default", EXIT_USAGE)
        else:
            plan = store.plan_gc(grace_s)
        summary = plan.summary()
        if not as_json:
            stdout.print(f"plan: {summary['unreferenced_pages']:,} unreferenced pages "
                         f"({human_bytes(summary['unreferenced_nbytes'])}) older than "
                         f"{human_duration(grace_s)}, {summary['quarantined_pages']} quarantined "
                         f"copies, {summary['stale_time_entries']} stale grace entries")
            if summary.get("compact_segments") or summary.get("retired_segments"):
                stdout.print(gc_compaction_plan_line(summary))
        deleted = None
        if not dry_run:
            with progress_bar(not as_json) as bar:
                task = bar.add_task("gc", total=summary["unreferenced_nbytes"] or None)
                deleted = plan.execute(progress=lambda n, nbytes: bar.advance(task, nbytes))
    if as_json:
        emit_json({"plan": summary, "dry_run": dry_run, "deleted": deleted})
        return
    if dry_run:
        stdout.print("dry run: nothing deleted")
    else:
        stdout.print(f"deleted {deleted['pages']:,} pages ({human_bytes(deleted['freed_nbytes'])}), "
                     f"skipped {deleted['skipped']} that became live, removed "
                     f"{deleted['quarantined']} quarantined copies and "
                     f"{deleted['stale_times']} stale entries")
        if "compacted_segments" in deleted:
            stdout.print(gc_compaction_done_line(deleted))


def evict(
    to: str = typer.Option(..., "--to", metavar="BYTES", help="target stored size: 4096, 512MiB, 2GB, 1.5GiB"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """Evict least-recently-used unpinned blocks until stored bytes fit a budget.

    Children go before their parents; blocks pinned by a checkpoint are never evicted, so the store may stay above the target (the output says so). Sizes take binary (KiB, MiB, GiB, and bare K, M, G) or decimal (KB, MB, GB) units.

    Example:

        kvstore evict --to 512MiB
    """
    to_nbytes = parse_size(to)
    with open_store(target(data_dir, url, token, tokens_file), write=True) as store, store_errors():
        before = store.stats().stored_nbytes
        report = store.evict(to_nbytes)
        after = store.stats().stored_nbytes
    doc = {"to_nbytes": to_nbytes, "before_nbytes": before, "after_nbytes": after,
           "evicted_blocks": report.blocks, "deleted_pages": report.pages,
           "freed_nbytes": report.freed_nbytes, "reached": after <= to_nbytes}
    if as_json:
        emit_json(doc)
        return
    stdout.print(f"evicted {report.blocks:,} blocks and {report.pages:,} pages, freed "
                 f"{human_bytes(report.freed_nbytes)}: {human_bytes(before)} -> {human_bytes(after)} "
                 f"(target {human_bytes(to_nbytes)})")
    if after > to_nbytes:
        stdout.print("[yellow]still above the target: the rest is pinned by checkpoints "
                     "(delete some) or shared with them[/yellow]")


def _gc_remote(grace_s: float, dry_run: bool, config: Optional[Path], tokens_file: Optional[Path],
               as_json: bool) -> None:
    """`kvstore gc --remote`: plan (and unless dry_run, sweep) the S3 tier's bucket. The
    bucket's salted block records decode with the chain salts of the tokens file that
    the service reads (--tokens-file, KVSTORE_TOKENS_FILE or tokens_file in --config)."""
    from api.settings import Settings
    from kvstore.tier import Bucket
    from kvstore.tier.gc import plan_remote_gc
    from kvstore.tier.layout import Layout

    try:
        settings = Settings.load(config, tokens_file=tokens_file)
        tier = settings.tier_config()
    except (ValueError, OSError) as exc:
        fail(f"bad settings: {exc}", EXIT_USAGE)
    salts = chain_salts(settings.tokens_file)
    if tier is None:
        fail("no bucket: set KVSTORE_S3_BUCKET (and KVSTORE_S3_ENDPOINT, credentials) or "
             "s3_bucket in --config", EXIT_USAGE)
    with store_errors():
        bucket = Bucket(tier)
        try:
            plan = plan_remote_gc(bucket, Layout(tier.prefix), grace_s, chain_salts=salts)
            summary = plan.summary()
            if not as_json:
                stdout.print(f"plan: bucket {summary['bucket']}/{summary['prefix']}: "
                             f"{summary['checkpoints']} checkpoints, {summary['marked_blocks']:,} live "
                             f"blocks, {summary['marked_pages']:,} live pages; unreferenced and older "
                             f"than {human_duration(grace_s)}: {summary['unreferenced_blocks']:,} blocks, "
                             f"{summary['unreferenced_pages']:,} pages, {summary['unreferenced_formats']} "
                             f"formats ({human_bytes(summary['unreferenced_nbytes'])}); "
                             f"{summary['spared_young']:,} unreferenced but young")
            deleted = None if dry_run else plan.execute()
        finally:
            bucket.close()
    if as_json:
        emit_json({"plan": summary, "dry_run": dry_run, "deleted": deleted})
    elif dry_run:
        stdout.print("dry run: nothing deleted")
    else:
        stdout.print(f"deleted {deleted['blocks']:,} blocks, {deleted['pages']:,} pages and "
                     f"{deleted['formats']} formats ({human_bytes(deleted['freed_nbytes'])}); "
                     f"skipped {deleted['skipped']} that became young")
