"""The Python client: `Lethe` (sync) and `AsyncLethe` (async), over httpx.

Every endpoint is one method; responses are parsed into the server's own pydantic models
(`lethe.server.protocol`). A server error raises `LetheError` with the status and the server's message.

    from lethe.clients.client import Lethe
    lethe = Lethe("http://localhost:8000", key="lk_...")
    forget = lethe.upload_dataset("forget.jsonl")
    job = lethe.wait(lethe.train_head(forget.id, retain.id), on_progress=print)
    lethe.set_profile("forget-demo", head=job.head)
    print(lethe.generate("Question: ...\\nAnswer:", profile="forget-demo", temperature=0).text)

`AsyncLethe` has the same methods, each a coroutine (`await c.get_job(...)`) or, for the streams, an async
iterator (`async for text in c.stream_generate(...)`), typed as such for mypy and IDEs. What each endpoint sends
and what it answers is written once (`_Requests`); the two clients only carry the request out, sync or async.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Self, TypeVar, cast

import httpx
from pydantic import TypeAdapter

from lethe.server.protocol import (ASUOut, AuditEntry, DatasetOut, EnforcedProfile, GenerateResponse, HeadOut, JobOut,
                                   KeyInfo, ProfileOut, TenantInfo, TenantOut)

TERMINAL = ("succeeded", "failed", "cancelled")
T = TypeVar("T")
Source = str | Path | bytes  # a file to upload: its path, or its bytes
Profile = str | dict[str, Any]  # a profile's name, or an inline profile


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
def _reaching(http: httpx.Client) -> Iterator[None]:
    """httpx's transport errors (no server, a timeout) as LetheConnectionError."""
    try:
        yield
    except httpx.TransportError as e:
        raise LetheConnectionError(str(http.base_url), e) from e


@asynccontextmanager
async def _areaching(http: httpx.AsyncClient) -> AsyncIterator[None]:
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


def _data(source: Source) -> tuple[bytes, str | None]:
    if isinstance(source, bytes):
        return source, None
    path = Path(source)
    return path.read_bytes(), path.name


