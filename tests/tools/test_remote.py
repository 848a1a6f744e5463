"""The same commands with --url/--token against a live service instead of --data-dir."""

from __future__ import annotations

import pytest

from tests.tools.helpers import ADMIN_TOKEN, USER_TOKEN, build_store, live_service, run
from tools.commands.common import (
    EXIT_DENIED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
)


@pytest.fixture(scope="module")
def service_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote") / "store"
    build_store(path)
    return path


@pytest.fixture(scope="module")
def service(service_path):
    with live_service(service_path, token=USER_TOKEN, admin_token=ADMIN_TOKEN) as url:
        yield url


def remote(url, *args, token=ADMIN_TOKEN):
    return run(*args, "--url", url, "--token", token)


def test_read_commands_over_http(service):
    listed = remote(service, "ls", "--json").json()
    checkpoints = [e for e in listed["entries"] if e["kind"] == "checkpoint"]
    prefixes = [e for e in listed["entries"] if e["kind"] == "prefix"]
    assert sorted(e["name"] for e in checkpoints) == ["native", "short", "system-prompt"]
    # block records list over HTTP too (GET /v1/blocks); only stored sizes stay unknown
    # build_store: four chains, each ending in a leaf; three are pinned by checkpoints
    assert sorted((e["tokens"], tuple(e["checkpoints"]), e["pinned"]) for e in prefixes) == [
        (10, ("default/native",), True), (12, ("team-a/short",), True),
        (37, (), False), (40, ("default/system-prompt",), True)]
    assert prefixes and all(e["stored_nbytes"] is None for e in prefixes) and listed["notes"]
    sp = [e for e in listed["entries"] if e["name"] == "system-prompt"][0]
    assert sp["tokens"] == 40 and sp["logical_nbytes"] == 9600 and sp["stored_nbytes"] is None
    user = remote(service, "ls", "--json", token=USER_TOKEN).json()["entries"]
    assert {e["namespace"] for e in user} == {"default"}, "tenancy leaked"
    shown = remote(service, "show", "default/system-prompt", "--json").json()
    assert shown["kind"] == "checkpoint" and len(shown["page_table"]) == 10
    assert remote(service, "show", "default/nope").code == EXIT_NOT_FOUND
    assert len(remote(service, "formats", "--json").json()["formats"]) == 2
    stats = remote(service, "stats", "--json").json()
    assert stats["stats"]["checkpoint_count"] == 3 and stats["gc_history"] is None
    check = remote(service, "check", "--read-data", "--json")
    assert check.code == EXIT_OK and check.json()["pages_read"] == check.json()["pages_checked"]


def test_admin_commands_over_http_need_the_admin_token(service):
    plan = remote(service, "gc", "--dry-run", "--grace", "0", "--json")
    assert plan.code == EXIT_OK and plan.json()["deleted"] is None
    assert remote(service, "gc", "--dry-run", token=USER_TOKEN).code == EXIT_DENIED
    assert remote(service, "evict", "--to", "1GiB", token=USER_TOKEN).code == EXIT_DENIED
    assert remote(service, "ls", token="wrong-token-wrong-token").code == EXIT_DENIED
    evicted = remote(service, "evict", "--to", "1GiB", "--json")
    assert evicted.code == EXIT_OK and evicted.json()["evicted_blocks"] == 0


def test_export_and_import_over_http(service, tmp_path):
    out = tmp_path / "short.safetensors"
    assert remote(service, "export", "team-a/short", out).code == EXIT_OK
    local = tmp_path / "local.safetensors"
    copied = tmp_path / "copy"
    assert run("import", out, "-d", copied).code == EXIT_OK
    assert run("export", "team-a/short", local, "-d", copied).code == EXIT_OK
    assert out.read_bytes() == local.read_bytes()
    again = remote(service, "import", out, "--name", "short-copy", "--json")
    assert again.code == EXIT_OK and again.json()["new_pages"] == 0
    assert remote(service, "show", "team-a/short-copy", "--json").json()["manifest"]["num_tokens"] == 12


def test_url_wins_over_kvstore_dir_but_not_over_an_explicit_data_dir(service, tmp_path):
    env = {"KVSTORE_DIR": "./var/kvstore"}
    ran = run("ls", "--json", "--url", service, "--token", ADMIN_TOKEN, env=env)
    assert ran.code == EXIT_OK and len(ran.json()["entries"]) >= 3
    both = run("ls", "--url", service, "--token", ADMIN_TOKEN, "--data-dir", tmp_path)
    assert both.code == EXIT_USAGE


def test_unreachable_service_fails_cleanly():
    ran = run("stats", "--url", "http://127.0.0.1:9", "--token", ADMIN_TOKEN)
    assert ran.code == EXIT_PROBLEMS and "cannot reach" in ran.stderr
