"""Issue 23: salted namespaces served end to end (docs/format.md section 3, docs/api.md
"Tenants"). team-b's chain keys are keyed by a secret salt the service holds in its
tokens file and the embedded store in StoreConfig.chain_salts; team-a is unsalted.

Each test fails without salts in the store (BlockRecord deriving its key unsalted):
the stored keys would then be the public ones a guesser computes.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import chain_salts_from_settings
from api.settings import Settings
from engine.attention import installed
from engine.engine_model import EngineModel
from engine.models import make_cache
from engine.policy import KVPolicy
from engine.publish import publish
from engine.restore import RestoreRequest, restore
from kvstore.client import RemoteStore
from kvstore.errors import InvalidInput
from kvstore.ids import chain_keys
from kvstore.records import BlockRecord
from kvstore.store import Store, StoreConfig
from tests.api.conftest import ADMIN, TOKENS_TOML, USER_A, USER_B
from tests.engine.factories import prompt_tokens, tiny_model
from tests.kvstore.factories import TINY_MAP_NBYTES, make_identity, save_salted

SALT_B = bytes(range(100, 132))
TOKENS_TOML_SALTED = TOKENS_TOML + f"""
[[namespace]]
name = "team-b"
chain_salt = "{SALT_B.hex()}"
"""
IDENTITY = make_identity()
MODEL_ID = "test/tiny"


def _settings(tmp_path) -> Settings:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS_TOML_SALTED)
    path.chmod(0o600)
    return Settings(data_dir=tmp_path / "store", tokens_file=path)


def _open(tmp_path, settings: Settings | None = None) -> Store:
    settings = settings or _settings(tmp_path)
    return Store(settings.data_dir, StoreConfig(map_nbytes=TINY_MAP_NBYTES,
                                                chain_salts=chain_salts_from_settings(settings)))


def _save(store, namespace: str, tokens: list[int], checkpoint: str | None = None) -> list[BlockRecord]:
    """Publish synthetic pages the way the engine does, keyed with the store's salt."""
    return save_salted(store, IDENTITY, namespace, tokens, checkpoint=checkpoint)


PROMPT_B = list(range(500, 540))  # 10 blocks of 4: the "secret" prompt a guesser tries


def test_salts_come_from_the_tokens_file_and_are_validated(tmp_path):
    salts = chain_salts_from_settings(_settings(tmp_path))
    assert salts.salt_for("team-b") == SALT_B and salts.salt_for("team-a") is None
    assert SALT_B.hex() not in repr(salts)
    bad = tmp_path / "bad.toml"
    for text in ('[[namespace]]\nname = "x"\nchain_salt = "abc"\n',
                 '[[namespace]]\nname = "x"\n',
                 f'[[namespace]]\nname = "../x"\nchain_salt = "{"ab" * 32}"\n'):
        bad.write_text(text)
        with pytest.raises((ValueError, InvalidInput)):
            chain_salts_from_settings(Settings(data_dir=tmp_path, tokens_file=bad))
    # an app over a store opened without the tokens file's salts refuses to start
    with Store(tmp_path / "plain") as plain, pytest.raises(ValueError, match="chain salts"):
        create_app(store=plain, settings=_settings(tmp_path))


def test_a_salted_namespace_keys_its_blocks_with_the_salt_and_unsalted_stays_as_it_was(tmp_path):
    with _open(tmp_path) as store:
        fid = store.put_format(IDENTITY)
        bs = IDENTITY.block_size_tokens
        b = _save(store, "team-b", PROMPT_B, checkpoint="secret")
        a = _save(store, "team-a", PROMPT_B)
        public_b = chain_keys(fid, "team-b", PROMPT_B, bs)
        salted_b = chain_keys(fid, "team-b", PROMPT_B, bs, salt=SALT_B)
        assert [r.key for r in b] == salted_b
        assert [r.key for r in a] == chain_keys(fid, "team-a", PROMPT_B, bs)  # unsalted
        # a guesser who computes team-b's keys without the salt finds nothing
        assert store.has_blocks(public_b) == [False] * len(public_b)
        assert store.find_blocks(public_b) == [None] * len(public_b)
        assert store.has_blocks(salted_b) == [True] * len(salted_b)
        # lookups hash with the store's salt; the stored records decode to their keys
        match = store.lookup_prefix(fid, "team-b", PROMPT_B)
        assert match.tokens_matched == len(PROMPT_B) and match.chain_keys == salted_b
        assert [r.key for r in store.list_blocks("team-b", limit=100)] == sorted(salted_b)
        assert store.get_checkpoint("team-b", "secret").chain_keys == tuple(salted_b)
        # an unsalted record's bytes have flags 0 (the layout of stores before salts);
        # a salted one sets bit 0 and never holds the salt
        assert a[0].encode()[1] == 0 and b[0].encode()[1] == 1
        assert SALT_B not in b[0].encode()
        # a publisher that forgets the salt is refused, nothing committed
        unsalted = BlockRecord(fid, "team-b", bytes(32), tuple(range(900, 904)), b[0].pages)
        with pytest.raises(InvalidInput, match="chain salt"):
            store.commit_blocks([unsalted])
        wrong = BlockRecord(fid, "team-b", bytes(32), tuple(range(900, 904)), b[0].pages,
                            salt=bytes(32))
        with pytest.raises(InvalidInput, match="chain salt"):
            store.commit_blocks([wrong])
        assert store.has_blocks([unsalted.key, wrong.key]) == [False, False]


