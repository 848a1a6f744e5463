"""What every operator command shares: the store switch, exit codes, output and units.

The store switch. A command takes either --data-dir (a local store directory, opened
as kvstore.store.Store) or --url/--token (a running service, opened as
kvstore.client.RemoteStore); both implement the same store protocol, so a command
body never asks which one it holds, except where a read has no HTTP route yet (those
say so and carry on with what they can show).

Chain salts. A store with salted namespaces (docs/api.md "Tenants") is opened with the
same tokens file the service reads: --tokens-file, or KVSTORE_TOKENS_FILE as for
`kvstore serve`; its [[namespace]] chain salts go into StoreConfig.chain_salts through
api.auth.chain_salts_from_settings, the service's own loader. Opened without salts, a
store that holds salted block records is refused in one line that says so (exit 2)
rather than reported record by record; finding out costs one pass over the block
records' flag bytes (1.5 s per million blocks on the 2-core dev machine), made only
when no salts were given.

Exit codes (the same for every command; docs/operations.md lists them):

    0  ok
    1  problems found (check, formats --diff) or the operation failed
       (I/O, store full, service unreachable)
    2  usage error: a bad option, size, duration, name or digest
    3  not found: no such store, checkpoint, block, page or format
    4  incompatible or corrupt: a format identity that differs or is newer than this
       code, a damaged page, a damaged store (StoreCorrupt), a corrupt or foreign
       export file
    5  conflict: the checkpoint exists (pass --replace), or another GC is running
    6  access denied by the service (wrong token, or a user token on an admin route)

Errors are turned into a message and one of these codes here, at the edge, and
nowhere else (see `store_errors`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from kvstore.errors import (
    AlreadyExists,
    GCAborted,
    IncompatibleFormat,
    IntegrityError,
    InvalidInput,
    KVStoreError,
    NotFound,
    StoreCorrupt,
)

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INCOMPATIBLE = 4
EXIT_CONFLICT = 5
EXIT_DENIED = 6

EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_PROBLEMS: "problems found, or the operation failed",
    EXIT_USAGE: "usage error",
    EXIT_NOT_FOUND: "not found",
    EXIT_INCOMPATIBLE: "incompatible or corrupt",
    EXIT_CONFLICT: "conflict (exists, or another GC runs)",
    EXIT_DENIED: "access denied",
}

DEFAULT_DATA_DIR = Path("./var/kvstore")

# Piped output (scripts, CI logs, tests) is not squeezed into 80 columns.
_WIDTH = int(os.environ.get("COLUMNS", "0") or 0) or (None if sys.stdout.isatty() else 160)
stdout = Console(highlight=False, width=_WIDTH)
stderr = Console(stderr=True, highlight=False, width=_WIDTH)


# -- shared options ----------------------------------------------------------------------
DataDirOption = typer.Option(
    None, "--data-dir", "-d", envvar="KVSTORE_DIR", show_envvar=True,
    help="store directory (default ./var/kvstore)")
UrlOption = typer.Option(
    None, "--url", envvar="KVSTORE_URL", show_envvar=True,
    help="a running service instead of a directory, e.g. http://127.0.0.1:8700")
TokenOption = typer.Option(
    None, "--token", envvar="KVSTORE_TOKEN", show_envvar=True,
    help="bearer token for --url (admin commands need the admin token)")
TokensFileOption = typer.Option(
    None, "--tokens-file", envvar="KVSTORE_TOKENS_FILE", show_envvar=True,
    help="the service's tokens file: its [[namespace]] chain salts open a store with "
         "salted namespaces (local stores only)")
JsonOption = typer.Option(False, "--json", help="print one JSON document on stdout for scripts")


@dataclass(frozen=True)
class Target:
    """Where a command's store is: a local directory or a service URL."""

    data_dir: Optional[Path]
    url: Optional[str]
    token: Optional[str]
    tokens_file: Optional[Path] = None  # chain salts for a local store (ignored with url)

    @property
    def remote(self) -> bool:
        return self.url is not None

    def describe(self) -> str:
        return self.url if self.remote else str(self.data_dir or DEFAULT_DATA_DIR)


def target(data_dir: Optional[Path], url: Optional[str], token: Optional[str],
           tokens_file: Optional[Path] = None) -> Target:
    from_env = os.environ.get("KVSTORE_DIR")
    if url and data_dir and not (from_env and Path(from_env) == Path(data_dir)):
        fail("pass --data-dir or --url, not both", EXIT_USAGE)
    return Target(None if url else data_dir, url or None, token or None, tokens_file or None)


def chain_salts(tokens_file: Optional[Path]):
    """The ChainSalts of the service's tokens file (none without one), read by the
    service's own loader so the CLI and `kvstore serve` cannot disagree."""
    from api.auth import chain_salts_from_settings
    from api.settings import Settings
    from kvstore.ids import ChainSalts

    if tokens_file is None:
        return ChainSalts()
    try:
        return chain_salts_from_settings(Settings(tokens_file=tokens_file))
    except FileNotFoundError:
        fail(f"no tokens file at {tokens_file} (--tokens-file / KVSTORE_TOKENS_FILE)", EXIT_NOT_FOUND)
    except (ValueError, OSError, KVStoreError) as exc:  # tomllib and pydantic errors are ValueErrors
        fail(f"bad tokens file {tokens_file}: {' '.join(str(exc).split())}", EXIT_USAGE)


