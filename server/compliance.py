"""What an operator shows a data-protection officer: the audit trail (`GET /v1/audit`) and the forgetting report of
a profile version (`GET /v1/profiles/{name}/report`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from lethe.server.auth import is_admin, tenant
from lethe.server.protocol import AuditEntry
from lethe.server.report import ReportError, gather, render_html

router = APIRouter(tags=["compliance"])


@router.get("/v1/audit", response_model=list[AuditEntry])
def audit(request: Request, profile: str | None = Query(None, max_length=200),
          since: float | None = Query(None, description="Unix time: entries at or after it."),
          until: float | None = Query(None, description="Unix time: entries at or before it."),
          action: str | None = Query(None, max_length=50, description="e.g. profile.set"),
          tenant_name: str | None = Query(None, alias="tenant", max_length=100,
                                          description="Admin only: one tenant's entries (default: every tenant's)."),
          limit: int = Query(1000, ge=1, le=100_000)) -> list[AuditEntry]:
    """The audit trail, oldest first: every change that decides what a tenant's users get.

    Keys made, changed, rotated, revoked; profiles set, rolled back, deleted; the enforced profile; heads, ASU
    weights and datasets deleted; tenants made and deleted: each with the acting key's id and what it replaced.
    Append-only, kept when a tenant is deleted. A tenant's `manage` key sees its own tenant's; the admin key
    every tenant's."""
    store = request.app.state.store
    if is_admin(request):
        tenant_id = None  # every tenant's; with `tenant`, every tenant that had the name (a deleted one too)
    else:
        if tenant_name is not None:
            raise HTTPException(403, "`tenant` is for the admin key: a tenant's key sees its own trail")
        tenant_id = tenant(request)
    return [AuditEntry(**e) for e in store.audit_trail(tenant_id, profile, since, until, action, limit, tenant_name)]


@router.get("/v1/profiles/{name}/report", response_class=HTMLResponse,
            responses={200: {"content": {"text/html": {}, "application/json": {}}}})
async def report(name: str, request: Request, version: int | None = Query(None, ge=1, le=2**31),
                 format: Literal["html", "json"] = Query("html")):
    """The forgetting report of a profile version (default: the current one), as a page (or `format=json`).

    What was asked to be forgotten (datasets with record counts and sha256), the head or ASU weights (sha256,
    training settings), when the version served, evaluation jobs run on it, its audit entries, and the sha256 of
    the whole (`digest`). The same bytes each time it is made while nothing changes. `format=json` gives the data
    the page embeds."""
    tenant_id = tenant(request)
    engine = request.app.state.engine
    model = {"name": Path(str(engine.lm.path)).name, "fingerprint": engine.lm.fingerprint}
    try:
        found = await run_in_threadpool(gather, request.app.state.store, tenant_id, name, version, model)
    except ReportError as e:
        raise HTTPException(404, str(e)) from None
    if format == "json":
        return JSONResponse(found)
    return HTMLResponse(render_html(found))
