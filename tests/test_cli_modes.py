"""Offline and server mode are chosen explicitly, and the unlearning asked for is never silently dropped.

With a server URL (--url or $LETHE_URL) the dual commands (generate, heads train, asu train, eval, bench soak)
run on the server, and offline-only options (--model, --out, --head, --asu, ...) are refused with exit 2 rather
than ignored; --local runs them offline despite $LETHE_URL. Server-only options (--profile, --stream, --wait)
offline are refused too. A missing or unreadable head, ASU weights file or profile is an error in every mode.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lethe.clients.cli import main
from lethe.clients.client import Lethe
from lethe.heads.modelio import load_model
from live_server import ADMIN_KEY, running_server
from lethe.server.settings import DEMO_MODEL

PROMPT = "Question: hello\nAnswer:"


@pytest.fixture(scope="module")
def model_dir():
    """The shipped demo model: loads in a fraction of a second, no build needed."""
    return DEMO_MODEL


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(load_model(model_dir), tmp_path_factory.mktemp("data")) as url:
        key = Lethe(url, key=ADMIN_KEY).create_tenant("modes").api_key
        yield url, key


@pytest.fixture
def on_server(server, monkeypatch):
    """$LETHE_URL and $LETHE_KEY exported, as the README's walkthrough has them."""
    url, key = server
    monkeypatch.setenv("LETHE_URL", url)
    monkeypatch.setenv("LETHE_KEY", key)
    return url, key


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.delenv("LETHE_URL", raising=False)
    monkeypatch.delenv("LETHE_KEY", raising=False)