def _sse(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _finished(state: JobOut) -> JobOut:
    if state.status != "succeeded":
        raise LetheError(409, f"job {state.id} {state.status}: {state.error}", state.model_dump())
    return state


@dataclass(frozen=True)
class _Request(Generic[T]):
    """One call: the method, the path, httpx's options (json, params, files, data) and how to read the answer."""

    method: str
    path: str
    answer: TypeAdapter[T]
    options: dict[str, Any] = field(default_factory=dict)

    def parse(self, response: httpx.Response) -> T:
        _raise_for(response)
        if response.status_code == 204 or not response.content:
            return cast(T, None)  # the deletes: 204, no body
        if self.answer is _TEXT:  # a page (the forgetting report), as sent
            return cast(T, response.text)
        return self.answer.validate_python(response.json())


_JSON = TypeAdapter(dict[str, Any])
_NONE = TypeAdapter(None)
_DATASET, _DATASETS = TypeAdapter(DatasetOut), TypeAdapter(list[DatasetOut])
_HEAD, _HEADS = TypeAdapter(HeadOut), TypeAdapter(list[HeadOut])
_ASU, _ASUS = TypeAdapter(ASUOut), TypeAdapter(list[ASUOut])
_JOB, _JOBS = TypeAdapter(JobOut), TypeAdapter(list[JobOut])
_PROFILE, _PROFILES = TypeAdapter(ProfileOut), TypeAdapter(list[ProfileOut])
_TENANT, _TENANTS = TypeAdapter(TenantOut), TypeAdapter(list[TenantInfo])
_KEYS, _KEY = TypeAdapter(list[KeyInfo]), TypeAdapter(KeyInfo)
_ENFORCED = TypeAdapter(EnforcedProfile)
_AUDIT = TypeAdapter(list[AuditEntry])
_TEXT = TypeAdapter(str)
_GENERATED = TypeAdapter(GenerateResponse)


def _upload(path: str, answer: TypeAdapter[T], source: Source, default_name: str,
            form: dict[str, str] | None = None) -> _Request[T]:
    data, filename = _data(source)
    return _Request("POST", path, answer, {"files": {"file": (filename or default_name, data)}, "data": form})


class _Requests:
    """What each endpoint sends and what it answers: one builder per client method, shared by both clients."""

    # operations
    @staticmethod
    def health() -> _Request[dict[str, Any]]:
        return _Request("GET", "/healthz", _JSON)

    @staticmethod
    def ready() -> _Request[dict[str, Any]]:
        return _Request("GET", "/readyz", _JSON)

    @staticmethod
    def models() -> _Request[dict[str, Any]]:
        return _Request("GET", "/v1/models", _JSON)

    # datasets
    @staticmethod
    def upload_dataset(source: Source, name: str | None) -> _Request[DatasetOut]:
        return _upload("/v1/datasets", _DATASET, source, "data.jsonl", {"name": name} if name else None)

    @staticmethod
    def list_datasets() -> _Request[list[DatasetOut]]:
        return _Request("GET", "/v1/datasets", _DATASETS)

    @staticmethod
    def get_dataset(dataset_id: str) -> _Request[DatasetOut]:
        return _Request("GET", f"/v1/datasets/{dataset_id}", _DATASET)

    @staticmethod
    def delete_dataset(dataset_id: str) -> _Request[None]:
        return _Request("DELETE", f"/v1/datasets/{dataset_id}", _NONE)

    # heads, ASU weights and their jobs
    @staticmethod
    def train_head(forget: str, retain: str, options: dict[str, Any]) -> _Request[JobOut]:
        return _Request("POST", "/v1/heads", _JOB, {"json": {"forget": forget, "retain": retain, **options}})

    @staticmethod
    def upload_head(source: Source) -> _Request[HeadOut]:
        return _upload("/v1/heads/upload", _HEAD, source, "head.safetensors")

    @staticmethod
    def upload_asu(source: Source) -> _Request[ASUOut]:
        return _upload("/v1/asu/upload", _ASU, source, "asu.safetensors")

    @staticmethod
    def list_heads() -> _Request[list[HeadOut]]:
        return _Request("GET", "/v1/heads", _HEADS)

    @staticmethod
    def get_head(head_id: str) -> _Request[HeadOut]:
        return _Request("GET", f"/v1/heads/{head_id}", _HEAD)

    @staticmethod
    def delete_head(head_id: str) -> _Request[None]:
        return _Request("DELETE", f"/v1/heads/{head_id}", _NONE)

    @staticmethod
    def train_asu(forget: str, retain: str, options: dict[str, Any]) -> _Request[JobOut]:
        return _Request("POST", "/v1/asu", _JOB, {"json": {"forget": forget, "retain": retain, **options}})

    @staticmethod
    def list_asu() -> _Request[list[ASUOut]]:
        return _Request("GET", "/v1/asu", _ASUS)

    @staticmethod
    def get_asu(weights_id: str) -> _Request[ASUOut]:
        return _Request("GET", f"/v1/asu/{weights_id}", _ASU)

    @staticmethod
    def delete_asu(weights_id: str) -> _Request[None]:
        return _Request("DELETE", f"/v1/asu/{weights_id}", _NONE)

    @staticmethod
    def get_job(job_id: str) -> _Request[JobOut]:
        return _Request("GET", f"/v1/jobs/{job_id}", _JOB)

    @staticmethod
    def list_jobs() -> _Request[list[JobOut]]:
        return _Request("GET", "/v1/jobs", _JOBS)

    @staticmethod
    def cancel_job(job_id: str) -> _Request[JobOut]:
        return _Request("POST", f"/v1/jobs/{job_id}/cancel", _JOB)

    @staticmethod
    def job_events(job_id: str) -> _Request[None]:  # a stream: read by the clients' _events, not parsed
        return _Request("GET", f"/v1/jobs/{job_id}/events", _NONE)

    @staticmethod
    def evaluate(forget: str, retain: str, profile: Profile, options: dict[str, Any]) -> _Request[JobOut]:
        return _Request("POST", "/v1/eval", _JOB, {"json": {"forget": forget, "retain": retain, "profile": profile,
                                                            **options}})

    # profiles
    @staticmethod
    def set_profile(name: str, spec: dict[str, Any]) -> _Request[ProfileOut]:
        return _Request("PUT", f"/v1/profiles/{name}", _PROFILE,
                        {"json": {k: v for k, v in spec.items() if v is not None}})

    @staticmethod
    def get_profile(name: str) -> _Request[ProfileOut]:
        return _Request("GET", f"/v1/profiles/{name}", _PROFILE)

    @staticmethod
    def list_profiles() -> _Request[list[ProfileOut]]:
        return _Request("GET", "/v1/profiles", _PROFILES)

    @staticmethod
    def rollback_profile(name: str, version: int | None) -> _Request[ProfileOut]:
        return _Request("POST", f"/v1/profiles/{name}/rollback", _PROFILE,
                        {"params": {"version": version} if version is not None else None})

    @staticmethod
    def delete_profile(name: str) -> _Request[None]:
        return _Request("DELETE", f"/v1/profiles/{name}", _NONE)

    # generation
    @staticmethod
    def generate(prompt: str, profile: Profile | None, sampling: dict[str, Any],
                 stream: bool = False) -> _Request[GenerateResponse]:
        body = {"prompt": prompt, **{k: v for k, v in sampling.items() if v is not None}}
        if profile is not None:
            body["profile"] = profile
        return _Request("POST", "/generate", _GENERATED, {"json": body | {"stream": True} if stream else body})

    # admin
    @staticmethod
    def create_tenant(name: str) -> _Request[TenantOut]:
        return _Request("POST", "/admin/tenants", _TENANT, {"json": {"name": name}})

    @staticmethod
    def create_key(tenant: str, scopes: list[str] | None = None, profile: str | None = None) -> _Request[TenantOut]:
        body = {k: v for k, v in (("scopes", scopes), ("profile", profile)) if v is not None}
        return _Request("POST", f"/admin/tenants/{tenant}/keys", _TENANT, {"json": body} if body else {})

    @staticmethod
    def update_key(tenant: str, key_id: str, scopes: list[str] | None, profile: str | None) -> _Request[KeyInfo]:
        body = {k: v for k, v in (("scopes", scopes), ("profile", profile)) if v is not None}
        return _Request("PATCH", f"/admin/tenants/{tenant}/keys/{key_id}", _KEY, {"json": body})

    @staticmethod
    def enforce_profile(profile: str | None, tenant: str | None = None) -> _Request[EnforcedProfile]:
        path = f"/admin/tenants/{tenant}/enforced-profile" if tenant else "/v1/enforced-profile"
        return _Request("PUT", path, _ENFORCED, {"json": {"profile": profile}})

    @staticmethod
    def enforced_profile() -> _Request[EnforcedProfile]:
        return _Request("GET", "/v1/enforced-profile", _ENFORCED)

    # compliance
    @staticmethod
    def audit(filters: dict[str, Any]) -> _Request[list[AuditEntry]]:
        return _Request("GET", "/v1/audit", _AUDIT, {"params": {k: v for k, v in filters.items() if v is not None}})

    @staticmethod
    def report(name: str, version: int | None) -> _Request[str]:
        return _Request("GET", f"/v1/profiles/{name}/report", _TEXT,
                        {"params": {"version": version} if version is not None else None})

    @staticmethod
    def report_data(name: str, version: int | None) -> _Request[dict[str, Any]]:
        return _Request("GET", f"/v1/profiles/{name}/report", _JSON,
                        {"params": {"format": "json"} | ({"version": version} if version is not None else {})})

    @staticmethod
    def list_tenants() -> _Request[list[TenantInfo]]:
        return _Request("GET", "/admin/tenants", _TENANTS)

    @staticmethod
    def list_keys(tenant: str) -> _Request[list[KeyInfo]]:
        return _Request("GET", f"/admin/tenants/{tenant}/keys", _KEYS)

    @staticmethod
    def revoke_key(tenant: str, key_id: str) -> _Request[None]:
        return _Request("DELETE", f"/admin/tenants/{tenant}/keys/{key_id}", _NONE)

    @staticmethod
    def rotate_key(tenant: str, key_id: str) -> _Request[TenantOut]:
        return _Request("POST", f"/admin/tenants/{tenant}/keys/{key_id}/rotate", _TENANT)

    @staticmethod
    def delete_tenant(tenant: str) -> _Request[None]:
        return _Request("DELETE", f"/admin/tenants/{tenant}", _NONE)


_r = _Requests


class Lethe:
    """Synchronous client."""

    def __init__(self, url: str = "http://127.0.0.1:8000", key: str | None = None, timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None):
        self.http = httpx.Client(base_url=url, headers=_headers(key), timeout=timeout, transport=transport)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: _Request[T]) -> T:
        with _reaching(self.http):
            return request.parse(self.http.request(request.method, request.path, **request.options))

    def _events(self, request: _Request[Any]) -> Iterator[dict[str, Any]]:
        with _reaching(self.http), self.http.stream(request.method, request.path, **request.options) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for(r)
            yield from _sse(r.iter_lines())

    # operations
    def health(self) -> dict[str, Any]:
        return self._send(_r.health())

    def ready(self) -> dict[str, Any]:
        return self._send(_r.ready())

    def models(self) -> dict[str, Any]:
        return self._send(_r.models())

    # datasets
    def upload_dataset(self, source: Source, name: str | None = None) -> DatasetOut:
        """Upload JSON Lines from a path or bytes."""
        return self._send(_r.upload_dataset(source, name))

    def list_datasets(self) -> list[DatasetOut]:
        return self._send(_r.list_datasets())

    def get_dataset(self, dataset_id: str) -> DatasetOut:
        return self._send(_r.get_dataset(dataset_id))

    def delete_dataset(self, dataset_id: str) -> None:
        return self._send(_r.delete_dataset(dataset_id))

    # heads, ASU weights and their jobs
    def train_head(self, forget: str, retain: str, **options: Any) -> JobOut:
        """Start a head job (options: rank, lr, weight_decay, max_epochs, balance, common_df, seed, format,
        pooling_window, answer_forms, fact_spans, contexts, context_shift, gate_answers, cache_precision)."""
        return self._send(_r.train_head(forget, retain, options))

    def upload_head(self, source: Source) -> HeadOut:
        """Upload a head file made offline."""
        return self._send(_r.upload_head(source))

    def upload_asu(self, source: Source) -> ASUOut:
        """Upload ASU weights made offline."""
        return self._send(_r.upload_asu(source))

    def list_heads(self) -> list[HeadOut]:
        return self._send(_r.list_heads())

    def get_head(self, head_id: str) -> HeadOut:
        return self._send(_r.get_head(head_id))

    def delete_head(self, head_id: str) -> None:
        return self._send(_r.delete_head(head_id))

    def train_asu(self, forget: str, retain: str, **options: Any) -> JobOut:
        """Start an ASU job (options: preset, tau, layers, lora_rank, full_layers, lora_layers, own_answers,
        retain_own_answers, distil, contexts, student_answers, retain_subspace, gate, retain_loss, retain_weight, lr,
        steps, seed, format)."""
        return self._send(_r.train_asu(forget, retain, options))

    def list_asu(self) -> list[ASUOut]:
        return self._send(_r.list_asu())

    def get_asu(self, weights_id: str) -> ASUOut:
        return self._send(_r.get_asu(weights_id))

    def delete_asu(self, weights_id: str) -> None:
        return self._send(_r.delete_asu(weights_id))

    def get_job(self, job_id: str) -> JobOut:
        return self._send(_r.get_job(job_id))

    def list_jobs(self) -> list[JobOut]:
        return self._send(_r.list_jobs())

    def cancel_job(self, job_id: str) -> JobOut:
        return self._send(_r.cancel_job(job_id))

    def job_events(self, job_id: str) -> Iterator[JobOut]:
        """The job's state each time it changes, until it ends."""
        for event in self._events(_r.job_events(job_id)):
            yield JobOut(**event)

    def wait(self, job: JobOut | str, on_progress: Callable[[JobOut], None] | None = None,
             timeout: float | None = None) -> JobOut:
        """Follow a job to its end; raises LetheError if it failed or was cancelled, TimeoutError after `timeout`
        seconds (the job goes on)."""
        job_id = job if isinstance(job, str) else job.id
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self.get_job(job_id)
        for state in self.job_events(job_id):
            if on_progress:
                on_progress(state)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state.status} after {timeout} s")
        return _finished(state)

    def evaluate(self, forget: str, retain: str, profile: Profile = "base", **options: Any) -> JobOut:
        """Start an evaluation job (options: seeds, max_new_tokens); `wait` for it, then read its metrics."""
        return self._send(_r.evaluate(forget, retain, profile, options))

    # profiles
    def set_profile(self, name: str, **spec: Any) -> ProfileOut:
        """Create or replace (a new version): backend, head, weights, preset, T, lam, gate, sticky_gate, head_gate,
        flagged_mass, candidates, cap, max_push, min_p, repeat_guard, word_guard, whole_words, abstain, abstain_above,
        adapter_above, note."""
        return self._send(_r.set_profile(name, spec))

    def get_profile(self, name: str) -> ProfileOut:
        return self._send(_r.get_profile(name))

    def list_profiles(self) -> list[ProfileOut]:
        return self._send(_r.list_profiles())

    def rollback_profile(self, name: str, version: int | None = None) -> ProfileOut:
        return self._send(_r.rollback_profile(name, version))

    def delete_profile(self, name: str) -> None:
        return self._send(_r.delete_profile(name))

    # generation
    def generate(self, prompt: str, profile: Profile | None = None, **sampling: Any) -> GenerateResponse:
        """One completion (sampling: max_new_tokens, temperature, top_p, top_k, seed, stop)."""
        return self._send(_r.generate(prompt, profile, sampling))

    def stream_generate(self, prompt: str, profile: Profile | None = None, **sampling: Any) -> Iterator[str]:
        """Yield the text as it is generated."""
        for event in self._events(_r.generate(prompt, profile, sampling, stream=True)):
            if "finish_reason" not in event:
                yield event["text"]

    # admin
    def create_tenant(self, name: str) -> TenantOut:
        return self._send(_r.create_tenant(name))

    def create_key(self, tenant: str, scopes: list[str] | None = None, profile: str | None = None) -> TenantOut:
        """Admin: a further key, with `scopes` (default every scope) and bound to `profile` or not."""
        return self._send(_r.create_key(tenant, scopes, profile))

    def update_key(self, tenant: str, key_id: str, scopes: list[str] | None = None,
                   profile: str | None = None) -> KeyInfo:
        """Admin: a key's new scopes and binding (omitted: every scope; unbound)."""
        return self._send(_r.update_key(tenant, key_id, scopes, profile))

    def enforce_profile(self, profile: str | None, tenant: str | None = None) -> EnforcedProfile:
        """Make every generation of the tenant use `profile` (None lifts it): the caller's tenant, or with the
        admin key the tenant named."""
        return self._send(_r.enforce_profile(profile, tenant))

    def enforced_profile(self) -> EnforcedProfile:
        return self._send(_r.enforced_profile())

    def audit(self, profile: str | None = None, since: float | None = None, until: float | None = None,
              action: str | None = None, tenant: str | None = None, limit: int | None = None) -> list[AuditEntry]:
        """The audit trail, oldest first (the caller's tenant's; with the admin key every tenant's, or `tenant`'s)."""
        return self._send(_r.audit({"profile": profile, "since": since, "until": until, "action": action,
                                    "tenant": tenant, "limit": limit}))

    def report(self, name: str, version: int | None = None) -> str:
        """The forgetting report of a profile version (default: the current one), as an HTML page."""
        return self._send(_r.report(name, version))

    def report_data(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The same report as the data the page embeds, with its `digest`."""
        return self._send(_r.report_data(name, version))

    def list_tenants(self) -> list[TenantInfo]:
        return self._send(_r.list_tenants())

    def list_keys(self, tenant: str) -> list[KeyInfo]:
        return self._send(_r.list_keys(tenant))

    def revoke_key(self, tenant: str, key_id: str) -> None:
        return self._send(_r.revoke_key(tenant, key_id))

    def rotate_key(self, tenant: str, key_id: str) -> TenantOut:
        return self._send(_r.rotate_key(tenant, key_id))

    def delete_tenant(self, tenant: str) -> None:
        """Delete a tenant with all its data (409 while one of its jobs is queued or running)."""
        return self._send(_r.delete_tenant(tenant))


class AsyncLethe:
    """Asynchronous client: the same methods as `Lethe`, as coroutines (the streams as async iterators)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", key: str | None = None, timeout: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.http = httpx.AsyncClient(base_url=url, headers=_headers(key), timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, request: _Request[T]) -> T:
        async with _areaching(self.http):
            return request.parse(await self.http.request(request.method, request.path, **request.options))

    async def _events(self, request: _Request[Any]) -> AsyncIterator[dict[str, Any]]:
        async with _areaching(self.http), self.http.stream(request.method, request.path, **request.options) as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                for event in _sse([line]):
                    yield event

    # operations
    async def health(self) -> dict[str, Any]:
        return await self._send(_r.health())

    async def ready(self) -> dict[str, Any]:
        return await self._send(_r.ready())

    async def models(self) -> dict[str, Any]:
        return await self._send(_r.models())

    # datasets
    async def upload_dataset(self, source: Source, name: str | None = None) -> DatasetOut:
        return await self._send(_r.upload_dataset(source, name))

    async def list_datasets(self) -> list[DatasetOut]:
        return await self._send(_r.list_datasets())

    async def get_dataset(self, dataset_id: str) -> DatasetOut:
        return await self._send(_r.get_dataset(dataset_id))

    async def delete_dataset(self, dataset_id: str) -> None:
        return await self._send(_r.delete_dataset(dataset_id))

    # heads, ASU weights and their jobs
    async def train_head(self, forget: str, retain: str, **options: Any) -> JobOut:
        return await self._send(_r.train_head(forget, retain, options))

    async def upload_head(self, source: Source) -> HeadOut:
        return await self._send(_r.upload_head(source))

    async def upload_asu(self, source: Source) -> ASUOut:
        return await self._send(_r.upload_asu(source))

    async def list_heads(self) -> list[HeadOut]:
        return await self._send(_r.list_heads())

    async def get_head(self, head_id: str) -> HeadOut:
        return await self._send(_r.get_head(head_id))

    async def delete_head(self, head_id: str) -> None:
        return await self._send(_r.delete_head(head_id))

    async def train_asu(self, forget: str, retain: str, **options: Any) -> JobOut:
        return await self._send(_r.train_asu(forget, retain, options))

    async def list_asu(self) -> list[ASUOut]:
        return await self._send(_r.list_asu())

    async def get_asu(self, weights_id: str) -> ASUOut:
        return await self._send(_r.get_asu(weights_id))

    async def delete_asu(self, weights_id: str) -> None:
        return await self._send(_r.delete_asu(weights_id))

    async def get_job(self, job_id: str) -> JobOut:
        return await self._send(_r.get_job(job_id))

    async def list_jobs(self) -> list[JobOut]:
        return await self._send(_r.list_jobs())

    async def cancel_job(self, job_id: str) -> JobOut:
        return await self._send(_r.cancel_job(job_id))

    async def job_events(self, job_id: str) -> AsyncIterator[JobOut]:
        async for event in self._events(_r.job_events(job_id)):
            yield JobOut(**event)

    async def wait(self, job: JobOut | str, on_progress: Callable[[JobOut], None] | None = None,
                   timeout: float | None = None) -> JobOut:
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

    async def evaluate(self, forget: str, retain: str, profile: Profile = "base", **options: Any) -> JobOut:
        return await self._send(_r.evaluate(forget, retain, profile, options))

    # profiles
    async def set_profile(self, name: str, **spec: Any) -> ProfileOut:
        return await self._send(_r.set_profile(name, spec))

    async def get_profile(self, name: str) -> ProfileOut:
        return await self._send(_r.get_profile(name))

    async def list_profiles(self) -> list[ProfileOut]:
        return await self._send(_r.list_profiles())

    async def rollback_profile(self, name: str, version: int | None = None) -> ProfileOut:
        return await self._send(_r.rollback_profile(name, version))

    async def delete_profile(self, name: str) -> None:
        return await self._send(_r.delete_profile(name))

    # generation
    async def generate(self, prompt: str, profile: Profile | None = None, **sampling: Any) -> GenerateResponse:
        return await self._send(_r.generate(prompt, profile, sampling))

    async def stream_generate(self, prompt: str, profile: Profile | None = None,
                              **sampling: Any) -> AsyncIterator[str]:
        async for event in self._events(_r.generate(prompt, profile, sampling, stream=True)):
            if "finish_reason" not in event:
                yield event["text"]

    # admin
    async def create_tenant(self, name: str) -> TenantOut:
        return await self._send(_r.create_tenant(name))

    async def create_key(self, tenant: str, scopes: list[str] | None = None, profile: str | None = None) -> TenantOut:
        return await self._send(_r.create_key(tenant, scopes, profile))

    async def update_key(self, tenant: str, key_id: str, scopes: list[str] | None = None,
                         profile: str | None = None) -> KeyInfo:
        return await self._send(_r.update_key(tenant, key_id, scopes, profile))

    async def enforce_profile(self, profile: str | None, tenant: str | None = None) -> EnforcedProfile:
        return await self._send(_r.enforce_profile(profile, tenant))

    async def enforced_profile(self) -> EnforcedProfile:
        return await self._send(_r.enforced_profile())

    async def audit(self, profile: str | None = None, since: float | None = None, until: float | None = None,
                    action: str | None = None, tenant: str | None = None,
                    limit: int | None = None) -> list[AuditEntry]:
        return await self._send(_r.audit({"profile": profile, "since": since, "until": until, "action": action,
                                          "tenant": tenant, "limit": limit}))

    async def report(self, name: str, version: int | None = None) -> str:
        return await self._send(_r.report(name, version))

    async def report_data(self, name: str, version: int | None = None) -> dict[str, Any]:
        return await self._send(_r.report_data(name, version))

    async def list_tenants(self) -> list[TenantInfo]:
        return await self._send(_r.list_tenants())

    async def list_keys(self, tenant: str) -> list[KeyInfo]:
        return await self._send(_r.list_keys(tenant))

    async def revoke_key(self, tenant: str, key_id: str) -> None:
        return await self._send(_r.revoke_key(tenant, key_id))

    async def rotate_key(self, tenant: str, key_id: str) -> TenantOut:
        return await self._send(_r.rotate_key(tenant, key_id))

    async def delete_tenant(self, tenant: str) -> None:
        return await self._send(_r.delete_tenant(tenant))


# The async methods share the sync ones' docstrings (help(AsyncLethe.train_head) lists the options too).
for _name, _method in vars(AsyncLethe).items():
    if not _name.startswith("_") and hasattr(Lethe, _name) and not _method.__doc__:
        _method.__doc__ = getattr(Lethe, _name).__doc__
del _name, _method
