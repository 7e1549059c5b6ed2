"""Who is calling: a tenant's API key, the admin key, or nobody (base model only, when allowed)."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from lethe.server.storage import KEY_PREFIX


def bearer(request: Request) -> str | None:
    """The key the caller sent (`Authorization: Bearer <key>` or `X-API-Key`), None if none. An Authorization
    header of any other form is 401, never anonymous: a caller who meant to send a key must learn it was not."""
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise HTTPException(401, "malformed Authorization header: expected `Bearer <key>`",
                                headers={"WWW-Authenticate": "Bearer"})
        return token.strip()
    key = request.headers.get("x-api-key")
    if key is not None and not key.strip():
        raise HTTPException(401, "empty X-API-Key header")
    return key.strip() if key is not None else None


def _caller(request: Request, anonymous_ok: bool) -> str | None:
    key = bearer(request)
    if key is None or (anonymous_ok and not key.startswith(KEY_PREFIX)):
        # no key, or a placeholder that is no Lethe key (`OpenAI(api_key="EMPTY")`, as with local servers): anonymous
        # where that is allowed. A Lethe key that is unknown (mistyped, revoked) stays 401, so a tenant never gets
        # the base model's answers while believing its profile answered.
        if anonymous_ok:
            return None
        raise HTTPException(401, "an API key is required (Authorization: Bearer <key>)")
    found = request.app.state.store.tenant_for_key(key)
    if found is None:
        raise HTTPException(401, "unknown API key")
    return found


def optional_tenant(request: Request) -> str | None:
    """The caller's tenant id, or None for an anonymous call (when allowed); a wrong key is 401."""
    return _caller(request, request.app.state.settings.allow_anonymous)


def tenant(request: Request) -> str:
    """The caller's tenant id; tenant endpoints need a key."""
    return _caller(request, anonymous_ok=False)


def admin(request: Request) -> None:
    expected = request.app.state.settings.admin_key
    key = bearer(request) or ""
    if not expected:
        raise HTTPException(403, "admin key required, and this server has none: start it with LETHE_ADMIN_KEY set "
                                 "(the admin endpoints are off without one)")
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise HTTPException(403, "admin key required: send the server's LETHE_ADMIN_KEY as the bearer key "
                                 "(lethe --key, or $LETHE_KEY)")
