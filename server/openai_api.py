"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

The profile is chosen by `model` (a profile name, or `base`) or by an `unlearning_profile` field.
Sampling: temperature, top_p, vLLM's top_k and min_p, presence and frequency penalties, seed, stop,
`n` choices, streamed too (and completions' lists of prompts or of token ids, fed as given), `echo`;
applied after the profile's tilt, on the distribution actually sampled. `logprobs` / `top_logprobs` are
those of the distribution each token was drawn from, after the tilt (`heads.decoding.logprobs`); with
`lethe_untilted_logprobs` the base model's come too. Completions' `echo` with `logprobs` scores the
prompt (`max_tokens: 0` for the prompt alone, as lm-evaluation-harness asks). Under an ASU profile each
choice says whether it decoded with the adapter (`lethe_adapter`; in a stream, in the choice's last chunk).
Fields that would change the answer and that Lethe does not implement (`repetition_penalty`, `logit_bias`, `tools`, a
`response_format` other than text, `best_of`, `suffix`) are refused with a 400 naming them; others
(`user`, ...) are ignored.

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
from pydantic import ConfigDict, Field, StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool

from lethe.heads.decoding.decode import Completion
from lethe.heads.decoding.logprobs import TokenLogprob, token_bytes
from lethe.heads.records import plain_prompt
from lethe.heads.decoding.sampling import (MAX_LOGPROBS, MAX_NEW_TOKENS, MAX_SEED, MAX_STOPS, MAX_TOP_K,
                                           SamplingParams)
from lethe.server.answer_json import dumps
from lethe.server.auth import Caller, generating
from lethe.server.generation import admit, check_policy, check_token_ids, complete, field_error, stream
from lethe.server.profiles import pin
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
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            param, message = None, f"the body is not valid JSON (at character {'.'.join(loc) or '?'})"
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
    model: str = Field("", max_length=200, description="A profile's name, `base` (or the served model name), or "
                                                      "left out: no profile (a bound key's or an enforced one).")
    max_tokens: int | None = Field(None, gt=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, description="vLLM's: the k likeliest tokens (0 or -1: off).")
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description="vLLM's: tokens below min_p x the best.")
    min_tokens: int = Field(0, ge=0, le=MAX_NEW_TOKENS, description="vLLM's: no end of text before this many tokens.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOPS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED - MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    unlearning_profile: str | None = Field(None, max_length=200)
    lethe_untilted_logprobs: StrictBool = Field(
        False, description="Lethe's: with logprobs, also the base model's own (`lethe_untilted_logprobs` per choice).")
    # accepted only at their neutral values: anything else is a 400 naming the field, never silently ignored
    repetition_penalty: float | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    best_of: int | None = None

    def checks(self, choices: int) -> None:
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed with stream: true", 400)
        if self.stream and self.lethe_untilted_logprobs:
            raise field_error("lethe_untilted_logprobs", "untilted logprobs are not streamed: ask without stream", 400)
        refused = {"repetition_penalty": self.repetition_penalty not in (None, 1, 1.0),
                   "logit_bias": bool(self.logit_bias), "tools": bool(self.tools),
                   "tool_choice": self.tool_choice not in (None, "none"),
                   "response_format": self.response_format is not None
                   and self.response_format.get("type", "text") != "text",
                   "best_of": self.best_of not in (None, 1)}
        for name, bad in refused.items():
            if bad:
                raise field_error(name, f"{name} is not supported by this server", 400)

    def profile(self, served: str | None = None) -> str | None:
        """The profile asked for: `unlearning_profile`, else `model`: `base` where it names the base model (`base`,
        or the operator's --served-model-name), None where it is empty."""
        if self.unlearning_profile:
            return self.unlearning_profile
        if not self.model:
            return None
        return "base" if self.model == "base" or self.model == served else self.model

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per new token, alternatives per prompt token); None: no log-probabilities."""
        return None, None

    def sampling(self, default_max: int, choice: int = 0) -> SamplingParams:
        """The choice'th sampling settings: with a seed, choice i draws with seed + i (n > 1 differ, yet repeat)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(max_new_tokens=default_max if self.max_tokens is None else self.max_tokens,
                              temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              min_p=self.min_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              seed=None if self.seed is None else self.seed + choice, stop=[s for s in stop if s],
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              untilted_logprobs=self.lethe_untilted_logprobs and logprobs is not None,
                              min_new_tokens=self.min_tokens)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="A prompt, a list of prompts (a choice each), or token ids (one list, or a list of lists), "
                    "fed to the model exactly as given.")
    max_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS, description="0 (with echo): the prompt alone.")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "Each token's log-probability and this many likeliest alternatives; with echo, the prompt's tokens too."))
    echo: StrictBool = Field(False, description="Put the prompt before the completion's text.")
    suffix: str | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: text, or token ids (checked by `check_prompts`); at least one, at most MAX_N."""
        items = [self.prompt] if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)) \
            else list(self.prompt)
        if not items or len(items) > MAX_N:
            raise field_error("prompt", f"give 1 to {MAX_N} prompts", 400)
        return items

    def check_prompts(self, tokenizer) -> list[str | list[int]]:
        items = self.prompts()
        for p in items:
            if not p or len(p) > MAX_PROMPT_CHARS:
                raise field_error("prompt", f"a prompt must have 1 to {MAX_PROMPT_CHARS} characters or tokens", 400)
            if not isinstance(p, str):
                check_token_ids(tokenizer, p, "prompt", 400)
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "must be at least 1 (0 only with echo: the prompt alone)", 400)
        return items


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(None, gt=0, le=MAX_NEW_TOKENS)
    logprobs: StrictBool | None = Field(None, description="Each new token's log-probability (`choices[].logprobs`).")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With logprobs: alternatives per token.")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs needs logprobs: true", 400)
        return (self.top_logprobs or 0) if self.logprobs else None, None


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


def chat_prompt(tokenizer, messages: list[Message]) -> str:
    """The tokenizer's chat template when it has one; else Lethe's question-answer format."""
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return plain_prompt(turns)


Choice = tuple[int, "str | list[int]", SamplingParams, object]  # (index, prompt, settings, resolved profile)


async def _admit_choices(request: Request, caller: Caller | None, body: OpenAIRequest, prompts: list,
                         default_max: int, fields: tuple[str, str]) -> list[Choice]:
    """Every choice (n per prompt) admitted, its profile version pinned; all or none (a refused one gives back
    what the others hold). The profile is the one the caller may use (`generation.check_policy`)."""
    queue, rows = request.app.state.engine.queue.maxsize, request.app.state.settings.quota_rows
    if len(prompts) * body.n > min(queue, rows):  # could never be admitted together: say so, not 429 for ever
        limit = f"queue of {queue} requests" if queue <= rows else f"{rows} requests in flight per tenant"
        raise field_error("n", f"{len(prompts) * body.n} choices exceed this server's {limit}", 400)
    wanted = [(i * body.n + j, p, body.sampling(default_max, j)) for i, p in enumerate(prompts) for j in range(body.n)]
    field = "unlearning_profile" if body.unlearning_profile else "model"
    profile = check_policy(caller, _asked(body, request), body.lethe_untilted_logprobs, field,
                           "lethe_untilted_logprobs")
    if len(wanted) > 1:  # one version for every choice, though the profile changes while they are admitted
        profile = await run_in_threadpool(pin, request.app.state.store, caller and caller.tenant_id, profile)
    tasks = [asyncio.ensure_future(admit(request, caller, p, params, profile, fields)) for _, p, params in wanted]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # what was admitted is given back, now or when its admission ends
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is not None or t.result()[0].done())
            task.cancel()
        raise
    return [(i, p, params, task.result()[0]) for (i, p, params), task in zip(wanted, tasks)]


async def _complete_all(request: Request, choices: list[Choice]) -> list[Completion]:
    """Every admitted choice decoded, in one batch with everyone else's rows."""
    tasks = [asyncio.ensure_future(complete(request, p, params, resolved)) for _, p, params, resolved in choices]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one choice failed (or the client left): the others stop too, their rows freed
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for *_, resolved in choices:
            resolved.done()  # choices whose task never started
        raise


