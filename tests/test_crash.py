"""Crash consistency: the server is killed (SIGKILL) during a head save and during a training job, and restarted."""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from lethe.heads.demo.corpus import split_by_author
from lethe.heads.records import question_prompt
from live_server import ADMIN_KEY, free_port


class Server:
    """`lethe serve` as a separate process, so it can be killed like a real one."""

    def __init__(self, model_dir, data_dir, crash_at: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, LETHE_ADMIN_KEY=ADMIN_KEY, LETHE_DEMO_TENANT="false")
        env.pop("LETHE_CRASH_AT", None)
        if crash_at:
            env["LETHE_CRASH_AT"] = crash_at
        self.proc = subprocess.Popen([sys.executable, "-m", "lethe.clients.cli", "serve", "--model", str(model_dir),
                                      "--port", str(self.port), "--data-dir", str(data_dir)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(300):
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.proc.stderr.read().decode())
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _wait_dead(server: Server, timeout: float = 60) -> int:
    return server.proc.wait(timeout=timeout)


def _upload(c: httpx.Client, records) -> str:
    return c.post("/v1/datasets", content="".join(json.dumps(r) + "\n" for r in records).encode()).json()["id"]


@pytest.mark.parametrize("crash_at", ["blob:put", "job:fitting"])
def test_killed_during_a_save_or_a_job_restarts_with_nothing_lost(tiny_model_dir, tiny_records, tmp_path, crash_at):
    data = tmp_path / "data"
    forget, retain = split_by_author(tiny_records, 1)
    prompt = question_prompt(forget[1]["question"])
    s = Server(tiny_model_dir, data)
    try:
        key = httpx.post(s.url + "/admin/tenants", json={"name": "t"},
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["api_key"]
        c = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        f_id, r_id = _upload(c, forget), _upload(c, retain)
        job = c.post("/v1/heads", json={"forget": f_id, "retain": r_id}).json()["id"]
        while (state := c.get(f"/v1/jobs/{job}").json())["status"] in ("queued", "running"):
            time.sleep(0.1)
        head = state["head"]
        c.put("/v1/profiles/p", json={"head": head})
        c.put("/v1/profiles/p", json={"head": head, "preset": "paper"})
        c.post("/v1/profiles/p/rollback")
        before = c.post("/generate", json={"prompt": prompt, "profile": "p", "temperature": 0}).json()
    finally:
        s.stop()

    s = Server(tiny_model_dir, data, crash_at=crash_at)  # dies at the crash point, as with kill -9
    c = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    doomed = c.post("/v1/heads", json={"forget": f_id, "retain": r_id, "seed": 1}).json()["id"]
    assert _wait_dead(s) == -9
    if crash_at == "blob:put":
        assert list(data.rglob(".*.tmp")), "the crash left a half-written head behind"

    s = Server(tiny_model_dir, data)
    try:
        c = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        job = c.get(f"/v1/jobs/{doomed}").json()
        assert job["status"] == "failed" and "stopped while the job was running" in job["error"]
        assert not list(data.rglob("*.tmp")), "no temporary files remain"
        heads = c.get("/v1/heads").json()
        assert [h["id"] for h in heads] == [head], "only the complete head is registered"
        f_sha, r_sha, head_sha = (c.get(f"/v1/datasets/{f_id}").json()["sha256"],
                                  c.get(f"/v1/datasets/{r_id}").json()["sha256"], heads[0]["sha256"])
        assert {p.name for p in (data / "blobs").glob("??/*")} == {f_sha, r_sha, head_sha}, "files match rows"
        profile = c.get("/v1/profiles/p").json()
        assert profile["version"] == 1 and [h["version"] for h in profile["history"]] == [1, 2]
        after = c.post("/generate", json={"prompt": prompt, "profile": "p", "temperature": 0}).json()
        assert after == before, "the active head serves exactly as before the crash"
        assert {d["id"] for d in c.get("/v1/datasets").json()} == {f_id, r_id}
    finally:
        s.stop()
