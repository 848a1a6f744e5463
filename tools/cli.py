"""The `kvstore` command line: thin wrappers over kvstore and api.

Each command is one function below: its docstring is its --help text and ends with
an example; it parses options, calls one package function, and turns errors into a
message and an exit code at this edge (see `fail`). Commands that read a store take
--data-dir for a local directory or --url/--token for a running service.

Exit codes are the ones every command shares (tools/commands/common.py EXIT_CODES):
0 ok; 1 problems found or the operation failed; 2 usage error (bad settings, or an
unsafe bind such as a non-loopback host without a token); 3 not found; 4
incompatible or corrupt; 5 conflict; 6 access denied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tools.commands import register as register_operator_commands
from tools.commands.common import EXIT_USAGE, fail, store_errors

app = typer.Typer(name="kvstore", help="Operate an mlx-kvstore page store.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)



@app.callback()
def _root() -> None:
    """Operate an mlx-kvstore page store: serve it over HTTP, inspect it, check it, collect garbage."""


@app.command()
def serve(
    data_dir: Annotated[Optional[Path], typer.Option(
        "--data-dir", help="store directory [env KVSTORE_DIR; default ./var/kvstore]")] = None,
    host: Annotated[Optional[str], typer.Option(
        help="bind address [env KVSTORE_HOST; default 127.0.0.1]")] = None,
    port: Annotated[Optional[int], typer.Option(help="port [env KVSTORE_PORT; default 8700]")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="TOML settings file [env KVSTORE_CONFIG]")] = None,
    tokens_file: Annotated[Optional[Path], typer.Option(
        "--tokens-file", help="TOML file of tokens and namespaces [env KVSTORE_TOKENS_FILE]")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="uvicorn log level [default info]")] = None,
) -> None:
    """Start the HTTP service on a store directory.

    Listens on 127.0.0.1:8700 with ./var/kvstore unless told otherwise. Tokens come from the environment (KVSTORE_TOKEN, KVSTORE_ADMIN_TOKEN) or --tokens-file, never from flags (they would show in `ps`). A non-loopback --host needs a token.

    Example:

        KVSTORE_TOKEN=$(openssl rand -hex 24) kvstore serve --data-dir /srv/kvstore --port 8700
    """
    from api.server import UnsafeBind
    from api.server import serve as run_server
    from api.settings import Settings

    try:
        settings = Settings.load(config, data_dir=data_dir, host=host, port=port,
                                 tokens_file=tokens_file, log_level=log_level)
    except (ValueError, OSError) as exc:
        fail(f"bad settings: {exc}", EXIT_USAGE)
    _refuse_a_damaged_store(Path(settings.data_dir))
    try:
        run_server(settings)
    except UnsafeBind as exc:
        fail(str(exc), EXIT_USAGE)


def _refuse_a_damaged_store(path: Path) -> None:
    """The service opens its store inside uvicorn's lifespan, where a refusal would end
    in a traceback: a damaged store (StoreCorrupt, exit 4) is refused here first, in one
    line. The open writes nothing to a damaged store; a new directory is left to the
    service."""
    from kvstore.store import Store

    if (path / "data.mdb").exists():
        with store_errors():
            Store(path).close()


register_operator_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