def _default_max(request: Request, prompt, default: int) -> int:
    """New tokens for a request without max_tokens: `default`, or what the context leaves after the prompt."""
    engine = request.app.state.engine
    return max(1, min(default, engine.context_length - engine.count_tokens(prompt)))


def _usage(completions: list[Completion], n: int = 1) -> dict:
    """Tokens used: each prompt counted once however many choices (`n` per prompt, in order) it had."""
    prompt = sum(c.prompt_tokens for c in completions[::n])
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _decoder(request: Request, entries) -> dict[int, str]:
    """The text of each token the log-probability entries name (chosen and alternatives), one token at a time."""
    ids = {t for t, e in entries} | {a for _, e in entries if e is not None for a, _ in e.top}
    engine = request.app.state.engine
    with engine.tokenizer_lock:
        return {t: engine.lm.tokenizer.decode([t]) for t in ids}


def completion_logprobs(request: Request, entries: list[tuple[int, TokenLogprob | None]], offset: int = 0) -> dict:
    """OpenAI's completions `logprobs`: tokens, their log-probabilities (None for a prompt's first token), the
    likeliest alternatives (the chosen token included, as vLLM gives them) and each token's offset in the text
    (from `offset`: a stream's chunk goes on from the one before)."""
    text = _decoder(request, entries)
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in entries:
        out["tokens"].append(text[token])
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else
                                   {text[a]: lp for a, lp in entry.top} | {text[token]: entry.logprob})
        out["text_offset"].append(offset)
        offset += len(text[token])
    return out


