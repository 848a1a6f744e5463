"""Every operator command through typer's CliRunner against a real temporary store:
--json parses, exit codes are the documented ones, help has an example."""

from __future__ import annotations

import re

import pytest
import typer

from kvstore.store import Store
from tests.kvstore.factories import flip_bit, stored_places, stored_value
from tests.tools.helpers import IDENTITY, build_store, run
from tools.commands import COMMANDS
from tools.commands.common import (
    EXIT_CONFLICT,
    EXIT_INCOMPATIBLE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    parse_duration,
    parse_size,
)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "store"
    saved = build_store(path)
    return path, saved


# -- --json on every command -------------------------------------------------------------------
def json_cases(path, saved, tmp):
    block = saved["loose"].records[-1].key.hex()
    page = saved["loose"].records[0].pages[0].hex()
    return {
        "ls": ["ls"],
        "show": ["show", "default/system-prompt"],
        "show-block": ["show", block],
        "show-page": ["show", page],
        "show-format": ["show", IDENTITY.format_id_hex],
        "formats": ["formats"],
        "stats": ["stats"],
        "check": ["check", "--read-data", "--subset", "1/2"],
        "gc": ["gc", "--dry-run", "--grace", "10m"],
        "evict": ["evict", "--to", "1GiB"],
        "export": ["export", "short", tmp / "short.safetensors", "-n", "team-a"],
    }


def test_every_command_json_parses(store_dir, tmp_path):
    path, saved = store_dir
    for label, args in json_cases(path, saved, tmp_path).items():
        ran = run(*args, "--json", "-d", path)
        assert ran.code == EXIT_OK, (label, ran.stderr)
        doc = ran.json()
        assert isinstance(doc, dict) and doc, label
    ran = run("import", tmp_path / "short.safetensors", "--verify-only", "--json", "-d", path)
    assert ran.code == EXIT_OK and ran.json()["verified"] is True


def test_ls_lists_checkpoints_and_prefixes_with_filters(store_dir):
    path, saved = store_dir
    doc = run("ls", "--json", "-d", path).json()
    kinds = sorted((e["kind"], e["namespace"], e["tokens"]) for e in doc["entries"])
    assert kinds == [("checkpoint", "default", 10), ("checkpoint", "default", 40),
                     ("checkpoint", "team-a", 12), ("prefix", "default", 10),
                     ("prefix", "default", 37), ("prefix", "default", 40), ("prefix", "team-a", 12)]
    loose = [e for e in doc["entries"] if e["kind"] == "prefix" and e["tokens"] == 37]
    assert loose[0]["evictable"] and loose[0]["name"] == saved["loose"].records[-1].key.hex()
    evictable = run("ls", "--json", "--evictable", "-d", path).json()["entries"]
    assert [e["tokens"] for e in evictable] == [37]
    team = run("ls", "--json", "--namespace", "team-a", "--kind", "checkpoint", "-d", path).json()
    assert [e["name"] for e in team["entries"]] == ["short"]
    by_bytes = run("ls", "--json", "--sort", "bytes", "-r", "--limit", "2", "-d", path).json()["entries"]
    assert [e["tokens"] for e in by_bytes] == [40, 40]
    packed = run("ls", "--json", "--format", "k8v4", "-d", path).json()["entries"]
    assert packed and all("k8v4" in e["page_format"] for e in packed)
    human = run("ls", "-d", path)
    assert human.code == EXIT_OK and "system-prompt" in human.stdout and "evictable" in human.stdout


def test_show_resolves_each_kind(store_dir):
    path, saved = store_dir
    ckpt = run("show", "system-prompt", "--json", "-d", path).json()
    assert ckpt["kind"] == "checkpoint"
    assert ckpt["format"]["format_id"] == IDENTITY.format_id_hex
    assert len(ckpt["page_table"]) == 10 and len(ckpt["page_table"][0]["pages"]) == 2
    assert ckpt["page_table"][0]["chain_key"] == saved["system-prompt"].records[0].key.hex()
    block = saved["system-prompt"].records[3]
    shown = run("show", block.key.hex(), "--json", "-d", path).json()
    assert shown["kind"] == "block" and shown["tokens"] == list(block.tokens)
    assert shown["references"]["checkpoints"] == ["default/system-prompt"]
    page = run("show", block.pages[0].hex(), "--json", "-d", path).json()
    assert page["kind"] == "page" and page["raw_nbytes"] == 512 and page["refcount"] >= 1
    assert run("show", IDENTITY.format_id_hex, "--json", "-d", path).json()["kind"] == "format"
    text = run("show", "team-a/short", "-d", path)
    assert text.code == EXIT_OK and "page table" in text.stdout and "signed-hadamard:7" in text.stdout


