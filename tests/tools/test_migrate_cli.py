"""`kvstore migrate` through typer's CliRunner on the golden schema-1 fixture: the plan
changes nothing, execute migrates (and `check --read-data` passes after), a second run
has nothing to do, refusals exit with their documented codes, and the copy draws a
rich progress bar on a terminal."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tests.kvstore.test_migrate import ROOT, add_v1_pages, dump
from tests.kvstore.test_v1_fixture import unpack
from tests.tools.helpers import run
from tools.commands.common import (
    EXIT_CONFLICT,
    EXIT_INCOMPATIBLE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
)


@pytest.fixture
def v1(tmp_path) -> Path:
    return unpack(tmp_path / "v1")


def test_plan_then_migrate_then_nothing_to_do(v1):
    raw = (v1 / "data.mdb").read_bytes()
    ran = run("migrate", v1, "--plan", "--json")
    assert ran.code == EXIT_OK, ran.stderr
    doc = ran.json()
    assert doc["executed"] is False and doc["plan"]["pages"] == 20
    assert doc["plan"]["pages_left"] == 20 and doc["plan"]["refusals"] == []
    assert (v1 / "data.mdb").read_bytes() == raw and not (v1 / "segments").exists()

    ran = run("migrate", v1)  # no terminal to ask on, no --yes: refused, nothing changed
    assert ran.code == EXIT_USAGE and "--yes" in ran.stderr
    assert (v1 / "data.mdb").read_bytes() == raw

    ran = run("migrate", v1, "--yes")
    assert ran.code == EXIT_OK, ran.stderr
    assert "plan: " in ran.stdout and "migrated 20 pages to schema 2" in ran.stdout
    assert "data.mdb compacted" in ran.stdout
    assert run("check", "--read-data", "-d", v1).code == EXIT_OK
    ran = run("migrate", v1, "--json", "--yes")
    assert ran.code == EXIT_OK and ran.json()["plan"]["nothing_to_do"] is True
    assert "schema version 2 already" in run("migrate", v1).stdout


def test_json_execute_reports_the_result(v1):
    ran = run("migrate", v1, "--yes", "--json", "--no-compact")
    assert ran.code == EXIT_OK, ran.stderr
    result = ran.json()["result"]
    assert result["pages"] == 20 and result["copied_pages"] == 20
    assert result["compacted"] is False and result["damaged_pages"] == []


def test_refusals_exit_with_their_codes(v1, tmp_path):
    assert run("migrate", tmp_path / "nowhere").code == EXIT_NOT_FOUND
    (v1 / "segments").mkdir()
    (v1 / "segments" / "00000003.seg").write_bytes(b"")
    ran = run("migrate", v1, "--yes")
    assert ran.code == EXIT_INCOMPATIBLE
    assert "refused (foreign_segments)" in ran.stderr and "Move them" in ran.stderr
    (v1 / "segments" / "00000003.seg").unlink()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from kvstore.store import Store; "
         "s = Store(sys.argv[1], readonly=True); print('open', flush=True); time.sleep(60)",
         str(v1)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"open"
        ran = run("migrate", v1, "--yes")
        assert ran.code == EXIT_CONFLICT and f"process {holder.pid}" in ran.stderr
    finally:
        holder.kill()
        holder.wait()
    assert dump(v1)["meta"][b"schema_version"] == (1).to_bytes(8, "big")


def test_execute_draws_a_progress_bar_on_a_terminal(v1, monkeypatch):
    from tools.commands import common

    add_v1_pages(v1, [bytes([i]) * 70000 for i in range(1, 9)])
    screen = io.StringIO()
    monkeypatch.setattr(common, "stderr", Console(file=screen, force_terminal=True, width=120))
    ran = run("migrate", v1, "--yes")
    assert ran.code == EXIT_OK, ran.stderr
    drawn = screen.getvalue()
    assert "migrate" in drawn and re.search(r"\d+(\.\d)?/\d+(\.\d)? (bytes|KiB)", drawn), drawn[-500:]