def chat_logprobs(request: Request, entries: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs`: per token its text, log-probability, UTF-8 bytes and the likeliest alternatives."""
    text = _decoder(request, [(e.token, e) for e in entries])
    engine = request.app.state.engine
    with engine.tokenizer_lock:  # a token's own bytes: part of a character where its text alone reads U+FFFD
        raw = {t: list(token_bytes(engine.lm.tokenizer, t)) for t in text}

    def item(token: int, logprob: float) -> dict:
        return {"token": text[token], "logprob": logprob, "bytes": raw[token]}

    return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(a, lp) for a, lp in e.top]}
                        for e in entries]}


def _generated(c: Completion, untilted: bool = False) -> list[tuple[int, TokenLogprob]]:
    entries = c.untilted_logprobs if untilted else c.logprobs
    return [(e.token, e) for e in entries or []]


def _prompt_entries(c: Completion, untilted: bool = False) -> list[tuple[int, TokenLogprob | None]]:
    entries = c.untilted_prompt_logprobs if untilted else c.prompt_logprobs
    return list(zip(c.prompt_ids or [], entries or []))


def _echoed(request: Request, prompt) -> str:
    return prompt if isinstance(prompt, str) else request.app.state.engine.detokenize(prompt)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, response: Response,
                      caller: Caller | None = Depends(generating)):
    """OpenAI-compatible completions; `model` (or `unlearning_profile`) picks the profile."""
    # checking token ids, tokenizing and building the answer take time in proportion to the input: off the loop
    prompts = await run_in_threadpool(body.check_prompts, request.app.state.engine.lm.tokenizer)
    body.checks(len(prompts) * body.n)
    if body.stream and body.echo and body.logprobs is not None:
        raise field_error("logprobs", "the prompt's logprobs (echo with logprobs) are not streamed: "
                                      "ask without stream", 400)
    if body.suffix:
        raise field_error("suffix", "suffix is not supported by this server", 400)
    default_max = 16 if body.max_tokens is not None else \
        await run_in_threadpool(_default_max, request, max(prompts, key=len), 16)
    if body.logprobs is not None:
        echoed = await run_in_threadpool(lambda: max(request.app.state.engine.count_tokens(p) if isinstance(p, str)
                                                     else len(p) for p in prompts)) if body.echo else 0
        _check_answer_size(request, len(prompts) * body.n, (body.max_tokens or default_max) + echoed, body.logprobs,
                           body.lethe_untilted_logprobs, "n, prompt, max_tokens, logprobs, echo")
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": body.model}
    choices = await _admit_choices(request, caller, body, prompts, default_max, ("prompt", "max_tokens"))
    used, headers = _profile(choices[0][3])
    head["model"] = body.model or choices[0][3].name or "base"  # left out: what answered
    echoes = await run_in_threadpool(lambda: {i: _echoed(request, p) if body.echo else "" for i, p, _, _ in choices})

    def logprobs(c: Completion, generated: list, untilted: bool = False) -> dict | None:
        if body.logprobs is None:
            return None
        prompt = _prompt_entries(c, untilted) if body.echo else []
        return completion_logprobs(request, prompt + generated)

    def choice(i: int, c: Completion) -> dict:
        out = {"index": i, "text": echoes[i] + c.text, "finish_reason": c.finish_reason,
               "logprobs": logprobs(c, _generated(c))} | _adapter(choices, c)
        if body.lethe_untilted_logprobs and body.logprobs is not None:
            out["lethe_untilted_logprobs"] = logprobs(c, _generated(c, True), True)
        return out

    if body.stream:
        started: set[int] = set()
        offsets: dict[int, int] = {}

        def piece(i: int, text: str, entries: list | None, finish: str | None = None) -> dict:
            """Choice i's next text (the echoed prompt first, in its first chunk) and its tokens' logprobs."""
            index = choices[i][0]
            first = index not in started
            started.add(index)
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(request, [(e.token, e) for e in entries or []],
                                         offsets.get(index, len(echoes[index])))
                offsets[index] = (lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"]
                                  else offsets.get(index, len(echoes[index])))
            return _envelope(head, used, {"index": index, "text": (echoes[index] if first else "") + text,
                                          "finish_reason": finish, "logprobs": lp})

        return stream(request, [(p, params, r) for _, p, params, r in choices], piece,
                      lambda i, c, rest: _with_adapter(piece(i, "", rest, c.finish_reason), choices, c),
                      lambda done: _stream_usage(body, done, lambda usage: _envelope(head, used, None, usage)),
                      headers)
    done = await _complete_all(request, choices)
    return await _answer(lambda: _envelope(head, used, [choice(i, c) for (i, *_), c in zip(choices, done)],
                                           _usage(done, body.n)), headers)


def _adapter(choices: list, c: Completion) -> dict:
    """A choice's `lethe_adapter` under an ASU profile: whether it decoded with the adapter (a profile with
    adapter_above decodes the prompts its probe does not call forget-like without it); nothing otherwise."""
    return {} if choices[0][3].adapter is None else {"lethe_adapter": c.adapter is not None}


def _with_adapter(chunk: dict, choices: list, c: Completion) -> dict:
    """A completion stream's last chunk of a choice, with its `lethe_adapter`."""
    chunk["choices"][0] |= _adapter(choices, c)
    return chunk


def _stream_usage(body: OpenAIRequest, done: list[Completion], envelope) -> list[dict]:
    """With `stream_options.include_usage`, OpenAI's last chunk: usage of every choice, and no choices."""
    if body.stream_options is not None and body.stream_options.include_usage:
        return [envelope(_usage(done, body.n))]
    return []


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, response: Response,
                           caller: Caller | None = Depends(generating)):
    """OpenAI-compatible chat; the tokenizer's chat template, else the Question/Answer format."""
    body.checks(body.n)
    body.logprob_counts()  # top_logprobs without logprobs is refused before anything is admitted
    if body.max_completion_tokens:  # OpenAI's newer name wins over the deprecated max_tokens, as in vLLM
        body.max_tokens = body.max_completion_tokens
    prompt = await run_in_threadpool(chat_prompt, request.app.state.engine.lm.tokenizer, body.messages)
    default_max = 64 if body.max_tokens else await run_in_threadpool(_default_max, request, prompt, 64)
    if body.logprobs:
        _check_answer_size(request, body.n, body.max_tokens or default_max, body.top_logprobs or 0,
                           body.lethe_untilted_logprobs, "n, max_tokens, top_logprobs")
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    choices = await _admit_choices(request, caller, body, [prompt], default_max, ("messages", "max_tokens"))
    used, headers = _profile(choices[0][3])
    model_name = body.model or choices[0][3].name or "base"  # left out: what answered

    def envelope(obj: str, choice: dict | list[dict] | None, usage: dict | None = None) -> dict:
        return _envelope({"id": rid, "object": obj, "created": created, "model": model_name}, used, choice, usage)

    def logprobs(entries: list[TokenLogprob] | None) -> dict | None:
        return None if entries is None else chat_logprobs(request, entries)

    if body.stream:
        role_sent: set[int] = set()
        started: set[int] = set()

        def delta(i: int, text: str, entries: list | None) -> dict:
            """The role once per choice, in its first chunk, as OpenAI sends it; the answer's leading spaces
            dropped, as in the non-streamed message, so both give the same text."""
            index = choices[i][0]
            if index not in started:
                text = text.lstrip()
                if text:
                    started.add(index)
            d = {"content": text} if index in role_sent else {"role": "assistant", "content": text}
            role_sent.add(index)
            out = {"index": index, "delta": d, "finish_reason": None}
            return envelope("chat.completion.chunk", out | ({"logprobs": logprobs(entries)} if body.logprobs else {}))

        def last(i: int, c: Completion, rest: list | None) -> dict:
            out = {"index": choices[i][0], "delta": {}, "finish_reason": c.finish_reason} | _adapter(choices, c)
            return envelope("chat.completion.chunk", out | ({"logprobs": logprobs(rest)} if body.logprobs else {}))

        return stream(request, [(p, params, r) for _, p, params, r in choices], delta, last,
                      lambda done: _stream_usage(body, done, lambda usage: envelope("chat.completion.chunk", None,
                                                                                     usage)), headers)
    done = await _complete_all(request, choices)

    def choice(i: int, c: Completion) -> dict:
        out = {"index": i, "message": {"role": "assistant", "content": c.text.lstrip()},
               "finish_reason": c.finish_reason, "logprobs": logprobs(c.logprobs)} | _adapter(choices, c)
        if body.lethe_untilted_logprobs and body.logprobs:
            out["lethe_untilted_logprobs"] = logprobs(c.untilted_logprobs)
        return out

    return await _answer(lambda: envelope("chat.completion", [choice(i, c) for (i, *_), c in zip(choices, done)],
                                          _usage(done, body.n)), headers)


def _check_answer_size(request: Request, choices: int, tokens: int, alternatives: int, untilted: bool,
                       fields: str) -> None:
    """An answer with log-probabilities has choices x tokens x (1 + alternatives) entries (twice with untilted
    ones): beyond LETHE_MAX_LOGPROB_ENTRIES it is refused before anything decodes (400 naming the fields)."""
    entries = choices * tokens * (1 + alternatives) * (2 if untilted else 1)
    limit = request.app.state.settings.max_logprob_entries
    if entries > limit:
        raise field_error(fields.split(",")[0], f"the answer would hold {entries:,} log-probability entries "
                                                f"({fields}), more than this server's {limit:,} "
                                                "(LETHE_MAX_LOGPROB_ENTRIES): ask for fewer", 400)


async def _answer(build, headers: dict[str, str]) -> Response:
    """The whole answer, built and encoded off the event loop (a large one takes seconds), a slice at a time
    (`answer_json.dumps`: one C call over megabytes would hold the GIL, and so the loop, throughout)."""
    return Response(await run_in_threadpool(lambda: dumps(build())), media_type="application/json", headers=headers)


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "lethe"}


def _model_names(request: Request, caller: Caller | None) -> list[str]:
    """What the caller may ask for: `base` (and the served name) and the tenant's profiles; only the imposed
    profile for a key bound to one or under an enforced profile."""
    if caller is not None and caller.rule is not None:
        return [caller.rule[0]]
    served = request.app.state.settings.served_model_name
    return ["base"] + ([served] if served else []) + \
        (request.app.state.store.profile_names(caller.tenant_id) if caller is not None else [])


@router.get("/v1/models")
def models(request: Request, caller: Caller | None = Depends(generating)):
    """`base` and the tenant's profiles, as OpenAI models (a bound key: its profile alone)."""
    return {"object": "list", "data": [_model(n) for n in _model_names(request, caller)]}


@router.get("/v1/models/{model_id}")
def model(model_id: str, request: Request, caller: Caller | None = Depends(generating)):
    """One model: `base`, or one of the tenant's profiles (404 otherwise)."""
    if model_id in _model_names(request, caller):
        return _model(model_id)
    raise HTTPException(404, f"model {model_id!r} not found")
