"""The FastAPI application: storage, engine, jobs and routes wired together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from pathlib import Path
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from lethe.heads.io import atomic_write_bytes
from lethe.heads.modelio import LoadedModel, load_model
from lethe.server import __version__
from lethe.server import compliance, openai_api, routes
from lethe.server.answer_json import dumps
from lethe.server.auth import Caller, generating, is_admin, optional_tenant
from lethe.server.engine import Engine, QueueFull
from lethe.server.generation import admit, check_policy, check_token_ids, complete, stream
from lethe.server.jobs import JobRunner
from lethe.server.metrics import Metrics
from lethe.server.profiles import AdapterCache, HeadCache
from lethe.server.quotas import QuotaExceeded, Quotas
from lethe.server.protocol import (DetokenizeRequest, DetokenizeResponse, GenerateRequest, GenerateResponse, Health,
                             ProfileUsed, Ready, TokenizeRequest, TokenizeResponse, TokenizerInfo, Usage, Version)
from lethe.server.settings import Settings
from lethe.server.storage import LEGACY, Store, StoredFileError

log = logging.getLogger("lethe")
DEMO_KEY_FILE = "demo-key"  # in the data directory: the demo tenant's first key, for `export LETHE_KEY=$(cat ...)`


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
                # in place, not a copy: the access log reads the route the router records in this scope
                scope["headers"] = headers + [(b"content-type", b"application/json")]
        await self.app(scope, receive, send)


def _json_safe(value):
    """Non-finite floats (from a body that held NaN or Infinity) as strings, lone surrogates escaped."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {_json_safe(k): _json_safe(v) for k, v in value.items()}
    return value


UPLOAD_PATHS = ("/v1/datasets", "/v1/heads/upload", "/v1/asu/upload")


def _error_body(path: str, status: int, detail) -> tuple[int, dict]:
    """(status, body) of an error: `{"detail": ...}` on the native API; OpenAI's shape (and 400 for a bad field)
    on its routes."""
    if openai_api.is_openai_path(path):
        return openai_api.error_body(status, detail)
    return status, {"detail": detail}


def _plain_error(status: int, message: str, path: str = "", headers: list | None = None):
    """A JSON error sent before any route runs."""
    status, payload = _error_body(path, status, message)
    body = json.dumps(payload).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")] + (headers or [])}
    return start, {"type": "http.response.body", "body": body}