def test_check_evict_and_gc_work_on_a_store_with_salted_namespaces(tmp_path):
    with _open(tmp_path) as store:
        _save(store, "team-b", PROMPT_B, checkpoint="secret")
        _save(store, "team-b", list(range(700, 720)))
        _save(store, "team-a", list(range(100, 140)))
        report = store.check(read_data=True)
        assert report.ok, report.problems
        assert report.blocks_checked == 10 + 5 + 10
        evicted = store.evict(0)  # every unpinned block: team-b's second prompt and team-a's
        assert evicted.blocks == 15
        plan = store.plan_gc(grace_s=0)
        plan.execute()
        report = store.check(read_data=True)
        assert report.ok, report.problems
        assert store.stats().block_count == 10  # the pinned checkpoint's blocks
    # reopened without team-b's salt: its records are refused, never keyed wrongly
    with Store(tmp_path / "store", StoreConfig(map_nbytes=TINY_MAP_NBYTES)) as bare:
        report = bare.check()
        assert not report.ok
        bad = [p for p in report.problems if p.kind == "block_bad"]
        assert len(bad) == 10 and all("chain salt" in p.detail for p in bad), bad
        with pytest.raises(InvalidInput, match="chain salt"):
            bare.list_blocks("team-b")


@pytest.fixture
def salted_service(tmp_path):
    settings = _settings(tmp_path)
    store = _open(tmp_path, settings)
    app = create_app(store=store, settings=settings)
    clients = {name: TestClient(app, headers={"Authorization": f"Bearer {token}"})
               for name, token in (("a", USER_A), ("b", USER_B), ("admin", ADMIN))}
    try:
        yield store, clients
    finally:
        for c in clients.values():
            c.close()
        store.close()


def test_tenant_a_cannot_learn_tenant_bs_salt_or_find_its_prompt_by_computing_keys(salted_service):
    store, clients = salted_service
    a, b, admin = clients["a"], clients["b"], clients["admin"]
    remote_b = RemoteStore("http://testserver", USER_B, client=b)
    records = _save(remote_b, "team-b", PROMPT_B, checkpoint="secret")  # over HTTP
    fid = IDENTITY.format_id
    bs = IDENTITY.block_size_tokens
    assert [r.key for r in records] == chain_keys(fid, "team-b", PROMPT_B, bs, salt=SALT_B)
    # B learns its own salt; A learns its own (none) and not B's
    assert b.get("/v1/namespaces/team-b/chain-salt").json() == {
        "namespace": "team-b", "salted": True, "salt": SALT_B.hex()}
    assert a.get("/v1/namespaces/team-a/chain-salt").json()["salted"] is False
    r = a.get("/v1/namespaces/team-b/chain-salt")
    assert r.status_code == 403 and SALT_B.hex() not in r.text
    # what an admin, a log or a bucket listing shows of team-b: its stored keys
    shown = {bytes.fromhex(blk["key"]) for blk in
             admin.get("/v1/blocks", params={"namespace": "team-b"}).json()["blocks"]}
    assert len(shown) == len(records)
    # A guesses the prompt exactly and computes the keys it can (no salt): no match
    guessed = chain_keys(fid, "team-b", PROMPT_B, bs)
    assert not shown & {bytes(k) for k in guessed}
    assert store.has_blocks(guessed) == [False] * len(guessed)
    # B's own processes, with the salt, find everything over HTTP
    match = remote_b.lookup_prefix(fid, "team-b", PROMPT_B)
    assert match.tokens_matched == len(PROMPT_B)
    assert remote_b.get_checkpoint("team-b", "secret").chain_keys == tuple(r.key for r in records)
    assert remote_b.has_blocks([r.key for r in records]) == [True] * len(records)
    # and the store checks clean, salted records and all
    assert admin.post("/v1/admin/check", json={}).json()["ok"] is True


