"""Generation shared by /generate and the OpenAI-compatible endpoints: checks, profile, engine, streaming."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from collections.abc import AsyncIterator, Callable

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from lethe.heads.decoding.decode import Completion
from lethe.heads.decoding.sampling import SamplingParams
from lethe.server.auth import Caller
from lethe.server.engine import Engine, Pending
from lethe.server.profiles import ProfileError, Resolved, resolve


def field_error(field: str, message: str, status: int = 422) -> HTTPException:
    """An error in FastAPI's validation format, naming the body field."""
    return HTTPException(status, detail=[{"loc": ["body", field], "msg": message, "type": "value_error"}])


def check_token_ids(tokenizer, ids: list[int], field: str, status: int) -> None:
    """Token ids given by a caller must be the tokenizer's: anything else is an error naming `field`."""
    vocab = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise field_error(field, f"token {bad} is not in the vocabulary of {vocab}", status)


def check_policy(caller: Caller | None, profile, untilted: bool, profile_field: str,
                 untilted_field: str = "untilted_logprobs"):
    """The profile this caller's request decodes with (`Caller.profile_for`: a binding or an enforced profile
    overrides what was asked, or refuses it with 403), and untilted numbers refused (403 naming the field) unless
    the key may see them. Anonymous callers get the base model only (`resolve` refuses a profile without a key)."""
    if untilted and (caller is None or not caller.may_see_untilted()):  # asked for, with logprobs or not
        why = ("anonymous callers" if caller is None else "keys bound to a profile or under an enforced profile"
               if caller.rule is not None else f"API key {caller.key_id}, which lacks the `evaluate` scope")
        raise field_error(untilted_field, "the base model's untilted log-probabilities are only for keys with the "
                                          f"`evaluate` scope and no profile imposed on them, not for {why}", 403)
    if caller is None:
        return profile
    try:
        return caller.profile_for(profile)
    except HTTPException as e:
        raise field_error(profile_field, e.detail, e.status_code) from None


async def admit(request: Request, caller: Caller | None, prompt: str, params: SamplingParams, profile,
                fields: tuple[str, str] = ("prompt", "max_new_tokens")) -> tuple[Resolved, int]:
    """Check the request against the limits and resolve its profile, pinning the version (and any adapter)
    now. Tokenizing, reading a head file and attaching an adapter run in a worker thread, never on the event
    loop, so no request can stall the others' streams or /healthz. `profile` is what the caller may use
    (`check_policy` first)."""
    return await run_in_threadpool(_admit, request, caller, prompt, params, profile, fields)


def _admit(request: Request, caller: Caller | None, prompt: str, params: SamplingParams, profile,
           fields: tuple[str, str]) -> tuple[Resolved, int]:
    tenant = caller.tenant_id if caller is not None else None
    app = request.app
    engine: Engine = app.state.engine
    limit = app.state.settings.max_new_tokens_limit
    if params.max_new_tokens > limit:
        raise field_error(fields[1], f"must be at most {limit}")
    prompt_tokens = engine.count_tokens(prompt)
    if prompt_tokens == 0:
        raise field_error(fields[0], "encodes to no tokens")
    if prompt_tokens + params.max_new_tokens > engine.context_length:
        raise field_error(fields[0], f"{prompt_tokens} prompt tokens + {params.max_new_tokens} new tokens exceed "
                                     f"the model's context of {engine.context_length} tokens")
    give_back = app.state.quotas.row(tenant)  # 429 beyond the caller's rows in flight
    try:
        resolved = resolve(app.state.store, app.state.heads, tenant, profile, app.state.adapters)
    except ProfileError as e:
        give_back()
        raise field_error(e.field if e.status == 422 else "profile", e.message, e.status) from None
    except BaseException:
        give_back()
        raise
    resolved = replace(resolved, tenant=tenant, release=_once(resolved.release, give_back))
    app.state.metrics.count_profile(resolved)  # by kind: a profile's name is the tenant's, never a label
    return resolved, prompt_tokens


def _once(*releases: Callable[[], None] | None) -> Callable[[], None]:
    """One function that gives back all a request holds (its adapter pin, its row), the first time it is
    called and never again, whichever thread calls it."""
    lock, held = threading.Lock(), [r for r in releases if r is not None]

    def release() -> None:
        with lock:
            todo = held[:]
            held.clear()
        for i, give_back in enumerate(todo):
            try:
                give_back()
            except BaseException:
                for rest in todo[i + 1:]:  # one failing must not keep the others held
                    rest()
                raise

    return release