def test_formats_diff_exit_codes(store_dir):
    path, _ = store_dir
    listed = run("formats", "--json", "-d", path).json()["formats"]
    assert len(listed) == 2
    a, b = (f["format_id"] for f in listed)
    same = run("formats", "--diff", a[:10], "--diff", a, "--json", "-d", path)
    assert same.code == EXIT_OK and same.json()["equal"] is True
    differ = run("formats", "--diff", a, "--diff", b, "--json", "-d", path)
    assert differ.code == EXIT_PROBLEMS
    fields = {d["field"] for d in differ.json()["diff"]}
    assert "len(layers)" in fields
    assert run("formats", "--diff", "ffff" * 4, "--diff", a, "-d", path).code == EXIT_NOT_FOUND
    assert run("formats", "--diff", a, "-d", path).code == EXIT_USAGE


def test_stats_reports_usage_dedup_and_largest(store_dir):
    path, _ = store_dir
    doc = run("stats", "--json", "-d", path).json()
    s = doc["stats"]
    assert s["checkpoint_count"] == 3 and s["dedup_ratio"] > 1.0
    assert doc["largest"][0]["tokens"] == 40 and doc["gc_history"] == []
    assert "dedup" in run("stats", "-d", path).stdout


# -- exit codes -----------------------------------------------------------------------------------
def test_usage_and_not_found_exit_codes(store_dir, tmp_path):
    path, _ = store_dir
    assert run("ls", "-d", tmp_path / "nothing-here").code == EXIT_NOT_FOUND
    assert run("gc", "-d", tmp_path / "nothing-here").code == EXIT_NOT_FOUND
    assert run("evict", "--to", "1G", "-d", tmp_path / "nothing-here").code == EXIT_NOT_FOUND
    assert not (tmp_path / "nothing-here").exists(), "a command other than import created a store"
    assert run("show", "no-such-checkpoint", "-d", path).code == EXIT_NOT_FOUND
    assert run("show", "default/no-such", "-d", path).code == EXIT_NOT_FOUND
    assert run("export", "nope", tmp_path / "x.safetensors", "-d", path).code == EXIT_NOT_FOUND
    assert run("import", tmp_path / "missing.safetensors", "-d", path).code == EXIT_NOT_FOUND
    assert run("export", "native", tmp_path / "x.bin", "--mlx-lm", "-d", path).code == EXIT_USAGE
    assert run("export", "native", tmp_path / "no" / "dir.safetensors", "-d", path).code == EXIT_NOT_FOUND
    assert run("show", "../etc", "-d", path).code == EXIT_USAGE
    assert run("check", "--subset", "3/2", "-d", path).code == EXIT_USAGE
    assert run("evict", "--to", "lots", "-d", path).code == EXIT_USAGE
    assert run("gc", "--grace", "soon", "-d", path).code == EXIT_USAGE
    assert run("ls", "--sort", "colour", "-d", path).code == EXIT_USAGE
    assert run("bench", "--suite", "nope").code == EXIT_USAGE
    assert run("no-such-command").code == EXIT_USAGE


def test_check_exit_code_follows_problems(tmp_path):
    path = tmp_path / "store"
    saved = build_store(path)
    assert run("check", "--read-data", "-d", path).code == EXIT_OK
    with Store(path) as store:  # a page whose value is stored once (no stale copy)
        candidates = [(d, stored_value(store, d)) for r in saved["loose"].records for d in r.pages]
    victim, value = next((d, v) for d, v in candidates if len(stored_places(path, v)) == 1)
    flip_bit(path, value, 48 * 8 + 100)  # one bit of the page body
    ran = run("check", "--read-data", "--json", "-d", path)
    assert ran.code == EXIT_PROBLEMS
    assert ran.json()["problem_counts"] == {"page_damaged": 1}
    assert ran.json()["problems"][0]["object"] == victim.hex()
    assert run("check", "-d", path).code == EXIT_OK, "structure alone cannot see body damage"


