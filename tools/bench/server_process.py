"""Server subprocesses for the serve-model tests and benchmark: stock mlx_lm.server,
`kvstore serve-model` and `kvstore serve`, started on 127.0.0.1 and stopped with SIGINT
(all stop cleanly on it; serve-model drains its write-behind queue first)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 90.0  # serve-model drains its uploads first (--drain-timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvstore_cli() -> list[str]:
    return [PYTHON, "-c", "from tools.cli import main; main()"]


class ServerProcess:
    """One server subprocess. Its stdout+stderr go to log_path (read it on failure)."""

    def __init__(self, argv: list[str], *, env: dict, log_path: Path, health: str = "/health"):
        self.port = free_port()
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env, self.log_path, self.health = env, log_path, health
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base_url + self.health, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not answer {self.health} in {START_TIMEOUT_S}s:\n{self.log()}")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {'name{labels}': value}."""
        out = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def server_env(hf_home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # the repository first, then whatever PYTHONPATH already named (packages installed
    # with --target on a machine without a virtualenv, e.g. MLX on the GPU machine)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=path)
    return env


def stock_server(model_dir: Path, env: dict, log_path: Path, *extra: str) -> ServerProcess:
    return ServerProcess([PYTHON, "-m", "mlx_lm", "server", "--model", str(model_dir), *extra],
                         env=env, log_path=log_path)


def serve_model(model_dir: Path, env: dict, log_path: Path, *extra: str) -> ServerProcess:
    return ServerProcess([*_kvstore_cli(), "serve-model", "--model", str(model_dir), *extra],
                         env=env, log_path=log_path)


def kvstore_serve(data_dir: Path, env: dict, log_path: Path, token: str) -> ServerProcess:
    env = {**env, "KVSTORE_TOKEN": token}
    return ServerProcess([*_kvstore_cli(), "serve", "--data-dir", str(data_dir)], env=env,
                         log_path=log_path, health="/v1/health")


def as_json(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
