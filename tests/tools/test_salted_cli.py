"""The CLI on a store with salted namespaces (issue 23): it opens the store with the
chain salts of the service's tokens file (--tokens-file or KVSTORE_TOKENS_FILE, read
by api.auth.chain_salts_from_settings), and without them it refuses in one line that
says what to pass, instead of a list of block_bad problems.

Without the fix `check` reports every salted block as block_bad (exit 1), and the
other commands know no --tokens-file (exit 2 from the option parser)."""

from __future__ import annotations

import pytest

from kvstore.ids import ChainSalts
from kvstore.store import Store, StoreConfig
from tests.kvstore.factories import save_salted
from tests.tools.helpers import IDENTITY, run
from tools.commands.common import EXIT_INCOMPATIBLE, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE

SALT_B = bytes(range(100, 132))
TOKENS_TOML = f"""
[[token]]
secret = "operator-admin-token-0123456789"
namespace = "*"
admin = true

[[namespace]]
name = "team-b"
chain_salt = "{SALT_B.hex()}"
"""
NO_ENV = {"KVSTORE_DIR": None, "KVSTORE_TOKENS_FILE": None, "KVSTORE_CONFIG": None}


def _save(store: Store, namespace: str, tokens: list[int], checkpoint: str | None = None):
    """Publish synthetic pages keyed with the store's salt for `namespace`."""
    return save_salted(store, IDENTITY, namespace, tokens, checkpoint=checkpoint)


@pytest.fixture
def salted(tmp_path):
    """(store dir, tokens file, salted block count): team-b salted with a checkpoint and
    an unpinned prefix, "default" unsalted."""
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(TOKENS_TOML)
    tokens_file.chmod(0o600)
    path = tmp_path / "store"
    with Store(path, StoreConfig(chain_salts=ChainSalts({"team-b": SALT_B}))) as store:
        pinned = _save(store, "team-b", list(range(500, 540)), checkpoint="secret")
        loose = _save(store, "team-b", list(range(700, 712)))
        _save(store, "default", list(range(20)), checkpoint="plain")
    assert all(r.salted for r in pinned + loose)
    return path, tokens_file, len(pinned) + len(loose)


def _assert_one_line_advice(ran, salted_blocks: int) -> None:
    assert ran.code == EXIT_USAGE, (ran.stdout, ran.stderr)
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, ran.stderr
    assert "--tokens-file" in lines[0] and f"{salted_blocks} block record(s)" in lines[0], lines[0]
    assert "block_bad" not in ran.stdout + ran.stderr


def test_check_passes_with_the_tokens_file(salted):
    path, tokens_file, n = salted
    ran = run("check", "--read-data", "--json", "-d", path, "--tokens-file", tokens_file, env=NO_ENV)
    assert ran.code == EXIT_OK, ran.stdout + ran.stderr
    assert ran.json()["problem_counts"] == {}
    assert ran.json()["blocks_checked"] == n + 5  # and the 5 unsalted blocks of "default"


def test_check_reads_the_tokens_file_from_the_services_env_var(salted):
    path, tokens_file, _ = salted
    ran = run("check", "-d", path, env={**NO_ENV, "KVSTORE_TOKENS_FILE": str(tokens_file)})
    assert ran.code == EXIT_OK, ran.stdout + ran.stderr


def test_check_without_salts_says_what_to_pass_in_one_line(salted):
    path, _, n = salted
    _assert_one_line_advice(run("check", "-d", path, env=NO_ENV), n)
    _assert_one_line_advice(run("check", "--json", "-d", path, env=NO_ENV), n)


