"""The FastAPI application: routes over the engine."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from heads.modelio import LoadedModel, load_model
from server.engine import Engine, QueueFull
from server.protocol import GenerateRequest, GenerateResponse, Health, Ready, Usage
from server.settings import Settings


def field_error(field: str, message: str, status: int = 422) -> HTTPException:
    """An error in FastAPI's validation format, naming the body field."""
    return HTTPException(status, detail=[{"loc": ["body", field], "msg": message, "type": "value_error"}])


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


def create_app(settings: Settings | None = None, lm: LoadedModel | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        model = lm or load_model(settings.model, settings.device, settings.dtype)
        app.state.engine = Engine(model, settings.max_batch_size, settings.max_queue)
        try:
            yield
        finally:
            app.state.engine.close()

    app = FastAPI(title="Lethe", summary="Inference-time unlearning server", lifespan=lifespan)
    app.add_middleware(JSONByDefault)

    @app.exception_handler(QueueFull)
    async def _busy(request: Request, exc: QueueFull):
        return JSONResponse({"detail": f"server busy: {exc}"}, status_code=429, headers={"Retry-After": "1"})

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return Health()

    @app.get("/readyz", response_model=Ready)
    async def readyz(request: Request) -> Ready:
        engine: Engine = request.app.state.engine
        return Ready(model=str(engine.lm.path), fingerprint=engine.lm.fingerprint)

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
        engine: Engine = request.app.state.engine
        if body.max_new_tokens > settings.max_new_tokens_limit:
            raise field_error("max_new_tokens", f"must be at most {settings.max_new_tokens_limit}")
        prompt_tokens = engine.count_tokens(body.prompt)
        if prompt_tokens == 0:
            raise field_error("prompt", "encodes to no tokens")
        if prompt_tokens + body.max_new_tokens > engine.context_length:
            raise field_error("prompt", f"{prompt_tokens} prompt tokens + max_new_tokens {body.max_new_tokens} "
                                        f"exceed the model's context of {engine.context_length} tokens")
        done = await engine.generate(body.prompt, body.sampling())
        return GenerateResponse(text=done.text, finish_reason=done.finish_reason,
                                usage=Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                                            total_tokens=done.prompt_tokens + done.completion_tokens))

    return app