async def read_bounded(receive, limit: int, timeout: float, setting: str, length: bytes | str | None = None
                       ) -> tuple[bytes | None, tuple[int, str] | None]:
    """A request body read whole from ASGI `receive`, up to `limit` bytes: (body, None); (None, (413, why)) as
    soon as it passes the limit (from its Content-Length `length` alone when it is given); (None, (408, why))
    when the next piece takes longer than `timeout` seconds; (None, None) when the client went away. `setting`
    names the limit in the message."""
    length = length.decode("latin-1") if isinstance(length, bytes) else (length or "")
    if length.isdigit() and int(length) > limit:
        return None, (413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes ({setting})")
    body, more = bytearray(), True
    while more:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            return None, (408, f"the request body stalled for more than {timeout:g} s")
        if message["type"] == "http.disconnect":
            return None, None
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > limit:
            return None, (413, f"request body exceeds the limit of {limit} bytes ({setting})")
    return bytes(body), None


class BoundedBody:
    """Every request body is bounded before anything parses it, and a body that stalls is cut off.

    JSON bodies (every route but the uploads) are read here up to `max_request_bytes` (413 beyond, from the
    Content-Length alone when it is given), then handed on; uploads are bounded by their route as they stream
    (`routes._read_upload`). Waiting more than `body_timeout` seconds for the next piece of a body answers
    408 (uploads: the route sees the client gone)."""

    def __init__(self, app, settings: Settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        timeout = self.settings.body_timeout

        async def timed_receive():
            try:
                return await asyncio.wait_for(receive(), timeout)
            except asyncio.TimeoutError:
                return {"type": "http.disconnect"}

        if scope["path"] in UPLOAD_PATHS:
            return await self.app(scope, timed_receive, send)
        body, refused = await read_bounded(receive, self.settings.max_request_bytes, timeout,
                                           "LETHE_MAX_REQUEST_BYTES", dict(scope["headers"]).get(b"content-length"))
        if refused is not None:
            for message in _plain_error(*refused, scope["path"]):
                await send(message)
            return
        if body is None:  # the client went away
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class AccessLog:
    """A JSON line and the request metrics per HTTP request, once its response is sent (a stream's too).

    Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, under which `request.is_disconnected()` never sees a
    client that left (its receive wrapper is cancelled before it reads), so a whole-answer request could not stop
    its row (`generation.complete`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500  # 500: no handler answered (the server's error page will)

        async def sent(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            seconds, path = time.perf_counter() - started, route_path(Request(scope))
            metrics = getattr(scope["app"].state, "metrics", None)
            if metrics is not None:
                metrics.requests.labels(path, str(status)).inc()
                metrics.request_seconds.labels(path).observe(seconds)
            log.info(json.dumps({"method": scope["method"], "path": path, "status": status,
                                 "ms": round(1000 * seconds, 1)}))


def route_path(request: Request) -> str:
    """The route template (`/v1/heads/{head_id}`), so metrics do not grow a label per id.

    Read after routing: the router puts the route it chose in `scope["route"]` (FastAPI's included
    routers are not flat in `app.router.routes`, so scanning that list misses them). A request no route
    matched (a 404 for an unknown path, or a trailing-slash redirect) is `unmatched`."""
    route = request.scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


SHARED_GRACE = 3600.0  # seconds: on a shared data directory, files younger than this may be another replica's work


def clean_temporary_files(store: Store) -> int:
    """Remove what a crash left behind: half-written files (atomic writes use `.<name>.*.tmp`), and
    complete files no row points at (written, then the process died before the row was inserted, or released
    while young). Where replicas share the store (a shared database), only files older than SHARED_GRACE: a
    younger one may be another replica's write in progress. Files of a release before the blob store are
    moved into it first (`Store.adopt_files`); what stays in its folders is what no row points at."""
    grace = SHARED_GRACE if store.shared else 0.0
    adopted = store.adopt_files()
    if adopted:
        log.warning("moved %d files into the blob store %s", adopted, store.blobs.url)
    removed, cutoff = store.clean_blobs(grace), time.time() - grace

    def old(path: Path) -> bool:
        try:
            return path.stat().st_mtime <= cutoff
        except FileNotFoundError:
            return False

    for tmp in store.dir.rglob(".*.tmp"):
        if old(tmp):
            tmp.unlink(missing_ok=True)
            removed += 1
    for folder, _ in LEGACY.values():
        if not (store.dir / folder).is_dir():
            continue
        for f in (store.dir / folder).iterdir():
            if f.is_file() and old(f):
                f.unlink(missing_ok=True)
                removed += 1
        with contextlib.suppress(OSError):  # gone once empty
            (store.dir / folder).rmdir()
    return removed


def check_served_name(store: Store, served: str | None) -> None:
    """`--served-model-name` must not be a tenant's profile name (the base model would answer under the name a
    tenant's users ask for to get their profile): a ValueError naming both."""
    if not served:
        return
    clash = store.q("SELECT t.name AS tenant, p.name AS profile FROM profiles p JOIN tenants t ON t.id = p.tenant_id "
                    "WHERE lower(p.name) = lower(?) ORDER BY t.name LIMIT 1", served)
    if clash:
        raise ValueError(f"--served-model-name {served!r} is the name of tenant {clash[0]['tenant']!r}'s profile "
                         f"{clash[0]['profile']!r}: choose another served name")


def use_chat_template(tokenizer, path: Path) -> None:
    """Serve with the Jinja chat template in `path`, tried on a short chat first: a template that does not render
    fails the start, naming the file, rather than every chat request."""
    text = path.read_text()
    previous, tokenizer.chat_template = tokenizer.chat_template, text
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 raises several kinds
        tokenizer.chat_template = previous
        raise ValueError(f"chat template {path}: {type(e).__name__}: {e}") from None


def create_app(settings: Settings | None = None, lm: LoadedModel | None = None, dispatch_jobs=None,
               decoder=None) -> FastAPI:
    """The server. `dispatch_jobs(job)`, if given, runs each claimed job elsewhere (on Ray Serve, a Ray task of its
    own: `ray_serve.job_dispatcher`); else jobs run on this process's job thread. `decoder`: the llama.cpp model
    for `settings.engine` llamacpp, if already open (else it is opened here)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        model = lm or load_model(settings.model, settings.device, settings.dtype)
        store = Store(settings.data_dir, settings.database_url, settings.blob_url, settings.blob_cache)
        check_served_name(store, settings.served_model_name)
        removed = clean_temporary_files(store)
        if removed:
            log.warning("removed %d files left by an interrupted write", removed)
        if settings.demo_tenant and not store.q("SELECT id FROM tenants LIMIT 1"):
            try:
                _, key = store.create_tenant("demo")
                saved = Path(settings.data_dir) / DEMO_KEY_FILE
                atomic_write_bytes(saved, key.encode() + b"\n")  # readable by its owner only (mkstemp's 0600)
                print(f"lethe: created tenant 'demo' with API key {key} (also in {saved}, readable by you only)",
                      flush=True)
            except IntegrityError:  # a replica starting beside this one made it first
                pass
        if settings.chat_template is not None:  # before the engine copies the tokenizer
            use_chat_template(model.tokenizer, Path(settings.chat_template))
        app.state.settings, app.state.store, app.state.metrics = settings, store, Metrics()
        fast = decoder
        if settings.engine == "llamacpp" and fast is None:
            from lethe.heads.decoding.llamacpp import open_gguf

            fast = open_gguf(model, settings.gguf, settings.max_batch_size, settings.max_model_len)
        app.state.engine = Engine(model, settings.max_batch_size, settings.max_queue, app.state.metrics,
                                  settings.max_model_len, fast, settings.max_rows_per_caller)
        app.state.heads = HeadCache(store, model, settings.head_cache_size)
        app.state.adapters = AdapterCache(store, app.state.engine, settings.adapter_cache_size)
        app.state.quotas = Quotas(store, settings)
        app.state.jobs = JobRunner(store, app.state.engine, app.state.metrics, app.state.heads,
                                   settings.job_stale_seconds, dispatch=dispatch_jobs,
                                   budget=settings.max_job_seconds, turn=settings.job_turn_seconds,
                                   slots=settings.job_slots)
        try:
            yield
        finally:
            app.state.jobs.close()
            app.state.engine.close()
            store.close()

    app = FastAPI(title="Lethe", summary="Inference-time unlearning server", lifespan=lifespan)
    app.add_middleware(JSONByDefault)
    app.add_middleware(BoundedBody, settings=settings)
    app.include_router(routes.router)
    app.include_router(openai_api.router)
    app.include_router(compliance.router)
    app.add_middleware(AccessLog)  # outermost of ours: it times and logs all of a request

    def _error(request: Request, status: int, detail, headers=None) -> JSONResponse:
        status, body = _error_body(request.url.path, status, detail)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        """FastAPI's 422, with inputs made JSON-safe (a NaN or Infinity in the body must not become a 500)."""
        return _error(request, 422, _json_safe(jsonable_encoder(exc.errors(), custom_encoder={Exception: str})))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(request, exc.status_code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(QuotaExceeded)
    async def _quota(request: Request, exc: QuotaExceeded):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return _error(request, 429, exc.message, headers)

    @app.exception_handler(StoredFileError)
    async def _stored_file(request: Request, exc: StoredFileError):
        """A stored file missing or damaged: the server's fault, said so (and logged for the operator)."""
        log.error("%s %s: %s", request.method, request.url.path, exc)
        return _error(request, 500, str(exc))

    @app.exception_handler(QueueFull)
    async def _busy(request: Request, exc: QueueFull):
        return _error(request, 429, f"server busy: {exc}", {"Retry-After": "1"})

    @app.exception_handler(DBAPIError)
    async def _database_away(request: Request, exc: DBAPIError):
        """The database went away (a PostgreSQL restart, say): 503 until it is back, and the pool reconnects by
        itself. Requests already admitted decode on; they need no database."""
        if not exc.connection_invalidated and not isinstance(exc, (OperationalError, InterfaceError)):
            raise exc
        log.warning("database unavailable: %s", type(exc.orig).__name__ if exc.orig is not None else exc)
        return _error(request, 503, "the metadata database is unavailable for a moment: retry", {"Retry-After": "1"})

    @app.get("/healthz", response_model=Health, tags=["operations"])
    async def healthz() -> Health:
        """`ok` while the process runs."""
        return Health()

    @app.get("/readyz", response_model=Ready, tags=["operations"])
    async def readyz(request: Request) -> Ready:
        """The model's name and fingerprint, once it is loaded (its path on the server is not shown)."""
        engine: Engine = request.app.state.engine
        return Ready(model=Path(str(engine.lm.path)).name, fingerprint=engine.lm.fingerprint)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        return _error(request, 408, "the request body ended early or stalled")

    @app.get("/version", response_model=Version, tags=["operations"])
    async def version(request: Request) -> Version:
        """Lethe's version, the model served (name and fingerprint), its context and the engine decoding it."""
        engine: Engine = request.app.state.engine
        return Version(version=__version__, model=Path(str(engine.lm.path)).name, fingerprint=engine.lm.fingerprint,
                       max_model_len=engine.context_length,
                       engine="torch" if engine.decoder is None else "llamacpp")

    @app.post("/tokenize", response_model=TokenizeResponse, tags=["operations"],
              dependencies=[Depends(optional_tenant)])
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        """Token ids of a prompt (or of chat messages through the chat template), as vLLM's /tokenize."""
        engine: Engine = request.app.state.engine

        def tokenize() -> list[int]:  # in proportion to the input: never on the event loop
            text = body.prompt if body.prompt is not None else openai_api.chat_prompt(engine.lm.tokenizer,
                                                                                      body.messages)
            return engine.encode(text, add_special_tokens=body.add_special_tokens)

        def answer() -> bytes:  # 200,000 ids for a 1 MB prompt: encoded off the loop, a slice at a time; the
            tokens = tokenize()  # ids are plain ints already, so no model validates them (one long C call)
            return dumps({"tokens": tokens, "count": len(tokens), "max_model_len": engine.context_length})

        return Response(await run_in_threadpool(answer), media_type="application/json")

    @app.get("/tokenizer_info", response_model=TokenizerInfo, tags=["operations"],
             dependencies=[Depends(optional_tenant)])
    async def tokenizer_info(request: Request) -> TokenizerInfo:
        """The tokenizer's special tokens, chat template and context, as vLLM's /tokenizer_info."""
        engine: Engine = request.app.state.engine
        tok = engine.lm.tokenizer
        template = getattr(tok, "chat_template", None)
        return TokenizerInfo(tokenizer_class=type(tok).__name__, eos_token=tok.eos_token, bos_token=tok.bos_token,
                             pad_token=tok.pad_token, chat_template=template if isinstance(template, str) else None,
                             model_max_length=engine.context_length)

    @app.post("/detokenize", response_model=DetokenizeResponse, tags=["operations"],
              dependencies=[Depends(optional_tenant)])
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        """The text of token ids, as vLLM's /detokenize."""
        engine: Engine = request.app.state.engine

        def detokenize() -> str:
            check_token_ids(engine.lm.tokenizer, body.tokens, "tokens", 422)
            return engine.detokenize(body.tokens)

        return DetokenizeResponse(prompt=await run_in_threadpool(detokenize))

    @app.get("/metrics", tags=["operations"])
    async def metrics(request: Request) -> Response:
        """Prometheus metrics, for the admin key; for anyone where LETHE_METRICS_PUBLIC is set, less what tells of
        tenants' activity (jobs and profile use), which stays the admin key's."""
        admin_asks = is_admin(request)
        if not admin_asks and not request.app.state.settings.metrics_public:
            raise StarletteHTTPException(403, "metrics need the admin key (or a server started with "
                                              "LETHE_METRICS_PUBLIC=true)")
        registry = request.app.state.metrics.registry if admin_asks else request.app.state.metrics.public
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate", response_model=GenerateResponse, tags=["generation"])
    async def generate(body: GenerateRequest, request: Request, caller: Caller | None = Depends(generating)):
        """Generate text; `profile` picks an unlearning profile (a name, `base`, or an inline spec); a key bound
        to a profile, or a tenant's enforced profile, decides it instead."""
        profile = body.profile.spec() if hasattr(body.profile, "spec") else body.profile
        params = body.sampling()
        profile = check_policy(caller, profile, False, "profile")
        resolved, _ = await admit(request, caller, body.prompt, params, profile)
        used = ProfileUsed(name=resolved.name, version=resolved.version)

        def response(c) -> GenerateResponse:
            return GenerateResponse(text=c.text, finish_reason=c.finish_reason, profile=used,
                                    usage=Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                                                total_tokens=c.prompt_tokens + c.completion_tokens))

        if body.stream:
            return stream(request, [(body.prompt, params, resolved)], lambda _, t, __: {"text": t},
                          lambda _, c, __: response(c).model_dump() | {"text": ""})
        return response(await complete(request, body.prompt, params, resolved))

    return app
