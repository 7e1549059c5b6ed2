"""`lethe bench scale`: what a second replica buys, and what Ray's routing costs, measured side by side in one run.

On one database (PostgreSQL: `--database-url`, or a throwaway server of Debian's where it is installed) and one
data directory, with 8 tenants each holding a random head in a profile of its own:
1. the plain server (`lethe serve`, one process, 1 torch thread), 1 client: the latency of one request;
2. Ray Serve with 1 replica (1 thread): 1 client (the same requests: Ray's routing overhead in ms), then
   16 clients on the 8 tenants' heads (tokens/s, p50 and p99 latency);
3. Ray Serve with 2 replicas (1 thread each): the same 16 clients.
Targets (issue 15): 2 replicas / 1 replica >= 1.7x in tokens/s, p99 within 1.2x; the overhead reported in ms.
Each loaded phase also reports where the machine's CPU time went (`cpu_by_role`: cores used by the replicas, Ray's
proxy and router, Ray's other processes, PostgreSQL and the clients), so a result can be read against the cores
the machine has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from lethe.server.bench import shown_path
from lethe.server.bench.heads import _key, _tenant_with_head, load


def _wait(url: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become ready")


@contextmanager
def plain_server(model: Path, data_dir: Path, database_url: str | None, admin_key: str, port: int,
                 threads: int = 1, env: dict | None = None):
    """`lethe serve` in a process of its own with `threads` torch threads (the clients' threads stay out of its
    GIL); `env`: more LETHE_ settings."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), LETHE_ADMIN_KEY=admin_key, LETHE_DEMO_TENANT="false",
               **(env or {}))
    store = ["--database-url", database_url] if database_url else []
    proc = subprocess.Popen([sys.executable, "-m", "lethe.clients.cli", "serve", "--model", str(model), "--port",
                             str(port), "--data-dir", str(data_dir), *store],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextmanager
def ray_server(settings, replicas: int):
    import ray
    from ray import serve

    from lethe.server.ray_serve import deployment

    serve.start(http_options={"host": "127.0.0.1", "port": settings.port})
    serve.run(deployment(settings, replicas, threads=1), name="lethe", route_prefix="/")
    try:
        url = f"http://127.0.0.1:{settings.port}"
        _wait(url)
        yield url
    finally:
        serve.delete("lethe")
        del ray


# (role, marks in a process's command line), the first match wins; the plain server counts as the one replica
ROLES = (("replicas", ("lethe-replica", "lethe.clients.cli serve")),
         ("ray proxy and router", ("ProxyActor", "lethe-router", "ServeController")),
         ("ray other", ("raylet", "gcs_server", "ray::", "ray/", "dashboard", "runtime_env")),
         ("postgresql", ("postgres",)))


def _role(proc, me: int) -> str:
    if proc.pid == me:
        return "clients (this process)"
    try:
        line = " ".join(proc.cmdline()) or proc.name()
    except Exception:  # gone, or not ours to read
        return "other"
    return next((role for role, marks in ROLES if any(m in line for m in marks)), "other")


def cpu_by_role(run):
    """`run()`'s result and the cores each role used while it ran (CPU seconds / wall seconds), with the
    machine's total: a phase whose total is near the machine's core count had no idle core to give."""
    import psutil

    me = os.getpid()

    def snapshot() -> dict[int, tuple[str, float]]:
        taken = {}
        for proc in psutil.process_iter():
            try:
                times = proc.cpu_times()
                taken[proc.pid] = (_role(proc, me), times.user + times.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return taken

    before, machine, started = snapshot(), psutil.cpu_times(), time.monotonic()
    result = run()
    after, machine_after, wall = snapshot(), psutil.cpu_times(), time.monotonic() - started
    used: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        used[role] = used.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    busy = lambda t: t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    usage = {role: round(seconds / wall, 2) for role, seconds in sorted(used.items())}
    usage["machine total"] = round((busy(machine_after) - busy(machine)) / wall, 2)
    usage["machine cores"] = psutil.cpu_count()
    return result, usage


@contextmanager
def _database(url: str | None):
    if url:
        yield url
        return
    from lethe.server.pg_local import binaries, fresh_database, postgres_server

    if binaries() is None:
        raise ValueError("bench scale needs PostgreSQL: --database-url postgresql://..., or Debian's postgresql "
                         "installed (a throwaway server is started)")
    folder = Path(tempfile.mkdtemp(prefix="lethe-pg-"))
    try:
        with postgres_server(folder) as server:
            yield fresh_database(server)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def bench_scale(model: Path, lm, database_url: str | None = None, tenants: int = 8, clients: int = 16,
                duration: float = 30.0, max_tokens: int = 32, single: int = 30, log=print) -> dict:
    """`lm`: the served model, loaded here only to make the random heads (its sizes and fingerprint)."""
    import secrets

    import ray
    import torch

    from lethe.heads.t3.guide import TiltSettings
    from lethe.heads.t3.head import HeadInfo, T3Head, save_head
    from lethe.server.pg_local import free_port
    from lethe.server.settings import Settings

    admin = secrets.token_urlsafe(16)
    cfg = lm.model.config
    result: dict = {"model": shown_path(model), "tenants": tenants, "clients": clients, "duration_s": duration,
                    "max_tokens": max_tokens}
    with _database(database_url) as database, tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        heads = []
        for i in range(tenants):
            torch.manual_seed(i)
            head = T3Head(cfg.hidden_size, cfg.vocab_size, 20)
            torch.nn.init.normal_(head.up.weight, std=0.5)
            heads.append(Path(tmp) / f"head{i}.safetensors")
            save_head(heads[-1], head, HeadInfo(base_fingerprint=lm.fingerprint, d=cfg.hidden_size,  # today's defaults
                                                vocab=cfg.vocab_size, rank=20, profile=TiltSettings().as_dict()))
        keys: list[str] = []
        log("bench scale: the plain server (1 process, 1 thread), 1 client")
        with plain_server(model, data, database, admin, free_port()) as url:
            for i, path in enumerate(heads):
                client = _tenant_with_head(url, admin, f"scale{i}", path)
                keys.append(_key(client))
                client.close()
            load(url, keys[:1], 1, 3.0, max_tokens)  # warm-up
            result["plain_1_client"], result["cpu_plain_1_client"] = cpu_by_role(
                lambda: load(url, keys[:1], 1, single, max_tokens))
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
        try:
            settings = Settings(model=model, data_dir=data, database_url=database, admin_key=admin,
                                demo_tenant=False, port=free_port())
            for replicas in (1, 2):
                log(f"bench scale: Ray Serve, {replicas} replica(s) x 1 thread")
                with ray_server(settings, replicas) as url:
                    load(url, keys, clients, 5.0, max_tokens)  # warm-up: every replica loads its heads
                    if replicas == 1:
                        result["ray_1_replica_1_client"] = load(url, keys[:1], 1, single, max_tokens)
                    result[f"ray_{replicas}_replicas"], result[f"cpu_ray_{replicas}_replicas"] = cpu_by_role(
                        lambda: load(url, keys, clients, duration, max_tokens))
        finally:
            from lethe.server.ray_serve import shutdown_local_ray

            shutdown_local_ray()
    one, two = result["ray_1_replicas"], result["ray_2_replicas"]
    result["throughput_2_over_1"] = round(two["tokens_per_s"] / one["tokens_per_s"], 3)
    result["p99_2_over_1"] = round(two["p99_s"] / one["p99_s"], 3)
    result["routing_overhead_ms"] = round(1000 * (result["ray_1_replica_1_client"]["mean_s"]
                                                  - result["plain_1_client"]["mean_s"]), 1)
    return result
