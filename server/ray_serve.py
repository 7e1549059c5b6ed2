"""Lethe on Ray Serve: several replicas of the whole server behind one HTTP address (`lethe serve --ray`).

    client -> Ray Serve's HTTP proxy -> Router (1 replica, no model) -> Replica (N, each a whole Lethe server:
                                         picks the head id             its own engine on its own device)
                                                                          |
                                       PostgreSQL (tenants, keys, datasets, heads, jobs, profiles) and a blob
                                       store (dataset, head and adapter files; LETHE_BLOB_URL) shared by all;
                                       each training or evaluation job a Ray task of its own (job_dispatcher)

Every replica runs the same FastAPI app as the one-process server, so the API, the OpenAI routes and their
errors are the same. The router reads the profile a generation request asks for (the tenant's current version,
from the database) and sends the request with that profile's head (or ASU weights) id as Ray Serve's
multiplexed model id: Ray routes it to a replica that already holds that head, and each replica keeps its own
LRU of heads and adapters (`LETHE_HEAD_CACHE_SIZE`, `LETHE_ADAPTER_CACHE_SIZE`). Everything else goes to any
replica. Each replica admits the request again itself, so it pins the version it reads then (a swap between the
router's read and the replica's admission only changes which replica answers, never which version: the one
the replica admitted, named in the response).

Requests travel to a replica as (method, path, query, headers, body) and come back as a stream: first the
status and headers, then the body's chunks as the app sends them, so server-sent events stream through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from lethe.server.settings import Settings

log = logging.getLogger("lethe.ray")

GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")
MULTIPART_SLACK = 64 * 1024  # an upload's framing beyond its file; the replica checks the file's exact limit


async def read_body(request, settings: Settings) -> tuple[bytes | None, tuple[int, str] | None]:
    """The request's body, bounded as the one-process server bounds it (`app.read_bounded`): JSON bodies by
    LETHE_MAX_REQUEST_BYTES, uploads by LETHE_MAX_UPLOAD_BYTES plus their framing (the replica checks the file's
    exact limit), a stall by LETHE_BODY_TIMEOUT."""
    from lethe.server.app import UPLOAD_PATHS, read_bounded

    upload = request.url.path in UPLOAD_PATHS
    limit = settings.max_upload_bytes + MULTIPART_SLACK if upload else settings.max_request_bytes
    body, refused = await read_bounded(request.receive, limit, settings.body_timeout,
                                       "LETHE_MAX_UPLOAD_BYTES" if upload else "LETHE_MAX_REQUEST_BYTES",
                                       request.headers.get("content-length"))
    if body is None and refused is None:
        refused = (408, "the request body ended early or stalled")  # the client went away
    return body, refused


def _key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def routing_id(store, path: str, headers: dict[str, str], body: bytes) -> str:
    """The multiplexed model id of a request: for a generation request asking for a profile, its current
    version's head (or ASU weights) id; '' for the base model and for everything else (any replica)."""
    if path not in GENERATION or not body:
        return ""
    try:
        payload = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    if path == "/generate":
        profile = payload.get("profile")
    else:
        profile = payload.get("unlearning_profile") or payload.get("model")
    key = _key(headers)
    caller = store.caller(key) if key else None
    imposed = caller and (caller["profile"] or caller["enforced"])
    if imposed:  # a bound key or an enforced profile: the replica will decode with that one, whatever was asked
        profile = imposed
    if isinstance(profile, dict):  # an inline profile names its head or weights itself
        return str(profile.get("head") or profile.get("weights") or "")
    if not isinstance(profile, str) or not profile or profile == "base" or caller is None:
        return ""
    current = store.current_profile(caller["tenant_id"], profile)
    if current is None:
        return ""
    return str(current[1].get("head") or current[1].get("weights") or "")


async def call_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> AsyncIterator[dict | bytes]:
    """One HTTP request through an ASGI app in this process: yields {"status", "headers"}, then the body's
    chunks as the app sends them. Closing the iterator early is the client going away (the app sees
    `http.disconnect`, and a stream's row stops)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("lethe", 80)}
    messages: asyncio.Queue[dict] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda t: messages.put_nowait({"type": "lethe.done"}))
    try:
        while True:
            message = await messages.get()
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
            elif message["type"] == "lethe.done":
                if task.exception() is not None:
                    raise task.exception()
                return
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=5)


async def start_lifespan(app) -> None:
    """Run the app's start-up (model, store, engine, jobs) as an ASGI server would, and keep it running."""
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    incoming: asyncio.Queue[dict] = asyncio.Queue()
    await incoming.put({"type": "lifespan.startup"})

    async def send(message: dict) -> None:
        if message["type"] == "lifespan.startup.complete" and not started.done():
            started.set_result(None)
        elif message["type"] == "lifespan.startup.failed" and not started.done():
            started.set_exception(RuntimeError(message.get("message") or "start-up failed"))

    app.state.lifespan_task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                        incoming.get, send))
    await started


