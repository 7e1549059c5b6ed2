"""The FastAPI application: storage, engine, jobs and routes wired together."""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Match

from heads.modelio import LoadedModel, load_model
from server import openai_api, routes
from server.auth import optional_tenant
from server.engine import Engine, QueueFull
from server.generation import admit, complete, stream
from server.jobs import JobRunner
from server.metrics import Metrics
from server.profiles import AdapterCache, HeadCache
from server.protocol import GenerateRequest, GenerateResponse, Health, ProfileUsed, Ready, Usage
from server.settings import Settings
from server.storage import Store

log = logging.getLogger("lethe")


class JSONByDefault:
    """Read request bodies sent without a JSON content type (curl -d's form type, or none) as JSON.

    The API takes JSON everywhere (uploads use multipart, which is left alone), so
    `curl -d '{...}'` works as written.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            ctype = dict(scope["headers"]).get(b"content-type", b"")
            if not ctype or ctype.startswith(b"application/x-www-form-urlencoded") or ctype.startswith(b"text/plain"):
                scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def _json_safe(value):
    """Non-finite floats (from a body that held NaN or Infinity) as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def route_path(request: Request) -> str:
    """The route template (`/v1/heads/{head_id}`), so metrics do not grow a label per id."""
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] == Match.FULL:
            return getattr(route, "path", "unmatched")
    return "unmatched"


def clean_temporary_files(store: Store) -> int:
    """Remove what a crash left behind: half-written files (atomic writes use `.<name>.*.tmp`), and
    complete files no row points at (written, then the process died before the row was inserted)."""
    removed = 0
    for tmp in store.dir.rglob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        removed += 1
    for folder, table in (("datasets", "datasets"), ("heads", "heads"), ("asu", "asu_weights")):
        known = {r["id"] for r in store.q(f"SELECT id FROM {table}")}
        for f in (store.dir / folder).iterdir():
            if f.is_file() and f.name.split(".")[0] not in known:
                f.unlink()
                removed += 1
    return removed


def create_app(settings: Settings | None = None, lm: LoadedModel | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        model = lm or load_model(settings.model, settings.device, settings.dtype)
        store = Store(settings.data_dir)
        removed = clean_temporary_files(store)
        if removed:
            log.warning("removed %d files left by an interrupted write", removed)
        if settings.demo_tenant and not store.q("SELECT id FROM tenants LIMIT 1"):
            _, key = store.create_tenant("demo")
            print(f"lethe: created tenant 'demo' with API key {key} (shown once)", flush=True)
        app.state.settings, app.state.store, app.state.metrics = settings, store, Metrics()
        app.state.engine = Engine(model, settings.max_batch_size, settings.max_queue, app.state.metrics)
        app.state.heads = HeadCache(store, model, settings.head_cache_size)
        app.state.adapters = AdapterCache(store, app.state.engine, settings.adapter_cache_size)
        app.state.jobs = JobRunner(store, app.state.engine, app.state.metrics, app.state.heads)
        try:
            yield
        finally:
            app.state.jobs.close()
            app.state.engine.close()
            store.close()

    app = FastAPI(title="Lethe", summary="Inference-time unlearning server", lifespan=lifespan)
    app.add_middleware(JSONByDefault)
    app.include_router(routes.router)
    app.include_router(openai_api.router)

    @app.middleware("http")
    async def access_log(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        path = route_path(request)
        if hasattr(request.app.state, "metrics"):
            request.app.state.metrics.requests.labels(path, str(response.status_code)).inc()
        log.info(json.dumps({"method": request.method, "path": path, "status": response.status_code,
                             "ms": round(1000 * (time.perf_counter() - started), 1)}))
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        """FastAPI's 422, with inputs made JSON-safe (a NaN or Infinity in the body must not become a 500)."""
        return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors(), custom_encoder={
            Exception: str}))}, status_code=422)

    @app.exception_handler(QueueFull)
    async def _busy(request: Request, exc: QueueFull):
        return JSONResponse({"detail": f"server busy: {exc}"}, status_code=429, headers={"Retry-After": "1"})

    @app.get("/healthz", response_model=Health, tags=["operations"])
    async def healthz() -> Health:
        """`ok` while the process runs."""
        return Health()

    @app.get("/readyz", response_model=Ready, tags=["operations"])
    async def readyz(request: Request) -> Ready:
        """The model's path and fingerprint, once it is loaded."""
        engine: Engine = request.app.state.engine
        return Ready(model=str(engine.lm.path), fingerprint=engine.lm.fingerprint)

    @app.get("/metrics", tags=["operations"])
    async def metrics(request: Request) -> Response:
        """Prometheus metrics."""
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate", response_model=GenerateResponse, tags=["generation"])
    async def generate(body: GenerateRequest, request: Request, tenant_id: str | None = Depends(optional_tenant)):
        """Generate text; `profile` picks an unlearning profile (a name, `base`, or an inline spec)."""
        profile = body.profile.spec() if hasattr(body.profile, "spec") else body.profile
        params = body.sampling()
        resolved, _ = admit(request, tenant_id, body.prompt, params, profile)
        used = ProfileUsed(name=resolved.name, version=resolved.version)

        def response(c) -> GenerateResponse:
            return GenerateResponse(text=c.text, finish_reason=c.finish_reason, profile=used,
                                    usage=Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                                                total_tokens=c.prompt_tokens + c.completion_tokens))

        if body.stream:
            return stream(request, body.prompt, params, resolved, lambda t: {"text": t},
                          lambda c: response(c).model_dump() | {"text": ""})
        return response(await complete(request, body.prompt, params, resolved))

    return app
