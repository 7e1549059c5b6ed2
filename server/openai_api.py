"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

The profile is chosen by `model` (a profile name, or `base`) or by an `unlearning_profile` field.
Fields of the OpenAI API that Lethe does not use are accepted and ignored, as OpenAI clients send
many of them; `n` > 1 and `logprobs` are refused with a 400 naming them.

Errors on these routes have OpenAI's shape, as vLLM's do: `{"error": {"message", "type", "param",
"code"}}`, and a request the schema refuses is 400 (the native API keeps FastAPI's 422 and
`{"detail": ...}`), so the openai SDK raises `BadRequestError` with `e.param` naming the field.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from pydantic import ConfigDict, Field, StrictBool

from heads.decoding.decode import Completion
from heads.records import PROMPT_FORMAT
from heads.decoding.sampling import MAX_NEW_TOKENS, MAX_SEED, MAX_STOPS, SamplingParams
from server.auth import optional_tenant
from server.generation import admit, complete, field_error, stream
from server.protocol import MAX_PROMPT_CHARS, StopString, ValidText

router = APIRouter(tags=["openai"])

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def error_body(status: int, detail) -> tuple[int, dict]:
    """(status, body) in OpenAI's error shape for a FastAPI `detail` (a message, or validation errors: the first
    one names the field, and the status becomes 400)."""
    param = None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid request"))
        status = 400 if status == 422 else status
    else:
        message = str(detail)
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


class StreamOptions(ValidText):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class OpenAIRequest(ValidText):
    model_config = ConfigDict(extra="ignore")
    model: str = Field("base", max_length=200)
    max_tokens: int | None = Field(None, gt=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOPS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    unlearning_profile: str | None = Field(None, max_length=200)

    def checks(self) -> None:
        if self.n != 1:
            raise field_error("n", "only n = 1 is supported")

    def profile(self) -> str | None:
        return self.unlearning_profile or (None if self.model in ("base", "") else self.model)

    def sampling(self, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(max_new_tokens=self.max_tokens or default_max, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=[s for s in stop if s])


class CompletionRequest(OpenAIRequest):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    logprobs: int | None = None


class Message(ValidText):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(max_length=100)
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(None, gt=0, le=MAX_NEW_TOKENS)
    logprobs: bool | None = None


def _profile(resolved) -> tuple[dict, dict[str, str]]:
    """Which profile version answered: a response field (`lethe_profile`) and headers."""
    name = resolved.name or ("inline" if resolved.row is not None or resolved.adapter is not None else "base")
    return ({"lethe_profile": {"name": resolved.name, "version": resolved.version}},
            {"X-Lethe-Profile": name, "X-Lethe-Profile-Version": "" if resolved.version is None else str(resolved.version)})


def _stream_end(body: OpenAIRequest, last: dict, usage: dict, envelope) -> list[dict]:
    """The final chunk (finish reason), and with `stream_options.include_usage` OpenAI's usage chunk (no choices)."""
    if body.stream_options is not None and body.stream_options.include_usage:
        return [last, envelope(None, usage)]
    return [last]


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def chat_prompt(tokenizer, messages: list[Message]) -> str:
    """The tokenizer's chat template when it has one; else Lethe's question-answer format."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([m.model_dump() for m in messages], tokenize=False,
                                             add_generation_prompt=True)
    parts = []
    for m in messages:
        if m.role == "user":
            parts.append(PROMPT_FORMAT.format(question=m.content))
        elif m.role == "assistant":
            parts.append(" " + m.content + "\n")
        else:
            parts.append(m.content + "\n")
    prompt = "".join(parts)
    return prompt if prompt.endswith("Answer:") else prompt + "Answer:"


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, response: Response,
                      tenant_id: str | None = Depends(optional_tenant)):
    """OpenAI-compatible completions; `model` (or `unlearning_profile`) picks the profile."""
    body.checks()
    if body.logprobs:
        raise field_error("logprobs", "logprobs are not supported")
    params = body.sampling(16)
    resolved, _ = await admit(request, tenant_id, body.prompt, params, body.profile(), ("prompt", "max_tokens"))
    rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    used, headers = _profile(resolved)

    def envelope(choice: dict | None, usage: dict | None = None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": body.model,
               "choices": [choice] if choice is not None else [], **used}
        return out | ({"usage": usage} if usage else {})

    if body.stream:
        return stream(request, body.prompt, params, resolved,
                      lambda t: envelope({"index": 0, "text": t, "finish_reason": None, "logprobs": None}),
                      lambda c: _stream_end(body, envelope({"index": 0, "text": "", "finish_reason": c.finish_reason,
                                                            "logprobs": None}), _usage(c), envelope), headers)
    c = await complete(request, body.prompt, params, resolved)
    response.headers.update(headers)
    return envelope({"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}, _usage(c))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, response: Response,
                           tenant_id: str | None = Depends(optional_tenant)):
    """OpenAI-compatible chat; the tokenizer's chat template, else the Question/Answer format."""
    body.checks()
    if body.logprobs:
        raise field_error("logprobs", "logprobs are not supported")
    if body.max_completion_tokens and not body.max_tokens:
        body.max_tokens = body.max_completion_tokens
    prompt = chat_prompt(request.app.state.engine.lm.tokenizer, body.messages)
    params = body.sampling(64)
    resolved, _ = await admit(request, tenant_id, prompt, params, body.profile(), ("messages", "max_tokens"))
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    used, headers = _profile(resolved)

    def envelope(obj: str, choice: dict | None, usage: dict | None = None) -> dict:
        out = {"id": rid, "object": obj, "created": created, "model": body.model,
               "choices": [choice] if choice is not None else [], **used}
        return out | ({"usage": usage} if usage else {})

    if body.stream:
        state = {"role_sent": False, "started": False}

        def delta(text: str) -> dict:
            """The role once, in the first chunk, as OpenAI sends it; the answer's leading spaces dropped, as in
            the non-streamed message, so both give the same text."""
            if not state["started"]:
                text = text.lstrip()
                state["started"] = bool(text)
            d = {"content": text} if state["role_sent"] else {"role": "assistant", "content": text}
            state["role_sent"] = True
            return envelope("chat.completion.chunk", {"index": 0, "delta": d, "finish_reason": None})

        return stream(request, prompt, params, resolved, delta,
                      lambda c: _stream_end(body, envelope("chat.completion.chunk", {
                          "index": 0, "delta": {}, "finish_reason": c.finish_reason}), _usage(c),
                          lambda choice, usage: envelope("chat.completion.chunk", choice, usage)), headers)
    c = await complete(request, prompt, params, resolved)
    response.headers.update(headers)
    return envelope("chat.completion", {"index": 0, "message": {"role": "assistant", "content": c.text.lstrip()},
                                        "finish_reason": c.finish_reason}, _usage(c))


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "lethe"}


@router.get("/v1/models")
def models(request: Request, tenant_id: str | None = Depends(optional_tenant)):
    """`base` and the tenant's profiles, as OpenAI models."""
    names = ["base"] + (request.app.state.store.profile_names(tenant_id) if tenant_id else [])
    return {"object": "list", "data": [_model(n) for n in names]}


@router.get("/v1/models/{model_id}")
def model(model_id: str, request: Request, tenant_id: str | None = Depends(optional_tenant)):
    """One model: `base`, or one of the tenant's profiles (404 otherwise)."""
    if model_id == "base" or (tenant_id and model_id in request.app.state.store.profile_names(tenant_id)):
        return _model(model_id)
    raise HTTPException(404, f"model {model_id!r} not found")