def run_job(settings: Settings, job: dict) -> str:
    """A claimed job, run in a Ray task of its own: the model loaded here (a job never uses a serving replica's),
    the job's heartbeat, progress and result written to the shared database and blob store; its final status."""
    import torch

    from lethe.heads.modelio import load_model
    from lethe.server.jobs import JobRunner, OwnModel
    from lethe.server.profiles import HeadCache
    from lethe.server.storage import Store

    torch.set_num_threads(max(1, int(settings.job_cpus)))
    lm = load_model(settings.model, settings.device, settings.dtype)
    store = Store(settings.data_dir, settings.database_url, settings.blob_url, settings.blob_cache)
    try:
        runner = JobRunner(store, OwnModel(lm), heads=HeadCache(store, lm, 4), stale=settings.job_stale_seconds,
                           worker=False, budget=settings.max_job_seconds)
        return runner.execute(job)
    finally:
        store.close()


def job_dispatcher(settings: Settings):
    """`dispatch(job)` for a replica's JobRunner: the job runs as a Ray task reserving `settings.job_cpus` CPUs and
    `settings.job_gpus` GPUs (1 where the replicas use CUDA, unless set), never retried (a job whose process died
    is failed, with the reason); the replica's job thread waits for it. The task inherits the replica's
    environment (Ray passes a parent's runtime_env on to its tasks)."""
    import ray

    gpus = settings.job_gpus or (1.0 if settings.device == "cuda" else 0.0)
    # max_calls=1: the task's process ends with the job, and the model it loaded goes with it
    task = ray.remote(max_calls=1)(run_job).options(num_cpus=settings.job_cpus, num_gpus=gpus, max_retries=0,
                                                    name="lethe-job")

    def dispatch(job: dict) -> str:
        try:
            return ray.get(task.remote(settings, dict(job)))
        except ray.exceptions.WorkerCrashedError:  # Ray's own text sends the reader to its log files
            raise RuntimeError("its process died: killed, or out of memory") from None

    return dispatch


