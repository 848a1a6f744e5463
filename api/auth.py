"""Bearer tokens, principals and namespaces.

A token maps to a Principal: the namespace it may touch and whether it is an admin.
Tokens come from Settings (KVSTORE_TOKEN for the user namespace, KVSTORE_ADMIN_TOKEN
for an admin over every namespace) and from a tokens file:

    # tokens.toml: keep it mode 0600
    [[token]]
    secret = "a-long-random-string"     # at least 16 characters
    namespace = "team-a"
    admin = false                       # admins may also delete, gc and evict
    [[token]]
    secret = "another-long-random-one"
    namespace = "*"                     # "*" only for admins: every namespace
    admin = true
    [[namespace]]                       # optional: a namespace with salted chain keys
    name = "team-a"
    chain_salt = "64 lowercase hex characters"  # secrets.token_hex(32); never change it
                                        # for a namespace that holds blocks

Chain salts (docs/format.md section 3, docs/api.md "Tenants"): the server opens its
store with them (StoreConfig.chain_salts) and tells a token its own namespace's salt
(GET /v1/namespaces/{namespace}/chain-salt), so a tenant's processes key blocks as the
store does while no other tenant can compute those keys.

AuthMiddleware authenticates every HTTP request except public_paths() before routing
(so an unknown path without a token is a 401, and a route added later cannot forget
authentication). Routes authorize with the dependencies below: require_admin, and
Principal.require_namespace for anything namespaced. A presented token is compared
with every configured secret using hmac.compare_digest, without stopping at the
first match, so the time taken does not depend on which secret matched.

With no token configured (the loopback default) every request is an anonymous
admin over every namespace; serve refuses to bind a non-loopback address that way.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from api.errors import Forbidden, error_response
from api.settings import Settings
from kvstore.ids import ChainSalts, check_namespace

log = logging.getLogger("kvstore.api")
ALL_NAMESPACES = "*"
PUBLIC_PATHS = frozenset({"/v1/health"})  # plus the dashboard shell: public_paths()
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class Principal:
    namespace: str          # a namespace, or "*" for every namespace
    admin: bool
    anonymous: bool = False

    def may_access(self, namespace: str) -> bool:
        return self.namespace in (ALL_NAMESPACES, namespace)

    def require_namespace(self, namespace: str) -> str:
        check_namespace(namespace)
        if not self.may_access(namespace):
            raise Forbidden(f"this token may not access namespace {namespace!r}")
        return namespace

    def default_namespace(self, namespace: str | None) -> str | None:
        """The namespace a request means: its own, or the token's when it names none."""
        if namespace is None:
            return None if self.namespace == ALL_NAMESPACES else self.namespace
        return self.require_namespace(namespace)


ANONYMOUS = Principal(ALL_NAMESPACES, admin=True, anonymous=True)


class TokenTable:
    """The configured secrets. Empty means authentication is off."""

    def __init__(self, entries: list[tuple[bytes, Principal]]):
        self._entries = entries

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, presented: bytes) -> Principal | None:
        found = None
        for secret, principal in self._entries:
            if hmac.compare_digest(secret, presented) and found is None:
                found = principal
        return found

    @classmethod
    def from_settings(cls, settings: Settings) -> "TokenTable":
        entries: list[tuple[bytes, Principal]] = []
        if settings.token is not None:
            entries.append((settings.token.get_secret_value().encode(),
                            Principal(settings.namespace, admin=False)))
        if settings.admin_token is not None:
            entries.append((settings.admin_token.get_secret_value().encode(),
                            Principal(ALL_NAMESPACES, admin=True)))
        if settings.tokens_file is not None:
            entries.extend(_read_tokens_file(settings.tokens_file))
        secrets = [s for s, _ in entries]
        if len(set(secrets)) != len(secrets):
            raise ValueError("two tokens share one secret; every principal needs its own")
        return cls(entries)


def chain_salts_from_settings(settings: Settings) -> ChainSalts:
    """The [[namespace]] chain salts of the tokens file (none without one)."""
    if settings.tokens_file is None:
        return ChainSalts()
    data = _load_tokens_file(settings.tokens_file)
    salts = {}
    for i, item in enumerate(data.get("namespace", [])):
        name, salt = item.get("name"), item.get("chain_salt")
        if set(item) - {"name", "chain_salt"}:
            raise ValueError(f"{settings.tokens_file}: namespace[{i}] takes only name and chain_salt")
        if not isinstance(salt, str):
            raise ValueError(f"{settings.tokens_file}: namespace[{i}].chain_salt must be 64 "
                             "lowercase hex characters")
        if name in salts:
            raise ValueError(f"{settings.tokens_file}: namespace {name!r} is named twice")
        salts[check_namespace(name)] = salt
    return ChainSalts(salts)


def _load_tokens_file(path: Path) -> dict:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("tokens file %s is readable by group or others; chmod 600 it", path)
    with open(path, "rb") as f:
        return tomllib.load(f)


def _read_tokens_file(path: Path) -> list[tuple[bytes, Principal]]:
    data = _load_tokens_file(path)
    out = []
    for i, item in enumerate(data.get("token", [])):
        secret, namespace = item.get("secret"), item.get("namespace")
        admin = item.get("admin", False)
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"{path}: token[{i}].secret must be at least {MIN_SECRET_CHARS} characters")
        if not isinstance(admin, bool):
            raise ValueError(f"{path}: token[{i}].admin must be true or false")
        if namespace == ALL_NAMESPACES:
            if not admin:
                raise ValueError(f"{path}: token[{i}]: only admin tokens may use namespace '*'")
        else:
            check_namespace(namespace)
        out.append((secret.encode(), Principal(namespace, admin=admin)))
    return out


def public_paths() -> frozenset[str]:
    """Health, and the dashboard's static shell (HTML, JS, CSS: no store data; a
    browser cannot send a bearer token with a page load, so the shell asks for it and
    sends it with every data request, which stays behind the token)."""
    from api.routes.dashboard import SHELL_PATHS  # here: api.routes imports this module
    return PUBLIC_PATHS | SHELL_PATHS


class AuthMiddleware:
    """Pure ASGI: authenticates before routing and stores the Principal in the scope."""

    def __init__(self, app, tokens: TokenTable, public: frozenset[str] | None = None):
        self.app = app
        self.tokens = tokens
        self.public = public_paths() if public is None else public

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        principal = ANONYMOUS
        if self.tokens.enabled and scope["path"] not in self.public:
            principal = self.tokens.lookup(_bearer(scope))
            if principal is None:
                response = error_response(401, "unauthorized", "a valid bearer token is required",
                                          {"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        return await self.app(scope, receive, send)


def _bearer(scope) -> bytes:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token:
                return token.strip()
            return b""
    return b""


def get_principal(request: Request) -> Principal:
    principal = request.scope.get("state", {}).get("principal")
    assert principal is not None, "AuthMiddleware did not run for this request"
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.admin:
        raise Forbidden("this route needs an admin token")
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]