def submit(request: Request, prompt: str, params: SamplingParams, resolved: Resolved,
           on_text: Callable[[str, list | None], None] | None = None) -> Pending:
    """Queue the request; whatever it pinned at admission is released when it ends, however it ends."""
    pending = Pending(prompt, params, resolved.row, resolved.adapter, resolved.tenant, on_text=on_text,
                      repeat_guard=resolved.repeat_guard)
    pending.future.add_done_callback(lambda _: resolved.done())
    try:
        return request.app.state.engine.submit(pending)
    except BaseException:
        resolved.done()
        raise


async def complete(request: Request, prompt: str, params: SamplingParams, resolved: Resolved) -> Completion:
    """The whole answer. A client that leaves first stops its row at the next step, as a stream's does: Starlette
    tells a handler that returns one response nothing, so the disconnect is watched for while the row decodes."""
    pending = submit(request, prompt, params, resolved)
    watcher = asyncio.ensure_future(_stop_when_gone(request, pending))
    try:
        return await asyncio.wrap_future(pending.future)
    except asyncio.CancelledError:
        pending.cancelled.set()
        raise
    finally:
        watcher.cancel()


async def _stop_when_gone(request: Request, pending: Pending, every: float = 0.25) -> None:
    while not pending.future.done():
        if await request.is_disconnected():
            pending.cancelled.set()
            return
        await asyncio.sleep(every)


def stream(request: Request, choices: list[tuple[str | list[int], SamplingParams, Resolved]],
           chunk: Callable[[int, str, list | None], dict],
           final: Callable[[int, Completion, list | None], dict | list[dict]],
           end: Callable[[list[Completion]], list[dict]] | None = None,
           headers: dict[str, str] | None = None) -> StreamingResponse:
    """Server-sent events for one or more choices decoding side by side: `chunk(i, text, logprobs)` for each new
    piece of choice i's text (with the log-probabilities of its tokens since the last piece, when the choice asks
    for them), `final(i, completion, logprobs not yet sent)` when choice i ends (one event or a list), then
    `end(completions)` once all have ended, then [DONE].

    A client that goes away cancels its requests: their rows stop at the next decoding step.
    """
    loop = asyncio.get_running_loop()
    texts: asyncio.Queue[tuple[int, str, list | None]] = asyncio.Queue()
    pendings = []
    try:
        for i, (prompt, params, resolved) in enumerate(choices):
            pendings.append(submit(request, prompt, params, resolved,
                                   lambda t, lp, i=i: loop.call_soon_threadsafe(texts.put_nowait, (i, t, lp))))
    except BaseException:
        for pending in pendings:
            pending.cancelled.set()
        raise
    dones = [asyncio.wrap_future(p.future) for p in pendings]

    async def events() -> AsyncIterator[str]:
        getter: asyncio.Future | None = None
        sent = [0] * len(dones)  # log-probability entries already sent, per choice
        ended: dict[int, Completion] = {}

        def piece(item: tuple[int, str, list | None]) -> str:
            i, text, logprobs = item
            sent[i] += len(logprobs or [])
            return f"data: {json.dumps(chunk(i, text, logprobs))}\n\n"

        try:
            while len(ended) < len(dones):
                getter = getter or asyncio.ensure_future(texts.get())
                running = {d for i, d in enumerate(dones) if i not in ended}
                finished, _ = await asyncio.wait({getter} | running, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    item, getter = getter.result(), None
                    yield piece(item)
                    continue
                while not texts.empty():  # a choice's text is queued before its end is seen
                    yield piece(texts.get_nowait())
                for i, done in enumerate(dones):
                    if i not in ended and done.done():
                        ended[i] = done.result()
                        rest = None if ended[i].logprobs is None else ended[i].logprobs[sent[i]:]
                        last = final(i, ended[i], rest)
                        for event in last if isinstance(last, list) else [last]:
                            yield f"data: {json.dumps(event)}\n\n"
            for event in end([ended[i] for i in range(len(dones))]) if end is not None else []:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if getter is not None:
                getter.cancel()
            for pending in pendings:
                pending.cancelled.set()  # no-op once finished; frees the row if the client left

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **(headers or {})})
