"""Authentication and tenancy, enumerated from app.routes so a new route is covered
the day it is added."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import iter_route_contexts

from api import auth
from api.auth import TokenTable
from api.routes.dashboard import SHELL_PATHS
from api.server import UnsafeBind, check_bind
from api.settings import Settings
from kvstore import errors
from kvstore.client import AccessDenied
from kvstore.records import Checkpoint
from tests.api.conftest import ADMIN, USER_A, USER_B, client_for, remote_for
from tests.kvstore.factories import make_identity, save_prefix

PUBLIC = {("GET", "/v1/health")} | {("GET", p) for p in SHELL_PATHS}
ADMIN_ROUTES = {("DELETE", "/v1/checkpoints/{namespace}/{name}"), ("POST", "/v1/admin/gc"),
                ("POST", "/v1/admin/evict"), ("POST", "/v1/admin/check")}
PARAMS = {"format_id": "ab" * 32, "digest": "cd" * 32, "namespace": "team-a", "name": "n1"}


def routes(app) -> list[tuple[str, str]]:
    out = []
    for route in iter_route_contexts(app.routes):
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                out.append((method, route.path))
    assert len(out) >= 20, f"only {len(out)} routes found; did route enumeration break?"
    return out


def concrete(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], path)


def test_every_route_but_health_needs_a_token(secured_app):
    listed = routes(secured_app)
    assert set(ADMIN_ROUTES) <= set(listed) and PUBLIC <= set(listed)
    for token in (None, "wrong-token-0123456789", USER_A + "x", USER_A[:-1]):
        client = client_for(secured_app, token)
        for method, path in listed:
            r = client.request(method, concrete(path), json={})
            if (method, path) in PUBLIC:
                assert r.status_code == 200, (method, path)
                # the shell is static text; store data come only from token-guarded JSON routes
                assert r.headers["content-type"].startswith(("text/", "application/json"))
                assert path == "/v1/health" or r.headers["content-type"].startswith("text/")
            else:
                assert r.status_code == 401, (token, method, path, r.status_code)
                assert r.json()["code"] == "unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
    assert client_for(secured_app, None).get("/no/such/path").status_code == 401


def test_admin_routes_refuse_user_tokens_and_take_admin_ones(secured_app):
    user, admin = client_for(secured_app, USER_A), client_for(secured_app, ADMIN)
    bodies = {"/v1/admin/evict": {"to_nbytes": 1 << 40}, "/v1/admin/gc": {"dry_run": True},
              "/v1/admin/check": {}}
    for method, path in routes(secured_app):
        r = user.request(method, concrete(path), json=bodies.get(path, {}))
        if (method, path) in ADMIN_ROUTES:
            assert r.status_code == 403 and r.json()["code"] == "forbidden", (method, path)
            r = admin.request(method, concrete(path), json=bodies.get(path, {}))
            assert r.status_code in (200, 204, 404), (method, path, r.status_code, r.text)
        else:
            assert r.status_code not in (401, 403), (method, path, r.status_code, r.text)


def test_tenants_cannot_see_each_other(secured_app, store):
    a = remote_for(client_for(secured_app, USER_A), USER_A)
    b = remote_for(client_for(secured_app, USER_B), USER_B)
    identity = make_identity()
    tokens = list(range(40))
    saved = save_prefix(a, identity, "team-a", tokens, checkpoint="secret")
    assert a.lookup_prefix(identity.format_id, "team-a", tokens).tokens_matched == 40
    # the same prompt under b's own namespace: chain keys are salted, nothing matches
    assert b.lookup_prefix(identity.format_id, "team-b", tokens).tokens_matched == 0
    with pytest.raises(AccessDenied):
        b.lookup_prefix(identity.format_id, "team-a", tokens)
    with pytest.raises(AccessDenied):
        b.get_checkpoint("team-a", "secret")
    with pytest.raises(AccessDenied):
        b.list_checkpoints("team-a")
    assert b.list_checkpoints() == []
    assert [c.name for c in a.list_checkpoints()] == ["secret"]
    with pytest.raises(errors.NotFound):
        b.get_blocks(saved.chain_keys[:1])
    assert b.has_blocks(saved.chain_keys) == [False] * len(saved.chain_keys)
    with pytest.raises(AccessDenied):
        b.commit_blocks(saved.records)
    with pytest.raises(AccessDenied):
        b.create_checkpoint(Checkpoint("mine", "team-a", identity.format_id, tuple(tokens),
                                       saved.chain_keys))
    admin = remote_for(client_for(secured_app, ADMIN), ADMIN)
    assert [c.name for c in admin.list_checkpoints()] == ["secret"]
    with pytest.raises(AccessDenied):
        a.delete_checkpoint("team-a", "secret")
    admin.delete_checkpoint("team-a", "secret")
    assert store.stats().checkpoint_count == 0


def test_tokens_are_compared_with_compare_digest_against_every_secret(monkeypatch, tmp_path):
    from tests.api.conftest import write_tokens_file
    table = TokenTable.from_settings(Settings(tokens_file=write_tokens_file(tmp_path)))
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert table.lookup(USER_A.encode()).namespace == "team-a"
    assert table.lookup(b"nope") is None
    assert len(calls) == 2 * len(table) == 6


def test_weak_or_shared_tokens_are_refused(tmp_path):
    with pytest.raises(ValueError):
        Settings(token="short")
    bad = tmp_path / "t.toml"
    bad.write_text('[[token]]\nsecret = "0123456789abcdef0"\nnamespace = "*"\n')
    with pytest.raises(ValueError, match="only admin"):
        TokenTable.from_settings(Settings(tokens_file=bad))
    with pytest.raises(ValueError, match="share one secret"):
        TokenTable.from_settings(Settings(token=ADMIN, admin_token=ADMIN))


def test_non_loopback_bind_needs_a_token():
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(Settings(host=host))
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.org"):
        with pytest.raises(UnsafeBind):
            check_bind(Settings(host=host))
        check_bind(Settings(host=host, token=USER_A))