def test_gc_and_evict_local(tmp_path):
    path = tmp_path / "store"
    build_store(path)
    with Store(path) as store:
        from kvstore.ids import page_digest

        loose = [bytes([i]) * 300 for i in range(5)]
        store.put_pages({page_digest(p): p for p in loose})
    plan = run("gc", "--dry-run", "--grace", "0", "--json", "-d", path).json()
    assert plan["plan"]["unreferenced_pages"] == 5 and plan["deleted"] is None
    kept = run("gc", "--grace", "1h", "--json", "-d", path).json()
    assert kept["deleted"]["pages"] == 0, "pages younger than the grace period were deleted"
    done = run("gc", "--grace", "0s", "--json", "-d", path).json()
    assert done["deleted"]["pages"] == 5
    assert len(run("stats", "--json", "-d", path).json()["gc_history"]) == 2
    before = run("stats", "--json", "-d", path).json()["stats"]["stored_nbytes"]
    evicted = run("evict", "--to", "0", "--json", "-d", path).json()
    assert evicted["evicted_blocks"] > 0 and evicted["after_nbytes"] < before
    assert not evicted["reached"], "checkpointed blocks must survive evict --to 0"
    assert run("check", "--read-data", "-d", path).code == EXIT_OK
    assert sorted(e["name"] for e in run("ls", "--json", "--kind", "checkpoint", "-d", path).json()["entries"]) \
        == ["native", "short", "system-prompt"]


def test_import_conflict_and_incompatible_exit_codes(store_dir, tmp_path):
    path, _ = store_dir
    out = tmp_path / "sp.safetensors"
    assert run("export", "system-prompt", out, "-d", path).code == EXIT_OK
    assert run("import", out, "-d", path).code == EXIT_CONFLICT
    assert run("export", "system-prompt", tmp_path / "m.safetensors", "--mlx-lm", "-d", path).code \
        == EXIT_INCOMPATIBLE


# -- help ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command):
    ran = run(command, "--help")
    assert ran.code == EXIT_OK
    assert "Example:" in ran.stdout
    assert f"kvstore {command}" in ran.stdout, "the example must show the command itself"
    assert "Exit codes" in ran.stdout


# -- units -------------------------------------------------------------------------------------------
def test_sizes_and_durations():
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("2G") == 2 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096
    assert parse_duration("30s") == 30 and parse_duration("10m") == 600
    assert parse_duration("1h") == 3600 and parse_duration("1h30m") == 5400
    assert parse_duration("0") == 0 and parse_duration("250ms") == 0.25
    for bad in ("", "MiB", "-1", "2XB"):
        with pytest.raises(typer.BadParameter):
            parse_size(bad)
    for bad in ("", "h", "1y", "1h-"):
        with pytest.raises(typer.BadParameter):
            parse_duration(bad)


def test_the_kvstore_cli_carries_every_command(store_dir):
    from typer.testing import CliRunner

    from tools.cli import app

    assert set(COMMANDS) <= {c.name for c in app.registered_commands}
    path, _ = store_dir
    ran = CliRunner().invoke(app, ["ls", "--json", "-d", str(path)])
    assert ran.exit_code == EXIT_OK and len(ran.stdout) > 2


def test_long_work_draws_progress_with_bytes_rate_and_eta(tmp_path, monkeypatch):
    """On a terminal, check --read-data, gc, export and import draw a rich progress bar
    (bytes done/total, bytes/s, ETA); off a terminal (pipes, CI) they draw nothing."""
    import io

    from rich.console import Console

    from tools.commands import common

    path = tmp_path / "store"
    build_store(path)
    with Store(path) as store:
        from kvstore.ids import page_digest

        loose = [bytes([i]) * 5000 for i in range(3)]
        store.put_pages({page_digest(p): p for p in loose})
    for args, label in ((["check", "--read-data"], "check --read-data"), (["gc", "--grace", "0"], "gc"),
                        (["export", "system-prompt", tmp_path / "sp.safetensors"], "export"),
                        (["import", tmp_path / "sp.safetensors", "--name", "sp2"], "import")):
        screen = io.StringIO()
        monkeypatch.setattr(common, "stderr", Console(file=screen, force_terminal=True, width=120))
        assert run(*args, "-d", path).code == EXIT_OK, args
        drawn = screen.getvalue()
        done = re.search(r"\d+(\.\d)?/\d+(\.\d)? (bytes|KiB)", drawn)  # bytes done / total
        assert label in drawn and done and "0:00:00" in drawn, (label, drawn[-500:])
    monkeypatch.setattr(common, "stderr", Console(file=io.StringIO(), force_terminal=False))
    assert run("check", "--read-data", "-d", path).code == EXIT_OK
    assert common.stderr.file.getvalue() == ""
