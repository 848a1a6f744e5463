"""Factories for the CLI tests: a typer app with the operator commands, a runner that
returns (exit code, stdout, stderr), and small stores built with the kvstore factories.

Stores here are real LMDB directories in tmp_path, closed before a command opens
them, exactly as an operator would meet them."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer
from typer.testing import CliRunner

from kvstore.store import Store
from tests.kvstore.factories import make_identity, make_layer, save_prefix
from tools.commands import register

IDENTITY = make_identity()                                    # native-bf16 + k8v4 + sliding
NATIVE_IDENTITY = make_identity(layers=(make_layer(), make_layer(k_head_dim=32)))


def make_app() -> typer.Typer:
    app = typer.Typer(name="kvstore", no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """kvstore (test app)"""

    return register(app)


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def run(*args, env: dict | None = None) -> Ran:
    result = CliRunner().invoke(make_app(), [str(a) for a in args], env=env or {"KVSTORE_DIR": None})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


def build_store(path: Path) -> dict:
    """Two checkpoints in two namespaces, one unpinned prefix sharing blocks with a
    checkpoint, and a native-only checkpoint for mlx-lm export."""
    with Store(path) as store:
        sys_prompt = save_prefix(store, IDENTITY, "default", list(range(40)), checkpoint="system-prompt")
        loose = save_prefix(store, IDENTITY, "default", list(range(30)) + [999] * 7)
        short = save_prefix(store, IDENTITY, "team-a", list(range(12)), checkpoint="short")
        native = save_prefix(store, NATIVE_IDENTITY, "default", list(range(10)), checkpoint="native")
    return {"system-prompt": sys_prompt, "loose": loose, "short": short, "native": native}


ADMIN_TOKEN = "operator-admin-token-0123456789"   # every namespace, admin routes
USER_TOKEN = "operator-user-token-0123456789"     # namespace "default" only


@contextmanager
def live_service(path: Path, *, wrap=None, **settings):
    """A real uvicorn serving api.create_app over the store at `path`, in a thread, on
    a free loopback port. Yields the base URL. Skips when api/ is absent."""
    import pytest

    app_module = pytest.importorskip("api.app")
    settings_module = pytest.importorskip("api.settings")
    import uvicorn

    store = Store(path)
    app = app_module.create_app(store=store, settings=settings_module.Settings(data_dir=path, **settings))
    app = wrap(app) if wrap else app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                          lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        store.close()
