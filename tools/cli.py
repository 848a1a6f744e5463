"""The `kvstore` command line: thin wrappers over kvstore and api.

Each command is one function below: its docstring is its --help text and ends with
an example; it parses options, calls one package function, and turns errors into a
message and an exit code at this edge (see `fail`). Commands that read a store take
--data-dir for a local directory or --url/--token for a running service.

Exit codes: 0 success; 1 the operation failed (a store error); 2 bad usage (typer's
own); 3 refused for safety (for example an unsafe bind).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tools.commands import register as register_operator_commands

app = typer.Typer(name="kvstore", help="Operate an mlx-kvstore page store.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)



@app.callback()
def _root() -> None:
    """Operate an mlx-kvstore page store: serve it over HTTP, inspect it, check it, collect garbage."""


EXIT_FAILED = 1
EXIT_REFUSED = 3


def fail(message: str, code: int = EXIT_FAILED) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


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
        fail(f"bad settings: {exc}", 2)
    try:
        run_server(settings)
    except UnsafeBind as exc:
        fail(str(exc), EXIT_REFUSED)


register_operator_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
