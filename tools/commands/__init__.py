"""The operator commands of the `kvstore` CLI: register(app) adds them to a typer app.

    ls        checkpoints and stored prefixes          (inspect.py)
    show      one checkpoint, block, page or format
    formats   format identities, and a diff of two
    stats     usage, dedup, hits, eviction and GC history
    check     typed problem report                     (maintain.py)
    gc        collect unreferenced pages
    evict     evict down to a byte budget
    export    checkpoint -> portable file or mlx-lm file (transfer.py, tools/portable.py)
    import    portable file -> checkpoint, verified first
    migrate   a schema-1 store to schema 2 (segment files)  (migrate.py)
    bench     run tools/bench suites                   (bench.py)
    serve-model  mlx_lm.server with the store as its L2 prompt cache (serve_model.py)

Each works on --data-dir or --url/--token, has --json, and uses the exit codes of
tools/commands/common.py. A command's docstring is its --help, ending in an example.
"""

from __future__ import annotations

import typer

from tools.commands.common import EXIT_CODES

COMMANDS = ("ls", "show", "formats", "stats", "check", "gc", "evict", "export", "import", "bench",
            "serve-model", "migrate")

EPILOG = "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items())


def register(app: typer.Typer) -> typer.Typer:
    """Add every operator command to `app` (the `kvstore` CLI in tools/cli.py)."""
    from tools.commands import bench, inspect, maintain, transfer

    for name, fn in (("ls", inspect.ls), ("show", inspect.show), ("formats", inspect.formats),
                     ("stats", inspect.stats), ("check", maintain.check), ("gc", maintain.gc),
                     ("evict", maintain.evict), ("export", transfer.export),
                     ("import", transfer.import_), ("bench", bench.bench)):
        app.command(name, epilog=EPILOG)(fn)
    from tools.commands import migrate, serve_model

    app.command("migrate", epilog=EPILOG)(migrate.migrate)

    app.command("serve-model", epilog=EPILOG,
                context_settings=serve_model.CONTEXT_SETTINGS)(serve_model.serve_model)
    return app


__all__ = ["register", "COMMANDS"]
