"""Tenant resources: datasets, head jobs, heads, profiles; and the admin endpoints."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.responses import StreamingResponse

from lethe.heads.records import RecordError, parse_jsonl, unicode_problem
from lethe.server.auth import actor, admin, tenant
from lethe.server.generation import field_error
from lethe.server.jobs import TERMINAL
from lethe.server.profiles import ProfileError, complete_spec
from lethe.server.protocol import (ASUJobRequest, ASUOut, DatasetOut, EnforcedProfile, EvalJobRequest, HeadJobRequest,
                                   HeadOut, JobOut, KeyInfo, KeyRequest, ProfileOut, ProfileSpec, TenantInfo, TenantOut,
                                   TenantRequest, profile_name_problem)
from lethe.server.storage import SCOPES, new_id

router = APIRouter()
TOFU_FIELDS = ("question", "answer", "paraphrased_answer", "perturbed_answer")


def not_found(kind: str, item_id: str) -> HTTPException:
    return HTTPException(404, f"{kind} {item_id!r} not found")


def owned(request: Request, table: str, tenant_id: str, item_id: str, kind: str) -> dict:
    """The tenant's row, or 404: another tenant's id takes the same path as a missing one."""
    row = request.app.state.store.get(table, tenant_id, item_id)
    if row is None:
        raise not_found(kind, item_id)
    return row


async def _read_upload(request: Request, limit: int) -> tuple[bytes, str | None]:
    """The records file from a multipart upload (field `file`) or the raw body; 413 beyond `limit` bytes.

    The body is read as it arrives and refused as soon as it passes the limit (a chunked upload with no
    Content-Length included), before any form parsing or spooling to disk."""
    length = request.headers.get("content-length")
    room = limit + 64 * 1024  # a multipart envelope around a file of `limit` bytes
    if length and length.isdigit() and int(length) > room:
        raise HTTPException(413, f"body of {length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > room:
            raise HTTPException(413, f"upload exceeds the limit of {limit} bytes")
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        request._body = bytes(body)  # Starlette parses the form from the body read above
        form = await request.form(max_files=1, max_fields=10)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise field_error("file", "a multipart upload needs a `file` field")
        data = await upload.read(limit + 1)
        name = form.get("name") or upload.filename
    else:
        data, name = bytes(body), request.query_params.get("name")
    if len(data) > limit:
        raise HTTPException(413, f"dataset exceeds the limit of {limit} bytes")
    if name is not None and (len(name) > 200 or unicode_problem(name)):
        raise field_error("name", "a name is at most 200 characters of valid Unicode")
    return data, name


@router.post("/v1/datasets", response_model=DatasetOut, status_code=201, tags=["datasets"])
async def upload_dataset(request: Request, tenant_id: str = Depends(tenant)) -> DatasetOut:
    """Upload JSON Lines records (TOFU `question`/`answer`, `prompt`/`completion`, or `text`)."""
    from starlette.concurrency import run_in_threadpool

    data, name = await _read_upload(request, request.app.state.settings.max_upload_bytes)
    # parsing 50 MB of JSON takes seconds: never on the event loop, where it would stall every stream
    return await run_in_threadpool(_store_dataset, request, tenant_id, data, name)


def _store_dataset(request: Request, tenant_id: str, data: bytes, name: str | None) -> DatasetOut:
    store, settings = request.app.state.store, request.app.state.settings
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise field_error("body", f"not valid UTF-8 (byte {e.start})") from None
    try:
        count = len(parse_jsonl(text, max_records=settings.max_dataset_records))
    except RecordError as e:
        raise HTTPException(422, detail=[{"loc": ["body", f"line {e.line}", e.field], "msg": e.message,
                                          "type": "value_error"}]) from None
    del text
    quotas = request.app.state.quotas
    quotas.dataset(tenant_id, len(data))  # refused before the file is written; checked again with the insert
    row = [new_id("ds"), tenant_id, name, count, None, len(data), time.time()]

    def insert(digest: str) -> None:
        row[4] = digest
        with quotas.guard(tenant_id):  # held for the check and the insert only, not for the write
            quotas.dataset(tenant_id, len(data))
            store.tx([("INSERT INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?)", tuple(row))])

    store.keep_file(data, insert)
    return DatasetOut(id=row[0], name=row[2], records=row[3], sha256=row[4], bytes=row[5], created=row[6])


@router.get("/v1/datasets", response_model=list[DatasetOut], tags=["datasets"])
def list_datasets(request: Request, tenant_id: str = Depends(tenant)):
    """The tenant's datasets."""
    return [DatasetOut(**{k: d[k] for k in DatasetOut.model_fields}) for d in request.app.state.store.list("datasets", tenant_id)]


