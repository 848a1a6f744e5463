"""`kvstore migrate`: a schema-1 store to schema 2 (segment files); kvstore/migrate.py."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tools.commands.common import (
    DEFAULT_DATA_DIR,
    EXIT_CONFLICT,
    EXIT_INCOMPATIBLE,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    JsonOption,
    emit_json,
    escape,
    fail,
    human_bytes,
    progress_bar,
    stderr,
    stdout,
    store_errors,
)

# what each refusal exits with (kvstore.migrate.REFUSAL_KINDS)
REFUSAL_EXIT = {"newer_version": EXIT_INCOMPATIBLE, "damaged_header": EXIT_INCOMPATIBLE,
                "foreign_segments": EXIT_INCOMPATIBLE, "in_use": EXIT_CONFLICT,
                "busy": EXIT_CONFLICT, "changed": EXIT_CONFLICT, "no_space": EXIT_PROBLEMS}
StoreArgument = typer.Argument(None, envvar="KVSTORE_DIR", show_envvar=True, metavar="STORE",
                               help="store directory (default ./var/kvstore)")


def migrate(
    store: Optional[Path] = StoreArgument,
    plan_only: bool = typer.Option(False, "--plan", help="print the plan and change nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="migrate without asking"),
    compact: bool = typer.Option(True, "--compact/--no-compact",
                                 help="finish by rewriting data.mdb without the freed page bodies"),
    as_json: bool = JsonOption,
) -> None:
    """Migrate a schema-1 store (page bodies in LMDB) to schema 2 (segment files).

    Prints the plan first: pages and bytes to copy, the free disk it needs, and any reason it cannot run (not a version-1 store, open in another process, not enough space). Then it copies every page unchanged into segment files in batches, each synced before its progress is recorded, and switches the index to the new locations and schema 2 in one transaction. Interrupted, it resumes where it stopped when run again; the store opens (read-only at version 1) and checks clean at every point. Stop every server and engine using the store first. --compact (the default) finally rewrites data.mdb without the freed v1 bodies; without it the file keeps its size.

    Example:

        kvstore migrate /srv/kvstore --plan && kvstore migrate /srv/kvstore --yes
    """
    from kvstore.migrate import MigrationRefused, plan_migration

    path = Path(store or DEFAULT_DATA_DIR)
    with store_errors():  # not a store: 3; newer or damaged: 4
        plan = plan_migration(path)
    summary = plan.summary()
    if not as_json:
        _print_plan(plan)
    if plan.refusals:
        if as_json:
            emit_json({"plan": summary, "executed": False})
        for r in plan.refusals:
            stderr.print(f"[red]refused ({r.kind}):[/red] {escape(r.message)}", soft_wrap=True)
        raise typer.Exit(REFUSAL_EXIT[plan.refusals[0].kind])
    if plan.nothing_to_do and not plan_only:
        plan.execute()  # removes what a compaction that was interrupted left behind
    if plan.nothing_to_do or plan_only:
        if as_json:
            emit_json({"plan": summary, "executed": False})
        elif plan_only and not plan.nothing_to_do:
            stdout.print("plan only: nothing changed (run again without --plan to migrate)")
        raise typer.Exit(EXIT_OK)
    if not yes:
        if as_json or not stdout.is_terminal:
            fail("pass --yes to migrate without a prompt (or --plan to see the plan only)",
                 EXIT_USAGE)
        if not typer.confirm(f"migrate {plan.pages_left:,} pages of {path} to schema 2?"):
            stdout.print("nothing changed")
            raise typer.Exit(EXIT_OK)
    with store_errors():  # full disk, I/O: 1, with the store's own message
        try:
            with progress_bar(not as_json) as bar:
                task = bar.add_task("migrate", total=plan.left_nbytes or None)
                result = plan.execute(progress=lambda n, nbytes: bar.advance(task, nbytes),
                                      compact=compact)
        except MigrationRefused as exc:  # checked again under the locks
            fail(f"{exc}", REFUSAL_EXIT.get(exc.kind, EXIT_PROBLEMS))
    if as_json:
        emit_json({"plan": summary, "executed": True, "result": result})
        return
    _print_result(result)


def _print_plan(plan) -> None:
    if plan.nothing_to_do:
        stdout.print(f"{plan.path} is at schema version 2 already: nothing to migrate")
        return
    if plan.schema_version != 1:
        return
    resumed = (f", resuming after {plan.resume.pages_copied:,} pages copied"
               if plan.resume else "")
    stdout.print(f"plan: {plan.path} schema 1 -> 2: {plan.pages:,} pages "
                 f"({human_bytes(plan.stored_nbytes)}), {plan.pages_left:,} to copy into "
                 f"segment files ({human_bytes(plan.copy_nbytes)}){resumed}; "
                 f"{plan.quarantined} quarantined copies")
    stdout.print(f"disk: needs {human_bytes(plan.need_nbytes)} free, "
                 f"{human_bytes(plan.free_nbytes)} free; data.mdb is "
                 f"{human_bytes(plan.data_file_nbytes)}")


def _print_result(result: dict) -> None:
    stdout.print(f"migrated {result['pages']:,} pages to schema 2 ({result['copied_pages']:,} "
                 f"copied in this run, {human_bytes(result['copied_nbytes'])}"
                 + (", resumed" if result["resumed"] else "") + f") into "
                 f"{result['segments']} segment file(s)")
    if result["damaged_pages"]:
        stdout.print(f"[yellow]{len(result['damaged_pages'])} page(s) failed verification at "
                     "version 1 and were carried over unchanged: `kvstore check --read-data` "
                     "lists them, a read quarantines them[/yellow]")
    if result["dropped_quarantined"]:
        stdout.print(f"dropped {result['dropped_quarantined']} quarantined copies whose header "
                     "cannot be read (as `kvstore gc` would)")
    before, after = result["data_file_nbytes_before"], result["data_file_nbytes_after"]
    if result["compacted"]:
        stdout.print(f"data.mdb compacted: {human_bytes(before)} -> {human_bytes(after)}")
    else:
        note = result["compact_note"] or "skipped (--no-compact)"
        stdout.print(f"data.mdb not compacted ({note}): it keeps {human_bytes(after)}")


__all__ = ["migrate"]
