"""Fixtures for the API tests: apps over temporary stores, clients per token, and a
real uvicorn subprocess. Tokens map to namespaces as a deployment would:

    USER_A  -> namespace team-a        USER_B -> namespace team-b
    ADMIN   -> every namespace, admin routes too
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from kvstore.client import RemoteStore
from tests.kvstore.factories import make_store

REPO = Path(__file__).resolve().parents[2]
USER_A = "user-a-0123456789abcdef"
USER_B = "user-b-0123456789abcdef"
ADMIN = "admin-0123456789abcdef00"
TOKENS_TOML = f"""
[[token]]
secret = "{USER_A}"
namespace = "team-a"
[[token]]
secret = "{USER_B}"
namespace = "team-b"
[[token]]
secret = "{ADMIN}"
namespace = "*"
admin = true
"""


def write_tokens_file(directory: Path) -> Path:
    path = directory / "tokens.toml"
    path.write_text(TOKENS_TOML)
    path.chmod(0o600)
    return path


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture
def open_client(store):
    """An app without tokens (the loopback default) over `store`."""
    with TestClient(create_app(store=store, settings=Settings(data_dir=store.path))) as client:
        yield client


@pytest.fixture
def secured_app(tmp_path, store):
    settings = Settings(data_dir=store.path, tokens_file=write_tokens_file(tmp_path))
    return create_app(store=store, settings=settings)


def client_for(app, token: str | None) -> TestClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return TestClient(app, headers=headers)


def remote_for(client: TestClient, token: str | None = None) -> RemoteStore:
    return RemoteStore("http://testserver", token, client=client)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python -m tools.cli serve` on a free loopback port, as an operator runs it."""

    def __init__(self, data_dir: Path, env: dict | None = None):
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "KVSTORE_DIR": str(data_dir), "KVSTORE_PORT": str(self.port),
                    "KVSTORE_LOG_LEVEL": "warning", "PYTHONPATH": str(REPO), **(env or {})}
        self.log = open(data_dir.parent / f"server-{self.port}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve"], cwd=REPO,
                                     env=full_env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"server exited: {self.read_log()}"
            try:
                if httpx.get(self.url + "/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start in 30 s"
            time.sleep(0.1)

    def read_log(self) -> str:
        self.log.flush()
        return (self.data_dir.parent / f"server-{self.port}.log").read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.url + "/v1/health").status_code == 200

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("live")
    (base / "store").mkdir()
    server = LiveServer(base / "store", {"KVSTORE_TOKENS_FILE": str(write_tokens_file(base)),
                                         "KVSTORE_MAP_NBYTES": str(1 << 20)})
    yield server
    server.stop()
