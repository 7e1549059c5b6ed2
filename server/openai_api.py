"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

The profile is chosen by `model` (a profile name, or `base`) or by an `unlearning_profile` field.
Sampling: temperature, top_p, vLLM's top_k and min_p, presence and frequency penalties, seed, stop,
`n` choices (and completions' lists of prompts or token ids), `echo`; applied after the profile's
tilt, on the distribution actually sampled. Fields that would change the answer and that Lethe does
not implement (`logprobs`, `repetition_penalty`, `logit_bias`, `tools`, a `response_format` other
than text, `best_of`, `suffix`) are refused with a 400 naming them; others (`user`, ...) are ignored.

Errors on these routes have OpenAI's shape, as vLLM's do: `{"error": {"message", "type", "param",
"code"}}`, and a request the schema refuses is 400 (the native API keeps FastAPI's 422 and
`{"detail": ...}`), so the openai SDK raises `BadRequestError` with `e.param` naming the field.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from pydantic import ConfigDict, Field, StrictBool

from lethe.heads.decoding.decode import Completion
from lethe.heads.records import PROMPT_FORMAT
from lethe.heads.decoding.sampling import MAX_NEW_TOKENS, MAX_SEED, MAX_STOPS, MAX_TOP_K, SamplingParams
from lethe.server.auth import optional_tenant
from lethe.server.generation import admit, check_token_ids, complete, field_error, stream
from lethe.server.protocol import MAX_PROMPT_CHARS, ChatMessage as Message, StopString, ValidText

router = APIRouter(tags=["openai"])

MAX_N = 16  # choices per request (n, or prompts x n)

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


_BRANCH = re.compile(r"str|int|float|bool|list|dict|none|.*\[.*")  # pydantic's names for a union's branches


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def error_body(status: int, detail) -> tuple[int, dict]:
    """(status, body) in OpenAI's error shape for a FastAPI `detail` (a message, or validation errors: the first
    one names the field, and the status becomes 400)."""
    param = None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        # our own checks say more than a union's "not a string" for the branch that did not apply
        first = next((d for d in detail if d.get("type") == "value_error"), detail[0])
        loc = [str(x) for x in first.get("loc", []) if x != "body" and not _BRANCH.fullmatch(str(x))]
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
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, description="vLLM's: the k likeliest tokens (0 or -1: off).")
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description="vLLM's: tokens below min_p x the best.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOPS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED - MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    unlearning_profile: str | None = Field(None, max_length=200)
    # accepted only at their neutral values: anything else is a 400 naming the field, never silently ignored
    repetition_penalty: float | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    best_of: int | None = None

    def checks(self, choices: int) -> None:
        refused = {"repetition_penalty": self.repetition_penalty not in (None, 1, 1.0),
                   "logit_bias": bool(self.logit_bias), "tools": bool(self.tools),
                   "tool_choice": self.tool_choice not in (None, "none"),
                   "response_format": self.response_format is not None
                   and self.response_format.get("type", "text") != "text",
                   "best_of": self.best_of not in (None, 1)}
        for name, bad in refused.items():
            if bad:
                raise field_error(name, f"{name} is not supported by this server", 400)
        if self.stream and choices > 1:
            raise field_error("n", "streaming gives one choice: n = 1 and one prompt", 400)

    def profile(self, served: str | None = None) -> str | None:
        """The profile asked for: `unlearning_profile`, else `model` unless it names the base model (`base`, or the
        operator's --served-model-name)."""
        if self.unlearning_profile:
            return self.unlearning_profile
        return None if self.model in ("base", "") or self.model == served else self.model

    def sampling(self, default_max: int, choice: int = 0) -> SamplingParams:
        """The choice'th sampling settings: with a seed, choice i draws with seed + i (n > 1 differ, yet repeat)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(max_new_tokens=self.max_tokens or default_max, temperature=self.temperature,
                              top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              seed=None if self.seed is None else self.seed + choice, stop=[s for s in stop if s])


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A prompt, a list of prompts (a choice each), or token ids (one list, or a list of lists).")
    logprobs: int | None = None
    echo: StrictBool = Field(False, description="Put the prompt before the completion's text.")
    suffix: str | None = None

    def prompts(self, tokenizer) -> list[str]:
        """The prompts as text (token ids decoded with the model's tokenizer); each non-empty and bounded."""
        items = [self.prompt] if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)) \
            else list(self.prompt)
        if not items or len(items) > MAX_N:
            raise field_error("prompt", f"give 1 to {MAX_N} prompts", 400)
        for ids in (p for p in items if not isinstance(p, str)):
            check_token_ids(tokenizer, ids, "prompt", 400)
        # token ids become text and are tokenized again with the prompt (a known gap: the ids are not fed as given)
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in items]
        for text in texts:
            if not text or len(text) > MAX_PROMPT_CHARS:
                raise field_error("prompt", f"a prompt must have 1 to {MAX_PROMPT_CHARS} characters", 400)
        return texts


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(None, gt=0, le=MAX_NEW_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _asked(body: OpenAIRequest, request: Request) -> str | None:
    return body.profile(request.app.state.settings.served_model_name)


def _profile(resolved) -> tuple[dict, dict[str, str]]:
    """Which profile version answered: a response field (`lethe_profile`) and headers."""
    name = resolved.name or ("inline" if resolved.row is not None or resolved.adapter is not None else "base")
    headers = {"X-Lethe-Profile": name} | ({} if resolved.version is None
                                           else {"X-Lethe-Profile-Version": str(resolved.version)})
    return {"lethe_profile": {"name": resolved.name, "version": resolved.version}}, headers


def _envelope(head: dict, used: dict, choice: dict | list[dict] | None, usage: dict | None = None) -> dict:
    """A response or stream chunk: `head` (id, object, created, model), the choices (one, a list, or none),
    which profile answered, and usage when given."""
    choices = choice if isinstance(choice, list) else [choice] if choice is not None else []
    return {**head, "choices": choices, **used} | ({"usage": usage} if usage else {})


def _stream_end(body: OpenAIRequest, last: dict, usage: dict, envelope) -> list[dict]:
    """The final chunk (finish reason), and with `stream_options.include_usage` OpenAI's usage chunk (no choices)."""
    if body.stream_options is not None and body.stream_options.include_usage:
        return [last, envelope(None, usage)]
    return [last]


def chat_prompt(tokenizer, messages: list[Message]) -> str:
    """The tokenizer's chat template when it has one; else Lethe's question-answer format."""
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    parts = []
    for turn in turns:
        if turn["role"] == "user":
            parts.append(PROMPT_FORMAT.format(question=turn["content"]))
        elif turn["role"] == "assistant":
            parts.append(" " + turn["content"] + "\n")
        else:
            parts.append(turn["content"] + "\n")
    prompt = "".join(parts)
    return prompt if prompt.endswith("Answer:") else prompt + "Answer:"


async def _choices(request: Request, tenant_id: str | None, body: OpenAIRequest, prompts: list[str],
                   default_max: int, fields: tuple[str, str]) -> tuple[list[tuple[int, str, Completion]], object]:
    """Every choice decoded (n per prompt, in one batch with everyone else's rows): (index, prompt, completion)
    in order, and the first choice's resolved profile (all resolve the same profile name)."""
    queue = request.app.state.engine.queue.maxsize
    if len(prompts) * body.n > queue:  # could never be admitted together: say so, not 429 for ever
        raise field_error("n", f"{len(prompts) * body.n} choices exceed this server's queue of {queue} requests", 400)

    async def one(index: int, prompt: str, choice: int):
        params = body.sampling(default_max, choice)
        resolved, _ = await admit(request, tenant_id, prompt, params, _asked(body, request), fields)
        return resolved, (index, prompt, await complete(request, prompt, params, resolved))

    tasks = [asyncio.ensure_future(one(i * body.n + j, p, j)) for i, p in enumerate(prompts) for j in range(body.n)]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one choice failed (a full queue, say): the others stop too, their rows freed
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [c for _, c in done], done[0][0]


def _default_max(request: Request, prompt: str, default: int) -> int:
    """New tokens for a request without max_tokens: `default`, or what the context leaves after the prompt."""
    engine = request.app.state.engine
    return max(1, min(default, engine.context_length - engine.count_tokens(prompt)))


def _usage(*completions: Completion) -> dict:
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, response: Response,
                      tenant_id: str | None = Depends(optional_tenant)):
    """OpenAI-compatible completions; `model` (or `unlearning_profile`) picks the profile."""
    prompts = body.prompts(request.app.state.engine.lm.tokenizer)
    body.checks(len(prompts) * body.n)
    if body.logprobs is not None:
        raise field_error("logprobs", "logprobs are not supported", 400)
    if body.suffix:
        raise field_error("suffix", "suffix is not supported by this server", 400)
    default_max = 16 if body.max_tokens else _default_max(request, max(prompts, key=len), 16)
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": body.model}

    def envelope(used: dict, choice: dict | list[dict] | None, usage: dict | None = None) -> dict:
        return _envelope(head, used, choice, usage)

    if body.stream:
        params = body.sampling(default_max)
        resolved, _ = await admit(request, tenant_id, prompts[0], params, _asked(body, request),
                                  ("prompt", "max_tokens"))
        used, headers = _profile(resolved)
        echoed = [body.echo]

        def piece(text: str) -> dict:  # with echo, the prompt comes first, in the first chunk
            text, echoed[0] = (prompts[0] + text if echoed[0] else text), False
            return envelope(used, {"index": 0, "text": text, "finish_reason": None, "logprobs": None})

        return stream(request, prompts[0], params, resolved, piece,
                      lambda c: _stream_end(body, envelope(used, {"index": 0, "text": prompts[0] if echoed[0] else "",
                                                                  "logprobs": None, "finish_reason": c.finish_reason}),
                                            _usage(c),
                                            lambda choice, usage: envelope(used, choice, usage)), headers)
    done, resolved = await _choices(request, tenant_id, body, prompts, default_max, ("prompt", "max_tokens"))
    used, headers = _profile(resolved)
    response.headers.update(headers)
    return envelope(used, [{"index": i, "text": (p if body.echo else "") + c.text, "finish_reason": c.finish_reason,
                            "logprobs": None} for i, p, c in done], _usage(*(c for _, _, c in done)))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, response: Response,
                           tenant_id: str | None = Depends(optional_tenant)):
    """OpenAI-compatible chat; the tokenizer's chat template, else the Question/Answer format."""
    body.checks(body.n)
    if body.logprobs or body.top_logprobs:
        raise field_error("logprobs", "logprobs are not supported", 400)
    if body.max_completion_tokens:  # OpenAI's newer name wins over the deprecated max_tokens, as in vLLM
        body.max_tokens = body.max_completion_tokens
    prompt = chat_prompt(request.app.state.engine.lm.tokenizer, body.messages)
    default_max = 64 if body.max_tokens else _default_max(request, prompt, 64)
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def envelope(used: dict, obj: str, choice: dict | list[dict] | None, usage: dict | None = None) -> dict:
        return _envelope({"id": rid, "object": obj, "created": created, "model": body.model}, used, choice, usage)

    if body.stream:
        params = body.sampling(default_max)
        resolved, _ = await admit(request, tenant_id, prompt, params, _asked(body, request),
                                  ("messages", "max_tokens"))
        used, headers = _profile(resolved)
        state = {"role_sent": False, "started": False}

        def delta(text: str) -> dict:
            """The role once, in the first chunk, as OpenAI sends it; the answer's leading spaces dropped, as in
            the non-streamed message, so both give the same text."""
            if not state["started"]:
                text = text.lstrip()
                state["started"] = bool(text)
            d = {"content": text} if state["role_sent"] else {"role": "assistant", "content": text}
            state["role_sent"] = True
            return envelope(used, "chat.completion.chunk", {"index": 0, "delta": d, "finish_reason": None})

        return stream(request, prompt, params, resolved, delta,
                      lambda c: _stream_end(body, envelope(used, "chat.completion.chunk", {
                          "index": 0, "delta": {}, "finish_reason": c.finish_reason}), _usage(c),
                          lambda choice, usage: envelope(used, "chat.completion.chunk", choice, usage)), headers)
    done, resolved = await _choices(request, tenant_id, body, [prompt], default_max, ("messages", "max_tokens"))
    used, headers = _profile(resolved)
    response.headers.update(headers)
    return envelope(used, "chat.completion", [
        {"index": i, "message": {"role": "assistant", "content": c.text.lstrip()}, "finish_reason": c.finish_reason}
        for i, _, c in done], _usage(*(c for _, _, c in done)))


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "lethe"}


@router.get("/v1/models")
def models(request: Request, tenant_id: str | None = Depends(optional_tenant)):
    """`base` and the tenant's profiles, as OpenAI models."""
    served = request.app.state.settings.served_model_name
    names = ["base"] + ([served] if served else []) + \
        (request.app.state.store.profile_names(tenant_id) if tenant_id else [])
    return {"object": "list", "data": [_model(n) for n in names]}


@router.get("/v1/models/{model_id}")
def model(model_id: str, request: Request, tenant_id: str | None = Depends(optional_tenant)):
    """One model: `base`, or one of the tenant's profiles (404 otherwise)."""
    if model_id in ("base", request.app.state.settings.served_model_name) or \
            (tenant_id and model_id in request.app.state.store.profile_names(tenant_id)):
        return _model(model_id)
    raise HTTPException(404, f"model {model_id!r} not found")