@router.get("/v1/datasets/{dataset_id}", response_model=DatasetOut, tags=["datasets"])
def get_dataset(dataset_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """One dataset: record count, sha256, size."""
    d = owned(request, "datasets", tenant_id, dataset_id, "dataset")
    return DatasetOut(**{k: d[k] for k in DatasetOut.model_fields})


@router.delete("/v1/datasets/{dataset_id}", status_code=204, tags=["datasets"])
def delete_dataset(dataset_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """Delete a dataset, and its file unless another dataset holds the same content."""
    store = request.app.state.store
    owned(request, "datasets", tenant_id, dataset_id, "dataset")
    users = store.users_of(tenant_id, "dataset", dataset_id)
    if users:
        raise HTTPException(409, f"dataset {dataset_id!r} is used by {', '.join(users)}; wait for them or cancel them")
    store.release(store.delete_item("datasets", tenant_id, dataset_id, actor(request)))
    return Response(status_code=204)


def _queue_position(store, job: dict) -> int | None:
    """A queued job's place among its tenant's own queued jobs (1: the next of them to start); other tenants' jobs
    are neither counted nor shown, so no tenant reads another's activity from it."""
    if job["status"] != "queued":
        return None
    return int(store.q("SELECT COUNT(*) FROM jobs WHERE tenant_id = ? AND status = 'queued' AND created <= ?",
                       job["tenant_id"], job["created"])[0][0])


def _job_out(job: dict, store, queue_position: int | None = None) -> JobOut:
    """`queue_position`: given where the caller already knows it (a whole list); else read for a queued job."""
    if queue_position is None:
        queue_position = _queue_position(store, job)
    return JobOut(id=job["id"], kind=job["kind"], status=job["status"], phase=job["phase"],
                  queue_position=queue_position,
                  progress=job["progress"] or 0.0, metrics=json.loads(job["metrics"]) if job["metrics"] else None,
                  head=job["result"] if job["kind"] == "t3" else None,
                  weights=job["result"] if job["kind"] == "asu" else None, error=job["error"], created=job["created"], started=job["started"],
                  finished=job["finished"])


def _check_datasets(request: Request, tenant_id: str, body) -> None:
    """The job's datasets exist and its format fits this model (chat needs a chat template)."""
    from lethe.heads.records import resolve_format

    for field in ("forget", "retain"):
        if request.app.state.store.get("datasets", tenant_id, getattr(body, field)) is None:
            raise field_error(field, f"dataset {getattr(body, field)!r} not found", 404)
    try:
        resolve_format(request.app.state.engine.lm.tokenizer, body.format)
    except ValueError as e:
        raise field_error("format", str(e).removeprefix("format: ")) from None


def _submit(request: Request, tenant_id: str, kind: str, params: dict) -> JobOut:
    """Queue a job. Its datasets are recorded as they are now (name, records, sha256), so the forgetting report
    of what it makes names its inputs even after they are deleted."""
    store = request.app.state.store
    params["inputs"] = {role: {k: row[k] for k in ("id", "name", "records", "sha256")}
                        for role in ("forget", "retain")
                        if (row := store.get("datasets", tenant_id, params[role])) is not None}
    quotas = request.app.state.quotas
    with quotas.guard(tenant_id):
        quotas.job(tenant_id)
        if kind in ("t3", "asu"):
            quotas.stored(tenant_id, "heads" if kind == "t3" else "asu_weights", kind)
        job_id = request.app.state.jobs.submit(tenant_id, kind, params)
    return _job_out(request.app.state.store.get("jobs", tenant_id, job_id), request.app.state.store)


@router.post("/v1/heads", response_model=JobOut, status_code=202, tags=["heads"])
def train_head(body: HeadJobRequest, request: Request, tenant_id: str = Depends(tenant)) -> JobOut:
    """Start a job that caches the model's states over the two datasets and fits a T3 head."""
    _check_datasets(request, tenant_id, body)
    return _submit(request, tenant_id, "t3", body.model_dump())


@router.post("/v1/asu", response_model=JobOut, status_code=202, tags=["asu"])
def train_asu(body: ASUJobRequest, request: Request, tenant_id: str = Depends(tenant)) -> JobOut:
    """Start a job that distils ASU adapters (LoRA) towards the tempered-attention teacher."""
    from lethe.heads.asu.attention import parse_layers
    from lethe.heads.asu.presets import PRESETS
    from lethe.heads.asu.teacher import names_fact

    _check_datasets(request, tenant_id, body)
    n_layers = request.app.state.engine.lm.model.config.num_hidden_layers
    for field in ("layers", "full_layers", "lora_layers"):
        try:
            if field == "layers" or getattr(body, field) is not None:
                parse_layers(getattr(body, field), n_layers)
        except ValueError as e:
            raise field_error(field, str(e)) from None
    if body.lora_layers is not None and body.full_layers is not None:
        raise field_error("lora_layers", "lora_layers places LoRA adapters; full_layers trains projections in full "
                                         "instead: give one of them")
    if body.gate and body.lora_layers is None and (body.preset != "lethe" or body.full_layers is not None):
        # (preset lethe puts the adapters in the teacher's tempered layers: train_asu refuses a gate if those are all)
        raise field_error("gate", "needs lora_layers (the gate reads the state entering the first adapted layer)")
    if body.gate and request.app.state.engine.decoder is not None:
        raise field_error("gate", "the llama.cpp engine serves no gated adapter (its LoRA acts on every token)")
    if body.retain_subspace and body.full_layers is not None:
        raise field_error("retain_subspace", "projects LoRA adapters' inputs; full_layers trains no adapter")
    if body.retain_own_answers and (body.retain_loss or PRESETS[body.preset]["retain_loss"]) != "kl":
        raise field_error("retain_own_answers", "needs retain_loss kl (gd would teach the model its own answers)")
    if body.student_answers and not any("question" in r and names_fact(r)
                                        for r in request.app.state.store.records(body.forget)):
        raise field_error("student_answers", "no forget record with a question names its `fact`, which the "
                                             "student's answers are searched for")
    return _submit(request, tenant_id, "asu", body.model_dump())


@router.post("/v1/eval", response_model=JobOut, status_code=202, tags=["eval"])
def evaluate(body: EvalJobRequest, request: Request, tenant_id: str = Depends(tenant)) -> JobOut:
    """Start a job that evaluates a profile on two datasets (TOFU metrics); the report is the job's metrics."""
    store = request.app.state.store
    _check_datasets(request, tenant_id, body)
    for field in ("forget", "retain"):
        if not all(all(k in r for k in TOFU_FIELDS) for r in store.records(getattr(body, field))):
            raise field_error(field, "evaluation needs TOFU records (question, answer, paraphrased_answer, "
                                     "perturbed_answer)")
    profile = body.profile.spec() if isinstance(body.profile, ProfileSpec) else body.profile
    try:
        version = None
        if isinstance(profile, str) and profile != "base":
            current = store.current_profile(tenant_id, profile)
            if current is None:
                raise ProfileError(404, "profile", f"profile {profile!r} not found")
            version, spec = current
        else:
            spec = {"backend": "base"} if profile == "base" else complete_spec(
                request.app.state.heads, tenant_id, profile, request.app.state.adapters)
    except ProfileError as e:
        raise field_error(e.field if e.status == 422 else "profile", e.message, e.status) from None
    params = body.model_dump(exclude={"profile"}) | {"spec": spec, "version": version,
                                                     "profile": profile if isinstance(profile, str) else None}
    return _submit(request, tenant_id, "eval", params)


def _asu_out(w: dict) -> ASUOut:
    info = json.loads(w["info"])
    return ASUOut(id=w["id"], job=w["job_id"], bytes=w["bytes"], created=w["created"], tau=info["tau"],
                  layers=info["layers"], lora_rank=info["lora_rank"], lora_layers=info.get("lora_layers", []),
                  gate=info.get("gate", {}), steps=info["steps"], training=info.get("training", {}),
                  metrics=info["metrics"],
                  sha256=w.get("sha256"))


@router.get("/v1/asu", response_model=list[ASUOut], tags=["asu"])
def list_asu(request: Request, tenant_id: str = Depends(tenant)):
    """The tenant's ASU weights."""
    return [_asu_out(w) for w in request.app.state.store.list("asu_weights", tenant_id)]


@router.get("/v1/asu/{weights_id}", response_model=ASUOut, tags=["asu"])
def get_asu(weights_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """One set of ASU weights: tau, layers, rank, steps, metrics."""
    w = owned(request, "asu_weights", tenant_id, weights_id, "ASU weights")
    return _asu_out(w)


def _delete_trained(request: Request, tenant_id: str, table: str, item_id: str, kind: str, key: str) -> Response:
    """Delete a head or ASU weights: refused (409) while any version of a profile (a rollback could make it
    current again) or a queued or running job refers to it. Requests already admitted keep what they were
    admitted with: a head object they hold, an adapter pinned until they end."""
    store = request.app.state.store
    owned(request, table, tenant_id, item_id, kind)
    users = store.users_of(tenant_id, key, item_id)
    if users:
        raise HTTPException(409, f"{kind} {item_id!r} is used by {', '.join(users)}; change or delete them first")
    digest = store.delete_item(table, tenant_id, item_id, actor(request))
    _remove_trained(request, table, item_id, digest)
    return Response(status_code=204)


def _remove_trained(request: Request, table: str, item_id: str, digest: str | None) -> None:
    """After its row is deleted: a head leaves the cache, ASU weights are detached (now, or when the last request
    using them ends), and the file goes unless another row names the same content."""
    (request.app.state.heads if table == "heads" else request.app.state.adapters).drop(item_id)
    request.app.state.store.release(digest)


@router.delete("/v1/asu/{weights_id}", status_code=204, tags=["asu"])
def delete_asu(weights_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """Delete ASU weights (409 while a profile uses them)."""
    return _delete_trained(request, tenant_id, "asu_weights", weights_id, "ASU weights", "weights")


async def _upload_trained(request: Request, tenant_id: str, table: str, prefix: str, check, out):
    """Store an uploaded head or ASU file if `check(path)` (which returns its metadata as a dict) accepts it and
    `out` can describe it; a file for another base model is 409, a malformed or out-of-bounds one 422, and
    nothing stays behind (no file, no row)."""
    from starlette.concurrency import run_in_threadpool

    data, _ = await _read_upload(request, request.app.state.settings.max_upload_bytes)
    # reading tensors, writing the file and waiting for the tenant's quota lock are not for the event loop
    return await run_in_threadpool(_store_trained, request, tenant_id, table, prefix, check, out, data)


def _store_trained(request: Request, tenant_id: str, table: str, prefix: str, check, out, data: bytes):
    from lethe.heads.t3.head import BaseMismatch, HeadFileError

    store, quotas = request.app.state.store, request.app.state.quotas
    quotas.stored(tenant_id, table)  # refused before the file is written; checked again with the insert
    item_id = new_id(prefix)
    path = store.blobs.staging(".safetensors")
    row = {"id": item_id, "tenant_id": tenant_id, "job_id": None, "bytes": len(data), "created": time.time()}

    def insert(digest: str) -> None:
        with quotas.guard(tenant_id):
            quotas.stored(tenant_id, table)
            store.tx([(f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (item_id, tenant_id, None, row["bytes"], row["info"], row["created"], digest))])

    try:
        path.write_bytes(data)
        try:
            row["info"] = json.dumps(check(path))
            response = out(row)
            response.model_dump_json()  # what GET will show must serialise, or the row is never stored
        except (HeadFileError, BaseMismatch, ValueError, KeyError, TypeError) as e:
            status = 409 if isinstance(e, BaseMismatch) else 422
            raise field_error("file", str(e).replace(str(path), "upload"), status) from None
        digest = store.keep_file(path, insert)
    finally:
        path.unlink(missing_ok=True)
    return response.model_copy(update={"sha256": digest})


@router.post("/v1/heads/upload", response_model=HeadOut, status_code=201, tags=["heads"])
async def upload_head(request: Request, tenant_id: str = Depends(tenant)) -> HeadOut:
    """Upload a head file made offline (`lethe heads train`); checked against this server's model."""
    from lethe.heads.t3.head import load_head

    cfg, fingerprint = request.app.state.engine.lm.model.config, request.app.state.engine.lm.fingerprint
    return await _upload_trained(request, tenant_id, "heads", "head", lambda path: load_head(
        path, fingerprint, cfg.vocab_size, cfg.hidden_size)[1].__dict__, _head_out)


@router.post("/v1/asu/upload", response_model=ASUOut, status_code=201, tags=["asu"])
async def upload_asu(request: Request, tenant_id: str = Depends(tenant)) -> ASUOut:
    """Upload ASU weights made offline (`lethe asu train`); checked completely against this server's model
    (every tensor fits a module, shapes, dtypes, rank and magnitudes) before it is stored."""
    from dataclasses import asdict

    from lethe.heads.asu.weights import load_asu

    adapters = request.app.state.adapters
    fingerprint = request.app.state.engine.lm.fingerprint
    return await _upload_trained(request, tenant_id, "asu_weights", "asu", lambda path: asdict(
        load_asu(path, fingerprint, adapters.shapes, adapters.n_layers)[1]), _asu_out)


def _head_out(h: dict) -> HeadOut:
    info = json.loads(h["info"])
    return HeadOut(id=h["id"], job=h["job_id"], bytes=h["bytes"], created=h["created"], rank=info["rank"],
                   metrics=info["metrics"], profile=info["profile"], sha256=h.get("sha256"))


@router.get("/v1/heads", response_model=list[HeadOut], tags=["heads"])
def list_heads(request: Request, tenant_id: str = Depends(tenant)):
    """The tenant's heads, with metrics and recommended settings."""
    return [_head_out(h) for h in request.app.state.store.list("heads", tenant_id)]


@router.get("/v1/heads/{head_id}", response_model=HeadOut, tags=["heads"])
def get_head(head_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """One head: rank, held-out metrics, recommended settings."""
    h = owned(request, "heads", tenant_id, head_id, "head")
    return _head_out(h)


@router.delete("/v1/heads/{head_id}", status_code=204, tags=["heads"])
def delete_head(head_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """Delete a head (409 while a profile uses it)."""
    return _delete_trained(request, tenant_id, "heads", head_id, "head", "head")


@router.get("/v1/jobs", response_model=list[JobOut], tags=["jobs"])
def list_jobs(request: Request, tenant_id: str = Depends(tenant)):
    """The tenant's jobs, oldest first."""
    store = request.app.state.store
    jobs = store.list("jobs", tenant_id)
    queued = [j["created"] for j in jobs if j["status"] == "queued"]  # the count `_queue_position` reads, from here
    places = {j["id"]: sum(c <= j["created"] for c in queued) for j in jobs if j["status"] == "queued"}
    return [_job_out(j, store, places.get(j["id"])) for j in jobs]


@router.get("/v1/jobs/{job_id}", response_model=JobOut, tags=["jobs"])
def get_job(job_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """A job: status, phase, progress 0-1, metrics, and the head or weights it made."""
    job = owned(request, "jobs", tenant_id, job_id, "job")
    return _job_out(job, request.app.state.store)


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobOut, tags=["jobs"])
def cancel_job(job_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """Cancel a queued or running job (409 once it ended)."""
    store = request.app.state.store
    owned(request, "jobs", tenant_id, job_id, "job")
    if not request.app.state.jobs.cancel(tenant_id, job_id):
        raise HTTPException(409, f"job {job_id!r} has already ended")
    return _job_out(store.get("jobs", tenant_id, job_id), store)


@router.get("/v1/jobs/{job_id}/events", tags=["jobs"])
async def job_events(job_id: str, request: Request, tenant_id: str = Depends(tenant)):
    """Server-sent events: the job's state each time it changes, until it ends."""
    store = request.app.state.store
    owned(request, "jobs", tenant_id, job_id, "job")

    async def events():
        last = None
        while True:
            job = _job_out(store.get("jobs", tenant_id, job_id), store).model_dump()
            if job != last:
                yield f"event: job\ndata: {json.dumps(job)}\n\n"
                last = job
            if job["status"] in TERMINAL or await request.is_disconnected():
                return
            await asyncio.sleep(0.2)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _profile_out(store, tenant_id: str, name: str, version: int | None = None) -> ProfileOut:
    """The profile as it is now, or (`version`) as the change just made left it: a concurrent change made since
    does not make this response name another version than the one this request made current."""
    current = store.current_profile(tenant_id, name)
    if current is None:
        raise not_found("profile", name)
    history = store.profile_history(tenant_id, name)
    if version is not None:
        current = next(((h["version"], h["spec"]) for h in history if h["version"] == version), current)
    return ProfileOut(name=name, version=current[0], spec=current[1], history=history)


@router.put("/v1/profiles/{name}", response_model=ProfileOut, tags=["profiles"])
def put_profile(name: str, body: ProfileSpec, request: Request, tenant_id: str = Depends(tenant)):
    """Create the profile, or replace it with a new version; requests admitted earlier keep theirs."""
    problem = profile_name_problem(name)
    served = request.app.state.settings.served_model_name
    if not problem and served is not None and name.lower() == served.lower():
        problem = f"{name!r} is this server's name for the base model (--served-model-name)"
    if problem:
        raise HTTPException(422, detail=[{"loc": ["path", "name"], "msg": problem, "type": "value_error"}])
    store = request.app.state.store
    try:
        spec = complete_spec(request.app.state.heads, tenant_id, body.spec(), request.app.state.adapters)
    except ProfileError as e:
        raise field_error(e.field, e.message, e.status) from None
    version = store.put_profile(tenant_id, name, spec, body.note, actor(request))
    return _profile_out(store, tenant_id, name, version)


@router.get("/v1/profiles", response_model=list[ProfileOut], tags=["profiles"])
def list_profiles(request: Request, tenant_id: str = Depends(tenant)):
    """The tenant's profiles with their current versions."""
    store = request.app.state.store
    return [_profile_out(store, tenant_id, n).model_copy(update={"history": []}) for n in store.profile_names(tenant_id)]


@router.get("/v1/profiles/{name}", response_model=ProfileOut, tags=["profiles"])
def get_profile(name: str, request: Request, tenant_id: str = Depends(tenant)):
    """A profile: current version, its settings, and the version history."""
    return _profile_out(request.app.state.store, tenant_id, name)


@router.post("/v1/profiles/{name}/rollback", response_model=ProfileOut, tags=["profiles"])
def rollback_profile(name: str, request: Request, version: int | None = Query(None, ge=1, le=2**31),
                     tenant_id: str = Depends(tenant)):
    """Make an earlier version current (default: the one before the current one)."""
    store = request.app.state.store
    current = store.current_profile(tenant_id, name)
    if current is None:
        raise not_found("profile", name)
    versions = [h["version"] for h in store.profile_history(tenant_id, name)]
    target = version if version is not None else max((v for v in versions if v < current[0]), default=None)
    if target is None or target not in versions:
        raise HTTPException(409 if version is None else 404, f"profile {name!r} has no version to roll back to"
                            if version is None else f"profile {name!r} has no version {version}")
    store.set_profile_version(tenant_id, name, target, actor(request))
    return _profile_out(store, tenant_id, name, target)


@router.delete("/v1/profiles/{name}", status_code=204, tags=["profiles"])
def delete_profile(name: str, request: Request, tenant_id: str = Depends(tenant)):
    """Delete a profile and all its versions (409 while keys are bound to it or it is enforced).

    Its version numbers are not given again: a profile made again under the name goes on from the next one."""
    store = request.app.state.store
    if store.current_profile(tenant_id, name) is None:
        raise not_found("profile", name)
    imposed = _imposers(store, tenant_id, name)
    if imposed:
        raise HTTPException(409, f"profile {name!r} is {imposed}: unbind or revoke them, or lift the enforcement, "
                                 "first")
    store.delete_profile(tenant_id, name, actor(request))
    return Response(status_code=204)


def _imposers(store, tenant_id: str, name: str) -> str:
    """What imposes profile `name` on the tenant's generations, in words ('' for nothing)."""
    said = []
    keys = store.bound_keys(tenant_id, name)
    if keys:
        said.append("bound to API keys " + ", ".join(k["id"] for k in keys))
    if store.enforced_profile(tenant_id) == name:
        said.append("enforced on every key of the tenant")
    return " and ".join(said)


@router.get("/v1/enforced-profile", response_model=EnforcedProfile, tags=["profiles"])
def get_enforced(request: Request, tenant_id: str = Depends(tenant)) -> EnforcedProfile:
    """The profile every generation of every key of the tenant uses (null: none)."""
    return EnforcedProfile(profile=request.app.state.store.enforced_profile(tenant_id))


@router.put("/v1/enforced-profile", response_model=EnforcedProfile, tags=["profiles"])
def put_enforced(body: EnforcedProfile, request: Request, tenant_id: str = Depends(tenant)) -> EnforcedProfile:
    """Make every generation of every key of the tenant use a profile; null lifts it.

    Its current version, whatever a request asks: another profile, `base` or an inline spec is 403. Recorded in the
    audit trail. One the admin key enforced only the admin key changes or lifts (403)."""
    return _enforce(request, tenant_id, body.profile)


def _enforce(request: Request, tenant_id: str, profile: str | None) -> EnforcedProfile:
    store = request.app.state.store
    current, by = store.enforcement(tenant_id)
    if by == "admin" and actor(request) != "admin" and profile != current:
        raise field_error("profile", f"the operator (admin key) enforces profile {current!r} on this tenant: only "
                                     "the admin key changes or lifts it", 403)
    if profile is not None:
        if store.current_profile(tenant_id, profile) is None:
            raise field_error("profile", f"profile {profile!r} not found", 404)
        others = [k["id"] for k in store.bound_keys(tenant_id) if k["profile"] != profile]
        if others:
            raise field_error("profile", f"API keys {', '.join(others)} are bound to other profiles: rebind or "
                                         f"revoke them before enforcing {profile!r}", 409)
    store.set_enforced_profile(tenant_id, profile, actor(request))
    return EnforcedProfile(profile=profile)


@router.post("/admin/tenants", response_model=TenantOut, status_code=201, tags=["admin"],
             dependencies=[Depends(admin)])
def create_tenant(body: TenantRequest, request: Request) -> TenantOut:
    """Admin: a tenant and its first API key (every scope; shown once, stored hashed)."""
    store = request.app.state.store
    if store.tenant_by_name(body.name):
        raise HTTPException(409, f"tenant {body.name!r} exists")
    tenant_id, key = store.create_tenant(body.name, actor(request))
    return TenantOut(id=tenant_id, name=body.name, api_key=key)


def _tenant_named(request: Request, name: str) -> str:
    tenant_id = request.app.state.store.tenant_by_name(name)
    if tenant_id is None:
        raise not_found("tenant", name)
    return tenant_id


@router.post("/admin/tenants/{name}/keys", response_model=TenantOut, status_code=201, tags=["admin"],
             dependencies=[Depends(admin)])
def create_key(name: str, request: Request, body: KeyRequest | None = None) -> TenantOut:
    """Admin: a further API key for a tenant, with `scopes` (default: all) and optionally bound to a `profile`.

    A bound key's scopes are `generate` alone: every generation through it uses that profile."""
    tenant_id = _tenant_named(request, name)
    scopes, profile = _key_terms(request, tenant_id, body or KeyRequest())
    key = request.app.state.store.add_key(tenant_id, scopes, profile, actor(request))
    return TenantOut(id=tenant_id, name=name, api_key=key)


def _key_terms(request: Request, tenant_id: str, body: KeyRequest) -> tuple[tuple[str, ...] | None, str | None]:
    """(scopes, profile) of a key as asked: a bound key may only generate; its profile must exist, and be the
    enforced one where the tenant enforces a profile."""
    store = request.app.state.store
    scopes = tuple(s for s in SCOPES if s in body.scopes) if body.scopes is not None else None
    if body.profile is None:
        return scopes, None
    if scopes is None:
        scopes = ("generate",)
    if scopes != ("generate",):
        raise field_error("scopes", "a key bound to a profile has the `generate` scope alone (give scopes "
                                    "[\"generate\"] or leave them out)")
    if store.current_profile(tenant_id, body.profile) is None:
        raise field_error("profile", f"profile {body.profile!r} not found", 404)
    enforced = store.enforced_profile(tenant_id)
    if enforced is not None and enforced != body.profile:
        raise field_error("profile", f"the tenant enforces profile {enforced!r}: a key can only be bound to it", 409)
    return scopes, body.profile


@router.patch("/admin/tenants/{name}/keys/{key_id}", response_model=KeyInfo, tags=["admin"],
              dependencies=[Depends(admin)])
def update_key(name: str, key_id: str, body: KeyRequest, request: Request) -> KeyInfo:
    """Admin: give a key new scopes and binding, as when it is made.

    Omitted scopes are every scope, an omitted profile unbinds it. Requests already admitted keep what they were
    admitted with."""
    store, tenant_id = request.app.state.store, _tenant_named(request, name)
    scopes, profile = _key_terms(request, tenant_id, body)
    if store.update_key(tenant_id, key_id, scopes, profile, actor(request)) is None:
        raise not_found("key", key_id)
    return next(KeyInfo(**k) for k in store.keys(tenant_id) if k["id"] == key_id)


@router.put("/admin/tenants/{name}/enforced-profile", response_model=EnforcedProfile, tags=["admin"],
            dependencies=[Depends(admin)])
def admin_enforce(name: str, body: EnforcedProfile, request: Request) -> EnforcedProfile:
    """Admin: a tenant's enforced profile (null lifts it), as `PUT /v1/enforced-profile`."""
    return _enforce(request, _tenant_named(request, name), body.profile)


@router.get("/admin/tenants", response_model=list[TenantInfo], tags=["admin"], dependencies=[Depends(admin)])
def list_tenants(request: Request) -> list[TenantInfo]:
    """Admin: every tenant, with its number of keys."""
    return [TenantInfo(**t) for t in request.app.state.store.tenants()]


@router.get("/admin/tenants/{name}/keys", response_model=list[KeyInfo], tags=["admin"],
            dependencies=[Depends(admin)])
def list_keys(name: str, request: Request) -> list[KeyInfo]:
    """Admin: a tenant's keys: id, first characters, created, last used (never the key itself)."""
    return [KeyInfo(**k) for k in request.app.state.store.keys(_tenant_named(request, name))]


@router.delete("/admin/tenants/{name}/keys/{key_id}", status_code=204, tags=["admin"], dependencies=[Depends(admin)])
def revoke_key(name: str, key_id: str, request: Request):
    """Admin: revoke a key; requests with it are 401 from now on (requests already admitted finish)."""
    if not request.app.state.store.revoke_key(_tenant_named(request, name), key_id, actor(request)):
        raise not_found("key", key_id)
    return Response(status_code=204)


@router.post("/admin/tenants/{name}/keys/{key_id}/rotate", response_model=TenantOut, status_code=201,
             tags=["admin"], dependencies=[Depends(admin)])
def rotate_key(name: str, key_id: str, request: Request) -> TenantOut:
    """Admin: a new key in place of `key_id` (shown once); the old one stops working at once."""
    tenant_id = _tenant_named(request, name)
    key = request.app.state.store.rotate_key(tenant_id, key_id, actor(request))
    if key is None:
        raise not_found("key", key_id)
    return TenantOut(id=tenant_id, name=name, api_key=key)


@router.delete("/admin/tenants/{name}", status_code=204, tags=["admin"], dependencies=[Depends(admin)])
def delete_tenant(name: str, request: Request):
    """Admin: delete a tenant with all its data: keys, profiles, datasets, heads, ASU weights, jobs and their
    files (409 while one of its jobs is queued or running: cancel them first)."""
    store, tenant_id = request.app.state.store, _tenant_named(request, name)
    try:
        owned = store.delete_tenant(tenant_id, actor(request))
    except ValueError as e:
        raise HTTPException(409, str(e)) from None
    for table in ("heads", "asu_weights"):
        for item_id, digest in owned[table]:
            _remove_trained(request, table, item_id, digest)
    for _, digest in owned["datasets"]:
        store.release(digest)
    return Response(status_code=204)
