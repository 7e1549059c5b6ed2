"""A real Lethe server (uvicorn on a free port, in a thread) for end-to-end tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from lethe.server.app import create_app
from lethe.server.settings import Settings

ADMIN_KEY = "test-admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(lm, data_dir, **overrides):
    port = free_port()
    settings = Settings(model=lm.path, data_dir=data_dir, port=port, admin_key=ADMIN_KEY, demo_tenant=False,
                        **{"allow_anonymous": True, **overrides})
    server = uvicorn.Server(uvicorn.Config(create_app(settings, lm), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def new_tenant(url: str, name: str) -> httpx.Client:
    r = httpx.post(url + "/admin/tenants", json={"name": name}, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                   timeout=60)
    r.raise_for_status()
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {r.json()['api_key']}"}, timeout=60)


@contextmanager
def running_ray(model_dir, data_dir, database_url: str, replicas: int = 2, env: dict | None = None, **overrides):
    """Lethe on a local Ray cluster (the machine's 2 cores, counted by Ray as one CPU per replica and one for a job's
    own task): `replicas` replicas of the server, 1 torch thread each,
    sharing the PostgreSQL database `database_url` and `data_dir`, behind Ray Serve's HTTP proxy; yields its URL."""
    import ray
    from ray import serve

    from lethe.server.ray_serve import deployment, shutdown_local_ray

    port = free_port()
    settings = Settings(model=model_dir, data_dir=data_dir, port=port, admin_key=ADMIN_KEY, demo_tenant=False,
                        database_url=database_url, **{"allow_anonymous": True, **overrides})
    ray.init(num_cpus=replicas + 1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(settings, replicas, threads=1, env=env), name="lethe", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_for_replicas(url, replicas)
        yield url
    finally:
        shutdown_local_ray()


def _wait_for_replicas(url: str, replicas: int, timeout: float = 180) -> None:
    """Until every replica has answered /readyz: Ray reports a replica healthy as its app starts (model, store,
    the compiled kernel), so a first request may otherwise wait for that start on a busy machine."""
    seen: set[str] = set()
    deadline = time.time() + timeout
    while len(seen) < replicas and time.time() < deadline:
        try:
            r = httpx.get(url + "/readyz", timeout=30)
            if r.status_code == 200:
                seen.add(r.headers.get("x-lethe-replica", ""))
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    if len(seen) < replicas:
        raise RuntimeError(f"{replicas - len(seen)} of {replicas} replicas never answered /readyz")