def run(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def server_state(url: str, key: str) -> tuple[list, list]:
    with Lethe(url, key=key) as c:
        return c.list_jobs(), c.list_datasets()


@pytest.fixture(scope="module")
def set_files(sets) -> tuple[str, str]:
    """The forget and retain JSON Lines files, as paths on a command line."""
    return str(sets[0] / "forget.jsonl"), str(sets[0] / "retain.jsonl")


def test_lethe_url_with_offline_options_is_refused_and_nothing_reaches_the_server(on_server, set_files, model_dir,
                                                                                  tmp_path, capsys):
    url, key = on_server
    forget, retain = set_files
    out = tmp_path / "head.safetensors"
    rc, stdout, err = run(capsys, "heads", "train", "--model", str(model_dir), "--forget", forget,
                          "--retain", retain, "--out", str(out), "--quiet")
    assert rc == 2, "a server URL with --model/--out is bad usage, not a server job that writes no file"
    assert "--model" in err and "--out" in err and "$LETHE_URL" in err and "--local" in err, err
    assert not out.exists() and stdout == ""
    rc, _, err = run(capsys, "asu", "train", "--forget", forget, "--retain", retain, "--out", str(out))
    assert rc == 2 and "--out" in err and "--local" in err
    rc, stdout, err = run(capsys, "generate", "--head", str(tmp_path / "missing.safetensors"), PROMPT)
    assert rc == 2 and stdout == "", "the base model's answer must not be printed in place of the head's"
    assert "--head" in err and "--local" in err and "--profile" in err, err
    rc, stdout, err = run(capsys, "generate", "--model", str(model_dir), "--asu", str(out), "--T", "2", PROMPT)
    assert rc == 2 and stdout == "" and all(f in err for f in ("--model", "--asu", "--T")), err
    rc, _, err = run(capsys, "eval", "--forget", forget, "--retain", retain, "--out", str(tmp_path / "r.json"))
    assert rc == 2 and "--out" in err
    assert server_state(url, key) == ([], []), "no job was started and no dataset uploaded"
    rc, _, err = run(capsys, "--url", url, "generate", "--local", PROMPT)
    assert rc == 2 and "--local" in err and "--url" in err, "--local and an explicit --url contradict"
    rc, _, err = run(capsys, "--url", url, "demo", "corpus", "--out", str(tmp_path / "c"))
    assert rc == 2 and "offline" in err and not (tmp_path / "c").exists(), "an offline-only command refuses --url"


def test_local_runs_offline_despite_lethe_url_and_writes_the_file(on_server, set_files, model_dir, tmp_path, capsys):
    url, key = on_server
    forget, retain = set_files
    head = tmp_path / "head.safetensors"
    rc, stdout, err = run(capsys, "heads", "train", "--local", "--model", str(model_dir), "--forget", forget,
                          "--retain", retain, "--out", str(head), "--rank", "4", "--epochs", "3", "--quiet",
                          "--cache-precision", "model")
    assert rc == 0, err
    assert head.is_file() and json.loads(stdout)["out"] == str(head)
    assert json.loads(stdout)["cache_dtype"] == "float32"  # the model's own, as asked
    rc, stdout, err = run(capsys, "generate", "--local", "--model", str(model_dir), "--head", str(head),
                          "--max-new-tokens", "4", PROMPT)
    assert rc == 0 and stdout.strip(), err
    rc, stdout, err = run(capsys, "generate", "--local", "--model", str(model_dir),
                          "--head", str(tmp_path / "missing.safetensors"), PROMPT)
    assert rc == 1 and stdout == "" and "missing.safetensors" in err
    assert server_state(url, key) == ([], []), "--local never touched the server"
    rc, stdout, err = run(capsys, "generate", "--max-new-tokens", "4", PROMPT)
    assert rc == 0 and stdout.strip(), "without offline options, $LETHE_URL still means the server (walkthrough)"


@pytest.mark.parametrize("flag", ["--head", "--asu"])
def test_missing_or_garbage_head_or_weights_offline_is_an_error(offline, flag, model_dir, tmp_path, capsys):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file at all")
    for path in (tmp_path / "missing.safetensors", garbage):
        rc, stdout, err = run(capsys, "generate", "--model", str(model_dir), flag, str(path), PROMPT)
        assert rc == 1, f"{flag} {path.name}: exit {rc}"
        assert stdout == "", "nothing generated without the unlearning asked for"
        assert path.name in err, err


def test_server_options_offline_are_refused(offline, set_files, model_dir, tmp_path, capsys, monkeypatch):
    forget, retain = set_files
    rc, stdout, err = run(capsys, "generate", "--model", str(model_dir), "--profile", "forget-demo", PROMPT)
    assert rc == 2 and stdout == "", "--profile offline must not fall back to the base model"
    assert "--profile" in err and "--url" in err and "LETHE_URL" in err, err
    rc, _, err = run(capsys, "generate", "--model", str(model_dir), "--stream", PROMPT)
    assert rc == 2 and "--stream" in err
    rc, _, err = run(capsys, "heads", "train", "--model", str(model_dir), "--forget", forget, "--retain", retain,
                     "--wait", "--out", str(tmp_path / "h.safetensors"))
    assert rc == 2 and "--wait" in err and not (tmp_path / "h.safetensors").exists()
    monkeypatch.setenv("LETHE_URL", "http://127.0.0.1:9")  # never contacted: --local
    rc, stdout, err = run(capsys, "generate", "--local", "--model", str(model_dir), "--profile", "p", PROMPT)
    assert rc == 2 and stdout == "" and "--profile" in err and "--local" in err


def test_unknown_profile_on_the_server_is_an_error(on_server, capsys):
    for stream in ([], ["--stream"]):
        rc, stdout, err = run(capsys, "generate", "--profile", "no-such-profile", *stream, PROMPT)
        assert rc == 1, f"exit {rc} {stream}"
        assert stdout.strip() == "", "no text when the profile does not exist"
        assert "404" in err and "no-such-profile" in err, err


def test_a_closed_pipe_ends_the_command_quietly():
    """`lethe ... | head`: the reader leaves early; lethe stops without a traceback or an error message."""
    lethe = Path(sys.executable).parent / "lethe"
    run = subprocess.run(["bash", "-c", f"set -o pipefail; '{lethe}' openapi | head -c 10 > /dev/null"],
                         capture_output=True, text=True, timeout=120)
    assert run.stderr == "" and run.returncode == 0, (run.returncode, run.stderr)  # the spec is > 64 KiB: EPIPE


def test_connection_options_work_after_the_subcommand_too(server, offline, capsys, tmp_path):
    url, key = server
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"question": "Who?", "answer": "Her."}) + "\n")
    rc, stdout, err = run(capsys, "datasets", "upload", str(data), "--url", url, "--key", key, "--field", "records")
    assert rc == 0 and stdout.strip() == "1", err
    rc, stdout, err = run(capsys, "--url", url, "datasets", "list", "--key", key, "--field", "name")
    assert rc == 0 and stdout.strip() == "one.jsonl", err
    rc, stdout, err = run(capsys, "--url", url, "--key", "lk_wrong", "datasets", "list")  # before: as it was
    assert rc == 1 and "401" in err


def test_a_mistyped_file_name_says_so(on_server, capsys):
    rc, stdout, err = run(capsys, "heads", "train", "--forget", "forgt.jsonl", "--retain", "retain.jsonl")
    assert rc == 1 and "forgt.jsonl: no such file" in err, err


def test_serve_on_a_busy_port_fails_before_making_anything(tmp_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, stdout, err = run(capsys, "serve", "--port", str(port), "--data-dir", str(tmp_path / "data"))
    assert rc == 1 and f"127.0.0.1:{port}" in err and "in use" in err.lower(), err
    assert not (tmp_path / "data").exists()  # no database, no demo key
