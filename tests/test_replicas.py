"""Lethe on 2 Ray Serve replicas sharing PostgreSQL: routing by head, profiles consistent across replicas, and the
faults a provider meets: a replica killed mid-stream, PostgreSQL restarted under load, a training job's worker
killed. A local Ray cluster on the machine's 2 CPUs and a PostgreSQL server of this module's own."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lethe.heads.demo.corpus import split_by_author
from lethe.heads.records import question_prompt
from lethe.heads.t3.head import save_head
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig
from live_server import ADMIN_KEY, running_ray
from lethe.server.pg_local import PostgresServer, binaries, fresh_database

pytestmark = pytest.mark.skipif(binaries() is None, reason="PostgreSQL is not installed")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tiny_lm, tiny_records, tmp_path_factory):
    """2 replicas on PostgreSQL; tenant `a` with profile `p` on head h1 (and a second head h2), tenant `b` with
    its own profile. The replicas' processes kill themselves (LETHE_CRASH_AT), as a worker dying does, when a job
    reaches its fitting phase and when an answer reaches 200 tokens; so heads are trained here and uploaded (no
    job runs before the job test), and only the mid-stream test asks for that many tokens."""
    folder = Path(tempfile.mkdtemp(prefix="lethe-pg-"))
    pg = PostgresServer(folder)
    pg.start()
    try:
        database = fresh_database(pg.url)
        with running_ray(tiny_model_dir, tmp_path_factory.mktemp("data"), database, replicas=2,
                         env={"LETHE_CRASH_AT": "job:fitting,decode:200"}, max_new_tokens_limit=256,
                         # a job's heartbeat comes from the replica that dispatched it; on 2 loaded cores it was once
                         # 3 s late, and another replica failed the job as stale while it was still caching
                         job_stale_seconds=10.0, body_timeout=2.0,
                         max_queue=64) as url:
            forget, retain = split_by_author(tiny_records, 1)
            other_forget, other_retain = split_by_author(tiny_records[::-1], 1)
            files = tmp_path_factory.mktemp("heads")
            cfg = FitConfig(rank=8, max_epochs=30)
            for name, (f, r) in {"h1": (forget, retain), "h2": (forget[:10], retain), "hb": (other_forget, other_retain)}.items():
                head, info = train_head(tiny_lm, f, r, cfg, progress=False)
                save_head(files / f"{name}.safetensors", head, info)
            tenants = {}
            for tenant in ("a", "b"):
                r = httpx.post(url + "/admin/tenants", json={"name": tenant}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert r.status_code == 201, r.text
                tenants[tenant] = {"Authorization": f"Bearer {r.json()['api_key']}"}
            heads = {}
            for name, tenant in (("h1", "a"), ("h2", "a"), ("hb", "b")):
                r = httpx.post(url + "/v1/heads/upload", headers=tenants[tenant],
                               files={"file": ("h.safetensors", (files / f"{name}.safetensors").read_bytes())})
                assert r.status_code == 201, r.text
                heads[name] = r.json()["id"]
            assert httpx.put(url + "/v1/profiles/p", json={"head": heads["h1"]}, headers=tenants["a"]).status_code == 200
            assert httpx.put(url + "/v1/profiles/p", json={"head": heads["hb"]}, headers=tenants["b"]).status_code == 200
            yield {"url": url, "pg": pg, "tenants": tenants, "heads": heads, "forget": forget, "retain": retain,
                   "database": database}
    finally:
        pg.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)


def _ask(cluster, tenant: str, model: str = "p", max_tokens: int = 8, **body) -> httpx.Response:
    prompt = question_prompt(cluster["forget"][0]["question"])
    return httpx.post(cluster["url"] + "/v1/completions", headers=cluster["tenants"][tenant], timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body})


def test_a_tenants_traffic_goes_to_the_replica_holding_its_head_and_base_traffic_to_both(cluster):
    answers = [_ask(cluster, "a") for _ in range(8)]
    assert all(r.status_code == 200 for r in answers)
    assert {r.headers["x-lethe-routed-to"] for r in answers} == {cluster["heads"]["h1"]}
    assert len({r.headers["x-lethe-replica"] for r in answers}) == 1  # the replica that loaded h1 keeps it
    assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    base = [_ask(cluster, "a", model="base") for _ in range(16)]
    assert {r.headers["x-lethe-routed-to"] for r in base} == {"any"}
    assert len({r.headers["x-lethe-replica"] for r in base}) == 2  # both replicas serve
    # tenant b's profile never changes tenant a's answers, whichever replica holds which head
    b = [_ask(cluster, "b") for _ in range(4)]
    assert all(r.status_code == 200 for r in b)
    assert _ask(cluster, "a").json()["choices"][0]["text"] == answers[0].json()["choices"][0]["text"]


def test_a_swap_is_seen_by_every_replica_at_once_and_answers_name_their_version(cluster):
    headers, heads = cluster["tenants"]["a"], cluster["heads"]
    swapped = httpx.put(cluster["url"] + "/v1/profiles/p", json={"head": heads["h2"]}, headers=headers)
    assert swapped.status_code == 200
    version = swapped.json()["version"]
    after = [_ask(cluster, "a") for _ in range(6)]  # at once: no replica may answer with the old version
    assert {r.headers["x-lethe-profile-version"] for r in after} == {str(version)}
    assert {r.headers["x-lethe-routed-to"] for r in after} == {heads["h2"]}
    back = httpx.post(cluster["url"] + f"/v1/profiles/p/rollback?version={version - 1}", headers=headers)
    assert back.status_code == 200, back.text
    assert {_ask(cluster, "a").headers["x-lethe-profile-version"] for _ in range(4)} == {str(version - 1)}
    # under load, from many clients: every answer names a version that was current while it was asked
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_ask, cluster, "a") for _ in range(16)]
        httpx.put(cluster["url"] + "/v1/profiles/p", json={"head": heads["h1"]}, headers=headers)
        results = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in results)
    assert {r.headers["x-lethe-profile-version"] for r in results} <= {str(version - 1), str(version + 1)}


def _wait_healthy(cluster, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if all(_ask(cluster, "a", model="base").status_code == 200 for _ in range(4)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("the cluster did not recover")


def test_a_killed_replica_ends_its_stream_with_an_error_and_the_others_finish(cluster):
    url, headers = cluster["url"], cluster["tenants"]["a"]
    events, replica = [], {}
    first = threading.Event()

    def long_stream():
        body = {"model": "p", "prompt": question_prompt(cluster["forget"][1]["question"]), "max_tokens": 230,
                "min_tokens": 230, "temperature": 1.0, "seed": 1, "stream": True}  # its replica dies at token 200
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
                replica["name"] = r.headers["x-lethe-replica"]
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
        except httpx.HTTPError as e:  # a connection cut short counts as an ended stream too
            events.append(f"transport: {type(e).__name__}")
        first.set()

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    assert first.wait(60) and "name" in replica
    others = []
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_ask, cluster, "b", "p", 16) for _ in range(4)]
        streaming.join(120)
        others = [f.result() for f in futures]
    assert not streaming.is_alive()
    assert events and events[-1] != "[DONE]", events[-3:]  # the killed stream did not end as if complete
    last = events[-1]
    assert last.startswith("transport") or "error" in json.loads(last), last
    # requests on the surviving replica finished; those that were on the killed one were refused, not hung
    assert all(r.status_code in (200, 503) for r in others) and any(r.status_code == 200 for r in others)
    _wait_healthy(cluster)
    assert _ask(cluster, "a").status_code == 200  # Ray restarted it; the tenant's profile answers again
    # nothing half-written: every profile version still points at a head that exists
    history = httpx.get(url + "/v1/profiles/p", headers=headers)
    heads = {h["id"] for h in httpx.get(url + "/v1/heads", headers=headers).json()}
    assert history.status_code == 200 and {v["spec"]["head"] for v in history.json()["history"]} <= heads


def test_postgres_restarted_under_load_gives_503_then_everything_works_without_a_restart(cluster):
    url, pg = cluster["url"], cluster["pg"]
    body = {"model": "base", "prompt": question_prompt(cluster["retain"][0]["question"]), "max_tokens": 190,
            "min_tokens": 190, "temperature": 1.0, "seed": 2}
    with ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(httpx.post, url + "/v1/completions", json=body,
                                headers=cluster["tenants"]["a"], timeout=120)
        time.sleep(1.0)  # admitted and decoding: it needs no database from here on
        pg.stop("fast")
        try:
            during = _ask(cluster, "a")  # its profile must be read from the database
            assert during.status_code == 503, during.text
            assert during.headers.get("retry-after") == "1"
            assert during.json()["error"]["type"] == "server_error"
        finally:
            pg.start()
        done = in_flight.result()
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] > 0
    deadline = time.time() + 30
    while (r := _ask(cluster, "a")).status_code != 200 and time.time() < deadline:
        time.sleep(0.5)
    assert r.status_code == 200, r.text  # the pools reconnected by themselves


def test_a_jobs_worker_killed_marks_it_failed_and_the_previous_head_keeps_serving(cluster):
    url, headers = cluster["url"], cluster["tenants"]["a"]
    before = _ask(cluster, "a")
    assert before.status_code == 200
    forget = "".join(json.dumps(r) + "\n" for r in cluster["forget"]).encode()
    retain = "".join(json.dumps(r) + "\n" for r in cluster["retain"]).encode()
    f = httpx.post(url + "/v1/datasets", content=forget, headers=headers).json()["id"]
    r = httpx.post(url + "/v1/datasets", content=retain, headers=headers).json()["id"]
    job = httpx.post(url + "/v1/heads", json={"forget": f, "retain": r}, headers=headers)
    assert job.status_code == 202, job.text
    job_id, deadline = job.json()["id"], time.time() + 90
    while time.time() < deadline:
        try:
            state = httpx.get(url + f"/v1/jobs/{job_id}", headers=headers, timeout=10)
            if state.status_code == 200 and state.json()["status"] in ("failed", "succeeded", "cancelled"):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    assert state.json()["status"] == "failed", state.json()
    # the job ran as a Ray task of its own: the replica that dispatched it saw its process die, and says so
    assert "the job's worker stopped while the job was running" in state.json()["error"], state.json()
    _wait_healthy(cluster)
    after = _ask(cluster, "a")
    assert after.status_code == 200
    assert after.headers["x-lethe-profile-version"] == before.headers["x-lethe-profile-version"]
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_the_router_bounds_bodies_as_the_one_process_server_does(cluster):
    """Every request passes the router: a body past its limit is refused as it passes it (not read whole), and a
    body that stalls is cut off (408), as `app.BoundedBody` does in one process."""
    import socket

    url, headers = cluster["url"], cluster["tenants"]["a"]

    def chunks():  # 8 MiB of JSON without a Content-Length: refused after the first MiB
        yield b'{"model": "base", "prompt": "'
        for _ in range(128):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={**headers, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "LETHE_MAX_REQUEST_BYTES" in r.json()["error"]["message"]
    r = httpx.post(url + "/generate", content=b"{" + b" " * (2 * 2**20) + b"}", headers=headers, timeout=60)
    assert r.status_code == 413 and "LETHE_MAX_REQUEST_BYTES" in r.json()["detail"]
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host.split("//")[1], int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"model\": ")
        started = time.perf_counter()
        answer = sock.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408"), answer[:200]
    assert time.perf_counter() - started < 20


def test_bench_scale_tells_each_process_role_apart():
    """`lethe bench scale`'s CPU table: each kind of process under its own role (a line that swallowed the proxy's
    role once counted it among Ray's other processes)."""
    from types import SimpleNamespace

    from lethe.server.bench.scale import _role

    def proc(line: str):
        return SimpleNamespace(pid=1, cmdline=lambda: line.split(), name=lambda: line)

    lines = {"ray::ServeReplica:lethe:lethe-replica.handle": "replicas",
             "python -m lethe.clients.cli serve --port 1": "replicas",
             "ray::ProxyActor": "ray proxy and router", "ray::ServeReplica:lethe:lethe-router": "ray proxy and router",
             "ray::ServeController": "ray proxy and router", "ray/core/src/ray/raylet/raylet": "ray other",
             "postgres: lethe lethe 127.0.0.1 idle": "postgresql", "bash": "other"}
    assert {line: _role(proc(line), me=0) for line in lines} == lines