def count_salted_blocks(store) -> int:
    """How many block records of a local store are keyed by a chain salt (the record's
    flag bit, docs/format.md section 5); one pass over the block records."""
    from kvstore.records import BLOCK_FLAG_SALTED

    with store.index.read() as index:
        return sum(1 for _, value in index.block_records()
                   if len(value) > 1 and value[1] & BLOCK_FLAG_SALTED)


@contextmanager
def open_store(where: Target, *, write: bool = False, create: bool = False) -> Iterator[Any]:
    """The store object for a command: Store for a directory, RemoteStore for a URL.

    Read-only commands open the directory read-only, so they never take a writer's
    place. Only `create` (import) makes a new store; for every other command a
    missing store is 'not found' (exit 3), not a new empty one."""
    if where.remote:
        from kvstore.client import RemoteStore

        with store_errors(), RemoteStore(where.url, where.token) as store:
            yield store
        return
    from kvstore.store import Store, StoreConfig

    path = Path(where.data_dir or DEFAULT_DATA_DIR)
    if not (path / "data.mdb").exists() and not create:
        fail(f"no store at {path} (pass --data-dir, set KVSTORE_DIR, or --url)", EXIT_NOT_FOUND)
    salts = chain_salts(where.tokens_file)
    with store_errors():
        store = Store(path, StoreConfig(chain_salts=salts), readonly=not write)
    try:
        if not salts:
            with store_errors():
                salted = count_salted_blocks(store)
            if salted:
                fail(f"{salted:,} block record(s) in {path} are keyed by a namespace's chain salt "
                     "and no salts were given: pass --tokens-file with the service's tokens file "
                     "(or set KVSTORE_TOKENS_FILE)", EXIT_USAGE)
        yield store
    finally:
        store.close()


def is_local(store) -> bool:
    from kvstore.store import Store

    return isinstance(store, Store)


# -- errors -> messages and exit codes ------------------------------------------------------
def fail(message: str, code: int = EXIT_PROBLEMS) -> None:
    stderr.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)  # one line, for logs
    raise typer.Exit(code)


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def exit_code_for(exc: BaseException) -> int:
    from tools.portable import ExportFileError

    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(exc, (IncompatibleFormat, IntegrityError, StoreCorrupt, ExportFileError)):
        return EXIT_INCOMPATIBLE
    if isinstance(exc, (AlreadyExists, GCAborted)):
        return EXIT_CONFLICT
    if isinstance(exc, PermissionError) or getattr(exc, "code", "") == "access_denied":
        return EXIT_DENIED
    if isinstance(exc, InvalidInput):
        return EXIT_USAGE
    return EXIT_PROBLEMS


@contextmanager
def store_errors() -> Iterator[None]:
    """Turn what kvstore (or the HTTP client) raises into a message and an exit code."""
    import httpx

    try:
        yield
    except KVStoreError as exc:
        fail(f"{exc} [{getattr(exc, 'code', type(exc).__name__)}]", exit_code_for(exc))
    except httpx.TransportError as exc:
        fail(f"cannot reach the service: {exc}", EXIT_PROBLEMS)
    except FileNotFoundError as exc:
        fail(str(exc), EXIT_NOT_FOUND)
    except OSError as exc:
        fail(str(exc), EXIT_PROBLEMS)


# -- output ------------------------------------------------------------------------------
def emit_json(document: Any) -> None:
    """One JSON document on stdout (bytes as hex, sets as lists)."""
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def progress_bar(enabled: bool = True) -> Progress:
    """A rich progress bar with bytes, bytes/s and ETA, on stderr. Disabled (drawn
    nowhere) when stderr is not a terminal or when --json asked for clean output."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
        TransferSpeedColumn(), TimeRemainingColumn(), TimeElapsedColumn(),
        console=stderr, transient=True, disable=not (enabled and stderr.is_terminal))


# -- units -------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[_p] = 1024**_i          # bare K, M, G: binary, like dd and docker
    _SIZE_UNITS[_p + "ib"] = 1024**_i
    _SIZE_UNITS[_p + "i"] = 1024**_i
    _SIZE_UNITS[_p + "b"] = 1000**_i    # KB, MB, GB: decimal, like disk vendors


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '2G' -> 2 GiB; '4096' -> 4096 bytes."""
    match = _SIZE.match(text or "")
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise typer.BadParameter(f"{text!r} is not a size; use e.g. 4096, 512MiB, 2GB or 1.5GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """'30s', '10m', '1h', '1h30m', '2d', '0' or a plain number of seconds -> seconds."""
    text = (text or "").strip().lower()
    pos, total = 0, 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if not match or match.end() == pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not text or pos != len(text):
        raise typer.BadParameter(f"{text!r} is not a duration; use e.g. 30s, 10m, 1h or 1h30m")
    return total


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def human_age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def human_duration(seconds: float) -> str:
    return human_age(seconds) if seconds else "0s"
