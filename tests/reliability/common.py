"""Shared pieces of the reliability suite: METRIC lines, subprocesses, a live server
that can be SIGKILLed and restarted on the same port, and store-wide invariants."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.kvstore import workers as kv_workers
from tests.kvstore.factories import expected_pages

REPO = Path(__file__).resolve().parents[2]
SOAK = os.environ.get("KVSTORE_SOAK") == "1"
IDENTITY = kv_workers.IDENTITY


def metric(name: str, **figures) -> str:
    """Print one `METRIC name k=v ...` line (pytest -s shows it; -rA keeps it)."""
    parts = " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
    line = f"METRIC {name} {parts}"
    print(line, flush=True)
    out = os.environ.get("KVSTORE_METRICS_FILE")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    return line


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def spawn(*args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """python -m tests.reliability.workers ARGS..., in its own process group."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "tests.reliability.workers", *args], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def read_status(sock: socket.socket) -> int | None:
    """The status of the first response on sock, read up to its first CRLF; None when
    the peer closed without one. Timeouts and resets are the caller's to judge."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data[9:12]) if data.startswith(b"HTTP/1.1 ") else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KillableServer:
    """The service (api.server.serve, as `kvstore serve` runs it) on a fixed port,
    restarted after each SIGKILL on the same port so clients keep their URL."""

    def __init__(self, data_dir: Path, log: Path, env: dict | None = None):
        self.data_dir, self.log = data_dir, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"KVSTORE_DIR": str(data_dir), "KVSTORE_PORT": str(self.port),
                    "KVSTORE_LOG_LEVEL": "warning", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 60.0) -> None:
        self.proc = spawn("serve", env=self.env, log=self.log)
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server did not start in {timeout_s} s: {self.tail()}")
            time.sleep(0.05)

    def sigkill(self) -> None:
        kill(self.proc)

    def rss_kib(self, field: str = "VmRSS") -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} for pid {self.proc.pid}")

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def tree_digest(root: Path) -> str:
    """sha256 over every path name and file content under root (symlinks not followed)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_symlink():
            h.update(b"->" + os.readlink(path).encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def restore_exact(store, namespace: str, tokens) -> tuple[int, bool]:
    """(tokens matched, every restored byte right) for one prefix, any store protocol."""
    match = store.lookup_prefix(IDENTITY.format_id, namespace, tokens)
    digests = [d for b in match.blocks for d in b.pages]
    want = expected_pages(IDENTITY, match.blocks)
    got = store.read_pages(digests) if digests else []
    return match.tokens_matched, [bytes(g) for g in got] == want


def verify_entries(store, entries: list[dict]) -> dict:
    """Every acknowledged save restores in full, byte-identically; every acknowledged
    checkpoint exists and names its tokens. Returns counts of each failure kind."""
    lost = wrong = ckpt_lost = 0
    for e in entries:
        matched, exact = restore_exact(store, e["ns"], e["tokens"])
        lost += matched != len(e["tokens"])
        wrong += not exact
        if e.get("checkpoint"):
            try:
                ok = list(store.get_checkpoint(e["ns"], e["checkpoint"]).tokens) == e["tokens"]
            except KeyError:
                ok = False
            ckpt_lost += not ok
    return {"lost": lost, "wrong": wrong, "checkpoints_lost": ckpt_lost}


def partial_checkpoints(store) -> int:
    """Checkpoints whose tokens do not restore in full (each must be all or nothing)."""
    bad = 0
    for c in store.list_checkpoints():
        matched, exact = restore_exact(store, c.namespace, list(c.tokens))
        bad += matched != len(c.tokens) or not exact
    return bad
