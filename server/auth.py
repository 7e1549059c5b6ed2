"""Who is calling: a tenant's API key, the admin key, or nobody (base model only, when allowed)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import HTTPException, Request

from lethe.server.storage import KEY_PREFIX


def bearer(request: Request, empty_ok: bool = False) -> str | None:
    """The key the caller sent (`Authorization: Bearer <key>` or `X-API-Key`), None if none. An Authorization
    header of any other form is 401, never anonymous: a caller who meant to send a key must learn it was not.
    `empty_ok`: `Bearer ` with nothing after it is no key (what lm-evaluation-harness and the openai SDK send
    with no key set), for routes where anonymous access is on."""
    if len(request.headers.getlist("authorization")) > 1 or len(request.headers.getlist("x-api-key")) > 1:
        raise HTTPException(401, "more than one key sent: send one (Authorization: Bearer <key>, or X-API-Key)")
    header = request.headers.get("authorization")
    if header is not None and request.headers.get("x-api-key") is not None:
        raise HTTPException(401, "two keys sent (Authorization and X-API-Key): send one")
    if header is not None:
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() == "bearer" and not token.strip() and empty_ok:
            return None
        if scheme.lower() != "bearer" or not token.strip():
            raise HTTPException(401, "malformed Authorization header: expected `Bearer <key>`",
                                headers={"WWW-Authenticate": "Bearer"})
        return token.strip()
    key = request.headers.get("x-api-key")
    if key is not None and not key.strip():
        raise HTTPException(401, "empty X-API-Key header")
    return key.strip() if key is not None else None


@dataclass(frozen=True)
class Caller:
    """A tenant's key as a request presents it: what it may do (`scopes`), the profile it is bound to and its
    tenant's enforced profile (either makes every generation through the key use that profile)."""
    tenant_id: str
    key_id: str
    scopes: tuple[str, ...]
    bound: str | None = None
    enforced: str | None = None

    @property
    def rule(self) -> tuple[str, str] | None:
        """(profile, why) when a profile is imposed on this key's generations: its binding, else the tenant's
        enforced profile (a binding never names another profile than the enforced one: `routes` refuses that)."""
        if self.bound is not None:
            return self.bound, f"this API key is bound to profile {self.bound!r}"
        if self.enforced is not None:
            return self.enforced, f"this tenant enforces profile {self.enforced!r} on every generation"
        return None

    def profile_for(self, asked: str | dict | None) -> str | dict | None:
        """The profile a generation through this key uses: the one imposed on it, whatever was asked (asking for
        no profile takes it; naming it is fine; naming another, `base` or an inline spec is 403, naming the rule),
        else the one asked for."""
        rule = self.rule
        if rule is None:
            return asked
        profile, why = rule
        if asked is None or asked == profile:
            return profile
        named = "an inline profile" if isinstance(asked, dict) else f"profile {asked!r}"
        raise HTTPException(403, f"{why}: {named} cannot be used with it; ask for {profile!r} or for no profile")

    def may_see_untilted(self) -> bool:
        """The base model's own numbers beside a profile's (`lethe_untilted_logprobs`): only a key with the
        `evaluate` scope, with no profile imposed on it."""
        return "evaluate" in self.scopes and self.rule is None


def _caller(request: Request, anonymous_ok: bool) -> Caller | None:
    key = bearer(request, empty_ok=anonymous_ok)
    if key is None or (anonymous_ok and not key.lower().startswith(KEY_PREFIX)):
        # no key, or a placeholder that is no Lethe key (`OpenAI(api_key="EMPTY")`, as with local servers): anonymous
        # where that is allowed. A Lethe key that is unknown (mistyped, revoked) stays 401, so a tenant never gets
        # the base model's answers while believing its profile answered.
        if anonymous_ok:
            return None
        raise HTTPException(401, "an API key is required (Authorization: Bearer <key>)")
    found = request.app.state.store.caller(key)
    if found is None:
        raise HTTPException(401, "unknown API key")
    caller = Caller(found["tenant_id"], found["key_id"], found["scopes"], found["profile"], found["enforced"])
    request.state.caller = caller
    return caller


def generating(request: Request) -> Caller | None:
    """The caller of a generation route: a key with the `generate` scope, or nobody (when anonymous access is on);
    a wrong key is 401, a key without the scope 403."""
    caller = _caller(request, request.app.state.settings.allow_anonymous)
    if caller is not None:
        _require(caller, "generate")
    return caller


def optional_tenant(request: Request) -> str | None:
    """The caller's tenant id, or None for an anonymous call (when allowed); a wrong key is 401."""
    caller = _caller(request, request.app.state.settings.allow_anonymous)
    return caller.tenant_id if caller is not None else None


def tenant(request: Request) -> str:
    """The caller's tenant id, for the tenant's resources (datasets, heads, ASU weights, jobs, profiles,
    evaluation): a key with the `manage` scope (403 without it)."""
    caller = _caller(request, anonymous_ok=False)
    _require(caller, "manage")
    return caller.tenant_id


def _require(caller: Caller, scope: str) -> None:
    """403 naming the scope a key lacks."""
    if scope not in caller.scopes:
        raise HTTPException(403, f"API key {caller.key_id} lacks the `{scope}` scope (it has: "
                                 f"{', '.join(caller.scopes) or 'none'}): ask for a key with it")


def actor(request: Request) -> str:
    """Who acts, as the audit trail records it: the calling key's id, or `admin` for the admin key."""
    caller = getattr(request.state, "caller", None)
    return caller.key_id if caller is not None else "admin"


def is_admin(request: Request) -> bool:
    """Whether the request carries the admin key (never raises)."""
    expected = request.app.state.settings.admin_key
    try:
        key = bearer(request) or ""
    except HTTPException:
        return False
    return bool(expected) and hmac.compare_digest(key.encode(), expected.encode())


def admin(request: Request) -> None:
    expected = request.app.state.settings.admin_key
    key = bearer(request) or ""
    if not expected:
        raise HTTPException(403, "admin key required, and this server has none: start it with LETHE_ADMIN_KEY set "
                                 "(the admin endpoints are off without one)")
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise HTTPException(403, "admin key required: send the server's LETHE_ADMIN_KEY as the bearer key "
                                 "(lethe --key, or $LETHE_KEY)")
