"""`lethe --url ... --key ...`: server commands through the client, JSON out, exit codes scripts rely on."""

import json

import httpx
import pytest

from lethe.clients.cli import main
from lethe.heads.demo.corpus import split_by_author
from lethe.heads.modelio import load_model
from live_server import ADMIN_KEY, running_server


@pytest.fixture(scope="module")
def url(tiny_model_dir, tmp_path_factory):
    with running_server(load_model(tiny_model_dir), tmp_path_factory.mktemp("data")) as u:
        yield u


def run(capsys, *args) -> tuple[int, list[str]]:
    rc = main(list(args))
    return rc, capsys.readouterr().out.splitlines()


def test_remote_commands_and_exit_codes(url, tiny_records, tmp_path, capsys):
    rc, out = run(capsys, "--url", url, "--key", ADMIN_KEY, "--field", "api_key", "tenants", "create", "cli")
    assert rc == 0 and out[0].startswith("lk_")
    auth = ("--url", url, "--key", out[0])
    forget, retain = split_by_author(tiny_records, 1)
    (tmp_path / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in forget))
    rc, out = run(capsys, *auth, "--field", "id", "datasets", "upload", str(tmp_path / "f.jsonl"), "--name", "f")
    assert rc == 0 and out[0].startswith("ds_")
    forget_id = out[0]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in retain))
    rc, out = run(capsys, *auth, "heads", "train", "--forget", forget_id, "--retain", str(tmp_path / "r.jsonl"),
                  "--wait", "--quiet", "--rank", "4", "--cache-precision", "model")
    job = json.loads(out[0])
    assert rc == 0 and job["status"] == "succeeded" and job["head"].startswith("head_")
    rc, out = run(capsys, *auth, "heads", "get", job["head"])
    assert rc == 0 and json.loads(out[0])["metrics"]["cache_dtype"] == "float32", "the option reached the job"
    rc, out = run(capsys, *auth, "datasets", "list")
    assert rc == 0 and len(out) == 2, "the local retain file was uploaded as a dataset"
    assert run(capsys, *auth, "--field", "version", "profiles", "set", "p", "--head", job["head"])[1] == ["1"]
    assert run(capsys, *auth, "--field", "version", "profiles", "set", "p", "--backend", "base")[1] == ["2"]
    assert run(capsys, *auth, "--field", "version", "profiles", "rollback", "p")[1] == ["1"]
    rc, out = run(capsys, *auth, "generate", "--profile", "p", "--stream", "Question: hello\nAnswer:")
    assert rc == 0 and out
    rc, out = run(capsys, *auth, "jobs", "list")
    assert rc == 0 and json.loads(out[0])["id"] == job["id"]
    assert run(capsys, *auth, "heads", "get", "head_nope")[0] == 1, "a refused command exits 1"
    assert run(capsys, *auth, "profiles", "set", "q", "--head", job["head"], "--T", "-1")[0] == 1
    assert run(capsys, "--url", url, "--key", "lk_bad", "datasets", "list")[0] == 1
    assert run(capsys, "--url", "http://127.0.0.1:9", "datasets", "list")[0] == 3, "unreachable server exits 3"
    assert run(capsys, "jobs", "list")[0] == 2, "a server command without --url is bad usage"
    with pytest.raises(SystemExit) as e:
        main(["profiles", "set"])
    assert e.value.code == 2
    assert httpx.get(url + "/healthz").status_code == 200
