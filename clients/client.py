"""The Lethe Python client: `Lethe` (sync) and `AsyncLethe` (async), over httpx.

Every endpoint is one method; responses are parsed into the server's own pydantic models
(`server.protocol`). A server error raises `LetheError` with the status and the server's message.

    from lethe.clients.client import Lethe
    lethe = Lethe("http://localhost:8000", key="lk_...")
    forget = lethe.upload_dataset("forget.jsonl")
    job = lethe.wait(lethe.train_head(forget.id, retain.id), on_progress=print)
    lethe.set_profile("forget-demo", head=job.head)
    print(lethe.generate("Question: ...\\nAnswer:", profile="forget-demo", temperature=0).text)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
from pydantic import TypeAdapter

from lethe.server.protocol import (ASUOut, DatasetOut, GenerateResponse, HeadOut, JobOut, KeyInfo, ProfileOut, TenantInfo,
                             TenantOut)

TERMINAL = ("succeeded", "failed", "cancelled")


class LetheError(Exception):
    """An error answer from the server: `status` (HTTP code) and `message` (the server's words)."""

    def __init__(self, status: int, message: str, detail: Any = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.detail = status, message, detail


class LetheConnectionError(LetheError):
    """The server could not be reached (refused, timed out, name not found); `status` is 0."""

    def __init__(self, url: str, error: Exception):
        super().__init__(0, f"cannot reach {url}: {error}")
        self.url = url


@contextmanager
def _reaching(http):
    """httpx's transport errors (no server, a timeout) as LetheConnectionError."""
    try:
        yield
    except httpx.TransportError as e:
        raise LetheConnectionError(str(http.base_url), e) from e


@asynccontextmanager
async def _areaching(http):
    try:
        yield
    except httpx.TransportError as e:
        raise LetheConnectionError(str(http.base_url), e) from e


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
        detail = body.get("detail") if "detail" in body else body.get("error", {}).get("message", body)
    except (json.JSONDecodeError, AttributeError):
        detail = response.text
    if isinstance(detail, list):  # validation errors: name the fields
        message = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail)
    else:
        message = str(detail)
    raise LetheError(response.status_code, message, detail)


def _data(source: str | Path | bytes) -> tuple[bytes, str | None]:
    if isinstance(source, bytes):
        return source, None
    path = Path(source)
    return path.read_bytes(), path.name


def _sse(lines) -> Iterator[dict]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


class _Calls:
    """What each endpoint sends and what it answers; `_call` (sync or async) carries it out."""

    def _call(self, method: str, path: str, model: Any = None, **kwargs):  # pragma: no cover - overridden
        raise NotImplementedError

    # operations
    def health(self):
        return self._call("GET", "/healthz")

    def ready(self):
        return self._call("GET", "/readyz")

    def models(self):
        return self._call("GET", "/v1/models")

    # datasets
    def upload_dataset(self, source: str | Path | bytes, name: str | None = None) -> DatasetOut:
        """Upload JSON Lines from a path or bytes."""
        data, filename = _data(source)
        return self._call("POST", "/v1/datasets", DatasetOut, files={"file": (filename or "data.jsonl", data)},
                          data={"name": name} if name else None)

    def list_datasets(self) -> list[DatasetOut]:
        return self._call("GET", "/v1/datasets", list[DatasetOut])

    def get_dataset(self, dataset_id: str) -> DatasetOut:
        return self._call("GET", f"/v1/datasets/{dataset_id}", DatasetOut)

    def delete_dataset(self, dataset_id: str):
        return self._call("DELETE", f"/v1/datasets/{dataset_id}")

    # heads, ASU weights and their jobs
    def train_head(self, forget: str, retain: str, **options) -> JobOut:
        """Start a head job (options: rank, lr, weight_decay, max_epochs, balance, common_df, seed)."""
        return self._call("POST", "/v1/heads", JobOut, json={"forget": forget, "retain": retain, **options})

    def upload_head(self, source: str | Path | bytes) -> HeadOut:
        """Upload a head file made offline."""
        data, filename = _data(source)
        return self._call("POST", "/v1/heads/upload", HeadOut, files={"file": (filename or "head.safetensors", data)})

    def upload_asu(self, source: str | Path | bytes) -> ASUOut:
        """Upload ASU weights made offline."""
        data, filename = _data(source)
        return self._call("POST", "/v1/asu/upload", ASUOut, files={"file": (filename or "asu.safetensors", data)})

    def list_heads(self) -> list[HeadOut]:
        return self._call("GET", "/v1/heads", list[HeadOut])

    def get_head(self, head_id: str) -> HeadOut:
        return self._call("GET", f"/v1/heads/{head_id}", HeadOut)

    def delete_head(self, head_id: str):
        return self._call("DELETE", f"/v1/heads/{head_id}")

    def train_asu(self, forget: str, retain: str, **options) -> JobOut:
        """Start an ASU job (options: tau, layers, lora_rank, retain_loss, retain_weight, lr, steps, seed)."""
        return self._call("POST", "/v1/asu", JobOut, json={"forget": forget, "retain": retain, **options})

    def list_asu(self) -> list[ASUOut]:
        return self._call("GET", "/v1/asu", list[ASUOut])

    def get_asu(self, weights_id: str) -> ASUOut:
        return self._call("GET", f"/v1/asu/{weights_id}", ASUOut)

    def delete_asu(self, weights_id: str):
        return self._call("DELETE", f"/v1/asu/{weights_id}")

    def get_job(self, job_id: str) -> JobOut:
        return self._call("GET", f"/v1/jobs/{job_id}", JobOut)

    def list_jobs(self) -> list[JobOut]:
        return self._call("GET", "/v1/jobs", list[JobOut])

    def cancel_job(self, job_id: str) -> JobOut:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel", JobOut)

    def evaluate(self, forget: str, retain: str, profile: str | dict = "base", **options) -> JobOut:
        """Start an evaluation job (options: seeds, max_new_tokens); `wait` for it, then read its metrics."""
        return self._call("POST", "/v1/eval", JobOut, json={"forget": forget, "retain": retain, "profile": profile,
                                                             **options})

    # profiles
    def set_profile(self, name: str, **spec) -> ProfileOut:
        """Create or replace (a new version): backend, head, weights, preset, T, lam, gate, candidates, cap, min_p,
        repeat_guard, abstain, abstain_above, note."""
        return self._call("PUT", f"/v1/profiles/{name}", ProfileOut, json={k: v for k, v in spec.items()
                                                                            if v is not None})

    def get_profile(self, name: str) -> ProfileOut:
        return self._call("GET", f"/v1/profiles/{name}", ProfileOut)

    def list_profiles(self) -> list[ProfileOut]:
        return self._call("GET", "/v1/profiles", list[ProfileOut])

    def rollback_profile(self, name: str, version: int | None = None) -> ProfileOut:
        return self._call("POST", f"/v1/profiles/{name}/rollback", ProfileOut,
                          params={"version": version} if version is not None else None)

    def delete_profile(self, name: str):
        return self._call("DELETE", f"/v1/profiles/{name}")

    # generation
    def generate(self, prompt: str, profile: str | dict | None = None, **sampling) -> GenerateResponse:
        """One completion (sampling: max_new_tokens, temperature, top_p, top_k, seed, stop)."""
        return self._call("POST", "/generate", GenerateResponse, json=self._generate_body(prompt, profile, sampling))

    @staticmethod
    def _generate_body(prompt: str, profile, sampling: dict) -> dict:
        body = {"prompt": prompt, **{k: v for k, v in sampling.items() if v is not None}}
        if profile is not None:
            body["profile"] = profile
        return body

    # admin
    def create_tenant(self, name: str) -> TenantOut:
        return self._call("POST", "/admin/tenants", TenantOut, json={"name": name})

    def create_key(self, tenant: str) -> TenantOut:
        return self._call("POST", f"/admin/tenants/{tenant}/keys", TenantOut)

    def list_tenants(self) -> list[TenantInfo]:
        return self._call("GET", "/admin/tenants", list[TenantInfo])

    def list_keys(self, tenant: str) -> list[KeyInfo]:
        return self._call("GET", f"/admin/tenants/{tenant}/keys", list[KeyInfo])

    def revoke_key(self, tenant: str, key_id: str):
        return self._call("DELETE", f"/admin/tenants/{tenant}/keys/{key_id}")

    def rotate_key(self, tenant: str, key_id: str) -> TenantOut:
        return self._call("POST", f"/admin/tenants/{tenant}/keys/{key_id}/rotate", TenantOut)

    def delete_tenant(self, tenant: str):
        """Delete a tenant with all its data (409 while one of its jobs is queued or running)."""
        return self._call("DELETE", f"/admin/tenants/{tenant}")


def _parse(response: httpx.Response, model):
    _raise_for(response)
    if response.status_code == 204 or not response.content:
        return None
    data = response.json()
    return TypeAdapter(model).validate_python(data) if model is not None else data


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


class Lethe(_Calls):
    """Synchronous client."""

    def __init__(self, url: str = "http://127.0.0.1:8000", key: str | None = None, timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None):
        self.http = httpx.Client(base_url=url, headers=_headers(key), timeout=timeout, transport=transport)

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, path: str, model: Any = None, **kwargs):
        with _reaching(self.http):
            return _parse(self.http.request(method, path, **kwargs), model)

    def stream_generate(self, prompt: str, profile: str | dict | None = None, **sampling) -> Iterator[str]:
        """Yield the text as it is generated."""
        body = self._generate_body(prompt, profile, sampling) | {"stream": True}
        with _reaching(self.http), self.http.stream("POST", "/generate", json=body) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for(r)
            for event in _sse(r.iter_lines()):
                if "finish_reason" not in event:
                    yield event["text"]

    def job_events(self, job_id: str) -> Iterator[JobOut]:
        """The job's state each time it changes, until it ends."""
        with _reaching(self.http), self.http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            if r.status_code >= 400:
                r.read()
                _raise_for(r)
            for event in _sse(r.iter_lines()):
                yield JobOut(**event)

    def wait(self, job: JobOut | str, on_progress: Callable[[JobOut], None] | None = None,
             timeout: float | None = None) -> JobOut:
        """Follow a job to its end; raises LetheError if it failed or was cancelled."""
        job_id = job if isinstance(job, str) else job.id
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self.get_job(job_id)
        for state in self.job_events(job_id):
            if on_progress:
                on_progress(state)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state.status} after {timeout} s")
        return _finished(state)