def deployment(settings: Settings, replicas: int, threads: int = 1, max_heads_per_replica: int = 64,
               env: dict[str, str] | None = None):
    """The Ray Serve application: a router in front of `replicas` Lethe replicas, each given `threads` CPUs
    (its torch threads) and, on a GPU machine, `settings.device` as its own; `env`: environment variables of
    the replicas' processes."""
    from ray import serve

    options = {"num_cpus": threads, "num_gpus": 1 if settings.device == "cuda" else 0}
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}

    @serve.deployment(name="lethe-replica", num_replicas=replicas, max_ongoing_requests=settings.max_queue,
                      ray_actor_options=options, health_check_period_s=5, health_check_timeout_s=30)
    class Replica:
        def __init__(self, settings: Settings, threads: int):
            import torch

            from lethe.server.app import create_app

            torch.set_num_threads(threads)
            self.app = create_app(settings, dispatch_jobs=job_dispatcher(settings))
            self._ready: asyncio.Task | None = None
            self.name = serve.get_replica_context().replica_id.unique_id  # answers say which replica answered

        async def _started(self) -> None:
            """Start the app once (its first caller, or the first health check, begins it); a caller that gives up
            while it starts must not cancel the start for everyone (shield)."""
            if self._ready is None:
                self._ready = asyncio.ensure_future(start_lifespan(self.app))
            await asyncio.shield(self._ready)

        @serve.multiplexed(max_num_models_per_replica=max_heads_per_replica)
        async def _holding(self, model_id: str) -> str:
            """Tells Ray's router this replica holds `model_id` (the app's own caches hold the head itself)."""
            return model_id

        async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                         body: bytes) -> AsyncIterator[dict | bytes]:
            await self._started()
            model_id = serve.get_multiplexed_model_id()
            if model_id:
                await self._holding(model_id)
            async for part in call_asgi(self.app, method, path, query, headers, body):
                if isinstance(part, dict):
                    part["headers"].append(("x-lethe-replica", self.name))
                yield part

        async def check_health(self) -> None:
            """Ray restarts a replica whose start failed or whose engine thread died. The first check begins the
            start, so a replica is warm before its first request."""
            if self._ready is None:
                self._ready = asyncio.ensure_future(start_lifespan(self.app))
            if self._ready.done():
                self._ready.result()
                engine = self.app.state.engine
                if not engine._thread.is_alive():
                    raise RuntimeError("the engine thread stopped")

    @serve.deployment(name="lethe-router", num_replicas=1, max_ongoing_requests=10_000,
                      ray_actor_options={"num_cpus": 0})
    class Router:
        """Receives every HTTP request and forwards it to a replica, by head id for generation requests."""

        def __init__(self, settings: Settings, replica):
            from lethe.server.storage import Store

            self.settings = settings
            self.store = Store(settings.data_dir, settings.database_url, settings.blob_url, settings.blob_cache)
            self.replica = replica

        async def __call__(self, request):
            from starlette.concurrency import run_in_threadpool
            from starlette.responses import JSONResponse, StreamingResponse

            from lethe.server.app import _error_body

            def error(status: int, message: str, headers: dict | None = None):
                """The error the one-process server would give (OpenAI's shape on its routes)."""
                status, payload = _error_body(request.url.path, status, message)
                return JSONResponse(payload, status_code=status, headers=headers)

            body, refused = await read_body(request, self.settings)
            if refused is not None:
                return error(*refused)
            headers = {k.lower(): v for k, v in request.headers.items()}
            try:
                model_id = await run_in_threadpool(routing_id, self.store, request.url.path, headers, body)
            except Exception as e:  # the database is away: any replica (which answers 503 if it needs it)
                log.warning("routing without the database: %s", type(e).__name__)
                model_id = ""
            stream = self.replica.options(stream=True, multiplexed_model_id=model_id).handle.remote(
                request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body)
            try:
                head = await stream.__anext__()
            except Exception as e:  # the replica died before answering: Ray restarts it; the client may retry
                log.warning("a replica failed before answering: %s", type(e).__name__)
                return error(503, "the replica serving this request stopped; retry", {"Retry-After": "1"})
            events = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])

            async def rest():
                try:
                    async for chunk in stream:
                        yield chunk
                except Exception as e:  # the replica died mid-answer: a stream ends with an error event
                    log.warning("a replica failed mid-answer: %s", type(e).__name__)
                    if not events:
                        raise
                    error = {"error": {"message": "the replica serving this stream stopped; retry the request",
                                       "type": "server_error", "param": None, "code": 503}}
                    yield f"data: {json.dumps(error)}\n\n".encode()

            headers = [(k, v) for k, v in head["headers"] if k.lower() != "content-length"]
            response = StreamingResponse(rest(), status_code=head["status"])
            response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers] + \
                [(b"x-lethe-routed-to", (model_id or "any").encode())]
            return response

    return Router.bind(settings, Replica.bind(settings, threads))


def shutdown_local_ray() -> None:
    """Stop Serve and the Ray cluster this process started, every process of it included: after
    `ray.shutdown()` a local cluster's dashboard and runtime-env agents outlive their raylet (seen with Ray 2.60),
    so the processes this one started are ended too."""
    import psutil
    import ray
    from ray import serve

    started = psutil.Process().children(recursive=True)
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        for proc in started:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(started, timeout=10)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def serve_forever(settings: Settings, replicas: int, threads: int = 1, num_cpus: int | None = None,
                  address: str | None = None) -> None:
    """`lethe serve --ray`: start (or join, with `address`) a Ray cluster, deploy, and serve until interrupted."""
    import signal
    import sys

    import ray
    from ray import serve

    if address is None:  # a local cluster: room for every replica and one job beside them, as Ray counts CPUs
        import math
        import os

        num_cpus = max(num_cpus or os.cpu_count() or 1, math.ceil(replicas * threads + settings.job_cpus))
    ray.init(address=address, num_cpus=None if address else num_cpus, include_dashboard=False,
             ignore_reinit_error=True, log_to_driver=True)
    # after ray.init, which sets a SIGTERM handler of its own: a service manager's stop runs `finally` below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(deployment(settings, replicas, threads), name="lethe", route_prefix="/")
        print(f"lethe: {replicas} replicas on Ray Serve at http://{settings.host}:{settings.port}", flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if address is None:
            shutdown_local_ray()  # the local cluster's processes (those `ray.init` started) go too
        else:
            serve.shutdown()
            ray.shutdown()


def app(args: dict):
    """The application builder for Ray Serve's own CLI and config files (`serve run lethe.server.ray_serve:app
    replicas=2`, or `import_path: lethe.server.ray_serve:app` in a config file): settings from the LETHE_*
    environment variables, `replicas` and `threads_per_replica` from `args`."""
    settings = Settings()
    if not (settings.database_url or "").startswith(("postgresql", "postgres:")):
        raise ValueError("Lethe on Ray Serve needs LETHE_DATABASE_URL=postgresql://... (a database the replicas share)")
    return deployment(settings, int(args.get("replicas", 2)), int(args.get("threads_per_replica", 1)))