@pytest.mark.parametrize("args", [
    ["ls"],
    ["show", "team-b/secret"],
    ["stats"],
    ["gc", "--dry-run", "--grace", "0"],
    ["evict", "--to", "0"],
], ids=lambda a: a[0])
def test_commands_open_a_salted_store_with_the_tokens_file_only(salted, tmp_path, args):
    path, tokens_file, n = salted
    args = [a.format(tmp=tmp_path) for a in args]
    _assert_one_line_advice(run(*args, "-d", path, env=NO_ENV), n)
    ran = run(*args, "-d", path, "--tokens-file", tokens_file, env=NO_ENV)
    assert ran.code == EXIT_OK, ran.stdout + ran.stderr
    assert run("check", "-d", path, "--tokens-file", tokens_file, env=NO_ENV).code == EXIT_OK


def test_export_of_a_salted_checkpoint_is_refused_before_writing(salted, tmp_path):
    """tools/portable.py re-derives a file's chain keys unsalted on import, so a portable
    file of a salted checkpoint could never be imported: none is written."""
    path, tokens_file, n = salted
    out = tmp_path / "secret.safetensors"
    _assert_one_line_advice(run("export", "secret", out, "-n", "team-b", "-d", path, env=NO_ENV), n)
    ran = run("export", "secret", out, "-n", "team-b", "-d", path, "--tokens-file", tokens_file,
              env=NO_ENV)
    assert ran.code == EXIT_INCOMPATIBLE and "salted namespace" in ran.stderr, ran.stderr
    assert not out.exists()
    plain = tmp_path / "plain.safetensors"
    assert run("export", "plain", plain, "-d", path, "--tokens-file", tokens_file,
               env=NO_ENV).code == EXIT_OK
    assert run("import", plain, "--name", "again", "-d", path, "--tokens-file", tokens_file,
               env=NO_ENV).code == EXIT_OK


def test_evict_with_the_tokens_file_evicts_salted_blocks(salted):
    path, tokens_file, _ = salted
    ran = run("evict", "--to", "0", "--json", "-d", path, "--tokens-file", tokens_file, env=NO_ENV)
    assert ran.code == EXIT_OK, ran.stderr
    assert ran.json()["evicted_blocks"] == 3  # team-b's unpinned 12-token prefix, 3 blocks


def test_a_bad_or_missing_tokens_file_is_one_line(salted, tmp_path):
    path, _, _ = salted
    bad = tmp_path / "bad.toml"
    bad.write_text('[[namespace]]\nname = "team-b"\nchain_salt = "not-hex"\n')
    bad.chmod(0o600)
    ran = run("check", "-d", path, "--tokens-file", bad, env=NO_ENV)
    assert ran.code == EXIT_USAGE and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert "bad tokens file" in ran.stderr
    ran = run("check", "-d", path, "--tokens-file", tmp_path / "absent.toml", env=NO_ENV)
    assert ran.code == EXIT_NOT_FOUND and "no tokens file" in ran.stderr, ran.stderr


def test_gc_remote_plans_with_the_tokens_files_salts(salted, monkeypatch):
    """No bucket here (tests/kvstore/test_s3_tier.py runs the real one against Ceph):
    the plan is captured to see which salts `gc --remote` hands it."""
    import kvstore.tier
    import kvstore.tier.gc

    _, tokens_file, _ = salted
    seen = []

    class Plan:
        def summary(self):
            return {}

    class NoBucket:
        def __init__(self, tier):
            pass

        def close(self):
            pass

    def plan_remote_gc(bucket, layout, grace_s, chain_salts=None):
        seen.append(chain_salts)
        return Plan()

    monkeypatch.setattr(kvstore.tier, "Bucket", NoBucket)
    monkeypatch.setattr(kvstore.tier.gc, "plan_remote_gc", plan_remote_gc)
    env = {**NO_ENV, "KVSTORE_S3_BUCKET": "kv-pages"}
    ran = run("gc", "--remote", "--dry-run", "--json", "--tokens-file", tokens_file, env=env)
    assert ran.code == EXIT_OK, ran.stderr
    ran = run("gc", "--remote", "--dry-run", "--json", env={**env, "KVSTORE_TOKENS_FILE": str(tokens_file)})
    assert ran.code == EXIT_OK, ran.stderr
    assert [s.salt_for("team-b") for s in seen] == [SALT_B, SALT_B]