def _prefilled(model, policy, tokens):
    cache = make_cache(model, policy)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


@pytest.mark.parametrize("over_http", [False, True])
def test_a_salted_namespace_round_trips_engine_publish_and_restore(salted_service, tmp_path, over_http):
    store, clients = salted_service
    target = RemoteStore("http://testserver", USER_B, client=clients["b"]) if over_http else store
    model = tiny_model("llama", mx.float32)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(70, seed=11).tolist()
    engine_model = EngineModel(model, MODEL_ID, policy=policy)
    cache = _prefilled(model, policy, tokens)
    result = publish(engine_model, target, tokens, cache, namespace="team-b", checkpoint="c")
    assert result.blocks == 5
    fid = engine_model.identity.format_id
    salted = chain_keys(fid, "team-b", tokens, 16, salt=SALT_B)
    assert store.has_blocks(salted) == [True] * 4  # the four full blocks, under salted keys
    assert store.has_blocks(chain_keys(fid, "team-b", tokens, 16)) == [False] * 4
    restored = restore(engine_model, target, RestoreRequest(tokens + [1], namespace="team-b"))
    assert restored.tokens_restored == 70
    want, got = cache[0].state[0][..., :70, :], restored.cache[0].state[0][..., :70, :]
    assert mx.array_equal(want, got).item()  # bit-exact: tolerance 0
    # the same prompt under the unsalted namespace shares nothing of it
    other = restore(engine_model, store, RestoreRequest(tokens + [1], namespace="team-a"))
    assert other.tokens_restored == 0
    assert store.check().ok


def test_a_server_older_than_salts_is_read_as_unsalted():
    """A RemoteStore against a server without the chain-salt route (404) keys every
    namespace unsalted, as that server does."""
    import httpx

    def handler(request):
        return httpx.Response(404, json={"code": "not_found", "message": "Not Found"})
    client = httpx.Client(base_url="http://old", transport=httpx.MockTransport(handler))
    with RemoteStore("http://old", None, client=client) as remote:
        assert remote.chain_salt("team-b") is None


# -- the S3 tier: a salted namespace through the bucket (tests/kvstore/test_s3_tier.py's
# Ceph fixtures; skipped loudly there when Ceph is unavailable)
from tests.kvstore.test_s3_tier import ceph, tier  # noqa: E402,F401 - pytest fixtures


def test_a_salted_namespace_travels_through_the_s3_tier(tmp_path, tier):  # noqa: F811
    from kvstore.tier import TieredStore
    from kvstore.tier.bucket import Bucket

    salts = {"team-b": SALT_B}
    opened = []

    def host(name, chain_salts):
        local = Store(tmp_path / name, StoreConfig(map_nbytes=TINY_MAP_NBYTES, chain_salts=chain_salts))
        opened.append(TieredStore(local, tier()))
        return opened[-1]
    try:
        a, b, bare = host("a", salts), host("b", salts), host("bare", {})
        records = _save(a, "team-b", PROMPT_B, checkpoint="secret")
        assert a.drain(30)
        fid, bs = IDENTITY.format_id, IDENTITY.block_size_tokens
        # B, with the salt, finds the prompt through the bucket and reads it back
        match = b.lookup_prefix(fid, "team-b", PROMPT_B)
        assert match.tokens_matched == len(PROMPT_B)
        assert match.chain_keys == [r.key for r in records]
        assert b.get_checkpoint("team-b", "secret").chain_keys == tuple(r.key for r in records)
        assert b.check().ok
        # the bucket's object names are salted keys: a guess without the salt names none
        bucket = Bucket(tier())
        try:
            names = {o.key.rsplit("/", 1)[-1] for o in bucket.list(a.layout.kind_prefix("blocks"))}
        finally:
            bucket.close()
        assert {r.key.hex() for r in records} <= names
        assert not names & {k.hex() for k in chain_keys(fid, "team-b", PROMPT_B, bs)}
        # a host without the salt computes the public keys: nothing matches
        assert bare.lookup_prefix(fid, "team-b", PROMPT_B).tokens_matched == 0
        # the bucket's GC decodes salted records with the store's salts: the pinned
        # prompt is kept
        plan = a.plan_remote_gc(grace_s=0)
        assert plan.marked_blocks >= len(records)
    finally:
        for store in opened:
            store.close()  # closes its local store too