class AsyncLethe(_Calls):
    """Asynchronous client: the same methods, as coroutines."""

    def __init__(self, url: str = "http://127.0.0.1:8000", key: str | None = None, timeout: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.http = httpx.AsyncClient(base_url=url, headers=_headers(key), timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def _call(self, method: str, path: str, model: Any = None, **kwargs):
        async with _areaching(self.http):
            return _parse(await self.http.request(method, path, **kwargs), model)

    async def stream_generate(self, prompt: str, profile: str | dict | None = None, **sampling) -> AsyncIterator[str]:
        body = self._generate_body(prompt, profile, sampling) | {"stream": True}
        async with _areaching(self.http), self.http.stream("POST", "/generate", json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                for event in _sse([line]):
                    if "finish_reason" not in event:
                        yield event["text"]

    async def job_events(self, job_id: str) -> AsyncIterator[JobOut]:
        async with _areaching(self.http), self.http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                for event in _sse([line]):
                    yield JobOut(**event)

    async def wait(self, job: JobOut | str, on_progress: Callable[[JobOut], None] | None = None,
                   timeout: float | None = None) -> JobOut:
        """Follow a job to its end; raises LetheError if it failed or was cancelled, TimeoutError after `timeout`
        seconds (the job goes on)."""
        job_id = job if isinstance(job, str) else job.id
        last: list[JobOut] = []

        async def follow() -> None:
            last.append(await self.get_job(job_id))
            async for state in self.job_events(job_id):
                last.append(state)
                if on_progress:
                    on_progress(state)

        try:
            await asyncio.wait_for(follow(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"job {job_id} still {last[-1].status if last else 'unknown'} after {timeout} s") \
                from None
        return _finished(last[-1])


def _finished(state: JobOut) -> JobOut:
    if state.status != "succeeded":
        raise LetheError(409, f"job {state.id} {state.status}: {state.error}", state.model_dump())
    return state
